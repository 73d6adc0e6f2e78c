"""The proxy as a host of the shared control loop (powerbatch.control.loop).

The admission queue is both the loop's feature source (its in-flight counts are exact and
current) and its limits sink. The request path only bumps counters here; every rate,
percentile and fit is computed on the loop's tick. `Governor` bundles what the request
handlers and `powerbatch serve` hold on to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

from powerbatch.admission import PRIORITIES, AdmissionQueue
from powerbatch.admission.priority import DEFERRABLE
from powerbatch.control import (
    AdmissionLimits,
    Decision,
    Deferrable,
    LatencySnapshot,
    LatencyWindow,
)
from powerbatch.control.clock import Boost
from powerbatch.control.config import ClockPolicy
from powerbatch.control.controller import Controller
from powerbatch.control.engine_queue import EngineQueue
from powerbatch.control.loop import CeilingSource, ControlLoop, HostSample, LimitsSink, PlanSource
from powerbatch.control.record import TickRecord
from powerbatch.energy.accounting import EnergyAccounting
from powerbatch.energy.settings import EnergySettings
from powerbatch.proxy.metrics import ProxyMetrics
from powerbatch.shape.tracker import ShapeTracker
from powerbatch.telemetry import PowerMonitor, UpstreamMetricsScraper, UpstreamSignals
from powerbatch.telemetry.clock import ClockActuator
from powerbatch.telemetry.limiter import LimitActuator
from powerbatch.telemetry.trace import TraceRow, TraceWriter

__all__ = ["AdmissionSink", "Governor", "ProxyFeatures", "TickRecord"]

log = logging.getLogger("powerbatch.control")


class AdmissionSink:
    """The admission queue's limits: the decision's enforced ones, or the safe batch."""

    def __init__(self, queue: AdmissionQueue, controller: Controller) -> None:
        self.queue = queue
        self.config = controller.config

    def apply(self, decision: Decision) -> None:
        if decision.enforced != self.queue.limits:
            self.queue.set_limits(decision.enforced)
        self.queue.set_deferrable(decision.deferrable)

    def fail_safe(self) -> None:
        self.queue.set_deferrable(Deferrable.DEFAULT)
        cfg, limits = self.config, self.queue.limits
        if cfg.mode == "enforce" and limits.max_requests > cfg.safe_batch:
            self.queue.set_limits(AdmissionLimits(cfg.safe_batch, limits.max_kv_tokens, None))


class ProxyFeatures:
    """The proxy's counts, latencies and the upstream's scraped metrics, for the loop.

    The proxy's own in-flight count is exact and current; the upstream's running count is
    scraped once a second and lags, so it is reported but not regressed on.
    """

    def __init__(
        self,
        queue: AdmissionQueue,
        metrics: ProxyMetrics,
        latency: LatencyWindow,
        interactive: tuple[str, ...],
    ) -> None:
        self.queue = queue
        self.metrics = metrics
        self.latency_window = latency
        self.interactive = interactive
        self.output_tokens_total = 0  # bumped by the request path
        self.upstream: UpstreamSignals | None = None
        self.engine_queue = EngineQueue()

    def sample(self) -> HostSample:
        q, m = self.queue, self.metrics
        m.in_flight.set(q.in_flight)
        m.kv_in_flight.set(q.kv_in_flight)
        for p, n in q.queued_by_class().items():
            m.queue_length.labels(p).set(n)
        return HostSample(
            in_flight=q.in_flight,
            queued=q.queued,
            kv_tokens=float(q.kv_in_flight),
            prefill_tokens_total=float(q.stats.prefill_tokens_admitted_total),
            decode_tokens_total=float(self.output_tokens_total),
            kv_cache_usage=self.upstream.kv_cache_usage if self.upstream else None,
            engine=self.engine_queue.load,
            queued_deferrable=q.queued_by_class().get(DEFERRABLE, 0),
        )

    def latency(self, t_s: float) -> LatencySnapshot:
        return self.latency_window.snapshot(t_s, self.interactive)

    def status_extra(self) -> dict[str, Any]:
        q, up = self.queue, self.upstream
        return {
            "queue": {  # live, not as of the last tick: operators and tests read it after work
                "in_flight": q.in_flight,
                "kv_tokens_in_flight": float(q.kv_in_flight),
                "queued_total": q.queued,
                "queued": q.queued_by_class(),
                "admitted_total": q.stats.admitted_total,
                "draining": q.draining,
            },
            "upstream": (
                {
                    "requests_running": up.requests_running,
                    "requests_waiting": up.requests_waiting,
                    "kv_cache_usage": up.kv_cache_usage,
                    "requests_started_total": up.requests_started_total,
                    "generation_tokens_total": up.generation_tokens_total,
                    "requests_started_per_s": eq.start_rate
                    if (eq := self.engine_queue.load)
                    else None,
                    "token_s": eq.token_s if eq else None,
                    "step_s": eq.step_s if eq else None,
                }
                if up
                else None
            ),
            "priorities": list(PRIORITIES),
        }

    async def scrape_forever(self, scraper: UpstreamMetricsScraper, interval_s: float) -> None:
        while True:
            try:
                self.upstream = await scraper.scrape()
            except Exception as exc:  # the upstream's metrics are an extra, never required
                log.debug("upstream metrics scrape failed: %s", exc)
                self.upstream = None
            q = self.queue
            self.engine_queue.update(self.upstream, q.stats.requests_admitted_total, q.in_flight)
            await asyncio.sleep(interval_s)


class Governor:
    """The control loop wired to the admission queue, plus the upstream metrics scraper."""

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
        trace: TraceWriter | None = None,
        extra_sinks: tuple[LimitsSink, ...] = (),
        actuator: LimitActuator | None = None,
        ceiling: CeilingSource | None = None,
        plan: PlanSource | None = None,
        energy: EnergySettings | None = None,
        sm_clock: ClockActuator | None = None,
        clock_policy: ClockPolicy | None = None,
    ) -> None:
        self.controller = controller
        self.queue = queue
        self.monitor = monitor
        self.metrics = metrics
        self.latency = latency or LatencyWindow()
        self.scraper = upstream_scraper
        self.scrape_interval_s = scrape_interval_s
        self.features = ProxyFeatures(
            queue, metrics, self.latency, controller.config.interactive_classes
        )
        self.energy = EnergyAccounting(monitor, controller.model, metrics.energy, energy)
        self.loop = ControlLoop(
            controller,
            monitor,
            self.features,
            [AdmissionSink(queue, controller), *extra_sinks],
            metrics,
            observers=[ShapeTracker(controller.shape, metrics.shape, plan), self.energy],
            window_s=window_s,
            source_averages=source_averages,
            history_len=history_len,
            trace=trace,
            actuator=actuator,
            ceiling=ceiling,
            plan=plan,
            sm_clock=sm_clock,
            clock_policy=clock_policy,
        )
        self._scrape_task: asyncio.Task[None] | None = None

    # What the request path touches: kept as attributes so a request costs no indirection.
    @property
    def output_tokens_total(self) -> int:
        return self.features.output_tokens_total

    @output_tokens_total.setter
    def output_tokens_total(self, value: int) -> None:
        self.features.output_tokens_total = value

    @property
    def upstream(self) -> UpstreamSignals | None:
        return self.features.upstream

    @property
    def last(self) -> Decision | None:
        return self.loop.last

    @property
    def history(self) -> deque[TickRecord]:
        return self.loop.history

    @property
    def ready(self) -> bool:
        return self.loop.ready

    async def start(self) -> None:
        await self.loop.start()
        if self.scraper is not None:
            self._scrape_task = asyncio.create_task(
                self.features.scrape_forever(self.scraper, self.scrape_interval_s),
                name="powerbatch-scrape",
            )

    async def stop(self) -> None:
        task, self._scrape_task = self._scrape_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.loop.stop()

    def prefill_boost(self, priority: str) -> Boost | None:
        """A streamed request of a boosted class is about to prefill: run it at the top clock."""
        clock = self.loop.sm_clock
        return clock.boost() if clock is not None and priority in clock.boost_classes else None

    def tick(self, t_s: float) -> Decision:
        return self.loop.tick(t_s)

    def status(self) -> dict[str, Any]:
        return self.loop.status()

    def trace_rows(self) -> list[TraceRow]:
        return self.loop.trace_rows()
