"""The vLLM plugin's pure parts: settings, version check, limit mapping, the control thread's tick.

None of this imports vLLM, so it runs in the normal suite; the real engine is tested under
`-m vllm` (tests/vllm). The plugin is its own distribution: found here from the source tree.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import FuncPowerSource
from test_telemetry_nvml import FakeGpu, fake_nvml

try:
    import powerbatch_vllm  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"))

from powerbatch_vllm import control
from powerbatch_vllm.compat import UnsupportedVllmVersion, check_vllm_version, parse_version
from powerbatch_vllm.config import PLUGIN, PluginConfig, load_config, reference_markdown
from powerbatch_vllm.control import ControlThread
from powerbatch_vllm.engine import EngineCaps, EngineLimits, StepStats, engine_limits
from powerbatch_vllm.metrics import ModelMeter
from powerbatch_vllm.plugin import _in_use

from powerbatch.cli import serve
from powerbatch.cli.settings import SERVE
from powerbatch.control import AdmissionLimits
from powerbatch.errors import ConfigError
from powerbatch.settings import load
from powerbatch.shape.runner import PlanRunner
from powerbatch.telemetry import PrometheusPowerSource, factory
from powerbatch.telemetry.monitor import PowerReading


def plugin_config(**flat: Any) -> PluginConfig:
    """Settings by their flat names, through the same checks as the environment's."""
    cfg: PluginConfig = load(PLUGIN, environ={}, overrides=flat)
    return cfg


CAPS = EngineCaps(
    max_active_reqs=64, max_step_tokens=2048, num_kv_blocks=511, block_size=16, chunked_prefill=True
)


# -- settings and versions ------------------------------------------------------------------


def test_config_from_env_and_file(tmp_path: Path) -> None:
    f = tmp_path / "pb.toml"
    f.write_text('[powerbatch_vllm]\nceiling_w = 500\npower_source = "model"\ntick_hz = 10\n')
    cfg = load_config({"POWERBATCH_VLLM_CONFIG": str(f), "POWERBATCH_VLLM_TICK_HZ": "4"})
    assert cfg.control.ceiling_w == 500 and cfg.power.power_source == "model"
    assert cfg.control.tick_hz == 4  # the environment wins over the file
    off = load_config({"POWERBATCH_VLLM_CEILING_W": "100", "POWERBATCH_VLLM_KV_CAP": "off"})
    assert off.engine.kv_cap is False
    # The simulator's setting sits in its own group, under its old name.
    sim = load_config({"POWERBATCH_VLLM_CEILING_W": "100", "POWERBATCH_VLLM_MODEL_PROFILE": "x"})
    assert sim.simulation.model_profile == "x"
    assert [f.section for f in PLUGIN.fields if f.name == "model_profile"] == [
        "Simulation (tests and demos, not production): the modelled power source"
    ]


