"""The control loop beside vLLM's scheduler: a daemon thread in the EngineCore process.

The thread owns an asyncio loop that runs the shared `ControlLoop` (powerbatch.control.loop):
the same power monitor, controller, feature window, status and trace as the proxy. Here the
engine's exact step counts are the feature source, and each decision becomes one immutable
`EngineLimits` that `schedule()` reads. The step never waits on this thread; if a tick fails,
safe limits hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from typing import Any

from powerbatch.control import ControlConfig, Controller, Decision, LatencySnapshot
from powerbatch.control.loop import ControlLoop, HostSample
from powerbatch.telemetry import (
    NvmlPowerSource,
    PowerMonitor,
    PowerSource,
    PrometheusPowerSource,
    default_power_limit_w,
)
from powerbatch.telemetry.trace import TraceWriter
from powerbatch_vllm.config import PluginConfig
from powerbatch_vllm.engine import EngineCaps, EngineLimits, StepStats, engine_limits
from powerbatch_vllm.metrics import PluginMetrics, StatusServer, dcgm_text

log = logging.getLogger("vllm.powerbatch")


def make_power_source(cfg: PluginConfig, caps: EngineCaps, stats: StepStats) -> PowerSource:
    """The configured source; `model` reads the engine's own steps through `stats`."""
    if cfg.power_source == "nvml":
        return NvmlPowerSource([int(g) for g in cfg.gpu_list])
    if cfg.power_source == "dcgm":
        assert cfg.dcgm_url is not None  # PluginConfig checks this
        return PrometheusPowerSource(
            cfg.dcgm_url, metric=cfg.dcgm_metric, labels={"gpu": cfg.gpu_list}
        )
    # Imported here only: the simulator package brings its HTTP server (aiohttp.web) along,
    # which an engine reading a real sensor has no use for.
    from powerbatch.sim.power_source import ModelPowerSource

    def features() -> tuple[int, float, int]:
        batch, prefill, kv_blocks = stats.take_window()
        return round(batch), prefill, round(kv_blocks * caps.block_size)

    return ModelPowerSource(features, cfg.model_profile, kv_capacity_tokens=max(caps.kv_tokens, 1))


def _trace_writer(path: str | None) -> TraceWriter | None:
    """The trace's writer, or None (logged) where the file cannot be opened: the ceiling
    matters more than its record."""
    if not path:
        return None
    try:
        return TraceWriter(path)
    except OSError as exc:
        log.error("powerbatch-vllm cannot write the control trace to %s: %s", path, exc)
        return None


class EngineFeatures:
    """The engine's exact counts as the loop's feature source."""

    def __init__(
        self, stats: StepStats, caps: EngineCaps, metrics: PluginMetrics, sink: EngineSink
    ) -> None:
        self.stats, self.caps, self.metrics, self.sink = stats, caps, metrics, sink

    def sample(self) -> HostSample:
        snap = self.stats.snapshot()
        usage = snap["kv_blocks_used"] / max(self.caps.num_kv_blocks, 1)
        m = self.metrics
        m.running.set(snap["running"])
        m.waiting.set(snap["waiting"])
        m.kv_usage.set(usage)
        m.step_s.set(snap["step_s"])
        return HostSample(
            in_flight=int(snap["running"]),
            queued=int(snap["waiting"]),
            # KV committed (prompt + max_tokens per running request), what the KV cap limits.
            kv_tokens=snap["kv_committed_tokens"],
            prefill_tokens_total=snap["prefill_tokens_total"],
            decode_tokens_total=snap["decode_tokens_total"],
            kv_cache_usage=usage,
        )

    def latency(self, t_s: float) -> LatencySnapshot:
        return self.stats.latency(t_s)

    def status_extra(self) -> dict[str, Any]:
        snap, caps, lim = self.stats.snapshot(), self.caps, self.sink.limits
        return {
            "queue": {  # live, not as of the last tick
                "in_flight": int(snap["running"]),
                "kv_tokens_in_flight": snap["kv_committed_tokens"],
                "waiting": int(snap["waiting"]),
            },
            "engine": {
                "limits": {
                    "max_active_reqs": lim.max_active_reqs,
                    "step_tokens": lim.step_tokens(caps, int(snap["running"])),
                    "prefill_tokens_per_step": lim.prefill_tokens_per_step,
                    "max_kv_blocks": lim.max_kv_blocks,
                },
                "configured": {
                    "max_active_reqs": caps.max_active_reqs,
                    "step_tokens": caps.max_step_tokens,
                    "kv_blocks": caps.num_kv_blocks,
                    "block_size": caps.block_size,
                },
                "counters": dict(snap),
            },
        }


