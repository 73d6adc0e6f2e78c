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

BATCH, SAFE = 8, 2


def _hang() -> float:
    """A read that blocks (a hung driver or exporter): the monitor's read timeout must fire."""
    time.sleep(0.6)  # longer than stale_after_s (0.3), shorter than the test's patience
    return 300.0


class _Lagging:
    """Good values, but each only every `period_s`: older than stale_after_s between them."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.next_s = 0.0

    def __call__(self) -> float | None:
        now = time.monotonic()
        if now < self.next_s:
            return None  # nothing new from the source
        self.next_s = now + self.period_s
        return 300.0


FAULTS: dict[str, Callable[[], Any]] = {
    "error": lambda: None,
    "nan": lambda: math.nan,
    "inf": lambda: math.inf,
    "negative": lambda: -50.0,
    "absurd_spike": lambda: 1e9,
    "hung_read": lambda: _hang,
    "lagging": lambda: _Lagging(0.8),
}


async def _wait_state(p: Proxy, want: Callable[[dict[str, Any]], bool], limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if want(p.gov.status()):
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"state not reached in {limit_s} s: {p.gov.status()['state']}")


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
            upstream(Behaviour(tokens=10, token_interval_s=0.05)) as up,
            running_proxy(up.url, batch=BATCH, safe_batch=SAFE) as p,
            aiohttp.ClientSession() as s,
        ):
            assert p.gov.queue.limits.max_requests == BATCH
            assert await _metric(s, p, "powerbatch_sensor_ok") == 1.0
            p.power["w"] = FAULTS[fault]()  # a callable is called on every read
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
            # Admission holds it: of BATCH concurrent requests, at most SAFE reach the upstream.
            up.max_active = 0
            replies = await asyncio.gather(
                *(s.post(p.url + "/v1/chat/completions", json=chat_body()) for _ in range(BATCH))
            )
            assert [r.status for r in replies] == [200] * BATCH
            for r in replies:
                r.release()
            assert up.max_active <= SAFE
            # Recovery: good readings again -> limits come back.
            p.power["w"] = 300.0
            await _wait_state(
                p,
                lambda st: st["state"] != "fail_closed"
                and st["limits"]["enforced"]["max_requests"] == BATCH,
                3.0,
            )
            assert await _metric(s, p, "powerbatch_sensor_ok") == 1.0

    run(go())


def test_single_spike_within_plausible_range_is_filtered_not_acted_on() -> None:
    """One wild-but-possible sample is an outlier to the Hampel filter, not an emergency cut."""

    async def go() -> None:
        async with upstream() as up, running_proxy(up.url, batch=BATCH) as p:
            await asyncio.sleep(0.5)  # fill the filter's window with normal samples
            n = {"i": 0}

            def one_spike() -> float:
                n["i"] += 1
                return 2500.0 if n["i"] == 1 else 300.0  # 2.5 x the 1000 W ceiling, once

            p.power["w"] = one_spike
            await asyncio.sleep(0.5)
            states = {r.state for r in p.gov.history}
            assert "fail_closed" not in states or p.gov.status()["state"] != "fail_closed"
            assert max(r.power_w or 0.0 for r in list(p.gov.history)[-20:]) < 1000.0
            assert p.gov.queue.limits.max_requests == BATCH

    run(go())