@pytest.mark.parametrize(
    "env",
    [
        {},  # the ceiling is required
        {"POWERBATCH_VLLM_CEILING_W": "x"},
        {"POWERBATCH_VLLM_CEILING_W": "500", "POWERBATCH_VLLM_POWER_SOURCE": "dcgm"},  # no URL
        {"POWERBATCH_VLLM_CEILING_W": "500", "POWERBATCH_VLLM_MODE": "shadow"},
        {"POWERBATCH_VLLM_CEILING_W": "500", "POWERBATCH_VLLM_CEILING": "1"},  # a typo
        {"POWERBATCH_VLLM_CEILING_W": "-5"},
    ],
)
def test_bad_config_fails_at_start(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_config(env)


def test_control_config_never_exceeds_vllm() -> None:
    cfg = plugin_config(ceiling_w=500, max_batch=512, initial_batch=16)
    cc = cfg.control_config(engine_max_batch=8, max_kv_tokens=1000)
    assert cc.max_batch == 8 and cc.initial_batch == 8 and cc.max_kv_tokens == 1000


def test_prior_takes_the_devices_power_limit_unless_told() -> None:
    cfg = plugin_config(ceiling_w=600)
    assert cfg.control_config(engine_max_batch=64, max_kv_tokens=1, device_max_w=700).max_w == 700
    assert cfg.control_config(engine_max_batch=64, max_kv_tokens=1).max_w is None
    # The ceiling above the device's limit (it cannot bind), or the operator's own figure: as set.
    assert cfg.control_config(engine_max_batch=64, max_kv_tokens=1, device_max_w=500).max_w is None
    told = plugin_config(ceiling_w=600, max_w=800)
    assert told.control_config(engine_max_batch=64, max_kv_tokens=1, device_max_w=700).max_w == 800


def test_reference_lists_every_setting() -> None:
    table = reference_markdown()
    assert "POWERBATCH_VLLM_CEILING_W" in table and "POWERBATCH_VLLM_RECORD_TRACE" in table


def test_version_check() -> None:
    assert parse_version("0.32.0+cpu").release == (0, 32, 0)
    for good in ("0.32.0+cpu", "0.32.5", "v0.32.1rc1.dev3+g1234abc", "0.32", "0.33.0", "0.33.1"):
        check_vllm_version(good, allow_unsupported=False)
    for bad in ("0.31.9", "0.34.0", "0.34.0rc1", "1.0.0", "0.32.0.dev1"):
        with pytest.raises(UnsupportedVllmVersion, match="supports vLLM"):
            check_vllm_version(bad, allow_unsupported=False)
    check_vllm_version("0.34.0", allow_unsupported=True)
    with pytest.raises(UnsupportedVllmVersion, match="cannot parse"):
        check_vllm_version("not-a-version", allow_unsupported=False)


def test_plugin_registers_only_when_used() -> None:
    assert not _in_use(["vllm", "serve", "m"], {})
    assert _in_use(["vllm", "serve", "--scheduler-cls", "powerbatch_vllm.scheduler.X"], {})
    assert _in_use([], {"POWERBATCH_VLLM_CEILING_W": "1"})


# -- limits in the engine's units -----------------------------------------------------------


def test_engine_limits_are_clamped_to_vllm() -> None:
    lim = engine_limits(AdmissionLimits(500, 10**9, 4000.0), CAPS, step_s=0.02)
    assert lim.max_active_reqs == 64 and lim.max_kv_blocks == 511
    assert lim.prefill_tokens_per_step == 80  # 4000 tok/s x 20 ms
    assert lim.step_tokens(CAPS, running=10) == 10 + 80
    assert lim.step_tokens(CAPS, running=64) <= CAPS.max_step_tokens
    small = engine_limits(AdmissionLimits(4, 100, 10.0), CAPS, step_s=0.02, min_step_tokens=32)
    assert small.max_active_reqs == 4 and small.max_kv_blocks == 7  # ceil(100 / 16)
    assert small.step_tokens(CAPS, running=4) == 4 + 32  # decodes always fit, plus the floor


def test_prefill_unpaced_without_step_time_or_chunking() -> None:
    assert (
        engine_limits(AdmissionLimits(8, 100, 4000.0), CAPS, step_s=None).prefill_tokens_per_step
        is None
    )
    no_chunk = EngineCaps(64, 2048, 511, 16, chunked_prefill=False)
    lim = engine_limits(AdmissionLimits(8, 100, 4000.0), no_chunk, step_s=0.02)
    assert lim.step_tokens(no_chunk, running=8) == 2048
    assert EngineLimits.unlimited(CAPS).step_tokens(CAPS, 64) == 2048


def test_step_stats_windows() -> None:
    s = StepStats()
    for i in range(4):
        s.record(
            running=8,
            waiting=2,
            decode_reqs=6,
            decode_tokens=6,
            prefill_tokens=40,
            kv_blocks_used=20 + i,
            t_s=i * 0.01,
        )
    batch, prefill, kv = s.take_window()
    assert (batch, prefill, kv) == (6.0, 40.0, 21.5)
    assert s.step_s == pytest.approx(0.01)
    # No step scheduled in this window, but the last one has not returned: it is running.
    assert s.take_window() == (6.0, 40.0, 23.0)
    for _ in range(4):
        s.step_done()
    assert s.take_window() == (0.0, 0.0, 23.0)  # idle window: no work, KV as it stands
    assert s.snapshot()["prefill_tokens_total"] == 160


def test_a_long_step_draws_its_power_until_it_returns() -> None:
    """A long prefill step (seconds on a slow device) is one schedule() call: the windows read
    while it runs must model the step's power, not idle. Idle readings in the middle of a
    burst taught the proxy in front of a real vLLM that 64 requests drew 78 W."""
    from powerbatch.sim.power_source import ModelPowerSource

    s = StepStats()
    s.record(
        running=64,
        waiting=0,
        decode_reqs=0,
        decode_tokens=0,
        prefill_tokens=2048,
        kv_blocks_used=300,
        t_s=0.0,
    )
    source = ModelPowerSource(
        lambda: (lambda b, p, k: (round(b), p, round(k * 16)))(*s.take_window())
    )
    busy_w = [asyncio.run(source.read()).power_w for _ in range(3)]  # three reads mid-step
    s.step_done()
    idle_w = asyncio.run(source.read()).power_w
    assert min(busy_w) > 3 * idle_w, (busy_w, idle_w)


def test_step_stats_latency() -> None:
    s = StepStats()
    t = 100.0
    for i in range(20):  # decode steps 25 ms apart: every running request's time per token
        s.record(
            running=4,
            waiting=0,
            decode_reqs=4,
            decode_tokens=4,
            prefill_tokens=0,
            kv_blocks_used=5,
            t_s=t + 0.025 * i,
        )
    t_end = t + 0.025 * 19
    # A step of prefill only, long after: no decode waited on it, so no TPOT sample.
    s.record(
        running=1,
        waiting=0,
        decode_reqs=0,
        decode_tokens=0,
        prefill_tokens=500,
        kv_blocks_used=5,
        t_s=t_end + 0.9,
    )
    s.record_first_tokens([0.2, 0.3, 0.4, 0.5, 3.0, -1.0], t_s=t_end + 1.0)  # -1: clock skew
    lat = s.latency(t_end + 1.0)
    assert lat.tpot_p95_s == pytest.approx(0.025)
    assert lat.ttft_p95_s is not None and 2.0 < lat.ttft_p95_s <= 3.0
    assert lat.samples == 5
    assert s.latency(t_end + 60.0).ttft_p95_s is None  # out of the window


# -- the control thread's tick, driven by hand ----------------------------------------------


class Watts(FuncPowerSource):
    """A sensor set by hand: `w` watts, or a failed read while it is None."""

    def __init__(self, w: float | None) -> None:
        self.w = w
        super().__init__(lambda: self.w)


def _thread(mode: str, watts: Watts) -> ControlThread:
    cfg = plugin_config(ceiling_w=500, mode=mode, warmup_s=0.0, metrics_port=0, initial_batch=32)
    stats = StepStats()
    return ControlThread(cfg, CAPS, stats, source=watts)


def _drive(
    ct: ControlThread, ticks: int, running: int, step_s: float = 0.2, prefill_tokens: int = 64
) -> None:
    """Ticks of 0.2 s, each after the engine's steps in it, `step_s` apart (TPOT = `step_s`)."""
    t = time.monotonic()
    steps = max(1, round(0.2 / step_s))
    for i in range(ticks):
        for k in range(steps):
            ct.stats.record(
                running=running,
                waiting=40,
                decode_reqs=running,
                decode_tokens=running,
                prefill_tokens=prefill_tokens,
                kv_blocks_used=100,
                t_s=t + i * 0.2 + k * step_s,
            )
        asyncio.run(ct.monitor.poll_once())
        ct.tick(t + (i + 1) * 0.2)


def test_over_the_ceiling_shrinks_the_engine_limits() -> None:
    ct = _thread("enforce", Watts(650.0))
    _drive(ct, 5, running=32)
    assert ct.last is not None and ct.last.binding == "power"
    assert ct.limits.max_active_reqs < 32
    assert ct.limits.prefill_tokens_per_step is not None  # paced once a step time is known
    status = ct.status()
    assert status["engine"]["limits"]["max_active_reqs"] == ct.limits.max_active_reqs
    assert status["engine"]["configured"]["max_active_reqs"] == 64
    assert status["limits"]["enforced"]["max_requests"] == ct.last.enforced.max_requests


def test_slow_decode_steps_shrink_the_batch_under_the_ceiling() -> None:
    slow = _thread("enforce", Watts(300.0))  # far under the 500 W ceiling
    _drive(slow, 15, running=32, step_s=0.2, prefill_tokens=0)  # TPOT 0.2 s against the 0.1 s SLO
    fast = _thread("enforce", Watts(300.0))
    _drive(fast, 15, running=32, step_s=0.02, prefill_tokens=0)
    assert slow.last is not None and fast.last is not None
    assert slow.last.binding == "latency" and slow.last.multipliers["latency"] > 0
    assert slow.limits.max_active_reqs < 32 <= fast.limits.max_active_reqs
    status = slow.status()["latency"]
    assert status["tpot_p95_s"] == pytest.approx(0.2) and status["tpot_slo_s"] == 0.1


class FakeTime:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _engine_run(
    fixed_s: float, per_request_s: float, seconds: float, tpot_slo_s: float = 0.1
) -> ControlThread:
    """A decode-only engine under `schedule()`'s cap, in fake time: requests of 40 tokens from
    an endless queue, started while the running set is under the plugin's active-request
    limit, each step `fixed_s + per_request_s x running` long; a tick every 0.2 s."""
    clock = FakeTime()
    cfg = plugin_config(
        ceiling_w=500, mode="enforce", warmup_s=0.0, metrics_port=0, initial_batch=32,
        tpot_slo_s=tpot_slo_s,
    )  # fmt: skip
    ct = ControlThread(cfg, CAPS, StepStats(clock=clock), source=Watts(300.0))
    left: dict[str, int] = {}
    n, next_tick = 0, clock.t + 0.2
    while clock.t < 1000.0 + seconds:
        new = {}
        while len(left) < ct.limits.max_active_reqs:
            req_id, n = f"r{n}", n + 1
            ct.stats.record_arrival(req_id, "normal")
            left[req_id], new[req_id] = 40, "normal"
        done = [r for r, k in left.items() if k <= 1]
        ct.stats.record_requests({r: (0, 1) for r in left}, new, finished=done)
        running = len(left)
        ct.stats.record(
            running=running,
            waiting=10,
            decode_reqs=running,
            decode_tokens=running,
            prefill_tokens=0,
            kv_blocks_used=100,
            t_s=clock.t,
        )
        left = {r: k - 1 for r, k in left.items() if k > 1}
        clock.t += fixed_s + per_request_s * running
        while clock.t >= next_tick:
            asyncio.run(ct.monitor.poll_once())
            ct.tick(next_tick)
            next_tick += 0.2
    return ct


def test_the_engines_step_tells_a_cut_no_batch_can_pay_for_from_one_that_pays() -> None:
    # A step of 150 ms however small the batch (the weights' read alone is over the 100-ms
    # SLO): the latency law reads the step from the engine's counts, sees the cuts buy
    # nothing, and gives the batch back (docs/scenarios.md, stop 47), where a window's p95
    # had wound it down to one request.
    futile = _engine_run(fixed_s=0.15, per_request_s=0.0005, seconds=60.0)
    status = futile.status()["latency"]
    assert status["cuts_undone_total"] >= 1
    assert futile.limits.max_active_reqs >= 16
    # A step of 2 ms per request: 50 requests' worth over the SLO at 64, so the cuts pay and
    # hold the batch where the step meets it.
    paying = _engine_run(fixed_s=0.02, per_request_s=0.002, seconds=60.0)
    assert paying.status()["latency"]["cuts_undone_total"] == 0
    assert 20 <= paying.limits.max_active_reqs <= 44
    assert paying.stats.step_s is not None and paying.stats.step_s < 0.11
    engine = paying.status()["engine"]
    assert engine["step_s"] == pytest.approx(paying.stats.step_s, rel=0.2)
    assert engine["token_s"] == pytest.approx(engine["step_s"], rel=0.2)


def test_step_stats_count_what_a_scrape_of_vllm_would() -> None:
    s = StepStats()
    s.record_arrival("a", "normal")
    s.record_arrival("b", "high")
    s.record_requests({"a": (30, 0), "b": (30, 0)}, {"a": "normal", "b": "high"})
    for t in (10.0, 10.02, 10.05):  # two decoding, 20 then 30 ms apart
        s.record(
            running=2, waiting=0, decode_reqs=2, decode_tokens=2, prefill_tokens=0,
            kv_blocks_used=4, t_s=t,
        )  # fmt: skip
    s.record_requests({"a": (0, 1)}, {}, finished=["a"])
    up = s.upstream(11.0)
    assert up.t_s == 11.0 and up.requests_waiting == 0.0 and up.requests_started_total == 2.0
    assert up.itl_count == 4.0 and up.itl_sum_s == pytest.approx(2 * 0.02 + 2 * 0.03)
    assert up.decode_count == 1.0 and up.decode_sum_s == up.itl_sum_s


def test_observe_mode_leaves_vllm_alone() -> None:
    ct = _thread("observe", Watts(650.0))
    _drive(ct, 5, running=32)
    assert ct.limits == EngineLimits.unlimited(CAPS)
    assert ct.last is not None and ct.last.proposed.max_requests < 32


def test_sensor_loss_holds_the_safe_batch() -> None:
    ct = _thread("enforce", Watts(300.0))
    _drive(ct, 3, running=16)
    ct.source.w = None  # the sensor fails
    asyncio.run(ct.monitor.poll_once())
    ct.tick(time.monotonic() + 1)
    assert ct.last is not None and ct.last.state == "fail_closed"
    assert ct.limits.max_active_reqs <= ct.control.safe_batch


def test_status_endpoint_serves_metrics_and_modelled_power() -> None:
    cfg = plugin_config(
        ceiling_w=500, power_source="model", metrics_port=1, warmup_s=0.0
    )  # port replaced below
    stats = StepStats()
    ct = ControlThread(cfg, CAPS, stats)
    from powerbatch_vllm.metrics import StatusServer

    server = StatusServer(
        "127.0.0.1", 0, ct.metrics, ct._extra_text, ct.status, ct.loop.history_rows
    )
    server.start()
    try:
        stats.record(
            running=8,
            waiting=0,
            decode_reqs=8,
            decode_tokens=8,
            prefill_tokens=0,
            kv_blocks_used=10,
        )
        asyncio.run(ct.monitor.poll_once())
        ct.tick(time.monotonic())
        host, port = server.address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'powerbatch_engine_limit{knob="active_requests"}' in text
        assert "DCGM_FI_DEV_POWER_USAGE{" in text
        with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=5) as r:
            assert json.loads(r.read())["power"]["source"] == "model"
    finally:
        server.stop()


