"""The control loop beside vLLM's scheduler: a daemon thread in the EngineCore process.

It owns an asyncio loop for the power monitor (the same `PowerMonitor` and power sources as the
proxy) and ticks the shared `Controller` at `tick_hz`. Each tick turns the engine's exact counts
into the controller's `Observation`, and its `Decision` into one immutable `EngineLimits` that
`schedule()` reads. The step never waits on this thread; if a tick fails, safe limits hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import logging
import math
import threading
import time
from collections import deque
from typing import Any

from powerbatch.control import Controller, Decision, Observation
from powerbatch.estimate import Features
from powerbatch.sim.power_source import ModelPowerSource
from powerbatch.telemetry import (
    NvmlPowerSource,
    PowerMonitor,
    PowerSource,
    PrometheusPowerSource,
    default_power_limit_w,
)
from powerbatch_vllm.config import PluginConfig
from powerbatch_vllm.engine import EngineCaps, EngineLimits, StepStats, engine_limits
from powerbatch_vllm.metrics import PluginMetrics, StatusServer, dcgm_text

log = logging.getLogger("vllm.powerbatch")


class _Ewma:
    """Time-aware EWMA of a level, or (rate=True) of a counter's rate."""

    def __init__(self, half_life_s: float, *, rate: bool = False) -> None:
        self.half_life_s, self.rate = half_life_s, rate
        self.value: float | None = None
        self._last: tuple[float, float] | None = None

    def update(self, t_s: float, x: float) -> float:
        last, self._last = self._last, (t_s, x)
        if last is None:
            self.value = 0.0 if self.rate else x
            return self.value
        dt = t_s - last[0]
        if dt <= 0:
            return self.value or 0.0
        sample = (x - last[1]) / dt if self.rate else x
        a = 1.0 - math.exp2(-dt / self.half_life_s)
        self.value = sample if self.value is None else self.value + a * (sample - self.value)
        return self.value


def make_power_source(cfg: PluginConfig, caps: EngineCaps, stats: StepStats) -> PowerSource:
    """The configured source; `model` reads the engine's own steps through `stats`."""
    if cfg.power_source == "nvml":
        return NvmlPowerSource([int(g) for g in cfg.gpu_list])
    if cfg.power_source == "dcgm":
        assert cfg.dcgm_url is not None  # PluginConfig checks this
        return PrometheusPowerSource(
            cfg.dcgm_url, metric=cfg.dcgm_metric, labels={"gpu": cfg.gpu_list}
        )

    def features() -> tuple[int, float, int]:
        batch, prefill, kv_blocks = stats.take_window()
        return round(batch), prefill, round(kv_blocks * caps.block_size)

    return ModelPowerSource(features, cfg.model_profile, kv_capacity_tokens=max(caps.kv_tokens, 1))


