"""The decision each tick: how many requests and KV tokens may be in flight, and how fast prefill.

Power as a trajectory optimised under constraints: maximise work done subject to a power
ceiling, a latency SLO and KV memory, pricing each constraint with a Lagrange multiplier (dual
ascent) that rises while it is violated and decays while it is slack. Each law has its module
in `powerbatch.control.laws`, where its docstring states it:

* `sensor`: no trustworthy watts, fail closed to the safe batch;
* `power`: the ceiling, by the meter for here and the model for there, λ_power on the measured
  violation, and the breach cut; under a device limit power bounds no batch (the limit holds
  the ceiling, the latency law prices how deep a batch throttles);
* `latency`: λ_latency on p95 time per token; p95 TTFT only speeds growth;
* `kv`: λ_kv on the upstream's KV-cache usage shrinks the KV cap;
* `engine`: while the engine queues work of its own, in flight is its running count plus a
  buffer, so the surplus waits in admission's queue, by class, not in the engine's FCFS one;
* `demand`: the per-request shape, and how far the batch may lead recent demand;
* `ramp`: the grid's ramps, floor and plan (off unless set);
* `pace`: the prefill pace, the fastest prompt flow whose watts fit.

The meter's dead time: a reading may describe the load of a second ago (an exporter that
collects once a second). The laws anchor on the load it measured (`Observation.seen`) and the
model learns each reading once, against that load: a Smith predictor, so growth granted since
the reading is counted, not seen as room. The ceiling itself may move each tick
(`Observation.ceiling_w`: a fleet budget's share).

Variance is kept low by bounded steps up, a dead band between growing and shrinking, a batch
that leads recent demand by a bounded factor (a burst ramps in instead of landing at once), and
the prefill pace: prefill bursts are the main source of spikes. The controller is pure: no
clocks, no I/O, so the proxy, `powerbatch replay` and the vLLM plugin drive the same code.
"""

from __future__ import annotations

import math

import numpy as np

from powerbatch.control.config import ControlConfig, Mode, ShapeSettings
from powerbatch.control.laws.demand import DemandLaw
from powerbatch.control.laws.engine import EngineLaw
from powerbatch.control.laws.kv import KvLaw
from powerbatch.control.laws.latency import LatencyLaw
from powerbatch.control.laws.pace import prefill_pace
from powerbatch.control.laws.power import PowerLaw
from powerbatch.control.laws.ramp import RampLaw
from powerbatch.control.laws.sensor import SensorGate
from powerbatch.control.types import (
    AdmissionLimits,
    Binding,
    Decision,
    Deferrable,
    Observation,
    State,
)
from powerbatch.estimate import PowerModel, PowerPrior
from powerbatch.estimate.features import design_ray

REASONS: dict[Binding, str] = {
    Binding.POWER: "the power ceiling sets the batch",
    Binding.LATENCY: "p95 time per output token sets the batch",
    Binding.KV: "upstream KV-cache usage sets the KV cap",
    Binding.MAX_BATCH: "at the configured maximum batch",
    Binding.NONE: "demand is below every limit",
    Binding.DEMAND: "batch follows demand",
    Binding.WARMUP: "silent warm-up: learning the plant at the initial batch",
    Binding.RAMP: "the grid's ramp limit paces the batch",
    Binding.ENGINE: "the engine queues work of its own: the surplus waits here, by class",
}


