"""The SM clock actuator's safety rules, each a test: clocks within the supported ones, reset on
exit and after a crash (the state file), a failed, refused or timed-out lock falls back to
unlocked clocks (in /status and a metric), the rate limit and dead band, and the ceiling still
failing closed without a trustworthy reading.

zeusd is the simulator's own zeusd API over real HTTP (zeusd's routes and shapes,
zeusd/src/routes/gpu.rs); it refuses a lock outside the supported clocks, so an actuator that
forgot to snap fails here. NVML is the fake pynvml of test_telemetry_nvml.py with the clock
calls added.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pynvml
import pytest
from conftest import run
from prometheus_client import CollectorRegistry
from test_telemetry_nvml import FakeGpu, fake_nvml

from powerbatch.control.clock import DeviceClock
from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.errors import ClockError
from powerbatch.sim import SimEngine
from powerbatch.sim.server import SimServer, start_sim_server
from powerbatch.telemetry.clock import (
    ClockActuator,
    NoClock,
    NvmlClock,
    ZeusdClock,
    grid_mhz,
    snap_lock,
)
from powerbatch.telemetry.limiter import ZeusdLimiter
from powerbatch.telemetry.zeusd import ZeusdClient

SUPPORTED = grid_mhz(345, 1980, 15)


async def _supported() -> list[int]:
    return SUPPORTED


def zeusd_clock(server: SimServer, state_dir: Path, gpus: tuple[int, ...] = (0, 1)) -> ZeusdClock:
    return ZeusdClock(ZeusdClient(server.url), gpus, supported=_supported, state_dir=state_dir)


def with_sim(body: Any, profile: str = "h100x4-llama70b") -> Any:
    async def main() -> Any:
        engine = SimEngine(profile, seed=3)
        server = await start_sim_server(engine, zeusd_apply_delay_s=0.01)
        try:
            return await body(server)
        finally:
            await server.close()

    return run(main())


def test_snap_lock_always_lands_on_supported_clocks() -> None:
    rng = np.random.default_rng(7)
    for _ in range(2000):
        a, b = sorted(rng.uniform(-500, 3000, 2))
        lo, hi = snap_lock(float(a), float(b), SUPPORTED)
        assert lo in SUPPORTED and hi in SUPPORTED and lo <= hi
    assert snap_lock(1000, 1234, SUPPORTED) == (1005, 1230)  # inside the request
    assert snap_lock(0, 99_999, SUPPORTED) == (345, 1980)


def test_requests_outside_the_supported_clocks_are_snapped_not_refused(tmp_path: Path) -> None:
    async def body(server: SimServer) -> list[Any]:
        act = ClockActuator(zeusd_clock(server, tmp_path), min_interval_s=0.0)
        assert await act.start()
        seen = [await act.apply((100.0, 1234.0))]
        seen.append(server.engine.gpu_locked_clocks_mhz)
        seen.append(await act.apply((1.0, 5000.0)))  # spans them all: same as unlocked
        seen.append(server.engine.gpu_locked_clocks_mhz)
        seen.append(act.status())
        await act.restore()
        await act.backend.close()
        return seen

    lock, engine_locks, wide, after, status = with_sim(body)
    assert lock == (345, 1230)
    assert engine_locks[:2] == [(345, 1230)] * 2 and engine_locks[2:] == [None, None]
    assert wide is None and after == [None] * 4
    assert status["failures_total"] == 0 and not status["degraded"]


def test_a_crashed_run_leaves_a_state_file_and_the_next_start_resets_first(
    tmp_path: Path,
) -> None:
    async def body(server: SimServer) -> list[Any]:
        crashed = zeusd_clock(server, tmp_path)
        await crashed.start()
        await crashed.lock(345, 1005)  # ... and the process dies without restore()
        await crashed.close()
        locked = server.engine.gpu_locked_clocks_mhz
        record = json.loads(crashed.state_file.path.read_text())
        fresh = zeusd_clock(server, tmp_path)
        await fresh.start()
        after = server.engine.gpu_locked_clocks_mhz
        exists = fresh.state_file.exists()
        await fresh.close()
        return [locked, record, after, fresh.recovered, exists]

    locked, record, after, recovered, exists = with_sim(body)
    assert locked[:2] == [(345, 1005)] * 2
    assert record["backend"] == "zeusd" and record["gpu_ids"] == [0, 1]
    assert after == [None] * 4 and recovered and not exists


def test_a_corrupt_state_file_still_resets_the_clocks(tmp_path: Path) -> None:
    """A reset needs nothing from the record (unlike a limit's restore, which needs the limits
    in force before): a corrupt one is reset anyway, never left locked."""

    async def body(server: SimServer) -> list[Any]:
        crashed = zeusd_clock(server, tmp_path)
        await crashed.start()
        await crashed.lock(345, 1005)
        await crashed.close()
        crashed.state_file.path.write_text("{not json")
        fresh = zeusd_clock(server, tmp_path)
        await fresh.start()
        after = server.engine.gpu_locked_clocks_mhz
        await fresh.close()
        return [after, fresh.recovered, fresh.state_file.exists()]

    after, recovered, exists = with_sim(body)
    assert after == [None] * 4 and recovered and not exists


def test_clock_gpu_ids_are_checked_and_named_as_the_limiters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duplicates"):
        NvmlClock((0, 0), state_dir=tmp_path)
    with pytest.raises(ValueError, match="at least one"):
        NvmlClock((), state_dir=tmp_path)
    clock = ZeusdClock(
        ZeusdClient("http://127.0.0.1:4938"), (0, 2), supported=_supported, state_dir=tmp_path
    )
    limiter = ZeusdLimiter("http://127.0.0.1:4938", (0, 2), state_dir=tmp_path)
    assert clock.state_file.path.name == "clocks-zeusd_127.0.0.1_4938-0_2.json"
    assert limiter.state_file.path.name == "limits-zeusd_127.0.0.1_4938-0_2.json"


class FlakyClock(NoClock):
    """A backend whose lock fails (or hangs) on demand; restore records the reset."""

    controls_device = True
    name = "flaky"

    def __init__(self, *, fail: str | None = None, reset_fails: bool = False) -> None:
        self.fail = fail
        self.reset_fails = reset_fails
        self.locked: tuple[int, int] | None = None
        self.resets = 0

    def supported_mhz(self) -> list[int]:
        return SUPPORTED

    async def lock(self, min_mhz: int, max_mhz: int) -> None:
        if self.fail == "refused":
            raise ClockError("NVML error: the argument is invalid")
        if self.fail == "hang":
            await asyncio.sleep(10)
        self.locked = (min_mhz, max_mhz)

    async def restore(self) -> None:
        self.resets += 1
        if self.reset_fails:
            raise ClockError("reset refused")
        self.locked = None


@pytest.mark.parametrize("fail", ["refused", "hang"])
def test_a_failed_or_timed_out_lock_falls_back_to_unlocked(
    fail: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> list[Any]:
        backend = FlakyClock(fail=fail)
        t = [0.0]
        act = ClockActuator(backend, timeout_s=0.05, clock=lambda: t[0])
        await act.start()
        with caplog.at_level(logging.WARNING, logger="powerbatch.telemetry.clock"):
            result = await act.apply((345.0, 1200.0))
        first = (result, backend.resets, act.status())
        again = await act.apply((345.0, 1200.0))  # inside the backoff: not retried
        t[0] = 5.0
        backend.fail = None
        retried = await act.apply((345.0, 1200.0))
        return [first, again, retried, act.status()]

    (result, resets, status), again, retried, later = run(main())
    assert result is None and resets == 1  # reset to the driver's policy
    assert status["degraded"] and status["fallbacks_total"] == 1 and status["locked_mhz"] is None
    assert "falling back to unlocked" in caplog.text
    assert again is None
    assert retried == (345, 1200) and not later["degraded"]


def test_a_failed_fallback_marks_the_clock_unknown() -> None:
    async def main() -> dict[str, Any]:
        act = ClockActuator(FlakyClock(fail="refused", reset_fails=True))
        await act.start()
        await act.apply((345.0, 1200.0))
        return act.status()

    status = run(main())
    assert status["degraded"] and status["known"] is False


def test_changes_are_rate_limited_with_a_dead_band_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> list[Any]:
        backend = FlakyClock()
        t = [100.0]
        act = ClockActuator(backend, dead_band_mhz=45, min_interval_s=2.0, clock=lambda: t[0])
        await act.start()
        out: list[Any] = []
        with caplog.at_level(logging.INFO, logger="powerbatch.telemetry.clock"):
            out.append(await act.apply((345, 1500)))  # a first lock
            t[0] += 0.5
            out.append(act.decide(act.normalise((345, 1200)), t[0]))  # lower, too soon
            out.append(await act.apply((345, 1200)))
            out.append(act.decide(act.normalise((345, 1530)), t[0]))  # +30 MHz: dead band
            out.append(await act.apply((345, 1800)))  # higher: at once
            t[0] += 2.5
            out.append(await act.apply((345, 1200)))  # lower, after the interval
            out.append(await act.apply(None))  # unlocking goes at once
        out.append(act.changes_total)
        return out

    first, too_soon, held, dead, up, down, unlocked, changes = run(main())
    assert first == (345, 1500) and too_soon == "too_soon" and held == (345, 1500)
    assert dead == "dead_band" and up == (345, 1800) and down == (345, 1200)
    assert unlocked is None and changes == 4
    assert caplog.text.count("SM clocks") == 4


def test_nvml_clock_reads_supported_clocks_locks_and_maps_no_permission(tmp_path: Path) -> None:
    gpus = [FakeGpu(), FakeGpu()]
    nvml = fake_nvml(gpus)
    state: dict[int, tuple[int, int] | None] = {id(g): None for g in gpus}
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 2619 if kind == pynvml.NVML_CLOCK_MEM else 1980
    nvml.nvmlDeviceGetSupportedGraphicsClocks = lambda h, mem: list(range(1980, 344, -15))
    deny = {"on": False}

    def lock(h: Any, lo: int, hi: int) -> None:
        if deny["on"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        state[id(h)] = (lo, hi)

    def reset(h: Any) -> None:
        state[id(h)] = None

    nvml.nvmlDeviceSetGpuLockedClocks = lock
    nvml.nvmlDeviceResetGpuLockedClocks = reset

    async def main() -> list[Any]:
        clock = NvmlClock((0, 1), state_dir=tmp_path, nvml=nvml)
        act = ClockActuator(clock)
        await act.start()
        out: list[Any] = [act.supported_mhz()[:2], await act.apply((300, 1111))]
        out.append(dict(state))
        out.append(await act.sample())
        deny["on"] = True
        await act.apply((300, 1500))
        out.append(act.status())
        await act.restore()
        out.append(clock.state_file.exists())
        await clock.close()
        return out

    first, lock_, locked, mhz, status, exists = run(main())
    assert first == [345, 360] and lock_ == (345, 1110)
    assert list(locked.values()) == [(345, 1110)] * 2
    assert mhz == 1980.0
    assert status["degraded"] and "CAP_SYS_ADMIN" in status["degraded_reason"]
    assert status["locked_mhz"] is None and not exists


def test_device_clock_stop_resets_and_exports_the_fallback_metric(tmp_path: Path) -> None:
    from powerbatch.control.types import Observation
    from powerbatch.estimate import Features

    async def main() -> list[Any]:
        backend = FlakyClock(fail="refused")
        registry = CollectorRegistry()
        cfg = ControlConfig(ceiling_w=600.0)
        dev = DeviceClock(
            ClockActuator(backend), ClockPolicy(clock_objective="energy"), cfg, registry
        )
        await dev.start()
        await dev.actuator.apply((345, 1200))  # refused: falls back
        obs = Observation(
            t_s=1.0, power_w=300.0, sensor_ok=True, features=Features(4, 1000, 0, 100), in_flight=4,
            queued=0,
        )  # fmt: skip
        dev.tick(obs, 1.0)
        values = {
            s.name: s.value
            for m in registry.collect()
            for s in m.samples
            if s.name.startswith("powerbatch_sm_clock")
        }
        backend.fail = None
        backend.locked = (345, 1200)
        await dev.stop()
        return [values, backend.locked, dev.status()]

    values, locked, status = run(main())
    assert values["powerbatch_sm_clock_fallbacks_total"] == 1.0
    assert values["powerbatch_sm_clock_degraded"] == 1.0
    assert math.isnan(values["powerbatch_sm_clock_mhz"])
    assert locked is None and status["fallbacks_total"] == 1


def test_a_failed_tick_and_observe_mode_leave_the_clock_unlocked() -> None:
    async def main() -> list[Any]:
        out: list[Any] = []
        for mode in ("enforce", "observe"):
            backend = FlakyClock()
            cfg = ControlConfig(ceiling_w=600.0, mode=mode)  # type: ignore[arg-type]
            dev = DeviceClock(
                ClockActuator(backend, min_interval_s=0.0),
                ClockPolicy(clock_objective="energy"),
                cfg,
                CollectorRegistry(),
            )
            await dev.start()
            await dev.actuator.apply((345, 1200))
            if mode == "enforce":
                dev.fail_safe()  # the loop's answer to a tick that raised
            else:
                from powerbatch.control.types import Observation
                from powerbatch.estimate import Features

                obs = Observation(
                    t_s=1.0, power_w=300.0, sensor_ok=True, features=Features(4, 1000, 0, 100),
                    in_flight=4, queued=0,
                )  # fmt: skip
                dev.tick(obs, 1.0)
            assert dev._task is not None
            await dev._task
            out.append(backend.locked)
        return out

    assert run(main()) == [None, None]


def test_no_lock_without_a_writable_state_file(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")

    async def body(server: SimServer) -> list[Any]:
        act = ClockActuator(zeusd_clock(server, blocker))
        await act.start()
        lock = await act.apply((345.0, 1200.0))
        status = act.status()
        await act.backend.close()
        return [lock, server.engine.gpu_locked_clocks_mhz, status]

    lock, locks, status = with_sim(body)
    assert lock is None and locks == [None] * 4
    assert status["degraded"] and "state file" in status["degraded_reason"]


def test_counter_rate_is_interpolated_between_scrapes_and_cut_at_the_last() -> None:
    from powerbatch.control.window import counter_rate

    scrapes = [(0.0, 0.0), (1.0, 100.0), (2.0, 500.0), (2.5, 600.0)]
    assert counter_rate(scrapes, 1.0, 2.0) == pytest.approx(400.0)
    assert counter_rate(scrapes, 0.5, 1.5) == pytest.approx(250.0)  # half of each second
    # Cut at the last scrape: 1.8..2.5 s, 180 tokens in 0.7 s.
    assert counter_rate(scrapes, 1.8, 2.8) == pytest.approx(180.0 / 0.7)
    assert counter_rate(scrapes, 2.4, 3.4) == pytest.approx(200.0)  # mostly unknown: last rate
    assert counter_rate(scrapes[:1], 0.0, 1.0) is None
    assert counter_rate(scrapes, 2.0, 2.0) is None


def test_the_clock_law_prices_a_reading_with_the_engines_tokens_of_its_second() -> None:
    """Answers not streamed reach the proxy's count at their end: the second a reading
    measured can show none of the 2,000 tokens/s the engine generated in it. The law gets the
    engine's counter over that second (the meter's lag back), a held reading the same."""
    from powerbatch.control.types import EngineLoad, Observation
    from powerbatch.estimate import Features

    dev = DeviceClock(
        ClockActuator(FlakyClock()),
        ClockPolicy(clock_objective="energy"),
        ControlConfig(ceiling_w=600.0),
        CollectorRegistry(),
    )
    # 1,000 tokens/s until 8 s, then 3,000 tokens/s.
    scrapes = tuple((float(t), 1000.0 * t + 2000.0 * max(0, t - 8)) for t in range(11))
    engine = EngineLoad(0.0, 8, 2.0, 10.0, generated=scrapes)
    proxy = Features(8, 1000, 0, 0)  # the proxy counted no token in the reading's second

    def seen(t_s: float, weight: float, load: EngineLoad | None) -> float | None:
        obs = Observation(
            t_s=t_s, power_w=300.0, sensor_ok=True, features=proxy, in_flight=8, queued=0,
            engine=load, reading_weight=weight,
        )  # fmt: skip
        dev.tick(obs, t_s, meter_lag_s=2.0)
        return dev.law.last_input.decode_tok_s if dev.law.last_input else None

    assert seen(11.0, 1.0, engine) == pytest.approx(3000.0)  # the second 8..9 s it measured
    assert seen(11.2, 0.0, engine) == pytest.approx(3000.0)  # held: the same second
    assert seen(9.0, 1.0, engine) == pytest.approx(1000.0)  # 6..7 s
    assert seen(12.0, 1.0, None) == 0.0  # no engine counter: the proxy's own count
