"""Prefill boost: a streamed request of a boosted class runs its prefill unlocked, and the law's
lock comes back, unpaced, with its first token (powerbatch.control.clock.DeviceClock)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from conftest import run
from faults import Behaviour, chat_body, running_proxy, upstream
from helpers import async_wait_until
from prometheus_client import CollectorRegistry
from test_telemetry_clock import FlakyClock

from powerbatch.control.clock import DeviceClock
from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws.clock import ClockChoice, ClockInput
from powerbatch.control.types import Observation
from powerbatch.estimate import Features
from powerbatch.telemetry.clock import ClockActuator

LOCK = (345, 1200)


class RecordingClock(FlakyClock):
    """Each change the device sees, with its time; a lock may take `lock_s`."""

    def __init__(self, lock_s: float = 0.0) -> None:
        super().__init__()
        self.lock_s = lock_s
        self.history: list[tuple[float, tuple[int, int] | None]] = []

    async def lock(self, min_mhz: int, max_mhz: int) -> None:
        await asyncio.sleep(self.lock_s)
        await super().lock(min_mhz, max_mhz)
        self.history.append((time.monotonic(), self.locked))

    async def restore(self) -> None:
        await asyncio.sleep(self.lock_s)
        await super().restore()
        self.history.append((time.monotonic(), None))


def _law_locks(dev: DeviceClock, seen: list[ClockInput]) -> None:
    """The law, replaced by one that always wants LOCK and keeps what it was shown."""

    def tick(inp: ClockInput, trusted: bool) -> ClockChoice:
        seen.append(inp)
        return ClockChoice(LOCK, "test")

    dev.law.tick = tick  # type: ignore[method-assign]


def _obs(t_s: float) -> Observation:
    return Observation(
        t_s=t_s, power_w=300.0, sensor_ok=True, features=Features(4, 1000, 0, 100), in_flight=4,
        queued=0,
    )  # fmt: skip


async def _settle(dev: DeviceClock) -> None:
    if dev._task is not None:
        await dev._task


def test_a_boost_unlocks_at_once_and_the_last_ones_end_relocks_unpaced() -> None:
    async def main() -> dict[str, Any]:
        backend = RecordingClock()
        # Lowering is paced a minute apart: only the boost's own return may skip that.
        registry = CollectorRegistry()
        dev = DeviceClock(
            ClockActuator(backend, min_interval_s=60.0),
            ClockPolicy(clock_objective="energy"),
            ControlConfig(ceiling_w=600.0),
            registry,
        )
        seen: list[ClockInput] = []
        _law_locks(dev, seen)
        await dev.start()
        dev.tick(_obs(1.0), 1.0)
        await _settle(dev)
        out: dict[str, Any] = {"locked": backend.locked}
        first, second = dev.boost(), dev.boost()
        await _settle(dev)
        out["boosted"] = backend.locked
        dev.tick(_obs(1.5), 1.5)  # a tick while boosted keeps the lift
        await _settle(dev)
        out["tick_in_boost"] = (backend.locked, seen[-1].top_mhz, seen[-1].changed_at_s)
        first.end()
        first.end()  # idempotent: the second boost still runs
        await _settle(dev)
        out["one_left"] = (backend.locked, dev.boosting)
        second.end()
        await _settle(dev)
        out["ended"] = (backend.locked, dev.boosting, dev.boosts_total)
        dev.tick(_obs(2.0), 2.0)
        out["law_saw"] = (seen[-1].top_mhz, seen[-1].changed_at_s)
        out["changes"] = [lock for _, lock in backend.history]
        out["metric"] = registry.get_sample_value("powerbatch_sm_clock_boosts_total")
        return out

    out = run(main())
    assert out["locked"] == LOCK
    assert out["boosted"] is None  # unlocked: the driver's own policy, the top clock
    # The law is told its own lock's top, and a boost is not a change of the law's.
    assert out["tick_in_boost"] == (None, 1200.0, 1.0)
    assert out["one_left"] == (None, 1)
    assert out["ended"] == (LOCK, 0, 2)
    assert out["law_saw"] == (1200.0, 1.0)
    assert out["changes"] == [LOCK, None, LOCK]
    assert out["metric"] == 2.0


def test_a_boost_that_ends_while_a_change_is_in_flight_leaves_the_laws_lock() -> None:
    """The newest wanted is applied after a change in flight, never a stale one; and the way
    back from a lift is unpaced whoever asks for it (here a tick, after the boost ended)."""

    async def main() -> list[Any]:
        backend = RecordingClock(lock_s=0.05)
        dev = DeviceClock(
            ClockActuator(backend, min_interval_s=60.0),
            ClockPolicy(clock_objective="energy"),
            ControlConfig(ceiling_w=600.0),
            CollectorRegistry(),
        )
        _law_locks(dev, [])
        await dev.start()
        dev.tick(_obs(1.0), 1.0)
        await asyncio.sleep(0)  # the lock is in flight...
        dev.boost().end()  # ...when a whole boost comes and goes
        await _settle(dev)
        out: list[Any] = [backend.locked, backend.history[-1][1]]
        boost = dev.boost()
        await asyncio.sleep(0)  # the lift is in flight...
        boost.end()
        dev.tick(_obs(1.5), 1.5)  # ...and a tick asks for the law's lock after the boost
        await _settle(dev)
        return [*out, [lock for _, lock in backend.history]]

    assert run(main()) == [LOCK, LOCK, [LOCK, None, LOCK]]


def test_observe_mode_boosts_nothing() -> None:
    async def main() -> list[Any]:
        backend = RecordingClock()
        dev = DeviceClock(
            ClockActuator(backend),
            ClockPolicy(clock_objective="energy"),
            ControlConfig(ceiling_w=600.0, mode="observe"),  # type: ignore[arg-type]
            CollectorRegistry(),
        )
        _law_locks(dev, [])
        await dev.start()
        dev.tick(_obs(1.0), 1.0)
        boost = dev.boost()
        await _settle(dev)
        boost.end()
        await _settle(dev)
        return backend.history

    assert run(main()) == []


def test_the_proxy_boosts_a_streamed_high_prefill_until_its_first_token_only() -> None:
    """A streamed high request: unlocked from before its headers to its first event, locked
    again while it decodes. A normal stream and a whole high answer run under the lock."""

    async def main() -> dict[str, Any]:
        backend = RecordingClock()
        behaviour = Behaviour(delay_s=0.3, tokens=4, token_interval_s=0.15)
        async with (
            upstream(behaviour) as up,
            running_proxy(
                up.url,
                sm_clock=ClockActuator(backend, min_interval_s=60.0),
                clock_policy=ClockPolicy(clock_objective="energy", clock_boost_classes=("high",)),
            ) as p,
        ):
            dev = p.gov.loop.sm_clock
            assert dev is not None
            _law_locks(dev, [])

            await async_wait_until(lambda: backend.locked == LOCK, 5.0, "the law's lock")
            out: dict[str, Any] = {}
            async with aiohttp.ClientSession() as s:
                for name, priority, stream in (
                    ("high_stream", "high", True),
                    ("normal_stream", "normal", True),
                    ("high_whole", "high", False),
                ):
                    n0 = len(backend.history)
                    t0 = time.monotonic()
                    async with s.post(
                        p.url + "/v1/chat/completions",
                        json=chat_body(stream=stream),
                        headers={"x-priority": priority},
                    ) as resp:
                        first = await resp.content.readany()
                        t_first = time.monotonic()
                        await resp.read()
                    out[name] = {
                        "changes": [(t - t0, lock) for t, lock in backend.history[n0:]],
                        "first_s": t_first - t0,
                        "status": resp.status,
                        "got": bool(first),
                    }
                # An upstream that fails before the first token: the boost ends with it.
                up.behaviour = Behaviour(delay_s=0.3, status=500)
                n0 = len(backend.history)
                async with s.post(
                    p.url + "/v1/chat/completions",
                    json=chat_body(stream=True),
                    headers={"x-priority": "high"},
                ) as resp:
                    await resp.read()
                    out["failed"] = resp.status
                await async_wait_until(lambda: backend.locked == LOCK, 2.0, "relocked")
                out["failed_changes"] = [lock for _, lock in backend.history[n0:]]
            out["boosting"] = dev.boosting
            return out

    out = run(main())
    hs = out["high_stream"]
    assert hs["status"] == 200 and hs["got"]
    (t_up, up_lock), (t_down, down_lock) = hs["changes"]
    assert up_lock is None and down_lock == LOCK
    # Lifted before the headers (the prefill), locked again by the first event, for the decode.
    assert t_up < 0.3 <= t_down <= hs["first_s"] + 0.05
    for name in ("normal_stream", "high_whole"):
        assert out[name]["status"] == 200 and out[name]["changes"] == [], name
    assert out["failed"] >= 500 and out["failed_changes"] == [None, LOCK]
    assert out["boosting"] == 0