class Controller:
    """Stateful across ticks; call `tick` at `config.tick_hz` with the latest observation."""

    def __init__(
        self,
        config: ControlConfig,
        model: PowerModel | None = None,
        shape: ShapeSettings | None = None,
    ) -> None:
        self.config = config
        self.shape = shape or ShapeSettings()
        self.model = model or PowerModel(
            PowerPrior.from_ceiling(config.ceiling_w, config.max_batch, config.max_w),
            window=config.model_window,
            half_life_s=config.model_half_life_s,
            confidence=config.confidence,
        )
        # The batches min..max: every law prices the model's curve over the same grid.
        self._grid = np.arange(config.min_batch, config.max_batch + 1, dtype=float)
        self.sensor = SensorGate(config.recover_s)
        self.power = PowerLaw(config, self.model, self._grid)
        self.latency = LatencyLaw(config)
        self.kv = KvLaw(config)
        self.engine = EngineLaw(config)
        self.demand = DemandLaw(config, self.model.prior)
        self.ramp = RampLaw(config, self.shape, self._grid)
        self._t0: float | None = None
        self._batch = config.initial_batch
        self.last: Decision | None = None

    def power_curve(self) -> np.ndarray:
        """The model's mean watts at each batch, min to max, at the learned request shape:
        what the shape planner turns a forecast batch into."""
        return self.model.predict_design(design_ray(self.demand.per_request, self._grid)).mean_w

    def multipliers(self) -> dict[str, float]:
        return {
            "power": self.power.multiplier,
            "latency": self.latency.multiplier,
            "kv": self.kv.multiplier,
        }

    # -- the tick -----------------------------------------------------------------------------

    def tick(self, obs: Observation) -> Decision:
        cfg, g = self.config, self.config.gains
        if self._t0 is None:
            self._t0 = obs.t_s
        warming = obs.t_s - self._t0 < cfg.warmup_s
        distrust = self.sensor.distrust(obs)
        if distrust is not None:
            return self._fail_closed(obs, distrust)

        ceiling_w = obs.ceiling_w if obs.ceiling_w is not None else cfg.ceiling_w
        capped, censored = self.power.censored(obs, ceiling_w)
        self.power.learn(obs, censored)
        self.demand.learn(obs.features)
        pred = self.model.predict_design(design_ray(self.demand.per_request, self._grid))
        current = self._batch
        power_w, anchor, in_flight, queued = self._as_enforced(obs, current, pred.mean_w)
        here_w = self.power.mean_at(pred.mean_w, anchor)
        judged = self.power.judge(obs, power_w, here_w, ceiling_w, capped, censored)
        if not warming:
            self.power.update_multiplier(judged.violation_w, ceiling_w)
            self.latency.update(obs.t_s, obs.latency, in_flight, obs.engine)
            self.kv.update(obs.kv_cache_usage)
        self.engine.update(obs.engine, obs.in_flight)
        target_w = judged.goal_w - self.power.multiplier

        step = self.latency.step(max(1, math.ceil(current * g.step_up_frac)), obs.latency)
        hysteresis_w = cfg.hysteresis_at(ceiling_w)
        caps: dict[Binding, int] = {}
        if not capped:  # under a device limit the driver holds the ceiling: power bounds no batch
            caps[Binding.POWER] = self.power.cap(
                judged.demand_w,
                target_w,
                current,
                step,
                anchor,
                pred.mean_w,
                pred.upper_w,
                hysteresis_w,
                in_flight=in_flight,
            )
        caps[Binding.LATENCY] = int(self.latency.batch)
        caps[Binding.DEMAND] = self.demand.cap(obs.t_s, in_flight + queued)
        if self.engine.cap is not None:
            caps[Binding.ENGINE] = self.engine.cap
        caps[Binding.MAX_BATCH] = cfg.max_batch
        binding = min(caps, key=lambda k: caps[k])
        cap = caps[binding]

        breach = power_w > ceiling_w
        cut = self.power.breach_cut(obs.t_s, current, in_flight) if breach else None
        emergency = cut is not None
        if cut is not None:
            new, binding = min(cut, cap), Binding.POWER
        elif breach:
            new = min(current, cap)
        elif warming and not capped:
            new = min(cfg.initial_batch, cap)
        elif capped:
            # The device limit holds the ceiling however fast the batch grows, so neither the
            # warm-up nor the growth step holds a burst back: it is let in at once, to where
            # the latency, demand and KV laws allow.
            new = cap
        else:
            new = cap if cap < current else min(cap, current + step)
        ramp = self.ramp.bounds(obs, power_w, in_flight, current, pred.mean_w, self.power.recent)
        if not breach and not warming:
            if new > ramp.up and new > current:
                new, binding = max(current, ramp.up), Binding.RAMP
            if new < current and power_w <= judged.goal_w and ramp.down > new:
                new, binding = min(current, ramp.down), Binding.RAMP
        self._batch = max(cfg.min_batch, min(new, cfg.max_batch))
        kv_cap = self.kv.cap(self._batch, self.demand.per_request.kv_tokens)

        room = in_flight < self._batch
        if queued > 0 and room and not emergency and self.kv.binds(obs.features.kv_tokens, kv_cap):
            binding = Binding.KV  # work waits while the batch has room: the KV cap holds it back
        elif queued == 0 and room and not emergency:
            binding = Binding.NONE  # nothing waits: no constraint is holding work back now
        state = State(cfg.mode)
        if warming:
            state = State.WARMUP
            binding = binding if emergency else Binding.WARMUP
        reserve = 0
        if capped:
            # The reserve's slots are places in the engine; where it queues work of its own,
            # they would only be places in its first-come queue, where classes count no more.
            places = cfg.max_batch if self.engine.cap is None else self.engine.cap
            reserve = max(0, min(places - self._batch, math.ceil(g.reserve_frac * self._batch)))
        pace = None
        if not capped:
            pace = prefill_pace(
                cfg,
                self.model,
                self.demand.per_request,
                seen=obs.seen,
                power_w=power_w,
                batch=self._batch,
                running=in_flight,
                target_w=target_w,
                seen_peak_tok_s=self.demand.prefill_peak(obs.t_s, obs.seen),
            )
        idx = self._batch - cfg.min_batch
        return self._decide(
            obs,
            AdmissionLimits(self._batch, kv_cap, pace, reserve),
            state=state,
            binding=binding,
            mean_w=float(pred.mean_w[idx]),
            upper_w=float(pred.upper_w[idx]),
            target_w=target_w,
            emergency=emergency,
            capped=capped,
            reason=self._explain(binding, emergency, obs, ceiling_w),
            deferrable=ramp.deferrable,
        )

    # -- pieces of the decision ---------------------------------------------------------------

    def _fail_closed(self, obs: Observation, why: str) -> Decision:
        """No trustworthy watts: no growth, and a small batch until they have been back for
        `recover_s`."""
        cfg = self.config
        self._batch = min(self._batch, cfg.safe_batch)
        kv_cap = self.kv.cap(self._batch, self.demand.per_request.kv_tokens)
        return self._decide(
            obs,
            AdmissionLimits(self._batch, kv_cap, cfg.min_prefill_tok_s),
            state=State.FAIL_CLOSED,
            binding=Binding.SENSOR,
            reason=f"no trustworthy power reading ({why}); "
            f"batch held at safe limit {cfg.safe_batch}",
        )

    def _as_enforced(
        self, obs: Observation, current: int, mean_w: np.ndarray
    ) -> tuple[float, float, int, int]:
        """Power, anchor batch, in flight and queued as if the proposal were in force.

        Enforcing, that is what the meter and the queue see. Observing, nothing is enforced,
        so the meter shows the load's own batch; judging the proposal by it would wind the
        power multiplier up on watts the proposal would never draw, and the proposal would
        sink far below what enforce mode settles at. So the proposal is judged by the meter
        plus the model's difference between the proposed batch and the one in flight.
        """
        assert obs.power_w is not None
        seen = obs.seen
        if self.config.mode != "observe" or seen.batch <= current:
            return obs.power_w, seen.batch, obs.in_flight, obs.queued
        mean_at = self.power.mean_at
        power_w = obs.power_w + mean_at(mean_w, current) - mean_at(mean_w, seen.batch)
        in_flight = min(obs.in_flight, current)
        return power_w, float(current), in_flight, obs.queued + obs.in_flight - in_flight

    def power_limit_w(self, ceiling_w: float | None = None) -> float | None:
        """The device limit to ask for under a ceiling (the configured one by default): the
        ceiling less `limit_margin_frac`; None when observing, which enforces nothing."""
        cfg = self.config
        if cfg.mode == Mode.OBSERVE:
            return None
        return (cfg.ceiling_w if ceiling_w is None else ceiling_w) * (
            1.0 - cfg.gains.limit_margin_frac
        )

    def _explain(
        self, binding: Binding, emergency: bool, obs: Observation, ceiling_w: float
    ) -> str:
        if emergency:
            return f"measured {obs.power_w:.0f} W over the {ceiling_w:.0f} W ceiling: cut at once"
        ttft = obs.latency.ttft_p95_s if obs.latency else None
        slo_s = self.config.ttft_slo_s
        if binding is Binding.POWER and ttft is not None and ttft > slo_s:
            return (
                f"ceiling holds over latency: p95 TTFT {ttft:.2f} s > SLO {slo_s:.2f} s; "
                "queueing and shedding by priority"
            )
        return REASONS.get(binding, binding.value)

    def _decide(
        self,
        obs: Observation,
        proposed: AdmissionLimits,
        *,
        state: State,
        binding: Binding,
        mean_w: float = math.nan,
        upper_w: float = math.nan,
        target_w: float = math.nan,
        emergency: bool = False,
        capped: bool = False,
        reason: str = "",
        deferrable: Deferrable = Deferrable.DEFAULT,
    ) -> Decision:
        cfg = self.config
        ceiling_w = obs.ceiling_w if obs.ceiling_w is not None else cfg.ceiling_w
        observing = cfg.mode == Mode.OBSERVE
        maxima = AdmissionLimits(cfg.max_batch, cfg.max_kv_tokens, None)
        self.last = Decision(
            t_s=obs.t_s,
            # Observing enforces nothing, the device limit included.
            enforced=maxima if observing else proposed,
            proposed=proposed,
            state=state,
            binding=binding,
            power_w=obs.power_w,
            predicted_w=mean_w,
            predicted_upper_w=upper_w,
            target_w=target_w,
            multipliers=self.multipliers(),
            emergency=emergency,
            reason=reason,
            ceiling_w=ceiling_w,
            power_limit_w=self.power_limit_w(ceiling_w),
            capped=capped,
            deferrable=deferrable,
        )
        return self.last