class ControlThread:
    """Runs the controller for one engine; `limits` is what the scheduler applies."""

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
        self.metrics = PluginMetrics()
        self.history: deque[dict[str, Any]] = deque(maxlen=history_len)
        self.dp_rank = dp_rank
        # Until the first tick: warm-up limits, as the controller itself starts.
        self.limits = EngineLimits.unlimited(caps)
        if cfg.mode == "enforce":
            self.limits = EngineLimits(
                self.control.initial_batch, None, caps.num_kv_blocks, cfg.min_step_tokens
            )
        self.last: Decision | None = None
        self._h = 0.5  # smoothing half-life of the features, as the proxy's power smoothing
        self._batch, self._kv = _Ewma(self._h), _Ewma(self._h)
        self._prefill, self._decode = _Ewma(self._h, rate=True), _Ewma(self._h, rate=True)
        self._features = Features(0.0, 0.0, 0.0, 0.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: StatusServer | None = None
        self._t0 = time.monotonic()
        m = self.metrics
        m.ceiling_w.set(cfg.ceiling_w)
        m.slo_s.labels("ttft").set(self.control.ttft_slo_s)
        m.slo_s.labels("tpot").set(self.control.tpot_slo_s)
        m.engine_configured.labels("active_requests").set(caps.max_active_reqs)
        m.engine_configured.labels("step_tokens").set(caps.max_step_tokens)
        m.engine_configured.labels("kv_blocks").set(caps.num_kv_blocks)
        self._export_limits()

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
                    lambda: list(self.history),
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
        if self.cfg.trace_path:
            self.write_trace(self.cfg.trace_path)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("powerbatch control thread died; holding the safe batch")
            self._fail_safe()

    async def _main(self) -> None:
        await self.monitor.start()
        period = 1.0 / self.control.tick_hz
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        try:
            while not self._stop.is_set():
                try:
                    self.tick(time.monotonic())
                except Exception:
                    log.exception("powerbatch control tick failed; holding the safe batch")
                    self.metrics.tick_errors.inc()
                    self._fail_safe()
                next_t += period
                await asyncio.sleep(max(0.0, next_t - loop.time()))
        finally:
            await self.monitor.stop()
            with contextlib.suppress(Exception):
                await self.source.close()

    def _fail_safe(self) -> None:
        if self.cfg.mode == "enforce":
            cur = self.limits
            self.limits = EngineLimits(
                min(cur.max_active_reqs, self.control.safe_batch),
                self.cfg.min_step_tokens,
                cur.max_kv_blocks,
                self.cfg.min_step_tokens,
            )

    # -- one tick ---------------------------------------------------------------------------

    def features(self, t_s: float, snap: dict[str, float]) -> Features:
        self._features = Features(
            batch=self._batch.update(t_s, snap["running"]),
            # KV committed (prompt + max_tokens per running request), what the KV cap limits.
            kv_tokens=self._kv.update(t_s, snap["kv_committed_tokens"]),
            prefill_tok_s=self._prefill.update(t_s, snap["prefill_tokens_total"]),
            decode_tok_s=self._decode.update(t_s, snap["decode_tokens_total"]),
        )
        return self._features

    def tick(self, t_s: float) -> Decision:
        snap = self.stats.snapshot()
        reading = self.monitor.snapshot()
        caps = self.caps
        obs = Observation(
            t_s=t_s,
            power_w=reading.smoothed_w if reading.ok else None,
            sensor_ok=reading.ok,
            sensor_error=reading.error,
            features=self.features(t_s, snap),
            in_flight=int(snap["running"]),
            queued=int(snap["waiting"]),
            latency=self.stats.latency(t_s),
            kv_cache_usage=snap["kv_blocks_used"] / max(caps.num_kv_blocks, 1),
        )
        d = self.controller.tick(obs)
        self.last = d
        if self.cfg.mode == "enforce":
            step_s = snap["step_s"]
            self.limits = engine_limits(
                d.enforced,
                caps,
                step_s=None if math.isnan(step_s) else step_s,
                min_step_tokens=self.cfg.min_step_tokens,
                pace_prefill=self.cfg.prefill_pacing,
                cap_kv=self.cfg.kv_cap,
            )
        self._export(d, reading.raw_w, snap)
        self.metrics.export_latency(obs.latency)
        self.history.append(self._row(t_s, d, reading.raw_w, snap))
        return d

    def _row(
        self, t_s: float, d: Decision, raw_w: float | None, snap: dict[str, float]
    ) -> dict[str, Any]:
        lim = self.limits
        f = self._features
        return {
            "t_s": round(t_s - self._t0, 3),
            "power_w": d.power_w,
            "raw_w": raw_w,
            "predicted_upper_w": None if math.isnan(d.predicted_upper_w) else d.predicted_upper_w,
            "target_w": None if math.isnan(d.target_w) else d.target_w,
            "state": d.state,
            "binding": d.binding,
            "limit_requests": d.proposed.max_requests,
            "limit_prefill_tok_s": d.proposed.prefill_tok_s,
            "engine_active_reqs": lim.max_active_reqs,
            "engine_step_tokens": lim.step_tokens(self.caps, int(snap["running"])),
            "engine_kv_blocks": lim.max_kv_blocks,
            "running": int(snap["running"]),
            "waiting": int(snap["waiting"]),
            "kv_usage": snap["kv_blocks_used"] / max(self.caps.num_kv_blocks, 1),
            "batch": f.batch,
            "prefill_tok_s": f.prefill_tok_s,
            "decode_tok_s": f.decode_tok_s,
        }

    def _export_limits(self, running: int = 0) -> None:
        lim, m = self.limits, self.metrics
        m.engine_limit.labels("active_requests").set(lim.max_active_reqs)
        m.engine_limit.labels("step_tokens").set(lim.step_tokens(self.caps, running))
        m.engine_limit.labels("kv_blocks").set(lim.max_kv_blocks)

    def _export(self, d: Decision, raw_w: float | None, snap: dict[str, float]) -> None:
        m = self.metrics
        m.ticks.inc()
        m.export_decision(d, raw_w)
        self._export_limits(int(snap["running"]))
        m.running.set(snap["running"])
        m.waiting.set(snap["waiting"])
        m.kv_usage.set(snap["kv_blocks_used"] / max(self.caps.num_kv_blocks, 1))
        m.step_s.set(snap["step_s"])
        f = self._features
        for name in ("batch", "kv_tokens", "prefill_tok_s", "decode_tok_s"):
            m.feature.labels(name).set(getattr(f, name))

    def _extra_text(self) -> str:
        if self.cfg.power_source != "model":
            return ""
        gpu = (self.cfg.gpu_list or ["0"])[0]
        return dcgm_text(
            self.monitor.snapshot().raw_w, gpu, f"powerbatch-model:{self.cfg.model_profile}"
        )

    def status(self) -> dict[str, Any]:
        d, lim, caps = self.last, self.limits, self.caps
        snap = self.stats.snapshot()
        reading = self.monitor.snapshot()
        lat = self.stats.latency(time.monotonic())
        return {
            "state": d.state if d else "starting",
            "mode": self.cfg.mode,
            "binding": d.binding if d else None,
            "reason": d.reason if d else "",
            "power": {
                "source": self.cfg.power_source,
                "measured_w": reading.smoothed_w if reading.ok else None,
                "raw_w": reading.raw_w,
                "ceiling_w": self.cfg.ceiling_w,
                "target_w": d.target_w if d else None,
                "predicted_upper_w": d.predicted_upper_w if d else None,
                "sensor_ok": reading.ok,
                "sensor_error": reading.error,
            },
            "limits": {
                "controller": (
                    {
                        "max_requests": d.enforced.max_requests,
                        "max_kv_tokens": d.enforced.max_kv_tokens,
                        "prefill_tok_s": d.enforced.prefill_tok_s,
                    }
                    if d
                    else None
                ),
                "engine": {
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
            },
            "engine": snap,
            "latency": {
                "ttft_p95_s": lat.ttft_p95_s,
                "tpot_p95_s": lat.tpot_p95_s,
                "samples": lat.samples,
                "ttft_slo_s": self.control.ttft_slo_s,
                "tpot_slo_s": self.control.tpot_slo_s,
            },
            "multipliers": d.multipliers if d else {},
        }

    def write_trace(self, path: str) -> None:
        rows = list(self.history)
        if not rows:
            return
        try:
            with open(path, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        except OSError as exc:
            log.error("cannot write the control trace to %s: %s", path, exc)
