"""The shape planner inside a real vLLM (CPU build): it plans from the engine's own counts.

The plugin counts arrivals per class in `add_request` and starts and completions from each
step's new and finished request ids; the planner reads those where the proxy reads its queue.
This drives a short mixed-priority load (vLLM's priority scheduling: -1 high, 0 normal, 1 low)
and checks that every request was counted once, that plans were solved, and that the planned
trajectory shows in `/status` and in `/history`, tick by tick. Power is the simulator's model
of the engine's real steps (no GPU here), so the figures are about the plumbing, not watts.

The high class streams, and the SM clock is controlled through a simulated zeusd: each of its
requests is boosted once when vLLM first schedules it (a streamed request of a boosted class,
read from vLLM's own request), and every boost has ended once its prompt was computed.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import pytest
from vllm_harness import OUT, sim_server, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

CLIENTS = 12
SECONDS = 20.0
PRIORITIES = {"high": -1, "normal": 0, "low": 1}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


async def _load(base_url: str) -> dict[str, int]:
    """Closed-loop clients, a third per class, short prompts; counts answers by class."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + SECONDS
    done = dict.fromkeys(PRIORITIES, 0)
    names = list(PRIORITIES)

    async def worker(i: int) -> None:
        cls = names[i % len(names)]
        n = 0
        while time.monotonic() < deadline:
            n += 1
            answer = await client.completions.create(
                model="tiny",
                prompt=" ".join(f"w{(i * 31 + n * 7 + k) % 500}" for k in range(24)),
                max_tokens=24 + (i * 5 + n) % 16,
                extra_body={"ignore_eos": True, "priority": PRIORITIES[cls]},
                stream=cls == "high",
                timeout=120,
            )
            if cls == "high":
                async for _ in answer:  # type: ignore[union-attr]
                    pass
            done[cls] += 1

    await asyncio.gather(*(worker(i) for i in range(CLIENTS)))
    await client.close()
    return done


def test_planner_plans_from_the_engines_counts_in_real_vllm() -> None:
    import powerbatch_vllm

    print(f"\n[shape] powerbatch_vllm from {powerbatch_vllm.__file__}")
    with sim_server("zeusd-sim") as zeusd_url:  # its zeusd routes
        _planner_and_boosts(zeusd_url)


def _planner_and_boosts(zeusd_url: str) -> None:
    env = {
        "POWERBATCH_VLLM_CEILING_W": "560",
        "POWERBATCH_VLLM_POWER_SOURCE": "model",
        "POWERBATCH_VLLM_MODEL_PROFILE": "h100-llama8b",
        "POWERBATCH_VLLM_WARMUP_S": "2",
        "POWERBATCH_VLLM_RAMP_UP_W_PER_S": "30",
        "POWERBATCH_VLLM_RAMP_DOWN_W_PER_S": "30",
        "POWERBATCH_VLLM_FLOOR_W": "300",
        "POWERBATCH_VLLM_PLANNER": "on",
        "POWERBATCH_VLLM_PLAN_HORIZON_S": "30",
        "POWERBATCH_VLLM_PLAN_EVERY_S": "1",
        "POWERBATCH_VLLM_CLOCK_CONTROL": "zeusd",
        "POWERBATCH_VLLM_ZEUSD_URL": zeusd_url,
        "POWERBATCH_VLLM_CLOCK_RANGE_MHZ": "345,1980",
        "POWERBATCH_VLLM_CLOCK_OBJECTIVE": "energy",
        "POWERBATCH_VLLM_CLOCK_BOOST_CLASSES": "high",
        "POWERBATCH_VLLM_LIMIT_STATE_DIR": str(OUT / "shape-state"),
    }
    with vllm_server("shape", env, extra_args=("--scheduling-policy", "priority")) as server:
        done = asyncio.run(_load(server.url))
        time.sleep(1.5)  # a tick after the last answer
        status = _get(server.plugin_url + "/status")
        history = _get(server.plugin_url + "/history")
    (OUT / "shape-status.json").write_text(json.dumps(status, indent=1))
    (OUT / "shape-history.json").write_text(json.dumps(history))
    shape, requests = status["shape"], status["engine"]["requests"]
    planned = [r["plan_w"] for r in history if r["plan_w"] is not None]
    print(f"[shape] answers {done}\n[shape] engine counts {requests}")
    print(f"[shape] plan {shape['plan']}\n[shape] {len(planned)} of {len(history)} ticks planned")
    # Every request counted once, by its class; none left waiting; all finished after running.
    assert all(n > 0 for n in done.values()), done
    assert requests["arrived"] == done
    assert requests["completed"] == sum(done.values())
    assert sum(requests["queued"].values()) == 0
    # The planner ran in the engine and the ticks followed its trajectory.
    assert shape["planner"] == "on"
    plan = shape["plan"]
    assert plan and plan["status"] == "optimal" and plan["horizon_s"] == 30
    assert len(plan["next_w"]) == 10 and all(0 <= w <= 560 for w in plan["next_w"])
    assert plan["solve_s"] < 0.5
    assert len(planned) >= 0.5 * len(history), "most ticks should have a plan to follow"
    # Each streamed high request was boosted once, and every boost ended.
    clock = status["clock"]
    print(f"[shape] clock {clock['boosts_total']} boosts, locked {clock['locked_mhz']}")
    assert clock["boosts_total"] == done["high"] and clock["boosting"] == 0