def _reading(t_s: float, raw_w: float) -> PowerReading:
    return PowerReading(
        t_s=t_s,
        raw_w=raw_w,
        filtered_w=raw_w,
        smoothed_w=raw_w,
        energy_j=None,
        ok=True,
        stale=False,
        error=None,
        consecutive_errors=0,
        age_s=0.0,
    )


def test_the_modelled_power_is_exported_as_a_gpus_one_second_mean() -> None:
    """A reader takes DCGM_FI_DEV_POWER_USAGE as a 1-s mean and does not despike it, so a
    prefill window's watts must reach it averaged, and only the INSTANT field may spike."""
    meter = ModelMeter()
    assert meter.text("0", "m") == ""
    for i, w in enumerate([400.0, 400.0, 400.0, 400.0, 700.0]):  # 0.2-s windows, one prefill
        meter(_reading(10.0 + 0.2 * i, w))
    fields = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in meter.text("0", "m").splitlines()
        if not line.startswith("#")
    }
    assert fields == {"DCGM_FI_DEV_POWER_USAGE": 460.0, "DCGM_FI_DEV_POWER_USAGE_INSTANT": 700.0}
    meter(_reading(11.7, 400.0))  # the window is one second: the prefill has left it
    assert meter.mean_w == 550.0  # (700 + 400) / 2: only samples of the last second count


