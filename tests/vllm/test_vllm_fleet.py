"""The vLLM scheduler plugin as a fleet member: its engine limit follows its leased share.

A real vLLM (CPU build, the tiny model) runs the powerbatch scheduler as member `vllm` of a
budget on a real `redis-server`; the other member is a `FleetMember` in this test's process,
publishing a scripted bid, as a proxy in front of another server would. First the other member
bids high and takes most of the budget: vLLM's share is small and the scheduler holds a small
batch. Then the other member's demand goes away: the allocator moves the watts to vLLM, and
the batch limit in force in vLLM's scheduler grows with the share. Power is the simulator's
H100 model of vLLM's exact steps (no GPU here), as in test_vllm_plugin.py.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer, redis_or_skip
from vllm_harness import OUT, Sampler, value, vllm_server

from powerbatch.fleet import FleetSettings
from powerbatch.fleet.member import FleetMember, MemberSignals

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BUDGET_W = 1100.0
# The other member's demand while it is hot: vLLM keeps its fair floor, the budget / N (550 W),
# under what the CPU vLLM draws unbounded (~600 W), so that the share binds; when the other's
# demand goes, vLLM may take up to its own limit.
OTHER_WANT_W = 700.0
VLLM_MIN_W, VLLM_MAX_W = 200.0, 700.0
TTL_S = 3.0
PHASE_S = 45.0
SETTLE_S = 15.0  # samples this long after a change are the transition, not judged
CLIENTS = 48
PROMPT_TOKENS = 32
MAX_TOKENS = 48


def prompt(n: int, seed: int) -> str:
    """`n` words the tiny model's word-level tokenizer counts one token each."""
    return " ".join(f"w{(seed * 7 + i) % 500}" for i in range(n))


