"""The control loop shared by the proxy and the vLLM plugin: telemetry in, limits out, each tick.

A host (the proxy's admission queue, the plugin's scheduler) supplies a `FeatureSource` (what is
in flight, counters of work done, latency) and one or more `LimitsSink`s (where limits go). The
loop owns everything between: tick timing and its fail-safe, the 1-second feature window, the
power the controller acts on, metrics, the `/status` document, history rows and the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from powerbatch.control.config import TraceSettings
from powerbatch.control.controller import Controller, Decision, Limits, Observation
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.metrics import ControlMetrics
from powerbatch.estimate import Features
from powerbatch.shape.tracker import ShapeTracker
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
    queued_deferrable: int = 0  # low-class requests waiting (the shape floor's reserve)


class FeatureSource(Protocol):
    """The host's side of the loop's input. `sample` is called once per tick, on the loop."""

    def sample(self) -> HostSample: ...

    def latency(self, t_s: float) -> LatencySnapshot | None: ...

    def status_extra(self) -> dict[str, Any]:
        """Sections for /status: new keys are added, a dict under an existing key is merged."""
        ...


class LimitsSink(Protocol):
    """Where a decision's limits go; `fail_safe` is called when a tick fails."""

    def apply(self, decision: Decision) -> None: ...

    def fail_safe(self) -> None: ...


class CeilingSource(Protocol):
    """Where this tick's ceiling comes from when it moves (a fleet budget's lease)."""

    def ceiling_w(self, t_s: float) -> float | None:
        """The ceiling now, or None for the configured one."""
        ...