def test_engine_charges_each_request_by_its_steps() -> None:
    """Fake steps: a prefill and a decode share a tick's energy above idle by their work."""
    cfg = plugin_config(
        ceiling_w=500,
        mode="observe",
        warmup_s=0.0,
        metrics_port=0,
        idle_w=100.0,
        prefill_weight=0.25,
    )
    stats = StepStats()
    ct = ControlThread(cfg, CAPS, stats, source=Watts(400.0), model_name="m")
    now = [0.0]
    ct.energy.clock = lambda: now[0]

    def tick(t_s: float) -> None:
        now[0] = t_s
        asyncio.run(ct.monitor.poll_once())
        ct.tick(time.monotonic())

    tick(0.0)  # the meter starts
    # 400 prompt tokens (100 units at 0.25) against 100 decoded tokens: an even split.
    stats.record_requests({"a": (400, 0), "b": (0, 100)}, {"a": "high", "b": "normal"})
    tick(1.0)  # 400 J metered: 100 J idle, 150 J each
    stats.record_requests({"a": (0, 50), "b": (0, 150)}, {}, finished=["b"])
    tick(2.0)  # 300 J above idle: 75 J to a, 225 J to b, which then leaves
    reg = ct.metrics.registry

    def joules(priority: str) -> float | None:
        labels = {"priority": priority, "tenant": "engine", "model": "m"}
        return reg.get_sample_value("powerbatch_request_energy_joules_total", labels)

    assert joules("high") == pytest.approx(225.0)
    assert joules("normal") == pytest.approx(375.0)
    assert reg.get_sample_value("powerbatch_idle_energy_joules_total") == pytest.approx(200.0)
    completion = reg.get_sample_value(
        "powerbatch_request_tokens_total",
        {"kind": "completion", "priority": "normal", "tenant": "engine", "model": "m"},
    )
    assert completion == 250.0
    energy = ct.status()["energy"]
    assert energy["in_flight"] == 1 and energy["by_class_j"]["normal"] == pytest.approx(375.0)


