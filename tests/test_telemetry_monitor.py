"""PowerMonitor driven by a scripted fake PowerSource and a hand-advanced clock."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

import pytest

from powerbatch.errors import SensorReadError, SensorUnavailable
from powerbatch.telemetry import PowerMonitor, PowerReading, PowerSample

Step = float | Exception | PowerSample


class ScriptedSource:
    """Plays a list of power values (or exceptions); sample i is at t_s = i * dt_s, and its
    energy counter has risen by each value read so far x dt_s (None with `energy=False`)."""

    name = "scripted"

    def __init__(self, script: Sequence[Step], dt_s: float = 0.1, energy: bool = True) -> None:
        self.script: list[Step] = list(script)
        self.dt_s = dt_s
        self.reads = 0
        self.energy_j: float | None = 0.0 if energy else None

    async def read(self) -> PowerSample:
        step = self.script[min(self.reads, len(self.script) - 1)]
        t_s = self.reads * self.dt_s
        self.reads += 1
        if isinstance(step, Exception):
            raise step
        if isinstance(step, PowerSample):
            return step
        if self.energy_j is not None:
            self.energy_j += step * self.dt_s
        return PowerSample(t_s=t_s, power_w=step, energy_j=self.energy_j)

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def poll_all(monitor: PowerMonitor, n: int, clock: Clock, dt_s: float = 0.1) -> list[PowerReading]:
    async def run() -> list[PowerReading]:
        out = []
        for _ in range(n):
            out.append(await monitor.poll_once())
            clock.now_s += dt_s
        return out

    return asyncio.run(run())


def test_good_samples_are_filtered_smoothed_and_counted() -> None:
    clock = Clock()
    monitor = PowerMonitor(ScriptedSource([500.0] * 10), clock=clock)
    readings = poll_all(monitor, 10, clock)
    last = readings[-1]
    assert last.ok and not last.stale and last.error is None
    assert (last.raw_w, last.filtered_w, last.smoothed_w) == (500.0, 500.0, 500.0)
    assert last.energy_j == pytest.approx(500.0)  # ten readings of 500 W, 0.1 s each
    assert last.t_s == pytest.approx(0.9)
    assert monitor.reads_total == 10
    assert monitor.read_errors_total == 0
    assert monitor.bad_samples_total == 0


def test_no_sample_yet_is_not_ok() -> None:
    reading = PowerMonitor(ScriptedSource([1.0])).snapshot()
    assert not reading.ok and reading.stale
    assert reading.raw_w is None and reading.age_s == math.inf
    assert reading.error is not None and "no good sample" in reading.error


def test_error_sets_ok_false_with_reason_then_recovers() -> None:
    clock = Clock()
    script: list[Step] = [
        400.0,
        SensorUnavailable("GPU 0: driver gone"),
        SensorReadError("x"),
        410.0,
    ]
    monitor = PowerMonitor(ScriptedSource(script), clock=clock)
    readings = poll_all(monitor, 4, clock)
    assert readings[0].ok
    failed = readings[1]
    assert not failed.ok
    assert failed.error == "SensorUnavailable: GPU 0: driver gone"
    assert failed.consecutive_errors == 1
    assert failed.raw_w == 400.0  # last known value kept for inspection
    assert readings[2].consecutive_errors == 2
    assert readings[2].error is not None and readings[2].error.startswith("SensorReadError")
    recovered = readings[3]
    assert recovered.ok and recovered.error is None and recovered.consecutive_errors == 0
    assert recovered.raw_w == 410.0
    assert monitor.read_errors_total == 2


def test_stale_when_no_good_sample_for_too_long() -> None:
    clock = Clock()
    monitor = PowerMonitor(ScriptedSource([300.0]), stale_after_s=1.0, clock=clock)
    poll_all(monitor, 1, clock, dt_s=0.0)
    assert monitor.snapshot().ok
    clock.now_s += 0.9
    assert monitor.snapshot().ok
    clock.now_s += 0.8
    reading = monitor.snapshot()
    assert not reading.ok and reading.stale
    assert reading.age_s == pytest.approx(1.7)
    assert reading.error == "stale: no good sample for 1.7 s"


def test_hung_source_times_out_as_an_error() -> None:
    class Hung(ScriptedSource):
        async def read(self) -> PowerSample:
            await asyncio.sleep(10)
            raise AssertionError("unreachable")

    monitor = PowerMonitor(Hung([0.0]), read_timeout_s=0.05)
    reading = asyncio.run(monitor.poll_once())
    assert not reading.ok
    assert reading.error is not None and "TimeoutError" in reading.error


def test_spike_is_removed_from_filtered_and_smoothed() -> None:
    clock = Clock()
    script: Sequence[Step] = [500.0] * 8 + [5000.0] + [500.0] * 3
    monitor = PowerMonitor(ScriptedSource(script), clock=clock)
    readings = poll_all(monitor, len(script), clock)
    spike = readings[8]
    assert spike.raw_w == 5000.0
    assert spike.filtered_w == 500.0
    assert spike.smoothed_w == 500.0
    assert max(w for _, w in monitor.history()) == 500.0


def test_without_hampel_spike_passes() -> None:
    clock = Clock()
    script: Sequence[Step] = [500.0] * 8 + [5000.0]
    monitor = PowerMonitor(ScriptedSource(script), hampel=None, clock=clock)
    assert poll_all(monitor, 9, clock)[-1].filtered_w == 5000.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -5.0, 2000.0])
def test_garbage_is_rejected_and_not_filtered(bad: float) -> None:
    clock = Clock()
    monitor = PowerMonitor(ScriptedSource([450.0, bad, 460.0]), max_plausible_w=1500.0, clock=clock)
    readings = poll_all(monitor, 3, clock)
    assert not readings[1].ok
    assert readings[1].error is not None and readings[1].error.startswith("bad sample")
    assert readings[1].raw_w == 450.0
    assert readings[2].ok and readings[2].smoothed_w is not None
    assert 450.0 <= readings[2].smoothed_w <= 460.0
    assert monitor.bad_samples_total == 1
    assert monitor.read_errors_total == 0
    assert [w for _, w in monitor.history()] == [450.0, 460.0]


def test_listener_gets_each_good_reading_and_its_errors_are_contained() -> None:
    clock = Clock()
    seen: list[PowerReading] = []

    def broken(_: PowerReading) -> None:
        raise RuntimeError("listener bug")

    monitor = PowerMonitor(ScriptedSource([100.0, SensorReadError("x"), 200.0]), clock=clock)
    monitor.add_listener(broken)
    monitor.add_listener(seen.append)
    poll_all(monitor, 3, clock)
    assert [r.raw_w for r in seen] == [100.0, 200.0]
    assert all(r.ok for r in seen)


def test_mean_w_and_history_window() -> None:
    clock = Clock()
    values: Sequence[Step] = [float(100 + 10 * i) for i in range(30)]  # a ramp, 0.1 s apart
    monitor = PowerMonitor(ScriptedSource(values), hampel=None, history_s=2.0, clock=clock)
    poll_all(monitor, 30, clock)
    history = monitor.history()
    assert history[0][0] >= history[-1][0] - 2.0 - 1e-9
    assert len(history) in (20, 21)
    # The newest second holds samples 20..29: mean 100 + 10 * 24.5.
    assert monitor.mean_w(1.0) == pytest.approx(345.0)
    assert PowerMonitor(ScriptedSource([1.0])).mean_w(1.0) is None


def test_the_mean_counts_a_burst_the_despiking_filter_takes_for_a_glitch() -> None:
    """Two 0.1-s readings of a prefill burst in a second of decode: the filter replaces them by
    the median, the energy counter does not."""
    burst: list[Step] = [100.0] * 12 + [1000.0, 1000.0] + [100.0] * 6
    with_counter = PowerMonitor(ScriptedSource(burst), clock=(clock := Clock()))
    poll_all(with_counter, len(burst), clock)
    assert with_counter.snapshot().filtered_w == 100.0  # the filter saw a glitch
    assert with_counter.mean_w(1.0) == pytest.approx(280.0)  # (8 x 100 + 2 x 1000) / 10
    without = PowerMonitor(ScriptedSource(burst, energy=False), clock=(clock := Clock()))
    poll_all(without, len(burst), clock)
    assert without.mean_w(1.0) == pytest.approx(100.0)  # no counter: the filtered mean


def test_a_counter_that_goes_back_is_not_differenced() -> None:
    clock = Clock()
    source = ScriptedSource([200.0] * 20)
    monitor = PowerMonitor(source, hampel=None, clock=clock)
    poll_all(monitor, 15, clock)
    source.energy_j = 0.0  # a driver reload resets the counter
    poll_all(monitor, 5, clock)
    assert monitor.mean_w(1.0) == pytest.approx(200.0)  # the samples' mean, not a negative rise


def test_errors_are_logged_once_per_message_per_window(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    monitor = PowerMonitor(ScriptedSource([SensorUnavailable("gone")]), clock=clock)
    with caplog.at_level(logging.WARNING, logger="powerbatch.telemetry"):
        poll_all(monitor, 50, clock)  # 5 s of failures: one line
        assert len(caplog.records) == 1
        clock.now_s += 10.0
        poll_all(monitor, 1, clock)
    assert len(caplog.records) == 2


def test_background_task_polls_and_stops() -> None:
    async def run() -> tuple[int, PowerReading, int]:
        source = ScriptedSource([SensorReadError("flaky"), 250.0])
        monitor = PowerMonitor(source, interval_s=0.01)
        await monitor.start()
        await monitor.start()  # idempotent
        await asyncio.sleep(0.15)
        await monitor.stop()
        reads_at_stop = source.reads
        await asyncio.sleep(0.05)
        return reads_at_stop, monitor.snapshot(), source.reads

    reads_at_stop, reading, reads_later = asyncio.run(run())
    assert reads_at_stop >= 5
    assert reads_later == reads_at_stop
    assert reading.ok and reading.raw_w == 250.0


def test_stop_lands_even_when_it_arrives_as_a_read_completes() -> None:
    """A cancel arriving in the same instant a read finishes must still end the polling task.

    Python 3.11's wait_for returned the read's result instead (the cancel was lost), so stop()
    waited forever on a monitor that kept polling: a rare hang in the proxy's teardown.
    """

    class CancelOnRead:
        name = "cancel-on-read"
        task: asyncio.Task[None] | None = None

        async def read(self) -> PowerSample:
            if self.task is not None:
                self.task.cancel()  # the stop request lands as this read completes
            return PowerSample(t_s=0.0, power_w=100.0)

        async def close(self) -> None:
            pass

    async def go() -> bool:
        source = CancelOnRead()
        monitor = PowerMonitor(source, interval_s=0.01)
        await monitor.start()
        source.task = monitor._task
        await asyncio.sleep(0.1)
        still_polling = monitor.running
        source.task = None  # so that a lost cancel does not hang this test as it hung teardown
        await monitor.stop()
        return still_polling

    assert asyncio.run(go()) is False


def test_what_the_energy_meter_reads_is_what_the_snapshot_says() -> None:
    """`metered()` (the proxy's energy meter, at every request's end) against `snapshot()`:
    no sample yet, good, failed with the last value kept, recovered, then stale."""
    clock = Clock()
    script: list[Step] = [400.0, SensorReadError("x"), 410.0]
    monitor = PowerMonitor(ScriptedSource(script), stale_after_s=1.0, clock=clock)

    def agree() -> None:
        r = monitor.snapshot()
        assert monitor.metered() == (r.raw_w if r.ok else None, r.energy_j, r.age_s)

    agree()
    for _ in script:
        poll_all(monitor, 1, clock, dt_s=0.3)
        agree()
    clock.now_s += 2.0
    agree()
    assert monitor.metered()[0] is None  # stale: no watts to meter