async def closed_loop(base_url: str, seconds: float, counts: dict[str, int]) -> None:
    """`CLIENTS` streaming clients, each sending its next request when the last one ends."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            try:
                stream = await client.completions.create(
                    model="tiny",
                    prompt=prompt(PROMPT_TOKENS, i * 1000 + n),
                    max_tokens=MAX_TOKENS,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    timeout=120,
                )
                async for _ in stream:
                    pass
                counts["ok"] += 1
            except openai.OpenAIError:
                counts["errors"] += 1
                await asyncio.sleep(0.2)

    await asyncio.gather(*(worker(i) for i in range(CLIENTS)))
    await client.close()


def judged(rows: list[dict[str, Any]], phase: str, start_s: float) -> list[dict[str, float]]:
    """The plugin's figures per sample in `phase`, from SETTLE_S after it began."""
    out = []
    for r in rows:
        p = r.get("plugin") or {}
        if r["phase"] != phase or r["t_s"] < start_s + SETTLE_S or not p:
            continue
        out.append(
            {
                "share_w": value(p, "powerbatch_fleet_share_watts") or math.nan,
                "power_w": value(p, "powerbatch_power_watts") or math.nan,
                "engine_limit": value(p, "powerbatch_engine_limit", knob="active_requests")
                or math.nan,
                "running": value(p, "powerbatch_engine_requests_running") or 0.0,
                "fallback": value(p, "powerbatch_fleet_fallback") or 0.0,
                "members": value(p, "powerbatch_fleet_members") or 0.0,
            }
        )
    return out


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def test_vllm_plugin_member_follows_its_share(tmp_path: Path) -> None:
    redis_or_skip()
    import powerbatch.fleet.member as member_module

    # Which powerbatch this run tests: the worktree's, when PYTHONPATH puts it first.
    print(f"\npowerbatch imported from {member_module.__file__}", file=sys.stderr)
    print(f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", file=sys.stderr)
    redis = RedisServer(tmp_path)
    redis.start()
    budget = "vllm-fleet"
    env = {
        "POWERBATCH_VLLM_CEILING_W": "600",
        "POWERBATCH_VLLM_POWER_SOURCE": "model",
        "POWERBATCH_VLLM_MODEL_PROFILE": "h100-llama8b",
        "POWERBATCH_VLLM_MODE": "enforce",
        "POWERBATCH_VLLM_FLEET_BUDGET": budget,
        "POWERBATCH_VLLM_FLEET_BUDGET_W": str(BUDGET_W),
        "POWERBATCH_VLLM_FLEET_REDIS_URL": redis.url,
        "POWERBATCH_VLLM_FLEET_MEMBER_ID": "vllm",
        "POWERBATCH_VLLM_FLEET_MEMBERS": "2",
        "POWERBATCH_VLLM_FLEET_MIN_SHARE_W": str(VLLM_MIN_W),
        "POWERBATCH_VLLM_FLEET_MAX_SHARE_W": str(VLLM_MAX_W),
        "POWERBATCH_VLLM_FLEET_LEASE_TTL_S": str(TTL_S),
    }
    other_settings = FleetSettings(
        fleet_budget=budget,
        fleet_budget_w=BUDGET_W,
        fleet_redis_url=redis.url,
        fleet_members=2,
        fleet_min_share_w=100.0,
        fleet_max_share_w=OTHER_WANT_W,
        fleet_lease_ttl_s=TTL_S,
    )
    want = {"w": OTHER_WANT_W}
    # The other member's server: it draws what it wants, up to its share.
    other: FleetMember | None = None

    def bid() -> MemberSignals:
        assert other is not None
        drawn = min(want["w"], other.usable_w()) if want["w"] > 0 else 90.0
        hot = want["w"] > 0
        return MemberSignals(
            power_w=drawn,
            in_flight=8 if hot else 0,
            queued_by_class={"high": 8} if hot else {},
            value_per_w=1e4 if hot else 0.0,  # worth far more than vLLM's watts
            want_w=want["w"],
        )

    other = FleetMember(other_settings, "other", signals=bid)
    try:
        with vllm_server("fleet", env) as server:
            sampler = Sampler({"plugin": server.plugin_url + "/metrics"})
            starts: dict[str, float] = {}
            counts = {"ok": 0, "errors": 0}
            moved_s: float | None = None

            async def drive() -> None:
                nonlocal moved_s
                assert other is not None
                await other.start()
                sampler.start()
                try:
                    sampler.phase = starts_phase("small", starts, sampler)
                    await closed_loop(server.url, PHASE_S, counts)
                    want["w"] = 0.0  # the other member's demand goes away
                    sampler.phase = starts_phase("large", starts, sampler)
                    load = asyncio.create_task(closed_loop(server.url, PHASE_S, counts))
                    t0 = time.monotonic()
                    while not load.done():
                        rows = sampler.rows[-1:]
                        p = rows[0].get("plugin") if rows else None
                        share = value(p, "powerbatch_fleet_share_watts") if p else None
                        if moved_s is None and share is not None and share >= 0.9 * VLLM_MAX_W:
                            moved_s = time.monotonic() - t0
                        await asyncio.sleep(0.25)
                    await load
                finally:
                    sampler.stop()
                    await other.stop()

            asyncio.run(drive())
            small = judged(sampler.rows, "small", starts["small"])
            large = judged(sampler.rows, "large", starts["large"])
            report = {
                phase: {k: round(med(rows, k), 1) for k in rows[0]}
                for phase, rows in (("small", small), ("large", large))
                if rows
            }
            print(f"\n[fleet] medians {report}", file=sys.stderr)
            print(f"[fleet] watts moved to vLLM in {moved_s} s; load {counts}", file=sys.stderr)
            (OUT / "fleet-samples.json").write_text(repr(sampler.rows)[:2_000_000])
            assert small and large, "no samples from the plugin"
            assert counts["ok"] > 0 and counts["errors"] <= 0.05 * counts["ok"], counts
            # Both members live on one budget.
            assert med(small, "members") == 2 and med(large, "members") == 2
            assert max(r["fallback"] for r in small + large) == 0
            # The share: its fair floor (budget / N; docs/fleet.md) while the other member is
            # hot and worth more, not the other's whole want, then the most vLLM may take,
            # within a few lease periods.
            assert med(small, "share_w") <= BUDGET_W / 2 + 1.0
            assert med(small, "share_w") < VLLM_MAX_W
            assert med(large, "share_w") >= 0.9 * VLLM_MAX_W
            assert moved_s is not None and moved_s <= 4 * TTL_S
            # The limit in force in vLLM's scheduler follows the share, and the power holds it.
            assert med(large, "engine_limit") >= 1.5 * med(small, "engine_limit"), report
            assert med(large, "running") > med(small, "running"), report
            for rows in (small, large):
                over = [r for r in rows if r["power_w"] > r["share_w"]]
                assert len(over) <= 0.05 * len(rows), over[:5]
    finally:
        redis.kill()


def starts_phase(name: str, starts: dict[str, float], sampler: Sampler) -> str:
    starts[name] = sampler.now()
    return name