# -- the shape planner inside the engine ----------------------------------------------------


def test_step_stats_count_arrivals_starts_and_completions() -> None:
    s = StepStats()
    for req_id, cls in (("a", "high"), ("b", "low"), ("c", "low"), ("d", "normal")):
        s.record_arrival(req_id, cls)
    counts = s.queue_counts()
    assert counts.arrived == {"high": 1, "normal": 1, "low": 2}
    assert counts.queued == {"high": 1, "normal": 1, "low": 2}
    assert s.queued_deferrable == 2
    # a and b are scheduled for the first time; d is aborted while it waits.
    s.record_requests({"a": (40, 0), "b": (40, 0)}, {"a": "high", "b": "low"})
    s.record_requests({"a": (0, 1), "b": (0, 1)}, {}, finished=["d"])
    counts = s.queue_counts()
    assert counts.queued == {"high": 0, "normal": 0, "low": 1}
    assert counts.completed == 0  # an abort in the queue is no completion
    s.record_requests({"b": (0, 1)}, {}, finished=["a"])
    s.record(
        running=1, waiting=1, decode_reqs=1, decode_tokens=1, prefill_tokens=0, kv_blocks_used=4
    )
    counts = s.queue_counts()
    assert counts.completed == 1 and counts.in_flight == 1
    assert counts.arrived == {"high": 1, "normal": 1, "low": 2}  # cumulative
    assert s.queued_deferrable == 1


