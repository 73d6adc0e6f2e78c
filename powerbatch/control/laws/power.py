"""Power law: the ceiling, held by the meter for here and the model for there.

The meter says what the batch in flight draws now; the learned model says what a step would
change. The batch grows one bounded step while measured power, plus the model's predicted
increment, plus the upper bound of one reading's noise, stays under
`ceiling − margin − hysteresis − λ_power`; it may also jump to where the model's *upper*
prediction bound fits. Inside the dead band it holds; over the target it steps down.
λ_power (watts) is dual ascent on the measured violation, so a model biased low is corrected by
feedback. A measured breach cuts the batch at once, without waiting for the model.

Device limit (a second actuator, where a limiter is configured): while a limit at or under the
ceiling is in force the driver holds the ceiling within milliseconds and the meter reads the cap
rather than the batch's demand. Such censored readings are not learned, power bounds no batch
(how deep a batch may throttle is the latency law's: p95 time per token against its SLO, which
is what throttling costs a user), and λ_power rises only on a breach of the ceiling itself.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t

from powerbatch.control.config import ControlConfig
from powerbatch.control.types import Observation
from powerbatch.estimate import PowerModel

LIMIT_TOLERANCE_W = 0.5
"""A device limit this far over the ceiling still counts as holding it (rounding of the set)."""
CENSORED_FRAC = 0.98
"""A reading at this share of the device limit or more shows the cap, not the demand."""
BIAS_KEEP = 0.8
"""The model's bias at the batch in flight is an EWMA keeping this much per tick's reading."""
SEEN_LEAD = 2.0
"""The batch grows to at most this multiple (plus one) of the batch the latest reading saw, or
the initial batch: a meter seconds behind cannot vouch for more, and the model's slope away
from its data is a guess. Growth so paced doubles once per dead time (the meter's lag plus its
window)."""
MIN_SPREAD_SAMPLES = 20
"""Readings needed before the meter's own spread bounds one reading's noise."""


@functools.lru_cache(maxsize=256)
def stats_t_quantile(confidence: float, df: int) -> float:
    """Cached: the tick asks for the same few quantiles every 200 ms."""
    return float(student_t.ppf(confidence, df))


@dataclass(frozen=True, slots=True)
class Judgement:
    """The watts the batch is judged by this tick, against which goal, and the violation the
    power multiplier rises on."""

    capped: bool
    demand_w: float
    goal_w: float
    violation_w: float


class PowerLaw:
    def __init__(self, config: ControlConfig, model: PowerModel, grid: np.ndarray) -> None:
        self.config = config
        self.model = model
        self._grid = grid  # the batches min..max, the model's predictions are indexed by
        self.multiplier = 0.0  # λ_power, watts
        self.recent: deque[tuple[float, float]] = deque()  # (t_s, 1-s power), `meter_window_s`
        self._bias_w = 0.0  # measured less modelled power at the batch in flight (EWMA)
        self._cut_until_s = -math.inf

    def mean_at(self, mean_w: np.ndarray, n: float) -> float:
        cfg = self.config
        return float(mean_w[round(min(max(n, cfg.min_batch), cfg.max_batch)) - cfg.min_batch])

    def censored(self, obs: Observation, ceiling_w: float) -> tuple[bool, bool]:
        """(a device limit holds the ceiling, the reading shows that limit rather than demand)."""
        limit_w = obs.power_limit_w
        capped = limit_w is not None and limit_w <= ceiling_w + LIMIT_TOLERANCE_W
        assert obs.power_w is not None
        return capped, capped and limit_w is not None and obs.power_w >= CENSORED_FRAC * limit_w

    def learn(self, obs: Observation, censored: bool) -> None:
        """Learn the reading against the load it measured (a Smith predictor for the meter's
        dead time), once, unless it is censored; keep it for the meter's spread."""
        assert obs.power_w is not None
        if obs.relearn and obs.power_limit_w is None:
            # The meter's lag was misjudged: what was learned paired watts with the wrong load.
            # Not under a device limit: the kept readings may show the cap, not the load.
            self.model.forget()
            for t_s, seen, power_w, weight in obs.relearn:
                self.model.observe(t_s, seen, power_w, weight)
        elif not censored and obs.reading_weight > 0:
            self.model.observe(obs.t_s, obs.seen, obs.power_w, obs.reading_weight)
        self.recent.append((obs.t_s, obs.power_w))
        while self.recent[0][0] < obs.t_s - self.config.gains.meter_window_s:
            self.recent.popleft()

    def judge(
        self,
        obs: Observation,
        power_w: float,
        model_here_w: float,
        ceiling_w: float,
        capped: bool,
        censored: bool,
    ) -> Judgement:
        """The meter against the goal, or (capped) against the ceiling itself, which the device
        limit holds; the bias is learned from fresh uncensored readings, an EWMA of 0.2 a tick,
        a reading weighing k ticks moving it as k ticks would."""
        cfg = self.config
        if not censored and obs.reading_weight > 0:
            rate = 1.0 - BIAS_KEEP**obs.reading_weight
            self._bias_w += rate * (power_w - model_here_w - self._bias_w)
        if capped:
            return Judgement(True, power_w, ceiling_w, power_w - ceiling_w)
        goal_w = ceiling_w - cfg.margin_at(ceiling_w)
        return Judgement(capped, power_w, goal_w, power_w - goal_w)

    def update_multiplier(self, violation_w: float, ceiling_w: float) -> None:
        g = self.config.gains
        lam = self.multiplier + g.power_gain * violation_w
        self.multiplier = min(max(lam, 0.0), g.power_lambda_max_frac * ceiling_w)

    def breach_cut(self, t_s: float, current: int, in_flight: int) -> int | None:
        """On a breach, the batch cut to `emergency_cut` of what is in flight, once, then not
        again for `cut_cooldown_s`: admission cannot preempt, so power falls only as requests
        finish. None inside the cooldown."""
        if t_s < self._cut_until_s:
            return None
        self._cut_until_s = t_s + self.config.gains.cut_cooldown_s
        return math.floor(min(current, max(in_flight, 1)) * self.config.gains.emergency_cut)

    def _largest_batch_under(self, upper_w: np.ndarray, target_w: float) -> int:
        """Largest batch such that it and every smaller batch is predicted under the target."""
        over = np.nonzero(upper_w > target_w)[0]
        if len(over) == 0:
            return int(self._grid[-1])
        if over[0] == 0:
            return self.config.min_batch
        return int(self._grid[over[0] - 1])

    def _meter_spread_w(self) -> float:
        """The upper quantile of recent 1-second power around its mean (`meter_window_s`)."""
        p = self.recent
        if len(p) < MIN_SPREAD_SAMPLES:
            return math.inf
        values = np.fromiter((w for _, w in p), float, len(p))
        return float(stats_t_quantile(self.config.confidence, len(p) - 1) * values.std(ddof=1))

    def cap(
        self,
        power_w: float,
        target_w: float,
        current: int,
        step: int,
        anchor_batch: float,
        mean_w: np.ndarray,
        upper_w: np.ndarray,
        hysteresis_w: float,
        in_flight: float | None = None,
    ) -> int:
        """The largest batch power allows this tick: the meter for here, the model for there.

        The model is used only for the *difference* a step would make (anchored on the
        measured power at the batch in flight), which is robust to a model whose level is
        off. Over the target, follow the model's upper bound down, at most `step_down_frac`
        per tick. Inside the dead band, hold. With room, grow where the bound fits, or probe
        one step where the anchored mean fits: where the model has seen no data its bound is
        wide and would pin the batch forever, and a probe teaches it the slope. The breach
        cut bounds the cost of a wrong probe.

        Now is judged by the meter plus what the model says the requests admitted since the
        reading add (`in_flight` against the anchor, never less than the meter): a meter seconds
        behind shows the room of an idle GPU while the batch that fills it is already running.
        """
        cfg = self.config
        # One fresh reading's spread: what separates a mean from a second over the ceiling.
        # The meter's own recent spread is the better measure where it is smaller than the
        # model's residuals (which also hold model misfit); the model's covers a quiet meter.
        noise_w = min(self.model.noise_quantile_w(), self._meter_spread_w())
        here_w = self.mean_at(mean_w, anchor_batch)

        def anchored_upper(n: int) -> float:
            return power_w + self.mean_at(mean_w, n) - here_w + noise_w

        now_w = power_w
        if in_flight is not None and in_flight > anchor_batch:
            now_w += self.mean_at(mean_w, in_flight) - here_w
        if now_w > target_w:
            n = current
            while n > cfg.min_batch and anchored_upper(n) > target_w + noise_w:
                n -= 1
            model_n = self._largest_batch_under(upper_w, target_w)
            floor_n = math.floor((1.0 - cfg.gains.step_down_frac) * current)
            return max(min(current, max(n, model_n)), floor_n)
        room_w = target_w - hysteresis_w
        if now_w >= room_w:
            return current
        n_grow = self._largest_batch_under(upper_w, room_w)
        # A step that overshoots the room must not stop the one request that fits (a boosted
        # step under a long queue); one, not as many as fit, since the anchor is one reading.
        probe = next((n for n in (current + step, current + 1) if anchored_upper(n) <= room_w), 0)
        lead = max(math.ceil(SEEN_LEAD * max(anchor_batch, 1.0)) + 1, cfg.initial_batch)
        return max(min(max(n_grow, probe), lead), current)
