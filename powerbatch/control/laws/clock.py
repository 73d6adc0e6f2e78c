"""Clock law: the SM clock's locked range with the fewest joules per token that keeps the SLOs.

A power cap does nothing while power is under it, and decode usually is ("Illusion of Power
Capping in LLM Decode", arXiv 2605.11999); memory-bound decode barely slows at a lower SM clock
while its power falls faster than the clock (VoltanaLLM, arXiv 2509.04827; arXiv 2501.08219),
so a lower clock through decode-heavy spells saves energy, and a high one serves prefill bursts
and a growing queue (VoltanaLLM sets prefill and decode clocks apart; throttLL'eM, arXiv
2408.05235, picks the clock from KV use and batch). The power limit still holds the ceiling.

Nothing is assumed of the plant but the sign of the clock's effect. The law learns online, by
recursive least squares with forgetting, the log of the 1-second power and of the time per
decode step (the batch over the decode token rate) against the log of the load (batch and
prefill rate) and the clock: one indicator per candidate top (`clock_levels` of them down to
`clock_floor_frac` of the highest). The load's coefficients are shared by every level, so a few
seconds at a level fix its two factors (power and step time against the top's at any load),
kept physical: a lower clock never draws more nor steps faster. It learns only where it acts
(nothing queued, no prefill burst), so exploration and reference see the same regime. A level
it has not seen is priced as no saving and a 1/f slowdown (compute-bound, the worst case), so
it is only chosen once exploration has shown it:
every `clock_explore_every_s`, while the SLOs have room, one level next to the chosen one or
just under the lowest one known is tried for `clock_explore_s`.

Each tick, in order:
* objective `throughput` (the default), no trustworthy reading, or no known clocks: unlocked;
* a prefill burst, a growing queue, p95 TTFT near its SLO or p95 TPOT over `clock_tpot_margin`
  of its SLO: the top clock, held `clock_hold_s`;
* otherwise the level minimising `w x J/token + (1 - w) x step time` (each over the top's, w = 1
  for `energy`, `clock_energy_weight` for `weighted`) among those whose predicted step time
  keeps `clock_tpot_margin` x the TPOT SLO and at most `clock_max_slowdown` over the top's (so
  the batch still drains the demand), moving only for `clock_min_gain` or more.

The lock is [lowest supported clock, chosen top]: a busy GPU runs at the top, an idle one drops.
Pure: no clocks, no I/O; the loop applies the choice through `powerbatch.control.clock`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from powerbatch.control.config import ClockPolicy, ControlConfig

HALF_LIFE_S = 120.0
"""The per-level models forget with this half-life: a plant drifts over minutes (thermals)."""
MIN_SAMPLES = 5.0
"""Effective samples before a level's model is trusted."""
BURST_FACTOR = 2.0
LEARN_PREFILL_FACTOR = 1.5
"""Ticks whose prefill rate is over this many times its slow average are not learned."""
"""A prefill rate this many times its slow average is a burst."""


@dataclass(frozen=True, slots=True)
class ClockInput:
    """What the law sees each tick (the loop builds it from the observation)."""

    t_s: float
    power_w: float | None
    batch: float
    decode_tok_s: float
    prefill_tok_s: float
    queued: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    top_mhz: float
    """The clock top in force: the locked one, or the highest supported when unlocked."""
    changed_at_s: float
    """When the lock last changed (readings are not learned until they settle)."""


@dataclass(frozen=True, slots=True)
class ClockChoice:
    lock: tuple[int, int] | None
    """(min, max) MHz to lock, or None: unlocked (the driver's policy)."""
    reason: str
    exploring: bool = False
    predicted_gain: float = 0.0
    """Predicted J/token saved against the top clock at this load, a share."""


class _Rls:
    """Recursive least squares with exponential forgetting, for y ~ x . theta."""

    def __init__(self, dim: int, forget: float) -> None:
        self.theta = np.zeros(dim)
        self.p = np.eye(dim) * 1e4
        self.forget = forget
        self.n = 0.0  # effective samples

    def update(self, x: np.ndarray, y: float) -> None:
        px = self.p @ x
        k = px / (self.forget + x @ px)
        self.theta = self.theta + k * (y - x @ self.theta)
        self.p = (self.p - np.outer(k, px)) / self.forget
        self.n = self.n * self.forget + 1.0

    def predict(self, x: np.ndarray) -> float:
        return float(x @ self.theta)


