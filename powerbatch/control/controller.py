"""The decision each tick: how many requests and KV tokens may be in flight, and how fast prefill.

Power as a trajectory optimised under constraints: maximise work done subject to a power ceiling,
a latency SLO and KV memory, pricing each constraint with a Lagrange multiplier (dual ascent) that
rises while it is violated and decays while it is slack. Concretely:

* power: the meter says what the batch in flight draws now; the learned model says what a
  step would change. The batch grows one bounded step while measured power, plus the model's
  predicted increment, plus the upper bound of one reading's noise, stays under
  `ceiling - margin - hysteresis - λ_power`; it may also jump to where the model's *upper*
  prediction bound fits. Inside the dead band it holds; over the target it steps down.
  λ_power (watts) is dual ascent on the measured violation, so a model biased low is corrected
  by feedback. A measured breach cuts the batch at once, without waiting for the model.
* latency: λ_latency rises while p95 time per output token is over its SLO and shrinks the batch
  multiplicatively, at most once per `latency_hold_s` (the p95's window must first show the
  smaller batch); p95 TTFT over its SLO only speeds growth, because the ceiling always wins.
* KV: λ_kv rises while the upstream's KV-cache usage is over target and shrinks the KV cap.
* device limit (a second actuator, where a limiter is configured): the decision asks for a limit
  of `ceiling × (1 − limit_margin_frac)`, which the driver holds within milliseconds. While a
  limit at or under the ceiling is in force, the meter reads the cap rather than the batch's
  demand: such censored readings are not learned, the batch is judged by the model's uncapped
  demand against `limit × (1 + throttle_allowance)`, and λ_power rises only on a breach of the
  ceiling itself. A limiter that fails (degraded) hands the ceiling back to admission alone.
* the meter's dead time: a reading may describe the load of a second ago (an exporter that
  collects once a second). The batch and prefill laws anchor on the load it measured
  (`Observation.reading_features`) and the model learns each reading once, against that load:
  a Smith predictor, so growth granted since the reading is counted, not seen as room.
* the ceiling itself may move each tick (`Observation.ceiling_w`: a fleet budget's share).
* shape (`ShapeSettings`, off unless set): the grid wants slow ramps and a floor. Growth is
  capped where the model's predicted increment over the batch of the last second reaches
  `ramp_up × 1 s` (and held while the meter already rose that much in a second); a step down is
  bounded where the model's predicted decrement reaches `ramp_down × 1 s`, unless measured power
  is over `ceiling - margin` (the ceiling always wins). Deferrable (low-class) work is released
  to hold `floor_w` or to slow a fall faster than half of `ramp_down`. A plan
  (`Observation.plan_w`, see powerbatch.shape.planner) stops growth at the planned power, holds
  deferrable work above it and releases it below. It does not lower the target: a plan one
  ramp from the meter, used as a target, stepped interactive work down on every noisy second.

Variance is kept low by bounded steps up, a dead band (hysteresis) between growing and shrinking,
a batch that leads recent demand by a bounded factor (so a burst ramps in instead of landing at
once), and a prefill pace: prefill bursts are the main source of spikes. The controller is pure:
no clocks, no I/O, so the proxy, `powerbatch replay` and the vLLM plugin drive the same code.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import t as student_t

from powerbatch.control.config import ControlConfig
from powerbatch.control.latency import LatencySnapshot
from powerbatch.estimate import Features, PowerModel, PowerPrior
from powerbatch.estimate.features import design_prefill_sweep, design_ray, design_row
from powerbatch.shape.settings import ShapeSettings

CONSTRAINTS: tuple[str, ...] = ("power", "latency", "kv")
BINDINGS: tuple[str, ...] = (
    "none",
    "power",
    "latency",
    "kv",
    "max_batch",
    "demand",
    "sensor",
    "warmup",
    "ramp",
)
DEFERRABLE_MODES: tuple[str, ...] = ("default", "hold", "release")


@dataclass(frozen=True, slots=True)
class Limits:
    """What admission enforces. `prefill_tok_s` None means prefill is not paced."""

    max_requests: int
    max_kv_tokens: int
    prefill_tok_s: float | None = None
    # Slots beyond max_requests that only the most urgent class may take: under a device limit
    # the cap holds the ceiling, so interactive work need not queue behind batch work.
    reserve_requests: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """What the controller sees each tick; the caller smooths features like the power reading."""

    t_s: float
    power_w: float | None  # measured 1-second power; None when there is no trustworthy reading
    sensor_ok: bool
    features: Features
    in_flight: int
    queued: int
    sensor_error: str | None = None
    latency: LatencySnapshot | None = None
    kv_cache_usage: float | None = None  # upstream's, 0..1
    ceiling_w: float | None = None  # this tick's ceiling (a fleet share); None: the configured
    power_limit_w: float | None = None  # device limit in force; None: no limiter, or degraded
    queued_deferrable: int = 0  # low-class requests waiting (they can fill a floor)
    plan_w: float | None = None  # the shape planner's power for this second; None: no plan
    # The features over the window `power_w` measured, where the meter lags the ticks (an
    # exporter that collects once a second); None: `features`. `reading_weight`: the samples
    # the reading stands for when learned (see loop.ReadingClock); 0 for a held value already
    # learned, which learned again against newer features would pair the watts of one second
    # with the load of another.
    reading_features: Features | None = None
    reading_weight: float = 1.0

    @property
    def seen(self) -> Features:
        """The load the power reading measured."""
        return self.reading_features or self.features


@dataclass(frozen=True, slots=True)
class Decision:
    t_s: float
    enforced: Limits  # what admission applies (in observe mode: the configured maxima)
    proposed: Limits  # what the controller would enforce
    state: str  # warmup | enforce | observe | fail_closed
    binding: str  # one of BINDINGS: the constraint that sets the batch now
    power_w: float | None
    predicted_w: float  # model mean at the proposed batch
    predicted_upper_w: float  # upper bound at the proposed batch
    target_w: float
    multipliers: dict[str, float] = field(default_factory=dict)
    emergency: bool = False
    reason: str = ""
    ceiling_w: float = math.nan  # the ceiling this decision held
    power_limit_w: float | None = None  # the device limit to set (a limiter applies it)
    capped: bool = False  # a device limit in force held the ceiling this tick
    deferrable: str = "default"  # one of DEFERRABLE_MODES: what admission does with low work


@functools.lru_cache(maxsize=256)
def stats_t_quantile(confidence: float, df: int) -> float:
    """Cached: the tick asks for the same few quantiles every 200 ms."""
    return float(student_t.ppf(confidence, df))


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
        self._t0: float | None = None
        self._batch = config.initial_batch
        self._latency_batch = float(config.max_batch)
        self._kv_scale = 1.0
        self._lambda = dict.fromkeys(CONSTRAINTS, 0.0)
        prior = self.model.prior
        self._shape = Features(
            1.0, prior.kv_tokens_per_request, 100.0, prior.decode_tok_s_per_request
        )
        self._demand: deque[tuple[float, int]] = deque()
        self._cut_until_s = -math.inf
        self._latency_hold_until_s = -math.inf
        self._recent_power: deque[tuple[float, float]] = deque()
        self._bias_w = 0.0  # measured less modelled power at the batch in flight (EWMA)
        self._recent_flight: deque[tuple[float, int]] = deque()  # in flight, for the ramps
        self._good_since_s: float | None = None
        self._failed_before = False
        self._grid = np.arange(config.min_batch, config.max_batch + 1, dtype=float)
        self.last: Decision | None = None

    def power_curve(self) -> np.ndarray:
        """The model's mean watts at each batch, min to max, at the learned request shape:
        what the shape planner turns a forecast batch into."""
        return self.model.predict_design(design_ray(self._shape, self._grid)).mean_w

    # -- pieces of the decision ---------------------------------------------------------------

    def _learn_shape(self, f: Features) -> None:
        if f.batch < 1:
            return
        per = f.per_request()
        a = self.config.gains.shape_rate
        s = self._shape
        self._shape = Features(
            1.0,
            (1 - a) * s.kv_tokens + a * per.kv_tokens,
            (1 - a) * s.prefill_tok_s + a * per.prefill_tok_s,
            (1 - a) * s.decode_tok_s + a * per.decode_tok_s,
        )

    def _largest_batch_under(self, upper_w: np.ndarray, target_w: float) -> int:
        """Largest batch such that it and every smaller batch is predicted under the target."""
        over = np.nonzero(upper_w > target_w)[0]
        if len(over) == 0:
            return int(self._grid[-1])
        if over[0] == 0:
            return self.config.min_batch
        return int(self._grid[over[0] - 1])

    def _power_cap(
        self,
        power_w: float,
        target_w: float,
        current: int,
        step: int,
        anchor_batch: float,
        mean_w: np.ndarray,
        upper_w: np.ndarray,
        hysteresis_w: float,
    ) -> int:
        """The largest batch power allows this tick: the meter for here, the model for there.

        The meter already says what the present batch draws, so the model is used only for
        the *difference* a step would make (anchored on the measured power at the batch now in
        flight), which is robust to a model whose level is off. Over the target, follow the
        model's upper bound down; the power multiplier lowers the target while the meter stays
        over it, so a model biased low is corrected. Inside the dead band, hold. With room, grow
        where the bound fits, or probe one step where the anchored mean fits: where the model
        has seen no data its bound is wide and would pin the batch forever, and a probe teaches
        it the slope. The breach cut bounds the cost of a wrong probe.
        """
        cfg = self.config

        def mean_at(n: float) -> float:
            i = round(min(max(n, cfg.min_batch), cfg.max_batch)) - cfg.min_batch
            return float(mean_w[i])

        # One fresh reading's spread: what separates a mean from a second over the ceiling.
        # The meter's own recent spread is the better measure where it is smaller than the
        # model's residuals (which also hold model misfit); the model's covers a quiet meter.
        noise_w = min(self.model.noise_quantile_w(), self._meter_spread_w())
        here_w = mean_at(anchor_batch)

        def anchored_upper(n: int) -> float:
            return power_w + mean_at(n) - here_w + noise_w

        if power_w > target_w:
            # Step down to where the anchored bound fits, at most `step_down_frac` per tick.
            n = current
            while n > cfg.min_batch and anchored_upper(n) > target_w + noise_w:
                n -= 1
            model_n = self._largest_batch_under(upper_w, target_w)
            floor_n = math.floor((1.0 - cfg.gains.step_down_frac) * current)
            return max(min(current, max(n, model_n)), floor_n)
        room_w = target_w - hysteresis_w
        if power_w >= room_w:
            return current
        n_grow = self._largest_batch_under(upper_w, room_w)
        # A step that overshoots the room must not stop the one request that fits (a boosted
        # step under a long queue); one, not as many as fit, since the anchor is one reading.
        probe = next((n for n in (current + step, current + 1) if anchored_upper(n) <= room_w), 0)
        return max(n_grow, probe, current)

    def _meter_spread_w(self) -> float:
        """The upper quantile of recent 1-second power around its mean (`meter_window_s`)."""
        p = self._recent_power
        if len(p) < 20:
            return math.inf
        values = np.fromiter((w for _, w in p), float, len(p))
        return float(stats_t_quantile(self.config.confidence, len(p) - 1) * values.std(ddof=1))

    def _recent_peak_demand(self, t_s: float, demand: int) -> int:
        self._demand.append((t_s, demand))
        while self._demand and self._demand[0][0] < t_s - self.config.gains.demand_window_s:
            self._demand.popleft()
        return max(d for _, d in self._demand)

    def _update_latency(self, t_s: float, lat: LatencySnapshot | None, in_flight: int) -> None:
        cfg, g = self.config, self.config.gains
        tpot = lat.tpot_p95_s if lat else None
        if tpot is not None:
            ratio = tpot / cfg.tpot_slo_s
            if ratio > 1.0:
                if t_s >= self._latency_hold_until_s:
                    self._latency_hold_until_s = t_s + g.latency_hold_s
                    self._lambda["latency"] += g.latency_gain * (ratio - 1.0)
                    base = min(self._latency_batch, float(max(in_flight, cfg.min_batch)))
                    self._latency_batch = base * (1.0 - g.latency_shrink * min(ratio - 1.0, 1.0))
            else:
                lam = self._lambda["latency"] + g.latency_gain * (ratio - 1.0)
                self._lambda["latency"] = max(0.0, lam)
                if self._lambda["latency"] == 0.0:
                    regrown = self._latency_batch * (1.0 + g.latency_regrow) + 1
                    self._latency_batch = min(float(cfg.max_batch), regrown)
        self._latency_batch = max(float(cfg.min_batch), self._latency_batch)

    def _update_kv(self, usage: float | None) -> None:
        if usage is None:
            return
        g = self.config.gains
        over = usage - self.config.kv_usage_target
        self._lambda["kv"] = max(0.0, self._lambda["kv"] + g.kv_gain * over)
        if over > 0:
            self._kv_scale = max(g.kv_min_scale, self._kv_scale * (1.0 - g.kv_shrink))
        elif self._lambda["kv"] == 0.0:
            self._kv_scale = min(1.0, self._kv_scale * (1.0 + g.kv_regrow))

    def _kv_limit(self, batch: int) -> int:
        # `kv_lead` x the batch's usual KV: room for the spread of context lengths (a single
        # long prompt must not idle the batch), yet a shift to much longer contexts is capped
        # before the power it costs shows on the meter.
        lead = self.config.gains.kv_lead
        by_shape = lead * batch * self._shape.kv_tokens * self._kv_scale
        return int(min(self.config.max_kv_tokens, max(by_shape, self._shape.kv_tokens)))

    def _prefill_pace(
        self, seen: Features, power_w: float, batch: int, running: float, target_w: float
    ) -> float | None:
        """Prompt tokens per second the watts allow, on top of the batch's decode.

        Prefill is compute-bound: a burst of prompts is a burst of watts that the batch limit
        does not see (a request replacing one that finished keeps the batch the same size).
        So the pace is the fastest rate whose modelled watts, over those of the load the meter
        measured (`seen`), added to the 1-second meter, fit under the target: the meter for
        the level, the model for the slope, as in the batch law. The load the pace is priced
        at is the batch running now (`running` requests, at most the limit), so the watts of
        requests admitted since the reading are not granted again to prompts: a meter a
        second behind would otherwise see the room twice at the start of a burst. Requests
        still queued are not counted: the pace is what admits them. The watts
        are the model's upper bound at r less its upper bound at `seen`, so a rate the model
        has seen little of (its bound widens away from the data) is priced higher than its
        mean. Near the target the pace is about the prompt flow now; over it, slower. It never
        exceeds `pace_max` x the batch's steady prompt flow (a burst let through at once is a
        burst of watts the model has not seen) and never falls under `min_prefill_tok_s` (a
        trickle still feeds the batch; the batch law, not a stalled queue, answers a plant
        whose decode fills the target). Not counted: one reading's spread (the batch law adds
        it; added here too, it starved the batch of prompts).
        """
        cfg = self.config
        if not cfg.prefill_pacing:
            return None
        floor = cfg.min_prefill_tok_s
        top = max(self._shape.prefill_tok_s * batch * cfg.gains.pace_max, floor)
        rates = np.geomspace(floor, top, 16)
        ahead = seen.per_request().scaled(max(min(float(batch), running), seen.batch, 1.0))
        rows = np.vstack([design_prefill_sweep(ahead, rates), design_row(seen)])
        upper_w = self.model.predict_design(rows).upper_w
        ok = rates[power_w + upper_w[:-1] - upper_w[-1] <= target_w]
        return float(ok.max()) if len(ok) else floor

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
        lo = self.config.min_batch

        def mean_at(n: float) -> float:
            return float(mean_w[round(min(max(n, lo), self.config.max_batch)) - lo])

        power_w = obs.power_w + mean_at(current) - mean_at(seen.batch)
        in_flight = min(obs.in_flight, current)
        return power_w, float(current), in_flight, obs.queued + obs.in_flight - in_flight

    def _kv_binds(self, kv_tokens_in_flight: float, kv_limit: int) -> bool:
        """The KV cap holds work back: it is shrunk by the KV multiplier, or nearly full."""
        return self._lambda["kv"] > 0.0 or kv_tokens_in_flight >= 0.9 * kv_limit

    def _second_ago(self, t_s: float, in_flight: int) -> tuple[float | None, int]:
        """The 1-second power and the batch in flight a second before `t_s` (a ramp's origin)."""
        flight = self._recent_flight
        flight.append((t_s, in_flight))
        while len(flight) > 1 and flight[1][0] <= t_s - 1.0 + 1e-9:
            flight.popleft()
        batch = flight[0][1] if flight[0][0] <= t_s - 1.0 + 1e-9 else min(n for _, n in flight)
        for t, w in self._recent_power:
            if t >= t_s - 1.0 - 1e-9:
                return (w if t <= t_s - 0.5 else None), batch
        return None, batch

    def _shape_bounds(
        self, obs: Observation, power_w: float, in_flight: int, current: int, mean_w: np.ndarray
    ) -> tuple[int, int, str]:
        """Ramp and floor: the batch range the ramps allow this tick, and deferrable work's mode.

        The grid limits how fast the site's power moves, so the batch in flight may exceed the
        batch in flight a second ago only by what the model predicts a second's ramp buys
        (at least one request, so an unlearnt slope cannot pin the batch); if that holds at
        every instant, 1-second power rises no faster than the ramp either. The meter's own
        rise over the last second stops growth outright (likewise a fall near the limit stops
        a step down: the model's slope is least known at the small batches a fall ends in).
        Low-class work waiting is the one load that may be moved in time: it is released to hold
        the floor and to slow a fall, held above a plan and released under it.
        """
        cfg, sh = self.config, self.shape
        lo, hi = cfg.min_batch, cfg.max_batch
        before_w, base = self._second_ago(obs.t_s, in_flight)
        base = min(max(base, lo), hi)
        delta_w = mean_w - mean_w[base - lo]
        up, down = hi, lo
        rise_w = power_w - before_w if before_w is not None else 0.0
        if sh.ramp_up is not None:
            ok = np.nonzero(delta_w <= sh.ramp_up)[0]
            up = max(int(self._grid[ok[-1]]) if len(ok) else lo, base + 1)
            if rise_w >= sh.ramp_up:
                up = min(up, current)
        if obs.plan_w is not None:
            # Grow only into the plan's headroom (stepping down stays the power law's).
            fits = np.nonzero(delta_w <= obs.plan_w - power_w)[0]
            up = min(up, max(int(self._grid[fits[-1]]) if len(fits) else lo, min(base, current)))
        if sh.ramp_down is not None:
            ok = np.nonzero(delta_w >= -sh.ramp_down)[0]
            down = int(self._grid[ok[0]]) if len(ok) else lo
            # Nor more requests than a second's ramp buys at the mean watts per request (an
            # upper bound on the marginal watts of a concave curve with an idle floor).
            per_request_w = power_w / max(base, 1)
            down = max(down, base - math.floor(sh.ramp_down / per_request_w))
            if -rise_w >= 0.75 * sh.ramp_down:  # the meter says it is falling about that fast
                down = max(down, current)
        mode = "default"
        waiting = obs.queued_deferrable > 0
        if obs.plan_w is not None:
            mode = "hold" if power_w > obs.plan_w else "release"
        if waiting and sh.floor_w is not None and power_w < sh.floor_w:
            mode = "release"
        if waiting and sh.ramp_down is not None and -rise_w > 0.5 * sh.ramp_down:
            mode = "release"
        return up, down, mode

    # -- the tick -----------------------------------------------------------------------------

    def tick(self, obs: Observation) -> Decision:
        cfg = self.config
        if self._t0 is None:
            self._t0 = obs.t_s
        warming = obs.t_s - self._t0 < cfg.warmup_s

        if obs.sensor_ok and obs.power_w is not None and math.isfinite(obs.power_w):
            if self._good_since_s is None:
                self._good_since_s = obs.t_s
        else:
            # Only a sensor that was good and went bad needs a hold-down when it returns;
            # no reading yet at start-up is not a failure.
            self._failed_before = self._failed_before or self._good_since_s is not None
            self._good_since_s = None
        recovering = (
            self._failed_before
            and self._good_since_s is not None
            and obs.t_s - self._good_since_s < cfg.recover_s
        )
        if obs.power_w is None or self._good_since_s is None or recovering:
            # Fail closed: no trustworthy watts, so no growth and a small batch until they have
            # been back for `recover_s` (a flapping sensor must not flap the batch).
            self._batch = min(self._batch, cfg.safe_batch)
            why = "sensor recovering" if recovering else (obs.sensor_error or "unknown")
            limits = Limits(self._batch, self._kv_limit(self._batch), cfg.min_prefill_tok_s)
            return self._decide(
                obs,
                limits,
                "fail_closed",
                "sensor",
                math.nan,
                math.nan,
                math.nan,
                reason=f"no trustworthy power reading ({why}); "
                f"batch held at safe limit {cfg.safe_batch}",
            )

        g = cfg.gains
        ceiling_w = obs.ceiling_w if obs.ceiling_w is not None else cfg.ceiling_w
        # A device limit at or under the ceiling holds it on the fast path; admission then
        # decides who gets the watts (see Gains.throttle_allowance).
        limit_w = obs.power_limit_w
        capped = limit_w is not None and limit_w <= ceiling_w + 0.5
        # Pinned at the limit, the meter shows the cap, not what the batch would draw: such a
        # reading is censored and would teach the model a flat curve, so it is not learned.
        censored = capped and limit_w is not None and obs.power_w >= 0.98 * limit_w
        # The meter's reading belongs to the load it measured: anchoring and learning on that
        # load, not on the load of this tick, is a Smith predictor for the meter's dead time.
        seen = obs.seen
        fresh = obs.reading_weight > 0
        if not censored and fresh:
            self.model.observe(obs.t_s, seen, obs.power_w, obs.reading_weight)
        self._recent_power.append((obs.t_s, obs.power_w))
        while self._recent_power[0][0] < obs.t_s - g.meter_window_s:
            self._recent_power.popleft()
        self._learn_shape(obs.features)
        pred = self.model.predict_design(design_ray(self._shape, self._grid))
        current = self._batch
        power_w, anchor, in_flight, queued = self._as_enforced(obs, current, pred.mean_w)

        lo = cfg.min_batch
        model_here_w = float(pred.mean_w[round(min(max(anchor, lo), cfg.max_batch)) - lo])
        if not censored and fresh:
            # What the meter says the model misses at the batch in flight: its level may be
            # off (a load mix it has not seen) while its slope is still right. An EWMA of 0.2
            # a tick, a reading weighing k ticks moving it as k ticks would.
            rate = 1.0 - 0.8**obs.reading_weight
            self._bias_w += rate * (power_w - model_here_w - self._bias_w)
        if capped and limit_w is not None:
            # The meter reads the cap, so judge the batch by its uncapped demand: the model at
            # the batch in flight, corrected by its bias from the last uncensored readings.
            demand_w = max(power_w, model_here_w + self._bias_w)
            goal_w = limit_w * (1.0 + g.throttle_allowance)
            violation_w = power_w - ceiling_w  # only a breach of the ceiling itself
        else:
            demand_w = power_w
            goal_w = ceiling_w - cfg.margin_at(ceiling_w)
            violation_w = power_w - goal_w
        if not warming:
            lam = self._lambda["power"] + g.power_gain * violation_w
            self._lambda["power"] = min(max(lam, 0.0), g.power_lambda_max_frac * ceiling_w)
            self._update_latency(obs.t_s, obs.latency, in_flight)
            self._update_kv(obs.kv_cache_usage)
        target_w = goal_w - self._lambda["power"]

        step = max(1, math.ceil(current * g.step_up_frac))
        ttft = obs.latency.ttft_p95_s if obs.latency else None
        if ttft is not None and ttft > cfg.ttft_slo_s:
            # Queueing is hurting first tokens: grow faster where watts allow.
            step = math.ceil(step * g.ttft_step_boost)
        peak = self._recent_peak_demand(obs.t_s, in_flight + queued)
        hysteresis_w = cfg.hysteresis_at(ceiling_w)
        caps = {
            "power": self._power_cap(
                demand_w, target_w, current, step, anchor, pred.mean_w, pred.upper_w, hysteresis_w
            ),
            "latency": int(self._latency_batch),
            "demand": max(cfg.initial_batch, math.ceil(peak * g.demand_headroom) + g.demand_slack),
            "max_batch": cfg.max_batch,
        }
        binding = min(caps, key=lambda k: caps[k])
        cap = caps[binding]

        breach = power_w > ceiling_w
        # Cut once per breach, then give the cut time to show before cutting again: admission
        # cannot preempt, so power falls only as requests finish.
        emergency = breach and obs.t_s >= self._cut_until_s
        if emergency:
            cut = math.floor(min(current, max(in_flight, 1)) * g.emergency_cut)
            new = min(cut, cap)
            self._cut_until_s = obs.t_s + g.cut_cooldown_s
            binding = "power"
        elif breach:
            new = min(current, cap)
        elif warming:
            new = min(cfg.initial_batch, cap)
        elif capped:
            # The device limit holds the ceiling however fast the batch grows, so a burst is
            # let in at once (to where the throttle allowance and the other constraints fit)
            # instead of queueing while the batch ramps a step a tick.
            new = cap
        else:
            new = cap if cap < current else min(cap, current + step)
        ramp_up, ramp_down, deferrable = self._shape_bounds(
            obs, power_w, in_flight, current, pred.mean_w
        )
        if not breach and not warming:
            if new > ramp_up and new > current:
                new, binding = max(current, ramp_up), "ramp"
            if new < current and power_w <= goal_w and ramp_down > new:
                new, binding = min(current, ramp_down), "ramp"
        self._batch = max(cfg.min_batch, min(new, cfg.max_batch))
        kv_limit = self._kv_limit(self._batch)

        room = in_flight < self._batch
        if (
            queued > 0
            and room
            and not emergency
            and self._kv_binds(obs.features.kv_tokens, kv_limit)
        ):
            binding = "kv"  # work waits while the batch has room: the KV cap holds it back
        elif queued == 0 and room and not emergency:
            binding = "none"  # nothing waits: no constraint is holding work back now
        if warming:
            state, binding = "warmup", "warmup" if not emergency else binding
        else:
            state = cfg.mode
        idx = self._batch - cfg.min_batch
        mean_w, upper_w = float(pred.mean_w[idx]), float(pred.upper_w[idx])
        reserve = 0
        if capped:
            reserve = min(cfg.max_batch - self._batch, math.ceil(g.reserve_frac * self._batch))
        # Under a device limit a burst of prompts is clipped by the driver within milliseconds;
        # pacing it as well would only delay first tokens.
        pace = (
            None if capped else self._prefill_pace(seen, power_w, self._batch, in_flight, target_w)
        )
        limits = Limits(self._batch, kv_limit, pace, reserve)
        return self._decide(
            obs,
            limits,
            state,
            binding,
            mean_w,
            upper_w,
            target_w,
            emergency=emergency,
            capped=capped,
            reason=self._explain(binding, emergency, obs, ceiling_w, capped),
            deferrable=deferrable,
        )

    def _explain(
        self, binding: str, emergency: bool, obs: Observation, ceiling_w: float, capped: bool
    ) -> str:
        cfg = self.config
        if emergency:
            return f"measured {obs.power_w:.0f} W over the {ceiling_w:.0f} W ceiling: cut at once"
        if binding == "power" and capped:
            return "the device limit holds the ceiling; the throttle allowance sets the batch"
        lat = obs.latency
        ttft = lat.ttft_p95_s if lat else None
        if binding == "power" and ttft is not None and ttft > cfg.ttft_slo_s:
            return (
                f"ceiling holds over latency: p95 TTFT {ttft:.2f} s > SLO {cfg.ttft_slo_s:.2f} s; "
                "queueing and shedding by priority"
            )
        return {
            "power": "the power ceiling sets the batch",
            "latency": "p95 time per output token sets the batch",
            "kv": "upstream KV-cache usage sets the KV cap",
            "max_batch": "at the configured maximum batch",
            "none": "demand is below every limit",
            "demand": "batch follows demand",
            "warmup": "silent warm-up: learning the plant at the initial batch",
            "ramp": "the grid's ramp limit paces the batch",
        }.get(binding, binding)

    def _decide(
        self,
        obs: Observation,
        proposed: Limits,
        state: str,
        binding: str,
        mean_w: float,
        upper_w: float,
        target_w: float,
        *,
        emergency: bool = False,
        capped: bool = False,
        reason: str = "",
        deferrable: str = "default",
    ) -> Decision:
        cfg = self.config
        ceiling_w = obs.ceiling_w if obs.ceiling_w is not None else cfg.ceiling_w
        if cfg.mode == "observe":
            enforced = Limits(cfg.max_batch, cfg.max_kv_tokens, None)
            limit_w = None  # observing enforces nothing, the device limit included
        else:
            enforced = proposed
            limit_w = ceiling_w * (1.0 - cfg.gains.limit_margin_frac)
        decision = Decision(
            t_s=obs.t_s,
            enforced=enforced,
            proposed=proposed,
            state=state,
            binding=binding,
            power_w=obs.power_w,
            predicted_w=mean_w,
            predicted_upper_w=upper_w,
            target_w=target_w,
            multipliers=dict(self._lambda),
            emergency=emergency,
            reason=reason,
            ceiling_w=ceiling_w,
            power_limit_w=limit_w,
            capped=capped,
            deferrable=deferrable,
        )
        self.last = decision
        return decision