def _shaped_thread(**shape: Any) -> ControlThread:
    cfg = plugin_config(
        ceiling_w=600, mode="enforce", warmup_s=0.0, metrics_port=0, initial_batch=8, **shape
    )
    return ControlThread(cfg, CAPS, StepStats(), source=Watts(300.0))


def _serve_seconds(ct: ControlThread, seconds: int, t0: float, first_id: int = 0) -> float:
    """An engine at 8 running: two arrivals a second (one low), two completions, 5 ticks."""
    t, n = t0, first_id
    for _ in range(seconds):
        for cls in ("normal", "low"):
            ct.stats.record_arrival(f"r{n}", cls)
            n += 1
        ct.stats.record_requests({}, {f"r{n - 2}": "normal"}, finished=[f"r{n - 10}"])
        for _ in range(5):
            t += 0.2
            ct.stats.record(
                running=8,
                waiting=3,
                decode_reqs=8,
                decode_tokens=8,
                prefill_tokens=64,
                kv_blocks_used=100,
                t_s=t,
            )
            asyncio.run(ct.monitor.poll_once())
            ct.tick(t)
    return t


def test_plugin_runs_the_planner_from_the_engines_counts() -> None:
    off = _shaped_thread(ramp_up_w_per_s=20.0, floor_w=450.0)
    assert off.loop.plan is None  # planner off: the reactive laws alone
    ct = _shaped_thread(ramp_up_w_per_s=20.0, floor_w=450.0, planner="on", plan_horizon_s=30)
    runner = ct.loop.plan
    assert isinstance(runner, PlanRunner)
    t = _serve_seconds(ct, 2, time.monotonic())
    runner.clock = lambda: t
    assert asyncio.run(runner.replan()) is None  # the first call starts the rate window
    t = _serve_seconds(ct, 1, t, first_id=4)
    plan = asyncio.run(runner.replan())
    assert plan is not None and plan.status == "optimal" and len(plan.power_w) == 30
    assert plan.power_w[0] <= 300.0 + 20.0 + 1e-6  # one ramp from the meter
    x = runner.inputs(t + 1.0)
    assert x is not None and x.deferrable_batch_s[0] > 0  # the engine's low queue is work
    t = _serve_seconds(ct, 2, t, first_id=6)
    d = ct.last
    planned = runner.plan_w(t)
    assert d is not None and d.power_w is not None and planned is not None
    assert ct.history[-1].plan_w == pytest.approx(planned)  # the tick saw the plan
    assert d.deferrable == "release"  # under the floor with low work waiting, whatever the plan
    shape = ct.status()["shape"]
    assert shape["planner"] == "on" and shape["plan"]["status"] == "optimal"
    requests = ct.status()["engine"]["requests"]
    assert requests["arrived"] == {"high": 0, "normal": 5, "low": 5}
    assert requests["queued"]["low"] == 5 and requests["completed"] == 5
    assert shape["planned_w"] == pytest.approx(planned) and len(shape["plan"]["next_w"]) == 10
    # Low work waited under the 450 W floor: counted as shortfall, from the engine's queue.
    assert shape["floor_shortfall_s"] > 0 and shape["floor_shortfall_w"] == pytest.approx(150.0)


