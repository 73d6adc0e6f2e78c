"""The control loop: telemetry in, limits out, at `tick_hz`, off the request path.

Joins the power monitor, the controller, the admission queue and the latency window. The request
path only bumps counters here; every rate, percentile and fit is computed on the tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from powerbatch.admission import PRIORITIES, AdmissionQueue
from powerbatch.control import Controller, Decision, LatencyWindow, Limits, Observation
from powerbatch.estimate import Features
from powerbatch.proxy.metrics import ProxyMetrics
from powerbatch.telemetry import (
    PowerMonitor,
    PowerReading,
    UpstreamMetricsScraper,
    UpstreamSignals,
)
from powerbatch.telemetry.trace import TraceRow

log = logging.getLogger("powerbatch.control")


@dataclass(frozen=True, slots=True)
class TickRecord:
    """One tick, kept for the status endpoint, the demo's plot and trace recording."""

    t_s: float
    power_w: float | None
    raw_w: float | None
    energy_j: float | None
    predicted_upper_w: float
    target_w: float
    limit_requests: int
    limit_kv_tokens: int
    prefill_tok_s: float | None
    in_flight: int
    kv_in_flight: int
    queued: int
    binding: str
    state: str
    features: Features


class _Window:
    """Levels averaged and counters differenced over the last `window_s` of ticks.

    The model regresses the 1-second power (the quantity the ceiling is about) on features
    taken over the same second, so cause and effect line up.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._ticks: deque[tuple[float, float, float, float, float]] = deque()

    def update(
        self, t_s: float, batch: float, kv: float, prefill_total: float, decode_total: float
    ) -> Features:
        ticks = self._ticks
        ticks.append((t_s, batch, kv, prefill_total, decode_total))
        while len(ticks) > 2 and ticks[1][0] <= t_s - self.window_s:
            ticks.popleft()
        first = ticks[0]
        dt = t_s - first[0]
        n = len(ticks)
        return Features(
            batch=sum(x[1] for x in ticks) / n,
            kv_tokens=sum(x[2] for x in ticks) / n,
            prefill_tok_s=(prefill_total - first[3]) / dt if dt > 0 else 0.0,
            decode_tok_s=(decode_total - first[4]) / dt if dt > 0 else 0.0,
        )


class Governor:
    def __init__(
        self,
        controller: Controller,
        queue: AdmissionQueue,
        monitor: PowerMonitor,
        metrics: ProxyMetrics,
        *,
        latency: LatencyWindow | None = None,
        upstream_scraper: UpstreamMetricsScraper | None = None,
        scrape_interval_s: float = 1.0,
        window_s: float = 1.0,
        source_averages: bool = False,
        history_len: int = 36_000,
    ) -> None:
        self.controller = controller
        self.queue = queue
        self.monitor = monitor
        self.metrics = metrics
        self.latency = latency or LatencyWindow()
        self.scraper = upstream_scraper
        self.scrape_interval_s = scrape_interval_s
        self.output_tokens_total = 0
        self.history: deque[TickRecord] = deque(maxlen=history_len)
        self.upstream: UpstreamSignals | None = None
        self.window_s = window_s
        # A source that already reports a 1-second mean (NVML's power usage on Hopper, dcgm's
        # DCGM_FI_DEV_POWER_USAGE) is used as it is: averaging it again would lag the power a
        # second behind the features it is regressed on.
        self.source_averages = source_averages
        self._window = _Window(window_s)
        self._tasks: list[asyncio.Task[None]] = []
        cfg = controller.config
        metrics.ceiling_w.set(cfg.ceiling_w)
        metrics.slo_s.labels("ttft").set(cfg.ttft_slo_s)
        metrics.slo_s.labels("tpot").set(cfg.tpot_slo_s)

    @property
    def last(self) -> Decision | None:
        return self.controller.last

    async def start(self) -> None:
        await self.monitor.start()
        self._tasks.append(asyncio.create_task(self._loop(), name="powerbatch-control"))
        if self.scraper is not None:
            self._tasks.append(asyncio.create_task(self._scrape_loop(), name="powerbatch-scrape"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.monitor.stop()

    async def _loop(self) -> None:
        period = 1.0 / self.controller.config.tick_hz
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # never let a bug leave stale limits in force unnoticed
                log.exception("control tick failed; holding the safe batch")
                self._fail_safe()
            next_t += period
            await asyncio.sleep(max(0.0, next_t - loop.time()))

    async def _scrape_loop(self) -> None:
        assert self.scraper is not None
        while True:
            try:
                self.upstream = await self.scraper.scrape()
            except Exception as exc:  # the upstream's metrics are an extra, never required
                log.debug("upstream metrics scrape failed: %s", exc)
                self.upstream = None
            await asyncio.sleep(self.scrape_interval_s)

    def _fail_safe(self) -> None:
        """A tick raised: hold the safe batch and say so, as a sensor failure would."""
        cfg = self.controller.config
        limits = self.queue.limits
        if cfg.mode == "enforce" and limits.max_requests > cfg.safe_batch:
            self.queue.set_limits(Limits(cfg.safe_batch, limits.max_kv_tokens, None))
        self.metrics.sensor_ok.set(0.0)
        for s in self.metrics.states:
            self.metrics.state.labels(s).set(1.0 if s == "fail_closed" else 0.0)

    def features(self, t_s: float) -> Features:
        # The proxy's own in-flight count is exact and current; the upstream's running count is
        # scraped once a second and lags, so it is reported but not regressed on.
        q = self.queue
        return self._window.update(
            t_s,
            float(q.in_flight),
            float(q.kv_in_flight),
            float(q.stats.prefill_tokens_admitted_total),
            float(self.output_tokens_total),
        )

    def power_w(self, reading: PowerReading) -> float | None:
        """The power the ceiling is about: the mean over the last `window_s`."""
        if not reading.ok:
            return None
        if self.source_averages:
            return reading.filtered_w
        return self.monitor.mean_w(self.window_s)

    def tick(self, t_s: float) -> Decision:
        reading = self.monitor.snapshot()
        features = self.features(t_s)
        cfg = self.controller.config
        obs = Observation(
            t_s=t_s,
            power_w=self.power_w(reading),
            sensor_ok=reading.ok,
            sensor_error=reading.error,
            features=features,
            in_flight=self.queue.in_flight,
            queued=self.queue.queued,
            latency=self.latency.snapshot(t_s, cfg.interactive_classes),
            kv_cache_usage=self.upstream.kv_cache_usage if self.upstream else None,
        )
        decision = self.controller.tick(obs)
        if decision.enforced != self.queue.limits:
            self.queue.set_limits(decision.enforced)
        self._export(decision, reading.filtered_w, reading.energy_j, obs)
        self.history.append(
            TickRecord(
                t_s=t_s,
                power_w=obs.power_w,
                raw_w=reading.filtered_w,
                energy_j=reading.energy_j,
                predicted_upper_w=decision.predicted_upper_w,
                target_w=decision.target_w,
                limit_requests=decision.proposed.max_requests,
                limit_kv_tokens=decision.proposed.max_kv_tokens,
                prefill_tok_s=decision.proposed.prefill_tok_s,
                in_flight=obs.in_flight,
                kv_in_flight=self.queue.kv_in_flight,
                queued=obs.queued,
                binding=decision.binding,
                state=decision.state,
                features=features,
            )
        )
        return decision

    def _export(
        self, d: Decision, raw_w: float | None, energy_j: float | None, obs: Observation
    ) -> None:
        m = self.metrics
        m.export_decision(d, raw_w, energy_j)
        m.in_flight.set(self.queue.in_flight)
        m.kv_in_flight.set(self.queue.kv_in_flight)
        for p, n in self.queue.queued_by_class().items():
            m.queue_length.labels(p).set(n)
        m.export_latency(obs.latency)

    def trace_rows(self) -> list[TraceRow]:
        """The ticks as a replayable trace (see powerbatch.telemetry.trace)."""
        return [
            TraceRow(
                t_s=r.t_s,
                power_w=r.power_w,
                energy_j=r.energy_j,
                requests_in_flight=r.features.batch,
                kv_tokens_in_flight=r.features.kv_tokens,
                prefill_tok_s=r.features.prefill_tok_s,
                decode_tok_s=r.features.decode_tok_s,
                queue_len=float(r.queued),
            )
            for r in self.history
            if r.power_w is not None
        ]

    def status(self) -> dict[str, Any]:
        """The JSON status: limits, power, multipliers, binding constraint, p95s, queue."""
        d = self.controller.last
        reading = self.monitor.snapshot()
        cfg = self.controller.config
        now = time.monotonic()
        lat = self.latency.snapshot(now, cfg.interactive_classes)
        model = self.controller.model

        def limits(x: Any) -> dict[str, Any]:
            return {
                "max_requests": x.max_requests,
                "max_kv_tokens": x.max_kv_tokens,
                "prefill_tok_s": x.prefill_tok_s,
            }

        return {
            "state": d.state if d else "starting",
            "mode": cfg.mode,
            "binding": d.binding if d else None,
            "reason": d.reason if d else "",
            "emergency": d.emergency if d else False,
            "limits": {
                "enforced": limits(d.enforced) if d else None,
                "proposed": limits(d.proposed) if d else None,
            },
            "power": {
                "measured_w": reading.smoothed_w if reading.ok else None,
                "raw_w": reading.raw_w,
                "predicted_w": d.predicted_w if d else None,
                "predicted_upper_w": d.predicted_upper_w if d else None,
                "target_w": d.target_w if d else None,
                "ceiling_w": cfg.ceiling_w,
                "energy_j": reading.energy_j,
                "sensor_ok": reading.ok,
                "sensor_error": reading.error,
            },
            "multipliers": d.multipliers if d else {},
            "latency": {
                "ttft_p95_s": lat.ttft_p95_s,
                "tpot_p95_s": lat.tpot_p95_s,
                "ttft_p95_by_class_s": lat.ttft_by_class_s,
                "ttft_slo_s": cfg.ttft_slo_s,
                "tpot_slo_s": cfg.tpot_slo_s,
            },
            "queue": {
                "in_flight": self.queue.in_flight,
                "kv_tokens_in_flight": self.queue.kv_in_flight,
                "queued": self.queue.queued_by_class(),
                "admitted_total": self.queue.stats.admitted_total,
                "draining": self.queue.draining,
            },
            "model": {
                "samples": model.n_samples,
                "residual_std_w": model.residual_std_w(),
                "coefficients": model.coefficients(),
            },
            "upstream": (
                {
                    "requests_running": self.upstream.requests_running,
                    "requests_waiting": self.upstream.requests_waiting,
                    "kv_cache_usage": self.upstream.kv_cache_usage,
                }
                if self.upstream
                else None
            ),
            "priorities": list(PRIORITIES),
        }
