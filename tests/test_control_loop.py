"""The control loop shared by the proxy and the vLLM plugin: one status, one history, one trace.

Each test drives a host (the proxy's Governor, the plugin's ControlThread) or the loop itself
with scripted power, and checks a promise the hosts make alike.
"""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from conftest import FuncPowerSource, run
from faults import running_proxy, upstream

from powerbatch.admission import AdmissionQueue
from powerbatch.cli.replay import replay, summarize
from powerbatch.control import AdmissionLimits, ControlConfig, Decision, Observation
from powerbatch.control.controller import Controller
from powerbatch.control.window import FeatureWindow, ReadingAligner
from powerbatch.errors import SensorReadError
from powerbatch.estimate import Features
from powerbatch.proxy import Governor, ProxyMetrics, ProxySettings, create_app
from powerbatch.settings import load
from powerbatch.telemetry import PowerMonitor, PowerSample
from powerbatch.telemetry.trace import TraceRow, TraceWriter, read_trace, trace_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "vllm"))

from powerbatch_vllm.config import PLUGIN, PluginConfig  # noqa: E402
from powerbatch_vllm.control import ControlThread  # noqa: E402
from powerbatch_vllm.engine import EngineCaps, StepStats  # noqa: E402


def plugin_config(**flat: Any) -> PluginConfig:
    cfg: PluginConfig = load(PLUGIN, environ={}, overrides=flat)
    return cfg


CAPS = EngineCaps(max_active_reqs=64, max_step_tokens=2048, num_kv_blocks=511, block_size=16)


def _strict(text: str | bytes) -> Any:
    """json.loads that refuses NaN and Infinity, as browsers and jq do."""

    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


class Timed:
    """A power source whose samples carry the times and watts the test sets."""

    name = "timed"

    def __init__(self) -> None:
        self.t = 1000.0
        self.w: float | None = 300.0

    async def read(self) -> PowerSample:
        if self.w is None:
            raise SensorReadError("scripted failure")
        return PowerSample(self.t, self.w)

    async def close(self) -> None:
        return None


def _governor(source: Any, clock: Any = time.monotonic, **cfg: Any) -> Governor:
    config = ControlConfig(ceiling_w=1000.0, warmup_s=0.0, **cfg)
    queue = AdmissionQueue(AdmissionLimits(config.initial_batch, config.max_kv_tokens, None))
    monitor = PowerMonitor(source, interval_s=0.1, stale_after_s=1.0, clock=clock)
    return Governor(Controller(config), queue, monitor, ProxyMetrics())


def _metric(gov: Governor, name: str) -> float:
    value = gov.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


# -- power: one meaning per name -------------------------------------------------------------


def test_measured_is_the_power_acted_on() -> None:
    """The measured power (metric and status) is the 1-second mean the controller acted on,
    not the monitor's EWMA."""
    src = Timed()
    gov = _governor(src, clock=lambda: src.t)
    for i in range(10):  # a second at 300 W, then a step to 500 W for half a second
        src.t = 1000.0 + 0.1 * i
        src.w = 300.0 if i < 5 else 500.0
        asyncio.run(gov.monitor.poll_once())
    d = gov.tick(src.t)
    assert d.power_w == pytest.approx(gov.monitor.mean_w(1.0))
    status = gov.status()
    assert status["power"]["measured_w"] == pytest.approx(d.power_w)
    assert _metric(gov, "powerbatch_power_watts") == pytest.approx(d.power_w)
    assert gov.monitor.snapshot().smoothed_w != pytest.approx(d.power_w, abs=1.0)


def test_raw_is_the_unfiltered_sample() -> None:
    """One wild but plausible sample: the Hampel filter drops it from the power acted on,
    while `raw_w` (metric, history, status) says what the sensor said."""
    src = Timed()
    gov = _governor(src, clock=lambda: src.t)
    for i in range(10):
        src.t = 1000.0 + 0.1 * i
        asyncio.run(gov.monitor.poll_once())
    src.t += 0.1
    src.w = 2500.0
    asyncio.run(gov.monitor.poll_once())
    reading = gov.monitor.snapshot()
    assert reading.filtered_w is not None and reading.filtered_w < 600.0
    gov.tick(src.t)
    assert gov.history[-1].raw_w == 2500.0
    assert _metric(gov, "powerbatch_power_raw_watts") == 2500.0
    assert gov.status()["power"]["raw_w"] == 2500.0