def test_plugin_planner_task_runs_on_the_control_threads_loop() -> None:
    ct = _shaped_thread(ramp_up_w_per_s=20.0, planner="on", plan_horizon_s=30, plan_every_s=0.5)

    _serve_seconds(ct, 2, time.monotonic())

    async def go() -> dict[str, Any]:
        await ct.loop.start()
        try:
            for _ in range(100):  # the plan task replans once the loop has ticked
                await asyncio.sleep(0.05)
                if ct.status()["shape"]["plan"]:
                    break
        finally:
            await ct.loop.stop()
        return ct.status()["shape"]

    shape = asyncio.run(go())
    assert shape["plan"] and shape["plan"]["status"] == "optimal"


# -- one factory for both hosts; what the EngineCore process loads --------------------------


@pytest.mark.parametrize("gpus_seen", [1, 0])
def test_auto_means_the_same_to_serve_and_the_plugin(
    gpus_seen: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: auto is "NVML where it sees the GPUs, else a dcgm-exporter at --dcgm-url".
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([FakeGpu()] * gpus_seen))
    url = "http://127.0.0.1:9400/metrics"
    want = "nvml" if gpus_seen else "dcgm"
    proxy = load(SERVE, overrides={"upstream": "http://127.0.0.1:9", "ceiling_w": 500})
    told = load(
        SERVE, overrides={"upstream": "http://127.0.0.1:9", "ceiling_w": 500, "dcgm_url": url}
    )
    plugin = plugin_config(ceiling_w=500, dcgm_url=url)
    assert serve.source_kind(proxy) == serve.source_kind(told) == want
    assert control.source_kind(plugin) == want
    if gpus_seen:
        assert control.source_kind(plugin_config(ceiling_w=500)) == "nvml"
        return

    # The dcgm-exporter each host reads: the one named, else (serve) the upstream's /metrics.
    def proxy_source(s: Any) -> Any:
        return factory.make_power_source(
            s.power, "dcgm", dcgm_url=serve.dcgm_url(s), limiter=s.limiter
        )

    for src, at in (
        (proxy_source(told), url),
        (proxy_source(proxy), proxy.proxy.metrics_url),
        (control.make_power_source(plugin, "dcgm", CAPS, StepStats()), url),
    ):
        assert isinstance(src, PrometheusPowerSource) and at in src.name
    with pytest.raises(ConfigError, match="POWERBATCH_VLLM_DCGM_URL"):  # the plugin has no upstream
        control.source_kind(plugin_config(ceiling_w=500))