class EngineSink:
    """The decision in vLLM's units: `limits` is swapped whole, so `schedule()` reads one
    attribute and never sees a half-made update."""

    def __init__(
        self,
        cfg: PluginConfig,
        control: ControlConfig,
        caps: EngineCaps,
        stats: StepStats,
        metrics: PluginMetrics,
    ) -> None:
        self.cfg, self.caps, self.stats, self.metrics = cfg, caps, stats, metrics
        self.safe_batch = control.safe_batch
        # Until the first tick: warm-up limits, as the controller itself starts.
        self.limits = EngineLimits.unlimited(caps)
        if cfg.mode == "enforce":
            self.limits = EngineLimits(
                control.initial_batch, None, caps.num_kv_blocks, cfg.min_step_tokens
            )
        self._export()

    def apply(self, decision: Decision) -> None:
        if self.cfg.mode == "enforce":
            step_s = self.stats.step_s
            self.limits = engine_limits(
                decision.enforced,
                self.caps,
                step_s=None if step_s is None or math.isnan(step_s) else step_s,
                min_step_tokens=self.cfg.min_step_tokens,
                pace_prefill=self.cfg.prefill_pacing,
                cap_kv=self.cfg.kv_cap,
            )
        self._export()

    def fail_safe(self) -> None:
        if self.cfg.mode == "enforce":
            cur = self.limits
            self.limits = EngineLimits(
                min(cur.max_active_reqs, self.safe_batch),
                self.cfg.min_step_tokens,
                cur.max_kv_blocks,
                self.cfg.min_step_tokens,
            )
        self._export()

    def _export(self) -> None:
        lim, m = self.limits, self.metrics
        m.engine_limit.labels("active_requests").set(lim.max_active_reqs)
        m.engine_limit.labels("step_tokens").set(lim.step_tokens(self.caps, self.stats.running))
        m.engine_limit.labels("kv_blocks").set(lim.max_kv_blocks)


class ControlThread:
    """Runs the control loop for one engine; `limits` is what the scheduler applies."""

    def __init__(
        self,
        cfg: PluginConfig,
        caps: EngineCaps,
        stats: StepStats,
        *,
        dp_rank: int = 0,
        source: PowerSource | None = None,
        history_len: int = 36_000,
    ) -> None:
        self.cfg, self.caps, self.stats = cfg, caps, stats
        device_max_w = None
        if cfg.power_source == "nvml" and cfg.max_w is None and source is None:
            device_max_w = default_power_limit_w([int(g) for g in cfg.gpu_list])
        self.control = cfg.control_config(
            engine_max_batch=caps.max_active_reqs,
            max_kv_tokens=caps.kv_tokens,
            device_max_w=device_max_w,
        )
        self.controller = Controller(self.control)
        self.source = source or make_power_source(cfg, caps, stats)
        plausible = cfg.max_plausible_w or 3.0 * cfg.ceiling_w
        self.monitor = PowerMonitor(
            self.source,
            interval_s=cfg.power_interval_s,
            stale_after_s=cfg.stale_after_s,
            max_plausible_w=plausible,
        )
        self.metrics = m = PluginMetrics()
        m.engine_configured.labels("active_requests").set(caps.max_active_reqs)
        m.engine_configured.labels("step_tokens").set(caps.max_step_tokens)
        m.engine_configured.labels("kv_blocks").set(caps.num_kv_blocks)
        self.sink = EngineSink(cfg, self.control, caps, stats, m)
        self.features = EngineFeatures(stats, caps, m, self.sink)
        # dcgm-exporter's DCGM_FI_DEV_POWER_USAGE is a 1-second mean; its INSTANT field is not.
        averaged = cfg.power_source == "dcgm" and "INSTANT" not in cfg.dcgm_metric.upper()
        self.loop = ControlLoop(
            self.controller,
            self.monitor,
            self.features,
            [self.sink],
            m,
            source_averages=averaged,
            history_len=history_len,
            trace=_trace_writer(cfg.trace_path),
        )
        self.dp_rank = dp_rank
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: StatusServer | None = None

    @property
    def limits(self) -> EngineLimits:
        return self.sink.limits

    @property
    def last(self) -> Decision | None:
        return self.loop.last

    @property
    def history(self) -> Any:
        return self.loop.history

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self.cfg.metrics_port:
            port = self.cfg.metrics_port + self.dp_rank
            try:
                self._server = StatusServer(
                    self.cfg.metrics_host,
                    port,
                    self.metrics,
                    self._extra_text,
                    self.status,
                    self.loop.history_rows,
                )
                self._server.start()
                log.info("powerbatch-vllm metrics on http://%s:%d/metrics", *self._server.address)
            except OSError as exc:  # the ceiling matters more than its dashboard
                log.error("powerbatch-vllm cannot serve metrics on port %d: %s", port, exc)
                self._server = None
        self._thread = threading.Thread(target=self._run, name="powerbatch-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._server is not None:
            self._server.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("powerbatch control thread died; holding the safe batch")
            self.sink.fail_safe()

    async def _main(self) -> None:
        await self.loop.start()
        try:
            await asyncio.to_thread(self._stop.wait)
        finally:
            await self.loop.stop()
            with contextlib.suppress(Exception):
                await self.source.close()

    # -- one tick, for tests and the loop -----------------------------------------------------

    def tick(self, t_s: float) -> Decision:
        return self.loop.tick(t_s)

    def _extra_text(self) -> str:
        if self.cfg.power_source != "model":
            return ""
        gpu = (self.cfg.gpu_list or ["0"])[0]
        return dcgm_text(
            self.monitor.snapshot().raw_w, gpu, f"powerbatch-model:{self.cfg.model_profile}"
        )

    def status(self) -> dict[str, Any]:
        return self.loop.status()