class PlanSource(Protocol):
    """The shape planner (powerbatch.shape.runner): planned power, solved off the tick."""

    def plan_w(self, t_s: float) -> float | None: ...

    def summary(self) -> dict[str, Any]: ...

    async def run_forever(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TickRecord:
    """One tick: what `/history`, the trace and the demo's plots are made of.

    `power_w` is the 1-second power the controller acted on; `raw_w` the latest sample as the
    source reported it, unfiltered.
    """

    t_s: float
    power_w: float | None
    raw_w: float | None
    energy_j: float | None
    predicted_w: float
    predicted_upper_w: float
    target_w: float
    limit_requests: int  # proposed
    limit_kv_tokens: int  # proposed
    prefill_tok_s: float | None  # proposed pace; None: unpaced
    enforced_requests: int
    in_flight: int
    kv_in_flight: float
    queued: int
    binding: str
    state: str
    features: Features
    plan_w: float | None = None  # the shape planner's power for this second
    power_limit_w: float | None = None  # the device limit in force (None: none, or degraded)

    def as_dict(self) -> dict[str, Any]:
        """Flat and strict-JSON-safe (non-finite numbers become None)."""
        out = {k: v for k, v in asdict(self).items() if k != "features"}
        out.update({f"feature_{k}": v for k, v in asdict(self.features).items()})
        safe: dict[str, Any] = json_safe(out)
        return safe

    def trace_row(self) -> TraceRow:
        f = self.features
        return TraceRow(
            t_s=self.t_s,
            power_w=self.power_w,
            energy_j=self.energy_j,
            requests_in_flight=f.batch,
            kv_tokens_in_flight=f.kv_tokens,
            prefill_tok_s=f.prefill_tok_s,
            decode_tok_s=f.decode_tok_s,
            queue_len=float(self.queued),
            raw_w=self.raw_w,
            limit_requests=float(self.limit_requests),
            limit_kv_tokens=float(self.limit_kv_tokens),
            enforced_requests=float(self.enforced_requests),
            state=self.state,
            binding=self.binding,
        )


HISTORY_COLUMNS: tuple[str, ...] = (
    *(n for n in TickRecord.__dataclass_fields__ if n != "features"),
    *(f"feature_{n}" for n in Features.__dataclass_fields__),
)


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinity replaced by None: strict JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


class FeatureWindow:
    """Levels averaged and counters differenced over the last `window_s` of ticks.

    The model regresses the 1-second power (the quantity the ceiling is about) on features
    taken over the same second, so cause and effect line up.
    """

    def __init__(self, window_s: float = 1.0) -> None:
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


class ReadingClock:
    """Which load a power reading measured, and how much it weighs when learned.

    A source the monitor averages is read afresh every tick, over the same second as the
    features: each tick's reading weighs one. An exporter that collects once a second
    (dcgm-exporter's `--collect-interval`) serves one value for a whole period: it is new on
    the tick that first sees it, it measured the second before that tick, whatever the ticks
    after it see, and it weighs the ticks since the last new value (at most a window's worth:
    it is a mean over one window, however long it is then held). A held value weighs 0.
    """

    def __init__(self, every_tick: bool, max_weight: float = 5.0) -> None:
        self.every_tick = every_tick
        self.max_weight = max_weight
        self._key: tuple[float | None, float | None] | None = None
        self._features: Features | None = None
        self._ticks = 0

    def update(
        self, raw_w: float | None, energy_j: float | None, features: Features
    ) -> tuple[float, Features]:
        """(weight, the features the reading measured) for this tick's reading and features.
        Without a raw value (an old trace) every reading is new."""
        self._ticks += 1
        key = (raw_w, energy_j)
        if self.every_tick or raw_w is None or key != self._key or self._features is None:
            weight = 1.0 if self.every_tick else float(min(self._ticks, self.max_weight))
            self._key, self._features, self._ticks = key, features, 0
            return weight, features
        return 0.0, self._features


def _limits(x: Limits | None) -> dict[str, Any] | None:
    if x is None:
        return None
    return {
        "max_requests": x.max_requests,
        "max_kv_tokens": x.max_kv_tokens,
        "prefill_tok_s": x.prefill_tok_s,
        "reserve_requests": x.reserve_requests,
    }


def open_trace(settings: TraceSettings) -> TraceWriter | None:
    """The trace's writer, or None (logged) where the file cannot be opened: the ceiling
    matters more than its record."""
    if not settings.record_trace:
        return None
    try:
        return TraceWriter(
            settings.record_trace,
            max_bytes=int(settings.trace_rotate_mib * 1024 * 1024),
            keep=settings.trace_keep,
        )
    except OSError as exc:
        log.error("cannot write the control trace to %s: %s", settings.record_trace, exc)
        return None


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
        window_s: float = 1.0,
        source_averages: bool = False,
        history_len: int = 36_000,
        trace: TraceWriter | None = None,
        clock: Callable[[], float] = time.monotonic,
        ceiling: CeilingSource | None = None,
        actuator: LimitActuator | None = None,
        plan: PlanSource | None = None,
    ) -> None:
        self.controller = controller
        self.plan = plan
        self._plan_task: asyncio.Task[None] | None = None
        self.shape = ShapeTracker(controller.shape, metrics.shape)
        self.ceiling = ceiling
        # The device power limit: a second, fast actuator; None or NoLimiter: admission alone.
        self.actuator = actuator if actuator and actuator.limiter.controls_device else None
        self._applying: asyncio.Task[None] | None = None
        self.monitor = monitor
        self.features = features
        self.sinks = list(sinks)
        self.metrics = metrics
        self.window_s = window_s
        # A source that already reports a 1-second mean (NVML's power usage on Hopper, dcgm's
        # DCGM_FI_DEV_POWER_USAGE) is used as it is: averaging it again would lag the power a
        # second behind the features it is regressed on.
        self.source_averages = source_averages
        self.history: deque[TickRecord] = deque(maxlen=history_len)
        self.trace = trace
        self.clock = clock
        self._window = FeatureWindow(window_s)
        tick_hz = controller.config.tick_hz
        self._reading_clock = ReadingClock(not source_averages, max(1.0, window_s * tick_hz))
        self._task: asyncio.Task[None] | None = None
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
    def state(self) -> str:
        """starting until the first tick; fail_closed after a tick that raised."""
        if self._tick_error is not None:
            return "fail_closed"
        d = self.controller.last
        return d.state if d else "starting"

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

    # -- running ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the power monitor and the tick task on the running event loop.

        The limiter starts first: it restores a limit a crashed run left behind before
        anything else happens. A limiter that cannot start leaves admission alone in charge.
        """
        if self.actuator is not None and not await self.actuator.start():
            log.error("power limiter degraded at start: %s", self.actuator.degraded_reason)
        await self.monitor.start()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="powerbatch-control")
        if self.plan is not None and (self._plan_task is None or self._plan_task.done()):
            self._plan_task = asyncio.create_task(self.plan.run_forever(), name="powerbatch-plan")

    async def stop(self) -> None:
        """Stop ticking and polling and flush the trace; the power source is left to its owner."""
        for task in (self._plan_task, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._plan_task = None
        await self.monitor.stop()
        if self.trace is not None:
            self.trace.close()
        if self.actuator is not None:
            if self._applying is not None:
                with contextlib.suppress(Exception):
                    await self._applying
            try:
                await self.actuator.restore()
            except Exception as exc:  # the state file makes the next start restore it
                log.error("could not restore the device power limit: %s", exc)
            await self.actuator.limiter.close()

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
        for s in m.states:
            m.state.labels(s).set(1.0 if s == "fail_closed" else 0.0)
        for sink in self.sinks:
            try:
                sink.fail_safe()
            except Exception:
                log.exception("limits sink %r failed to go safe", sink)

    # -- one tick -----------------------------------------------------------------------------

    def tick(self, t_s: float) -> Decision:
        reading = self.monitor.snapshot()
        host = self.features.sample()
        features = self._window.update(
            t_s, host.in_flight, host.kv_tokens, host.prefill_tokens_total, host.decode_tokens_total
        )
        latency = self.features.latency(t_s)
        plan_w = self.plan.plan_w(t_s) if self.plan is not None else None
        weight, measured = self._reading_clock.update(reading.raw_w, reading.energy_j, features)
        obs = Observation(
            t_s=t_s,
            power_w=self.power_w(reading),
            sensor_ok=reading.ok,
            sensor_error=reading.error,
            features=features,
            in_flight=host.in_flight,
            queued=host.queued,
            latency=latency,
            kv_cache_usage=host.kv_cache_usage,
            ceiling_w=self.ceiling.ceiling_w(t_s) if self.ceiling is not None else None,
            power_limit_w=self._limit_in_force_w(),
            queued_deferrable=host.queued_deferrable,
            plan_w=plan_w,
            reading_features=measured,
            reading_weight=weight,
        )
        d = self.controller.tick(obs)
        self.shape.observe(d, plan_w, host.queued_deferrable)
        if self.plan is not None:
            self.shape.note_plan(self.plan.summary())
        for sink in self.sinks:
            sink.apply(d)
        self._apply_limit(d.power_limit_w)
        self._sample, self._latency, self._tick_error = host, latency, None
        if t_s - self._model_at >= 1.0:  # for /status, off its request path
            self._model_at = t_s
            self._model = self._model_summary()
        self._export(d, reading, features, latency)
        record = TickRecord(
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
            plan_w=plan_w,
            power_limit_w=self._limit_in_force_w(),
        )
        self.history.append(record)
        if self.trace is not None:
            try:
                self.trace.write(record.trace_row())
            except OSError as exc:  # a full disk must not fail the ceiling
                log.error("trace writing stopped: %s", exc)
                self.trace = None
        return d

    def _limit_in_force_w(self) -> float | None:
        """The device limit the controller may lean on: None while degraded (then admission
        alone holds the ceiling with the software margin) or with no limiter."""
        a = self.actuator
        if a is None or a.degraded:
            return None
        return a.in_force_w

    def _apply_limit(self, requested_w: float | None) -> None:
        """Hand the requested limit to the actuator off the tick: a set takes milliseconds to
        a second (zeusd's block=true), and the tick must not wait. One set at a time; the next
        tick brings the newest request."""
        if self.actuator is None or requested_w is None:
            return
        if self._applying is not None and not self._applying.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand, without a loop (tests of the tick alone)
            return
        self._applying = loop.create_task(self._apply(requested_w), name="powerbatch-limit")

    async def _apply(self, requested_w: float) -> None:
        assert self.actuator is not None
        try:
            await self.actuator.apply(requested_w)
        except Exception:  # the actuator reports its own failures; this is a bug guard
            log.exception("applying the device power limit failed")

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
        if self.actuator is not None:
            m.export_limiter(self.actuator.status())
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
        """The ticks kept in memory as a replayable trace (see powerbatch.telemetry.trace)."""
        return [r.trace_row() for r in self.history]

    def history_rows(self, since_s: float = -math.inf) -> list[dict[str, Any]]:
        return [r.as_dict() for r in list(self.history) if r.t_s > since_s]

    def history_columns(self, since_s: float = -math.inf) -> dict[str, list[Any]]:
        """The history as columns (one list per field), for plots."""
        rows = self.history_rows(since_s)
        return {c: [r[c] for r in rows] for c in HISTORY_COLUMNS}

    def status(self) -> dict[str, Any]:
        """The JSON status, one shape for every host; strict JSON (no NaN)."""
        d = self.controller.last
        cfg = self.controller.config
        reading = self.monitor.snapshot()
        host = self._sample
        lat = self._latency
        reason = d.reason if d else ""
        if self._tick_error is not None:
            reason = f"control tick failed ({self._tick_error}); safe limits held"
        doc: dict[str, Any] = {
            "state": self.state,
            "mode": cfg.mode,
            "ready": reading.ok,
            "binding": d.binding if d else None,
            "reason": reason,
            "emergency": d.emergency if d else False,
            "limits": {
                "enforced": _limits(d.enforced if d else None),
                "proposed": _limits(d.proposed if d else None),
            },
            "power": {
                "source": self.monitor.source.name,
                "measured_w": d.power_w if d else None,
                "raw_w": reading.raw_w,
                "predicted_w": d.predicted_w if d else None,
                "predicted_upper_w": d.predicted_upper_w if d else None,
                "target_w": d.target_w if d else None,
                "ceiling_w": d.ceiling_w if d else cfg.ceiling_w,
                "capped": d.capped if d else False,
                "energy_j": reading.energy_j,
                "sensor_ok": reading.ok,
                "sensor_error": reading.error,
            },
            "multipliers": d.multipliers if d else {},
            "latency": {
                "ttft_p95_s": lat.ttft_p95_s if lat else None,
                "tpot_p95_s": lat.tpot_p95_s if lat else None,
                "ttft_p95_by_class_s": lat.ttft_by_class_s if lat else {},
                "samples": lat.samples if lat else 0,
                "ttft_slo_s": cfg.ttft_slo_s,
                "tpot_slo_s": cfg.tpot_slo_s,
            },
            "queue": {
                "in_flight": host.in_flight if host else 0,
                "kv_tokens_in_flight": host.kv_tokens if host else 0.0,
                "waiting": host.queued if host else 0,
            },
            "model": dict(self._model),
            "power_limit": self.actuator.status() if self.actuator is not None else None,
            "shape": self.shape.status(),
        }
        extra = self.features.status_extra()
        ceiling_status = getattr(self.ceiling, "status_extra", None)
        if ceiling_status is not None:  # a fleet member's `fleet` section
            extra = {**extra, **ceiling_status()}
        for key, section in extra.items():
            if isinstance(doc.get(key), dict) and isinstance(section, dict):
                doc[key].update(section)
            else:
                doc[key] = section
        result: dict[str, Any] = json_safe(doc)
        return result

    def predict_w(self, features: Features) -> float:
        """The power model's mean watts at this load."""
        return self.controller.model.predict_one(features)[0]

    def device_limit_bounds_w(self) -> tuple[float, float] | None:
        """The device's (min, max) power limit where a limiter controls the device, else None."""
        return self.actuator.bounds_w() if self.actuator is not None else None