def _load(batch: float, prefill_tok_s: float) -> np.ndarray:
    return np.array([1.0, math.log(max(batch, 1.0)), math.log1p(max(prefill_tok_s, 0.0) / 1000.0)])


class ClockLaw:
    def __init__(self, policy: ClockPolicy, config: ControlConfig) -> None:
        self.policy = policy
        self.config = config
        self.levels: list[int] = []
        self._supported: list[int] = []
        self._log_power = _Rls(3, 1.0)
        self._log_step = _Rls(3, 1.0)
        self._counts = np.zeros(0)  # effective samples per level
        self._forget = 1.0
        self._best = 0  # index into levels (0 is the top)
        self._hold_until_s = -math.inf
        self._explore_until_s = -math.inf
        self._explore_level: int | None = None
        self._next_explore_s: float | None = None
        self._prefill_avg = 0.0
        self._queued: deque[int] = deque(maxlen=5)
        self.last: ClockChoice | None = None
        self.last_input: ClockInput | None = None

    @property
    def active(self) -> bool:
        return self.policy.clock_objective != "throughput"

    def set_supported(self, supported: Sequence[int], tick_hz: float) -> None:
        """The device's clocks (ascending); the levels are spread over the upper part."""
        if list(supported) == self._supported:
            return
        self._supported = sorted(supported)
        if not self._supported:
            self.levels = []
            return
        top = self._supported[-1]
        floor = max(self.policy.clock_floor_frac * top, self._supported[0])
        wanted = np.linspace(top, floor, self.policy.clock_levels)
        levels: list[int] = []
        for w in wanted:  # snap each down to a supported clock, no repeats
            below = [c for c in self._supported if c <= w] or [self._supported[0]]
            if below[-1] not in levels:
                levels.append(below[-1])
        self.levels = levels
        forget = 0.5 ** (1.0 / (HALF_LIFE_S * tick_hz))
        dim = 3 + len(levels) - 1
        self._log_power, self._log_step = _Rls(dim, forget), _Rls(dim, forget)
        self._counts = np.zeros(len(levels))
        self._forget = forget
        self._best = 0

    def _level_of(self, mhz: float) -> int:
        return min(range(len(self.levels)), key=lambda i: abs(self.levels[i] - mhz))

    def _lock(self, i: int) -> tuple[int, int] | None:
        return None if i == 0 else (self._supported[0], self.levels[i])

    def learn(self, inp: ClockInput) -> None:
        if not self.levels or inp.power_w is None or not math.isfinite(inp.power_w):
            return
        a = 0.02  # the prefill rate's slow average (about 10 s at 5 Hz)
        self._prefill_avg += a * (inp.prefill_tok_s - self._prefill_avg)
        self._queued.append(inp.queued)
        if inp.t_s - inp.changed_at_s < self.policy.clock_settle_s:
            return
        if inp.batch < 1 or inp.decode_tok_s <= 0:
            return
        if inp.queued > 0 or inp.prefill_tok_s > LEARN_PREFILL_FACTOR * max(self._prefill_avg, 1.0):
            # Learn where the law acts (nothing waits, no burst): exploration only happens
            # there, and a model fitted on bursts too would price every level against a top
            # measured under a heavier load than the level was.
            return
        i = self._level_of(inp.top_mhz)
        z = self._z(i, _load(inp.batch, inp.prefill_tok_s))
        self._log_power.update(z, math.log(max(inp.power_w, 1e-3)))
        self._log_step.update(z, math.log(inp.batch / inp.decode_tok_s))
        self._counts *= self._forget
        self._counts[i] += 1.0

    def _z(self, i: int, load: np.ndarray) -> np.ndarray:
        onehot = np.zeros(len(self.levels) - 1)
        if i > 0:
            onehot[i - 1] = 1.0
        return np.concatenate([load, onehot])

    def samples(self, i: int) -> float:
        """Effective samples behind level i's model."""
        return float(self._counts[i]) if len(self._counts) > i else 0.0

    def _predict(self, i: int, x: np.ndarray) -> tuple[float, float, bool]:
        """(power W, step s, known) at level i; unknown levels are priced pessimistically."""
        z0 = self._z(0, x)
        p_top, s_top = math.exp(self._log_power.predict(z0)), math.exp(self._log_step.predict(z0))
        if i == 0:
            return p_top, s_top, True
        if self.samples(i) < MIN_SAMPLES or self.samples(0) < MIN_SAMPLES:
            return p_top, s_top * self.levels[0] / self.levels[i], False
        power_f, step_f = self._monotone_factors()[i]
        return p_top * power_f, s_top * step_f, True

    def _monotone_factors(self) -> list[tuple[float, float]]:
        """Per level, the (power, step) factors against the top, made physical: a lower clock
        never draws more power nor makes a step shorter at the same load (f x V^2 falls with f,
        and SM time grows as 1/f on any GPU). Down the levels, power is a running minimum
        (at most 1) and step time a running maximum (at least 1); unknown levels carry on the
        last known factors. This is the only shape assumed, and it is not the simulator's."""
        out: list[tuple[float, float]] = [(1.0, 1.0)]
        p_min, s_max = 1.0, 1.0
        for i in range(1, len(self.levels)):
            if self.samples(i) >= MIN_SAMPLES:
                k = 3 + i - 1
                p_min = min(p_min, math.exp(float(self._log_power.theta[k])))
                s_max = max(s_max, math.exp(float(self._log_step.theta[k])))
            out.append((p_min, s_max))
        return out

    def _guard(self, inp: ClockInput) -> str | None:
        """Why the top clock is needed now, or None."""
        cfg, pol = self.config, self.policy
        if inp.tpot_p95_s is not None and inp.tpot_p95_s > pol.clock_tpot_margin * cfg.tpot_slo_s:
            return f"p95 TPOT {inp.tpot_p95_s:.3f} s near its SLO"
        if inp.ttft_p95_s is not None and inp.ttft_p95_s > 0.8 * cfg.ttft_slo_s:
            return f"p95 TTFT {inp.ttft_p95_s:.2f} s near its SLO"
        if inp.prefill_tok_s > BURST_FACTOR * max(self._prefill_avg, 1.0) and inp.queued > 0:
            return "a prefill burst"
        q = self._queued
        if len(q) == q.maxlen and q[-1] > 0 and q[-1] > q[0]:
            return "the queue grows"
        return None

    def tick(self, inp: ClockInput, sensor_ok: bool) -> ClockChoice:
        self.last_input = inp
        self.learn(inp)
        choice = self._choose(inp, sensor_ok)
        self.last = choice
        return choice

    def _choose(self, inp: ClockInput, sensor_ok: bool) -> ClockChoice:
        pol = self.policy
        if not self.active:
            return ClockChoice(None, "objective throughput: the driver's clock policy")
        if not sensor_ok or inp.power_w is None:
            self._best = 0
            return ClockChoice(None, "no trustworthy power reading: unlocked")
        if len(self.levels) < 2:
            return ClockChoice(None, "no supported clocks known: unlocked")
        if self._next_explore_s is None:
            self._next_explore_s = inp.t_s + pol.clock_explore_every_s
        why = self._guard(inp)
        if why is not None:
            self._hold_until_s = inp.t_s + pol.clock_hold_s
            self._explore_until_s = -math.inf
            self._best = 0
            return ClockChoice(None, f"top clock: {why}")
        if inp.t_s < self._hold_until_s:
            return ClockChoice(None, "top clock: holding after a burst")
        if inp.batch < 1:
            return ClockChoice(self._lock(self._best), "idle: clock held")
        x = _load(inp.batch, inp.prefill_tok_s)
        if inp.t_s < self._explore_until_s and self._explore_level is not None:
            return ClockChoice(self._lock(self._explore_level), "exploring", exploring=True)
        best, gain = self._best_level(x)
        current = self._best
        if best != current:
            _, cur_gain = self._score(current, x)
            if gain - cur_gain < pol.clock_min_gain and self._feasible(current, x):
                best, gain = current, cur_gain
        if best > current and self._explore_level == best:
            # The last try found a better level: try the next one soon, not a period later.
            self._next_explore_s = min(
                self._next_explore_s or math.inf, inp.t_s + pol.clock_explore_every_s / 4
            )
        self._best = best
        if inp.t_s >= self._next_explore_s and self._room(inp):
            self._next_explore_s = inp.t_s + pol.clock_explore_every_s
            candidates = self._explore_candidates(best, x)
            if candidates:
                pick = min(candidates, key=self.samples)
                self._explore_level = pick
                self._explore_until_s = inp.t_s + pol.clock_explore_s
                return ClockChoice(self._lock(pick), "exploring", exploring=True)
        reason = (
            "top clock: no lower clock is known to save energy within the SLOs"
            if best == 0
            else f"{self.levels[best]} MHz: predicted {100 * gain:.0f} % fewer J/token"
        )
        return ClockChoice(self._lock(best), reason, predicted_gain=gain)

    def _explore_candidates(self, best: int, x: np.ndarray) -> list[int]:
        """The chosen level's neighbours, and the first level under the lowest one known to be
        feasible (so exploration walks down the frontier one level at a time, never further)."""
        n = len(self.levels)
        out = {i for i in (best + 1, best - 1) if 0 <= i < n}
        if self.samples(0) < 3 * MIN_SAMPLES:
            out.add(0)  # the reference every level is priced against
        known = [i for i in range(n) if self.samples(i) >= MIN_SAMPLES]
        if known and self._feasible(max(known), x):
            frontier = max(known) + 1
            if frontier < n:
                out.add(frontier)
        return sorted(out)

    def _room(self, inp: ClockInput) -> bool:
        """The SLOs have room for a try: p95 TPOT well under its margin, nothing queued."""
        slo = self.config.tpot_slo_s * self.policy.clock_tpot_margin
        return inp.queued == 0 and (inp.tpot_p95_s is None or inp.tpot_p95_s < 0.75 * slo)

    def _feasible(self, i: int, x: np.ndarray) -> bool:
        if i == 0:
            return True
        _, step, known = self._predict(i, x)
        _, step_top, _ = self._predict(0, x)
        pol = self.policy
        return (
            known
            and step <= pol.clock_tpot_margin * self.config.tpot_slo_s
            and step <= (1.0 + pol.clock_max_slowdown) * step_top
        )

    def _score(self, i: int, x: np.ndarray) -> tuple[float, float]:
        """(score, J/token saved against the top) at level i; lower scores are better."""
        p, s, _ = self._predict(i, x)
        p0, s0, _ = self._predict(0, x)
        if p0 <= 0 or s0 <= 0:
            return (1.0, 0.0)
        energy = (p * s) / (p0 * s0)
        w = 1.0 if self.policy.clock_objective == "energy" else self.policy.clock_energy_weight
        return w * energy + (1.0 - w) * (s / s0), 1.0 - energy

    def _best_level(self, x: np.ndarray) -> tuple[int, float]:
        best, best_score, best_gain = 0, 1.0, 0.0
        for i in range(1, len(self.levels)):
            if not self._feasible(i, x):
                continue
            score, gain = self._score(i, x)
            if score < best_score:
                best, best_score, best_gain = i, score, gain
        return best, best_gain

    def summary(self) -> dict[str, object]:
        """For /status: the levels and what is known of each."""
        return {
            "objective": self.policy.clock_objective,
            "levels_mhz": self.levels,
            "samples": [round(self.samples(i), 1) for i in range(len(self.levels))],
            "chosen_mhz": self.levels[self._best] if self.levels else None,
            "reason": self.last.reason if self.last else None,
            "factors": self.factors(),
            "input": None
            if self.last_input is None
            else {
                k: getattr(self.last_input, k)
                for k in ("power_w", "batch", "decode_tok_s", "prefill_tok_s", "top_mhz")
            },
        }

    def factors(self) -> list[tuple[float, float] | None]:
        """Per level, the (power, step time) factors against the top's; None: unknown."""
        return [
            (round(p, 3), round(st, 3)) if i == 0 or self.samples(i) >= MIN_SAMPLES else None
            for i, (p, st) in enumerate(self._monotone_factors())
        ]