# -- strict JSON ----------------------------------------------------------------------------


def test_status_and_history_are_strict_json_while_failed_closed() -> None:
    async def go() -> None:
        async with upstream() as up, running_proxy(up.url, batch=4, safe_batch=2) as p:
            p.power["w"] = None  # the sensor dies: predictions are NaN while failed closed
            for _ in range(200):
                if p.gov.status()["state"] == "fail_closed":
                    break
                await asyncio.sleep(0.02)
            async with aiohttp.ClientSession() as s:
                async with s.get(p.url + "/status") as r:
                    status = _strict(await r.read())
                async with s.get(p.url + "/status/history") as r:
                    history = _strict(await r.read())
            assert status["state"] == "fail_closed"
            assert status["power"]["predicted_upper_w"] is None
            assert None in history["predicted_upper_w"]

    run(go())


def test_history_is_strict_json_from_the_first_tick() -> None:
    """Before the model has a sample its residual spread is unknown; status and history say
    null, not NaN."""

    async def go() -> None:
        async with upstream() as up:
            src = Timed()
            src.w = None
            gov = _governor(src)
            app = create_app(gov, ProxySettings(upstream=up.url))
            runner = aiohttp.web.AppRunner(app, access_log=None)
            await runner.setup()
            await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            try:
                for _ in range(100):
                    if gov.history:
                        break
                    await asyncio.sleep(0.02)
                async with aiohttp.ClientSession() as s:
                    async with s.get(url + "/status/history") as r:
                        _strict(await r.read())
                    async with s.get(url + "/status") as r:
                        _strict(await r.read())
            finally:
                await runner.cleanup()

    run(go())


# -- ready ----------------------------------------------------------------------------------


def test_ready_is_503_until_the_power_source_gives_a_good_reading() -> None:
    async def go() -> None:
        async with upstream() as up:
            src = Timed()
            src.w = None  # dead from the start
            gov = _governor(src)
            app = create_app(gov, ProxySettings(upstream=up.url))
            runner = aiohttp.web.AppRunner(app, access_log=None)
            await runner.setup()
            await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            try:
                for _ in range(100):  # the loop ticks (failed closed), the upstream is fine
                    if gov.last is not None:
                        break
                    await asyncio.sleep(0.02)
                async with aiohttp.ClientSession() as s:
                    async with s.get(url + "/ready") as r:
                        body = await r.json()
                        assert r.status == 503, body
                    assert body["ready"] is False and "power" in body["reason"]
                    assert _metric(gov, "powerbatch_ready") == 0.0
                    src.t, src.w = time.monotonic(), 300.0  # the sensor comes up
                    for _ in range(100):
                        src.t = time.monotonic()
                        async with s.get(url + "/ready") as r:
                            if r.status == 200:
                                break
                        await asyncio.sleep(0.05)
                    assert r.status == 200
            finally:
                await runner.cleanup()

    run(go())


# -- the fail-safe --------------------------------------------------------------------------


@dataclass
class RecordingSink:
    applied: list[Decision] = field(default_factory=list)
    safe: int = 0

    def apply(self, decision: Decision) -> None:
        self.applied.append(decision)

    def fail_safe(self) -> None:
        self.safe += 1


def test_a_tick_that_raises_holds_the_safe_batch_on_every_sink() -> None:
    src = Timed()
    gov = _governor(src, clock=lambda: src.t, initial_batch=8, safe_batch=2, max_batch=16)
    extra = RecordingSink()
    gov.loop.sinks.append(extra)
    asyncio.run(gov.monitor.poll_once())
    assert gov.loop.safe_tick() is not None
    assert gov.queue.limits.max_requests == 8 and len(extra.applied) == 1

    def broken() -> Any:
        raise RuntimeError("bug in a feature source")

    gov.features.sample = broken  # type: ignore[method-assign]
    assert gov.loop.safe_tick() is None
    assert gov.queue.limits.max_requests == 2 and extra.safe == 1
    assert gov.loop.state == "fail_closed"
    status = _strict(json.dumps(gov.status()))
    assert status["state"] == "fail_closed" and "bug in a feature source" in status["reason"]
    assert _metric(gov, "powerbatch_control_tick_errors_total") == 1.0
    state = gov.metrics.registry.get_sample_value(
        "powerbatch_controller_state", {"state": "fail_closed"}
    )
    assert state == 1.0


# -- the plugin on the same loop ------------------------------------------------------------


