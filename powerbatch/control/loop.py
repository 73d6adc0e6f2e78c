"""The control loop shared by the proxy and the vLLM plugin: telemetry in, limits out, each tick.

A host (the proxy's admission queue, the plugin's scheduler) supplies a `FeatureSource` (what is
in flight, counters of work done, latency), one or more `LimitsSink`s (where limits go) and any
`TickObserver`s (accounting that watches the ticks: the shape tracker, energy per request). The
loop owns everything between: tick timing and its fail-safe, the 1-second feature window, the
power the controller acts on, the device limit, metrics, history and the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from powerbatch.control.clock import DeviceClock
from powerbatch.control.config import ClockPolicy
from powerbatch.control.controller import Controller
from powerbatch.control.device import DeviceLimit
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.metrics import ControlMetrics
from powerbatch.control.record import History, TickRecord
from powerbatch.control.status import status_document
from powerbatch.control.types import Decision, EngineLoad, Observation, State
from powerbatch.control.window import FeatureWindow, ReadingAligner
from powerbatch.estimate import Features
from powerbatch.telemetry.clock import ClockActuator
from powerbatch.telemetry.limiter import LimitActuator
from powerbatch.telemetry.monitor import PowerMonitor, PowerReading
from powerbatch.telemetry.trace import TraceRow, TraceWriter

log = logging.getLogger("powerbatch.control")


@dataclass(frozen=True, slots=True)
class HostSample:
    """What a host counts exactly at one instant; counters are cumulative totals."""

    in_flight: int
    queued: int
    kv_tokens: float  # KV tokens committed by the requests in flight
    prefill_tokens_total: float
    decode_tokens_total: float
    kv_cache_usage: float | None = None  # the engine's KV-cache usage, 0..1, where known
    engine: EngineLoad | None = None  # the engine's own queue and start rate, as last scraped
    queued_deferrable: int = 0  # low-class requests waiting (the shape floor's reserve)


class StatusSection(Protocol):
    def status_extra(self) -> dict[str, Any]:
        """Sections for /status: new keys are added, a dict under an existing key is merged."""
        ...


class FeatureSource(StatusSection, Protocol):
    """The host's side of the loop's input. `sample` is called once per tick, on the loop."""

    def sample(self) -> HostSample: ...

    def latency(self, t_s: float) -> LatencySnapshot | None: ...


class LimitsSink(Protocol):
    """Where a decision's limits go; `fail_safe` is called when a tick fails."""

    def apply(self, decision: Decision) -> None: ...

    def fail_safe(self) -> None: ...


class TickObserver(StatusSection, Protocol):
    """Watches every tick (and every failed one); changes no limit."""

    def observe(self, obs: Observation, decision: Decision) -> None: ...

    def fail_safe(self) -> None: ...


class CeilingSource(StatusSection, Protocol):
    """Where this tick's ceiling comes from when it moves (a fleet budget's lease)."""

    def ceiling_w(self, t_s: float) -> float | None:
        """The ceiling now, or None for the configured one."""
        ...

    def device_limit_w(self, t_s: float) -> float | None:
        """A device limit under the one the ceiling asks for (a falling share's, which comes
        down before the ceiling does), or None."""
        ...


class PlanSource(Protocol):
    """The shape planner (powerbatch.shape.runner): planned power, solved off the tick."""

    def plan_w(self, t_s: float) -> float | None: ...

    def summary(self) -> dict[str, Any]: ...

    async def run_forever(self) -> None: ...