ENGINE_CORE = """
import sys
from test_telemetry_nvml import FakeGpu, fake_nvml
sys.modules["pynvml"] = fake_nvml([FakeGpu()])
from powerbatch_vllm import config, control, energy, engine, metrics
env = {"CEILING_W": "500", "POWER_SOURCE": "nvml", "METRICS_PORT": "0"}
cfg = config.load_config({"POWERBATCH_VLLM_" + k: v for k, v in env.items()})
caps = engine.EngineCaps(64, 2048, 511, 16, True)
ct = control.ControlThread(cfg, caps, engine.StepStats())
assert ct.kind == "nvml", ct.kind
print(" ".join(m for m in ("aiohttp.web", "powerbatch.admission.queue", "powerbatch.sim")
               if m in sys.modules or any(k.startswith(m + ".") for k in sys.modules)))
"""


def test_engine_core_on_nvml_loads_no_http_server_queue_or_simulator() -> None:
    # What vLLM's EngineCore imports for the scheduler (scheduler.py needs vLLM itself, which is
    # not here; it adds only vLLM's own modules to these) and builds, on an NVML power source.
    tests = str(Path(__file__).parent)
    path = [tests, str(Path(tests).parent / "plugins" / "vllm"), *sys.path]
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_CORE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ":".join(path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []


# -- the prefill boost: the scheduler's thread asks, the control thread's loop lifts ----------


def test_streams_reads_the_output_kind_the_openai_server_asks_for() -> None:
    from types import SimpleNamespace

    from powerbatch_vllm.energy import streams

    def request(kind: str | None) -> Any:
        output_kind = None if kind is None else SimpleNamespace(name=kind)
        return SimpleNamespace(sampling_params=SimpleNamespace(output_kind=output_kind))

    assert streams(request("DELTA"))
    assert not streams(request("FINAL_ONLY")) and not streams(request("CUMULATIVE"))
    assert not streams(request(None)) and not streams(SimpleNamespace(sampling_params=None))


def test_the_scheduler_thread_lifts_the_clock_through_the_control_threads_loop() -> None:
    from prometheus_client import CollectorRegistry
    from test_clock_boost import LOCK, RecordingClock, _law_locks

    from powerbatch.control.clock import DeviceClock
    from powerbatch.control.config import ClockPolicy
    from powerbatch.telemetry.clock import ClockActuator

    ct = _thread("enforce", Watts(300.0))
    assert ct.boost_classes == frozenset()  # no clock control: nothing to boost
    backend = RecordingClock()
    policy = ClockPolicy(clock_objective="energy", clock_boost_classes=("high",))
    ct.loop.sm_clock = DeviceClock(
        ClockActuator(backend, min_interval_s=60.0), policy, ct.control, CollectorRegistry()
    )
    _law_locks(ct.loop.sm_clock, [])
    assert ct.boost_classes == {"high"}

    def until(what: Any, label: str) -> None:
        deadline = time.monotonic() + 5.0
        while backend.locked != what:
            assert time.monotonic() < deadline, (label, backend.locked)
            time.sleep(0.01)

    ct.start()
    try:
        until(LOCK, "the law's lock")
        ct.boost("a")  # from this (the scheduler's) thread
        ct.boost("b")
        until(None, "lifted")
        ct.unboost("a")
        ct.unboost("a")  # twice: no effect
        time.sleep(0.2)
        assert backend.locked is None  # b is still prefilling
        ct.unboost("b")
        until(LOCK, "given back, unpaced")
    finally:
        ct.stop()
    # Locked, lifted once for both, given back; reset when the thread stops.
    assert [lock for _, lock in backend.history] == [LOCK, None, LOCK, None]