class Watts(FuncPowerSource):
    """A sensor set by hand: `w` watts, or a failed read while it is None."""

    def __init__(self, w: float | None) -> None:
        self.w = w
        super().__init__(lambda: self.w)


def _steps(stats: StepStats, stop: threading.Event, running: int = 24) -> None:
    """An engine stepping every 10 ms with `running` decodes and some prefill."""
    while not stop.is_set():
        stats.record(
            running=running,
            waiting=5,
            decode_reqs=running,
            decode_tokens=running,
            prefill_tokens=128,
            kv_blocks_used=200,
            kv_committed_tokens=running * 400,
        )
        time.sleep(0.01)


def test_plugin_trace_is_written_as_it_goes_and_replays(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    cfg = plugin_config(
        ceiling_w=500,
        metrics_port=0,
        warmup_s=0.0,
        tick_hz=20.0,
        power_interval_s=0.02,
        record_trace=str(path),
    )
    stats = StepStats()
    ct = ControlThread(cfg, CAPS, stats, source=Watts(420.0))
    stop = threading.Event()
    engine = threading.Thread(target=_steps, args=(stats, stop), daemon=True)
    engine.start()
    ct.start()
    try:
        deadline = time.monotonic() + 10.0
        rows: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if path.exists():
                with open(path, newline="") as fh:
                    rows = list(csv.DictReader(fh))
                if len(rows) >= 20:
                    break
        # Before stop(): a crash now would keep these.
        assert len(rows) >= 20, f"{len(rows)} rows on disk before stop()"
    finally:
        ct.stop()
        stop.set()
        engine.join(2.0)
    assert rows[-1]["state"] and rows[-1]["binding"]
    out = subprocess.run(
        [sys.executable, "-m", "powerbatch", "replay", str(path), "--ceiling-w", "500"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    decisions = list(csv.DictReader(out.stdout.splitlines()))
    assert len(decisions) >= 20
    assert all(float(r["batch"]) > 0 for r in decisions[5:]), decisions[:8]
    assert "summary:" in out.stderr


def test_plugin_is_not_ready_before_a_good_reading() -> None:
    cfg = plugin_config(ceiling_w=500, metrics_port=0, warmup_s=0.0)
    ct = ControlThread(cfg, CAPS, StepStats(), source=Watts(None))
    asyncio.run(ct.monitor.poll_once())
    ct.tick(time.monotonic())
    status = _strict(json.dumps(ct.status()))
    assert status["ready"] is False and status["state"] == "fail_closed"
    assert ct.metrics.registry.get_sample_value("powerbatch_ready") == 0.0
    ct.source.w = 300.0  # type: ignore[attr-defined]
    asyncio.run(ct.monitor.poll_once())
    ct.tick(time.monotonic())
    assert ct.status()["ready"] is True
    assert ct.status()["latency"]["cuts_undone_total"] == 0  # with the SLOs beside it
    assert ct.metrics.registry.get_sample_value("powerbatch_ready") == 1.0


def test_proxy_and_plugin_status_share_one_shape() -> None:
    gov = _governor(Watts(300.0))
    asyncio.run(gov.monitor.poll_once())
    gov.tick(time.monotonic())
    ct = ControlThread(
        plugin_config(ceiling_w=500, metrics_port=0, warmup_s=0.0),
        CAPS,
        StepStats(),
        source=Watts(300.0),
    )
    asyncio.run(ct.monitor.poll_once())
    ct.tick(time.monotonic())
    proxy, plugin = gov.status(), ct.status()
    shared = {"state", "mode", "binding", "reason", "emergency", "limits", "power"}
    shared |= {"multipliers", "latency", "queue", "model", "ready"}
    assert shared <= set(proxy) and shared <= set(plugin)
    for section in ("limits", "power", "latency"):
        assert set(proxy[section]) == set(plugin[section]), section
    assert "upstream" in proxy and "engine" in plugin
    assert set(gov.loop.history_rows()[0]) == set(ct.loop.history_rows()[0])


def test_the_plugin_does_not_load_the_simulator() -> None:
    """An EngineCore reading NVML must not import the simulator's HTTP server."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import powerbatch_vllm.control; "
        "bad = [m for m in ('powerbatch.sim.server', 'aiohttp.web') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "plugins" / "vllm")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the trace writer and replay's summary --------------------------------------------------


def _row(i: int, power_w: float | None = 400.0) -> TraceRow:
    return TraceRow(t_s=0.2 * i, power_w=power_w, requests_in_flight=8.0, state="enforce")


def test_trace_rotates_and_keeps_n_files(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    w = TraceWriter(path, max_bytes=2_000, keep=2, flush_every_s=0.0)
    for i in range(300):
        w.write(_row(i))
    w.close()
    names = sorted(p.name for p in trace_files(path))
    assert names == ["trace.csv", "trace.csv.1", "trace.csv.2"]
    rows = list(read_trace(path))  # the kept set, oldest first
    times = [r.t_s for r in rows]
    assert times == sorted(times) and times[-1] == pytest.approx(0.2 * 299)
    assert 0 < len(rows) < 300  # the oldest rotated away
    # A restart does not overwrite the last run's file: it becomes .1.
    TraceWriter(path, keep=2).close()
    assert list(read_trace(path))[-1].t_s == pytest.approx(0.2 * 299)


def test_trace_rows_without_power_are_skipped_by_replay(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    w = TraceWriter(path)
    for i in range(30):
        w.write(_row(i, None if i % 3 == 0 else 400.0))
    w.close()
    rows = list(read_trace(path))
    assert sum(r.power_w is None for r in rows) == 10
    decided = list(replay(iter(rows), ControlConfig(ceiling_w=500.0)))
    assert len(decided) == 20


def test_replay_summary_counts_seconds_over_the_ceiling() -> None:
    cfg = ControlConfig(ceiling_w=500.0, warmup_s=0.0)
    rows = [  # 4 seconds at 5 rows each; second 2 averages 520 W, second 3 peaks at 560 W
        TraceRow(t_s=s + 0.2 * k, power_w=w, requests_in_flight=8.0)
        for s, w in ((0, 400.0), (1, 450.0), (2, 520.0), (3, 560.0))
        for k in range(5)
    ]
    summary = summarize(replay(iter(rows), cfg), cfg.ceiling_w)
    assert summary is not None
    assert summary.seconds == 4
    assert summary.over_ceiling_pct == pytest.approx(50.0)
    assert summary.peak_1s_w == pytest.approx(560.0)
    assert 1 <= summary.batch_min <= summary.batch_median <= summary.batch_max
    text = summary.text(cfg.ceiling_w)
    assert "50.0%" in text and "560.0 W" in text


def test_replay_command_prints_the_summary(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    w = TraceWriter(path)
    for i in range(50):
        w.write(TraceRow(t_s=0.2 * i, power_w=600.0 if i >= 25 else 300.0, requests_in_flight=8.0))
    w.close()
    out = subprocess.run(
        [sys.executable, "-m", "powerbatch", "replay", str(path), "--ceiling-w", "500"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "over the 500 W ceiling 50.0% of seconds" in out.stderr
    assert "peak 1-s power 600.0 W" in out.stderr
    assert "proposed batch limit" in out.stderr
    assert len(list(csv.DictReader(out.stdout.splitlines()))) == 50


def test_summary_is_none_without_power() -> None:
    assert summarize([], 500.0) is None


# -- a meter that lags the ticks -------------------------------------------------------------


def _learned_slope_w(aligned: bool, late_s: float = 0.0, lag: list[float] | None = None) -> float:
    """Watts per request the controller's model learns from an exporter that collects the
    1-second mean once a second while the batch moves every 0.6 s (true slope: 10 W), and
    serves it `late_s` later (the learned lag goes into `lag`)."""
    rng = np.random.default_rng(3)
    ctl = Controller(ControlConfig(ceiling_w=2000.0, warmup_s=0.0))
    window, clock = FeatureWindow(1.0), ReadingAligner(every_tick=False)
    batches = rng.integers(2, 40, size=200)
    tick_s, sub = 0.2, 20  # the plant integrates its power over 10-ms slices

    def batch_at(t: float) -> int:
        return int(batches[int(t / 0.6)])

    held_w, prefill = 0.0, 0.0
    for i in range(int(100 / tick_s)):
        t = i * tick_s
        if i % 5 == 0 and i:  # the exporter's collection: the mean over the second before
            slices = np.arange(t - 1.0 - late_s, t - late_s, 1.0 / sub / 5)
            held_w = float(np.mean([100.0 + 10.0 * batch_at(s) for s in slices]))
        n = batch_at(t)
        prefill += 100.0 * n * tick_s
        f = window.update(t, n, 500.0 * n, prefill, 30.0 * n * t)
        weight, measured = clock.update(held_w, None, f, t, held_w)
        if i < 5:
            continue
        ctl.tick(
            Observation(
                t_s=t,
                power_w=held_w,
                sensor_ok=True,
                features=f,
                in_flight=n,
                queued=0,
                reading_features=measured if aligned else None,
                reading_weight=weight if aligned else 1.0,
                relearn=tuple(clock.relearn) if aligned else (),
            )
        )
    if lag is not None:
        lag.append(clock.lag.lag_s)
    lo, hi = Features(5.0, 2500.0, 500.0, 150.0), Features(35.0, 17500.0, 3500.0, 1050.0)
    mean_w = ctl.model.predict([lo, hi]).mean_w
    return float(mean_w[1] - mean_w[0]) / 30.0


def test_a_held_reading_is_learned_once_against_the_load_it_measured() -> None:
    # An exporter serves one collection for a whole second. Learned again on every tick,
    # against the load of later ticks, it pairs the watts of one second with the load of
    # another, and the slope shrinks towards zero: the model prices growth too cheap.
    slope_w = _learned_slope_w(aligned=True)
    naive_w = _learned_slope_w(aligned=False)
    assert 8.0 <= slope_w <= 11.5, (slope_w, naive_w)  # 5 ticks a second sample the load
    assert naive_w < 0.8 * slope_w, (slope_w, naive_w)


def test_the_meter_lag_is_learned_from_the_readings() -> None:
    # The same exporter, 2 s late (a relay, a slow scrape): paired with the second before the
    # tick that first sees it, a reading describes load that has since moved twice. The lag is
    # learned from the readings alone, and the slope with it.
    lag: list[float] = []
    slope_w = _learned_slope_w(aligned=True, late_s=2.0, lag=lag)
    assert 1.8 <= lag[0] <= 2.2, lag
    assert 7.0 <= slope_w <= 11.5, slope_w  # learned at 3 s, then at 2 s once told apart
    on_time: list[float] = []
    _learned_slope_w(aligned=True, lag=on_time)
    assert on_time[0] <= 0.2, on_time


def _late_meter_run(late_s: float) -> tuple[list[float], list[int]]:
    """A plant of 150 W + 9 W per request, its 1-s mean served `late_s` late once a second; a
    queue of 80 waits from t = 0. Returns each whole second's true mean and the batch limits."""
    ceiling = 600.0  # 50 requests
    rng = np.random.default_rng(7)
    ctl = Controller(ControlConfig(ceiling_w=ceiling, warmup_s=0.0))
    window, clock = FeatureWindow(1.0), ReadingAligner(every_tick=False)
    tick_s, limit = 0.2, ctl.config.initial_batch
    true: list[float] = []
    limits: list[int] = []
    held_w, decoded = 150.0, 0.0
    for i in range(int(60 / tick_s)):
        t = i * tick_s
        n = min(limit, 80)
        true.append(150.0 + 9.0 * n)
        if i % 5 == 0 and i:
            back = round(late_s / tick_s)
            held_w = float(np.mean(true[max(0, i - 5 - back) : max(1, i - back)]))
            held_w += float(rng.normal(0.0, 3.0))
        decoded += 30.0 * n * tick_s
        f = window.update(t, n, 500.0 * n, 0.0, decoded)
        weight, measured = clock.update(held_w, None, f, t, held_w)
        d = ctl.tick(
            Observation(
                t_s=t,
                power_w=held_w,
                sensor_ok=True,
                features=f,
                in_flight=n,
                queued=80 - n,
                reading_features=measured,
                reading_weight=weight,
                relearn=tuple(clock.relearn),
            )
        )
        limit = d.enforced.max_requests
        limits.append(limit)
    seconds = [float(np.mean(true[k : k + 5])) for k in range(0, len(true) - 4, 5)]
    return seconds, limits


def test_a_late_meter_does_not_let_the_batch_outrun_it() -> None:
    # Two seconds late, the meter shows the room of a batch long since grown. The batch must
    # not take that room twice: the ceiling holds in (nearly) every second, and the batch
    # still fills it.
    seconds, limits = _late_meter_run(2.0)
    shown = [round(p) for p in seconds]
    assert sum(p > 600.0 for p in seconds) <= 3, shown  # while the slope is learned
    assert max(seconds) <= 1.2 * 600.0, shown
    assert sum(p > 600.0 for p in seconds[20:]) == 0, shown
    assert max(limits[-50:]) >= 40, limits[-50:]