class ControlLoop:
    """Ticks the controller at `tick_hz` and publishes what it decided.

    Runs as an asyncio task on whichever event loop calls `start()` (the proxy's own; the
    plugin's control thread's). `tick()` is synchronous and may be driven by hand in tests.
    """

    def __init__(
        self,
        controller: Controller,
        monitor: PowerMonitor,
        features: FeatureSource,
        sinks: Sequence[LimitsSink],
        metrics: ControlMetrics,
        *,
        observers: Sequence[TickObserver] = (),
        window_s: float = 1.0,
        source_averages: bool = False,
        history_len: int = 36_000,
        trace: TraceWriter | None = None,
        clock: Callable[[], float] = time.monotonic,
        ceiling: CeilingSource | None = None,
        actuator: LimitActuator | None = None,
        plan: PlanSource | None = None,
        sm_clock: ClockActuator | None = None,
        clock_policy: ClockPolicy | None = None,
    ) -> None:
        self.controller = controller
        self.monitor = monitor
        self.features = features
        self.sinks = list(sinks)
        self.observers = list(observers)
        self.metrics = metrics
        self.ceiling = ceiling
        self.plan = plan
        # The device power limit: a second, fast actuator; None or NoLimiter: admission alone.
        self.device = (
            DeviceLimit(actuator) if actuator and actuator.limiter.controls_device else None
        )
        # The SM clock: a third actuator, chosen by the clock law (None: the driver's policy).
        self.sm_clock = (
            DeviceClock(
                sm_clock,
                clock_policy or ClockPolicy(),
                controller.config,
                metrics.registry,
                clock,
            )
            if sm_clock is not None and sm_clock.backend.controls_device
            else None
        )
        self.window_s = window_s
        # A source that already reports a 1-second mean (NVML's power usage on Hopper, dcgm's
        # DCGM_FI_DEV_POWER_USAGE) is used as it is: averaging it again would lag the power a
        # second behind the features it is regressed on.
        self.source_averages = source_averages
        self.record = History(history_len, trace)
        self.clock = clock
        self._window = FeatureWindow(window_s)
        tick_hz = controller.config.tick_hz
        self._aligner = ReadingAligner(
            not source_averages, max(1.0, window_s * tick_hz), tick_s=1.0 / tick_hz
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._sample: HostSample | None = None
        self._latency: LatencySnapshot | None = None
        self._model: dict[str, Any] = {}
        self._model_at = -math.inf
        self._tick_error: str | None = None
        cfg = controller.config
        metrics.ceiling_w.set(cfg.ceiling_w)
        metrics.slo_s.labels("ttft").set(cfg.ttft_slo_s)
        metrics.slo_s.labels("tpot").set(cfg.tpot_slo_s)
        metrics.ready.set(0.0)

    # -- state --------------------------------------------------------------------------------

    @property
    def last(self) -> Decision | None:
        return self.controller.last

    @property
    def history(self) -> deque[TickRecord]:
        return self.record.records

    @property
    def state(self) -> State:
        """starting until the first tick; fail_closed after a tick that raised."""
        if self._tick_error is not None:
            return State.FAIL_CLOSED
        d = self.controller.last
        return d.state if d else State.STARTING

    @property
    def ready(self) -> bool:
        """A good power reading has been had and the sensor is good now (or recovering from a
        fault, which the controller rides out at the safe batch)."""
        return self.monitor.snapshot().ok

    def power_w(self, reading: PowerReading) -> float | None:
        """The power the ceiling is about: the mean over the last `window_s`."""
        if not reading.ok:
            return None
        if self.source_averages:
            return reading.filtered_w
        return self.monitor.mean_w(self.window_s)

    def predict_w(self, features: Features) -> float:
        """The power model's mean watts at a load (a fleet member's bid prices its demand)."""
        return self.controller.model.predict_one(features)[0]

    def device_limit_bounds_w(self) -> tuple[float, float] | None:
        """The device's (lowest, highest) limit where a limiter controls it, else None."""
        return self.device.bounds_w() if self.device is not None else None

    # -- running ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the device limit (crash recovery first) and set it, then the power monitor and
        the tick task on the running event loop. A limiter that cannot start leaves admission
        in charge.

        The limit is in force before this returns, so before the proxy listens: the first tick
        comes a moment later and its set takes milliseconds to a second more, and a prompt
        admitted in between would run at the device's default limit (one did: its first second
        drew 676 W against a 440 W ceiling, on a drawn plant of the scenario bench)."""
        if self.device is not None:
            await self.device.start()
            t_s = self.clock()
            ceiling_w = self.ceiling.ceiling_w(t_s) if self.ceiling is not None else None
            limit_w = self.controller.power_limit_w(ceiling_w)
            await self.device.apply(self._limit_request_w(limit_w, ceiling_w, t_s)[0])
        if self.sm_clock is not None:
            await self.sm_clock.start()
        await self.monitor.start()
        if not any(not t.done() for t in self._tasks):
            self._tasks = [asyncio.create_task(self.run(), name="powerbatch-control")]
            if self.plan is not None:
                self._tasks.append(
                    asyncio.create_task(self.plan.run_forever(), name="powerbatch-plan")
                )

    async def stop(self) -> None:
        """Stop ticking and polling, flush the trace and restore the device limit; the power
        source is left to its owner."""
        for task in reversed(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.monitor.stop()
        self.record.close()
        if self.sm_clock is not None:
            await self.sm_clock.stop()
        if self.device is not None:
            await self.device.stop()

    async def run(self) -> None:
        """Tick at `tick_hz` until cancelled; a tick that raises holds the safe limits."""
        period = 1.0 / self.controller.config.tick_hz
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            self.safe_tick()
            next_t += period
            delay = next_t - loop.time()
            if delay < 0:  # fell behind: skip the missed ticks rather than burst
                next_t, delay = loop.time(), 0.0
            await asyncio.sleep(delay)

    def safe_tick(self) -> Decision | None:
        """One tick; never raises. A failure holds the safe batch, as a sensor failure would."""
        try:
            return self.tick(self.clock())
        except Exception as exc:  # never let a bug leave stale limits in force unnoticed
            log.exception("control tick failed; holding the safe batch")
            self._fail_safe(f"{type(exc).__name__}: {exc}")
            return None

    def _fail_safe(self, why: str) -> None:
        self._tick_error = why
        m = self.metrics
        m.tick_errors.inc()
        m.sensor_ok.set(0.0)
        for s in State:
            m.state.labels(s).set(1.0 if s is State.FAIL_CLOSED else 0.0)
        parts: list[LimitsSink | TickObserver] = [*self.sinks, *self.observers]
        for part in parts:
            try:
                part.fail_safe()
            except Exception:
                log.exception("%r failed to go safe", part)
        if self.sm_clock is not None:
            self.sm_clock.fail_safe()

    # -- one tick -----------------------------------------------------------------------------

    def _limit_in_force_w(self) -> float | None:
        return self.device.in_force_w() if self.device is not None else None

    def _limit_request_w(
        self, limit_w: float | None, ceiling_w: float | None, t_s: float
    ) -> tuple[float | None, float | None]:
        """The limit to ask for, and what bounds it from above: the ceiling, or while a fleet
        share falls the lower limit its member asks for. `DeviceLimit.request` sets a raise
        of that bound at once; against the ceiling shown while a share falls (which follows
        the meter down from the old share), a share that came back read as no rise, and its
        limit waited the pace (docs/fleet.md, stop 44)."""
        below = self.ceiling.device_limit_w(t_s) if self.ceiling is not None else None
        if below is None:
            return limit_w, ceiling_w
        bound = below if ceiling_w is None else min(ceiling_w, below)
        return (None if limit_w is None else min(limit_w, below)), bound

    def tick(self, t_s: float) -> Decision:
        reading = self.monitor.snapshot()
        host = self.features.sample()
        features = self._window.update(
            t_s, host.in_flight, host.kv_tokens, host.prefill_tokens_total, host.decode_tokens_total
        )
        latency = self.features.latency(t_s)
        power_w = self.power_w(reading)
        weight, measured = self._aligner.update(
            reading.raw_w, reading.energy_j, features, t_s, power_w
        )
        obs = Observation(
            t_s=t_s,
            power_w=power_w,
            sensor_ok=reading.ok,
            sensor_error=reading.error,
            features=features,
            in_flight=host.in_flight,
            queued=host.queued,
            latency=latency,
            kv_cache_usage=host.kv_cache_usage,
            engine=host.engine,
            ceiling_w=self.ceiling.ceiling_w(t_s) if self.ceiling is not None else None,
            power_limit_w=self._limit_in_force_w(),
            queued_deferrable=host.queued_deferrable,
            plan_w=self.plan.plan_w(t_s) if self.plan is not None else None,
            reading_features=measured,
            reading_weight=weight,
            relearn=tuple(self._aligner.relearn),
        )
        undone = self.controller.latency.undone_total
        d = self.controller.tick(obs)
        if self.controller.latency.undone_total > undone:
            self.metrics.latency_cuts_undone.inc()
            log.info("TPOT cuts undone: %s", self.controller.latency.last_undo)
        for sink in self.sinks:
            sink.apply(d)
        for observer in self.observers:
            observer.observe(obs, d)
        if self.device is not None:
            self.device.request(*self._limit_request_w(d.power_limit_w, obs.ceiling_w, t_s))
        if self.sm_clock is not None:
            self.sm_clock.tick(obs, t_s, self._aligner.lag.lag_s)
        self._sample, self._latency, self._tick_error = host, latency, None
        if t_s - self._model_at >= 1.0:  # for /status, off its request path
            self._model_at = t_s
            self._model = self._model_summary()
        self._export(d, reading, features, latency)
        self.record.append(
            TickRecord(
                t_s=t_s,
                power_w=d.power_w,
                raw_w=reading.raw_w,
                energy_j=reading.energy_j,
                predicted_w=d.predicted_w,
                predicted_upper_w=d.predicted_upper_w,
                target_w=d.target_w,
                limit_requests=d.proposed.max_requests,
                limit_kv_tokens=d.proposed.max_kv_tokens,
                prefill_tok_s=d.proposed.prefill_tok_s,
                enforced_requests=d.enforced.max_requests,
                in_flight=host.in_flight,
                kv_in_flight=host.kv_tokens,
                queued=host.queued,
                binding=d.binding,
                state=d.state,
                features=features,
                plan_w=obs.plan_w,
                power_limit_w=self._limit_in_force_w(),
                **self._clock_fields(),
            )
        )
        return d

    def _clock_fields(self) -> dict[str, Any]:
        """The clock law's choice this tick, for the record (empty without a clock law)."""
        choice = self.sm_clock.law.last if self.sm_clock is not None else None
        if choice is None:
            return {}
        top = None if choice.lock is None else float(choice.lock[1])
        return {"clock_top_mhz": top, "clock_reason": choice.reason}

    def _export(
        self,
        d: Decision,
        reading: PowerReading,
        features: Features,
        latency: LatencySnapshot | None,
    ) -> None:
        m = self.metrics
        m.ticks.inc()
        m.export_decision(d, reading.raw_w, reading.energy_j)
        if self.device is not None:
            m.export_limiter(self.device.status())
        m.export_latency(latency)
        m.ready.set(1.0 if reading.ok else 0.0)
        for name in ("batch", "kv_tokens", "prefill_tok_s", "decode_tok_s"):
            m.feature.labels(name).set(getattr(features, name))

    def _model_summary(self) -> dict[str, Any]:
        model = self.controller.model
        return {
            "samples": model.n_samples,
            "residual_std_w": model.residual_std_w(),
            "coefficients": model.coefficients(),
        }

    # -- what it publishes --------------------------------------------------------------------

    def trace_rows(self) -> list[TraceRow]:
        return self.record.trace_rows()

    def history_rows(self, since_s: float = -math.inf) -> list[dict[str, Any]]:
        return self.record.rows(since_s)

    @property
    def reading_span_s(self) -> float:
        """How far back the power the loop acts on reaches: the meter's learned lag plus its
        averaging window. A change younger than this is not yet wholly in the reading."""
        return self._aligner.lag.lag_s + self.window_s

    @property
    def last_sample(self) -> HostSample | None:
        """What the host counted at the last tick (None before the first)."""
        return self._sample

    def history_columns(self, since_s: float = -math.inf) -> dict[str, list[Any]]:
        return self.record.columns(since_s)

    def status(self) -> dict[str, Any]:
        """The JSON status, one shape for every host; strict JSON (no NaN)."""
        sections: list[StatusSection] = [self.features, *self.observers]
        if self.ceiling is not None:
            sections.append(self.ceiling)  # a fleet member's `fleet` section
        return status_document(
            state=self.state,
            decision=self.controller.last,
            config=self.controller.config,
            reading=self.monitor.snapshot(),
            source=self.monitor.source.name,
            host=self._sample,
            latency=self._latency,
            tick_error=self._tick_error,
            model=self._model,
            power_limit=self.device.status() if self.device is not None else None,
            sections=[s.status_extra() for s in sections]
            + [{"latency": self.controller.latency.status(self.clock())}]
            + ([{"clock": self.sm_clock.status()}] if self.sm_clock is not None else []),
        )
