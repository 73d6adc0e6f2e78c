"""Power telemetry faults: the sensor errors, goes stale, lies, or lags.

Each fault must drive the controller to fail closed (batch at safe_batch, `state: fail_closed`,
`binding: sensor`, `powerbatch_sensor_ok 0`) and admission must actually hold the safe batch;
when the sensor comes back, so do the limits.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from conftest import run
from faults import Behaviour, Proxy, chat_body, running_proxy, upstream
from helpers import async_wait_until

BATCH, SAFE = 8, 2


class _Flapping:
    """A good value only every `period_s`, errors between: stale for most of each period."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.next_s = 0.0

    def __call__(self) -> float | None:
        now = time.monotonic()
        if now < self.next_s:
            return None  # nothing new from the source
        self.next_s = now + self.period_s
        return 300.0


# fault -> the sensor state that produces it (ScriptedPowerSource: "w" and "delay_s").
FAULTS: dict[str, Callable[[], dict[str, Any]]] = {
    "error": lambda: {"w": None},
    "nan": lambda: {"w": math.nan},
    "inf": lambda: {"w": math.inf},
    "negative": lambda: {"w": -50.0},
    "absurd_spike": lambda: {"w": 1e9},
    "hung_read": lambda: {"delay_s": 30.0},  # the monitor's read timeout must fire
    "lagging_reads": lambda: {"delay_s": 0.5},  # each answer later than stale_after_s
}


async def _wait_state(p: Proxy, want: Callable[[dict[str, Any]], bool], limit_s: float) -> float:
    t0 = time.monotonic()
    await async_wait_until(
        lambda: want(p.gov.status()),
        limit_s,
        lambda: f"the state wanted (now {p.gov.status()['state']})",
        interval_s=0.02,
    )
    return time.monotonic() - t0


async def _metric(s: aiohttp.ClientSession, p: Proxy, name: str) -> float:
    async with s.get(p.url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_sensor_fault_fails_closed_and_recovers(fault: str) -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(tokens=4, token_interval_s=0.05)) as up,
            running_proxy(up.url, batch=BATCH, safe_batch=SAFE) as p,
            aiohttp.ClientSession() as s,
        ):
            assert p.gov.queue.limits.max_requests == BATCH
            assert await _metric(s, p, "powerbatch_sensor_ok") == 1.0
            p.power.update(FAULTS[fault]())
            took = await _wait_state(p, lambda st: st["state"] == "fail_closed", 2.0)
            assert took < 1.5  # stale_after_s 0.3, ticks at 20 Hz
            async with s.get(p.url + "/status") as r:
                st = await r.json()
            assert st["binding"] == "sensor" and st["power"]["sensor_ok"] is False
            assert st["limits"]["enforced"]["max_requests"] == SAFE
            assert st["power"]["sensor_error"]
            assert "safe limit" in st["reason"]
            assert await _metric(s, p, "powerbatch_sensor_ok") == 0.0
            assert await _metric(s, p, 'powerbatch_controller_state{state="fail_closed"}') == 1.0
            # Admission holds it: of 2 x SAFE concurrent requests, SAFE at a time go upstream.
            up.max_active = 0
            replies = await asyncio.gather(
                *(s.post(p.url + "/v1/chat/completions", json=chat_body()) for _ in range(2 * SAFE))
            )
            assert [r.status for r in replies] == [200] * 2 * SAFE
            for r in replies:
                r.release()
            assert up.max_active <= SAFE
            # Recovery: good readings again -> limits come back.
            p.power.update(w=300.0, delay_s=0.0)
            await _wait_state(
                p,
                lambda st: (
                    st["state"] != "fail_closed"
                    and st["limits"]["enforced"]["max_requests"] == BATCH
                ),
                3.0,
            )
            assert await _metric(s, p, "powerbatch_sensor_ok") == 1.0

    run(go())


def test_single_spike_within_plausible_range_is_filtered_not_acted_on() -> None:
    """One wild-but-possible sample is an outlier to the Hampel filter, not an emergency cut."""

    async def go() -> None:
        async with upstream() as up, running_proxy(up.url, batch=BATCH) as p:
            await asyncio.sleep(0.3)  # fill the filter's window with normal samples
            n = {"i": 0}

            def one_spike() -> float:
                n["i"] += 1
                return 2500.0 if n["i"] == 1 else 300.0  # 2.5 x the 1000 W ceiling, once

            t0 = time.monotonic()
            p.power["w"] = one_spike
            await asyncio.sleep(0.3)
            after = [r for r in p.gov.history if r.t_s >= t0]
            assert n["i"] > 5 and len(after) > 3
            assert all(r.state == "warmup" and r.limit_requests == BATCH for r in after)
            assert max(r.power_w or 0.0 for r in after) < 400.0  # the 2500 W sample was dropped

    run(go())


def test_flapping_sensor_is_fail_closed_whenever_it_is_stale() -> None:
    async def go() -> None:
        async with upstream() as up, running_proxy(up.url, batch=BATCH, safe_batch=SAFE) as p:
            p.power["w"] = _Flapping(0.8)
            t0 = time.monotonic()
            await asyncio.sleep(2.0)
            ticks = [r for r in p.gov.history if r.t_s > t0 + 0.4]
            closed = [r for r in ticks if r.state == "fail_closed"]
            assert len(closed) > len(ticks) / 2  # good for at most 0.3 s of every 0.8 s
            assert all(r.limit_requests <= SAFE and r.binding == "sensor" for r in closed)

    run(go())
