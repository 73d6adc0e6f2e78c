"""Clock law: the SM clock's locked range with the fewest joules per token that keeps the SLOs.

A power cap does nothing while power is under it, and decode usually is ("Illusion of Power
Capping in LLM Decode", arXiv 2605.11999); memory-bound decode barely slows at a lower SM clock
while its power falls faster than the clock (VoltanaLLM, arXiv 2509.04827; arXiv 2501.08219),
so a lower clock through decode-heavy spells saves energy, and a high one serves prefill bursts
and a growing queue (VoltanaLLM sets prefill and decode clocks apart; throttLL'eM, arXiv
2408.05235, picks the clock from KV use and batch). The power limit still holds the ceiling.
Energy per token against the clock is U-shaped with one minimum (VoltanaLLM; Zeus, NSDI '23,
finds the same of GPU power limits and searches them online; ML.ENERGY's leaderboard measures
J/token the same way, from the GPU's energy counter over the tokens served).

**What is measured.** Nothing is assumed of the plant but the sign of the clock's effect and
that one minimum. The law learns online, by recursive least squares with forgetting, the log of
the 1-second power and of the time per decode step (the batch over the decode token rate)
against the log of the demand served (decode and prefill token rates) and the clock: below
capacity the demand is the same at any clock, so a level's power against the top's at the
same tokens/s is its J/token against the top's (`_load`). One indicator per candidate top
(`clock_levels` of them down to `clock_floor_frac` of the highest). The load's coefficients
are shared by every level, so a probe's readings give that level's two factors (power and step
time against the top's at the same load), kept physical: a lower clock never draws more nor
steps faster. It learns only where it acts (nothing queued, no prefill burst) and only readings
taken wholly after the clock in force was set: the meter's learned lag plus its 1-s window
(at least `clock_settle_s`) after each change; a held reading is learned once.

**How it searches.** A golden-section search over the levels, on the measured J/token (or the
weighted score): the top is the reference; two interior probes cut the bracket, a level whose
step time breaks the TPOT margin or the slowdown bound cuts it from below, until at most three
neighbours are left and each is probed. A probe is `clock_explore_s` of readings after the
settle, so with a 1-s meter 2 s late the search takes about six probes of 5 s: it converges in
about 30 s where walking one level per period took the whole run. It picks the best measured
level, moving only for `clock_min_gain`. It searches again when the load's shape moves (the
decode rate by half or double, or the prefill rate's share), forgetting most of what it
learned, and once settled it rechecks one neighbour every `clock_explore_every_s`.

Each tick, in order:
* objective `throughput` (the default), no trustworthy reading, or no known clocks: unlocked;
* a prefill burst, a growing queue, p95 TTFT near its SLO or p95 TPOT over `clock_tpot_margin`
  of its SLO: the top clock, held `clock_hold_s`; an SLO at risk under a lock, where the top
  would have kept it (the level's measured slowdown taken out), also bars that level and every
  lower one for `SLO_MEMORY_S` (the law backs off, not only up and down again);
* otherwise the probe in progress, the next probe (while the SLOs have room), or the best level:
  the one minimising `w x J/token + (1 - w) x step time` (each over the top's, w = 1 for
  `energy`, `clock_energy_weight` for `weighted`) among those whose measured step time keeps
  `clock_tpot_margin` x the TPOT SLO and at most `clock_max_slowdown` over the top's.

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
"""Effective samples (ticks' worth of readings) before a level's model is trusted."""
BURST_FACTOR = 2.0
"""A prefill rate this many times its slow average is a burst."""
LEARN_PREFILL_FACTOR = 1.5
"""Ticks whose prefill rate is over this many times its slow average are not learned."""
READING_WINDOW_S = 1.0
"""A power reading is a mean over this long (the loop's window; dcgm-exporter's 1-s collection)."""
SLO_MEMORY_S = HALF_LIFE_S
"""A level under which an SLO came near stays barred this long."""
SHIFT_DEMAND = math.log(2.0)
"""The load's shape has moved (search again) when the decode rate's slow average is over this,
in log, from where the search settled..."""
SHIFT_PREFILL = 0.5
"""...or log1p(prefill tok/s / 1000) is over this from it."""
KEEP_ON_SHIFT = 0.2
"""On a shift, what is kept of the learned models' weight (the rest is forgotten at once)."""
PROBE_TIMEOUT_S = 15.0
"""A probe that gathers no readings this long after its settle is dropped (kept in the bracket)."""
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True, slots=True)
class ClockInput:
    """What the law sees each tick (the loop builds it from the observation)."""

    t_s: float
    power_w: float | None
    batch: float
    """The load the reading measured (`Observation.seen`), as are the rates."""
    decode_tok_s: float
    prefill_tok_s: float
    queued: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    top_mhz: float
    """The clock top in force: the locked one, or the highest supported when unlocked."""
    changed_at_s: float
    """When the lock last changed (readings are not learned until they settle)."""
    reading_weight: float = 1.0
    """The ticks the reading stands for; 0: a held reading already learned."""
    meter_lag_s: float = 0.0
    """How far behind the ticks the meter's readings are (the loop's learned lag)."""
    prefill_now_tok_s: float | None = None
    """This tick's prefill rate, for bursts (None: `prefill_tok_s`)."""


@dataclass(frozen=True, slots=True)
class ClockChoice:
    lock: tuple[int, int] | None
    """(min, max) MHz to lock, or None: unlocked (the driver's policy)."""
    reason: str
    exploring: bool = False
    predicted_gain: float = 0.0
    """Predicted J/token saved against the top clock at this load, a share."""


class _Rls:
    """Recursive least squares with exponential forgetting, for y ~ x . theta; a sample may
    stand for several ticks (`w`), forgetting as many."""

    def __init__(self, dim: int, forget: float) -> None:
        self.theta = np.zeros(dim)
        self.p = np.eye(dim) * 1e4
        self.forget = forget
        self.n = 0.0  # effective samples

    def update(self, x: np.ndarray, y: float, w: float = 1.0) -> None:
        lam = self.forget**w
        px = self.p @ x
        k = px / (lam / w + x @ px)
        self.theta = self.theta + k * (y - x @ self.theta)
        self.p = (self.p - np.outer(k, px)) / lam
        self.n = self.n * lam + w

    def discount(self, keep: float) -> None:
        """Forget at once: what was learned weighs `keep` of what it did."""
        self.p = self.p / keep
        self.n *= keep

    def predict(self, x: np.ndarray) -> float:
        return float(x @ self.theta)


def _load(decode_tok_s: float, prefill_tok_s: float) -> np.ndarray:
    """The demand served: below capacity it is the same at any clock (the batch is not: a
    slower step gathers more requests, Little's law), so a level's power against the top's at
    the same tokens/s is its J/token against the top's."""
    return np.array(
        [1.0, math.log(max(decode_tok_s, 1.0)), math.log1p(max(prefill_tok_s, 0.0) / 1000.0)]
    )


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
        self._tick_hz = 5.0
        self._best = 0  # index into levels (0 is the top)
        self._hold_until_s = -math.inf
        # The search: a bracket of levels while searching (None: settled), the levels probed
        # since it began, the probe in progress and what it has gathered.
        self._bracket: tuple[int, int] | None = (0, 0)
        self._probed: set[int] = set()
        self._probe: int | None = None
        self._probe_since_s = -math.inf
        self._probe_w = 0.0
        self._next_check_s = math.inf
        self._check_up = False
        self._settled_x: np.ndarray | None = None
        self._x_avg: np.ndarray | None = None
        self._barred_from: int | None = None  # this level and lower ones: an SLO came near
        self._barred_until_s = -math.inf
        self._prefill_avg = 0.0
        self._queued: deque[int] = deque(maxlen=5)
        self.search_started_s: float | None = None
        self.settled_at_s: float | None = None
        """When the last search settled (None: searching), for /status and the tests."""
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
        self._tick_hz = tick_hz
        self._best = 0
        self._start_search(None)

    def _level_of(self, mhz: float) -> int:
        return min(range(len(self.levels)), key=lambda i: abs(self.levels[i] - mhz))

    def _lock(self, i: int) -> tuple[int, int] | None:
        return None if i == 0 else (self._supported[0], self.levels[i])

    def settle_s(self, inp: ClockInput) -> float:
        """How long after a change a reading is wholly of the new clock: the meter's lag and
        its window (and a tick for the change to take), at least `clock_settle_s`."""
        tick_s = 1.0 / self._tick_hz
        return max(self.policy.clock_settle_s, inp.meter_lag_s + READING_WINDOW_S + tick_s)

    def learn(self, inp: ClockInput) -> None:
        if not self.levels or inp.power_w is None or not math.isfinite(inp.power_w):
            return
        a = 0.02  # the prefill rate's slow average (about 10 s at 5 Hz)
        prefill_now = inp.prefill_tok_s if inp.prefill_now_tok_s is None else inp.prefill_now_tok_s
        self._prefill_avg += a * (prefill_now - self._prefill_avg)
        self._queued.append(inp.queued)
        if inp.batch >= 1:
            x = _load(inp.decode_tok_s, inp.prefill_tok_s)
            self._x_avg = x if self._x_avg is None else self._x_avg + a * (x - self._x_avg)
        w = inp.reading_weight
        if w <= 0 or inp.t_s - inp.changed_at_s < self.settle_s(inp):
            return
        if inp.batch < 1 or inp.decode_tok_s <= 0:
            return
        if inp.queued > 0 or inp.prefill_tok_s > LEARN_PREFILL_FACTOR * max(self._prefill_avg, 1.0):
            # Learn where the law acts (nothing waits, no burst): probes only happen there,
            # and a model fitted on bursts too would price every level against a top
            # measured under a heavier load than the level was.
            return
        i = self._level_of(inp.top_mhz)
        z = self._z(i, _load(inp.decode_tok_s, inp.prefill_tok_s))
        self._log_power.update(z, math.log(max(inp.power_w, 1e-3)), w)
        self._log_step.update(z, math.log(inp.batch / inp.decode_tok_s), w)
        self._counts *= self._forget**w
        self._counts[i] += w
        if self._probe == i:
            self._probe_w += w

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

    def _guard(self, inp: ClockInput) -> tuple[str, bool] | None:
        """Why the top clock is needed now, and whether an SLO is why; or None."""
        cfg, pol = self.config, self.policy
        if inp.tpot_p95_s is not None and inp.tpot_p95_s > pol.clock_tpot_margin * cfg.tpot_slo_s:
            return f"p95 TPOT {inp.tpot_p95_s:.3f} s near its SLO", True
        if inp.ttft_p95_s is not None and inp.ttft_p95_s > 0.8 * cfg.ttft_slo_s:
            return f"p95 TTFT {inp.ttft_p95_s:.2f} s near its SLO", True
        prefill_now = inp.prefill_tok_s if inp.prefill_now_tok_s is None else inp.prefill_now_tok_s
        if prefill_now > BURST_FACTOR * max(self._prefill_avg, 1.0) and inp.queued > 0:
            return "a prefill burst", False
        q = self._queued
        if len(q) == q.maxlen and q[-1] > 0 and q[-1] > q[0]:
            return "the queue grows", False
        return None

    def tick(self, inp: ClockInput, sensor_ok: bool) -> ClockChoice:
        self.last_input = inp
        self.learn(inp)
        choice = self._choose(inp, sensor_ok)
        self.last = choice
        return choice

    # ---- the search --------------------------------------------------------------------------

    def _floor(self, t_s: float) -> int:
        """The lowest level allowed now (an SLO came near at the one under it)."""
        if self._barred_from is not None and t_s < self._barred_until_s:
            return max(self._barred_from - 1, 0)
        return len(self.levels) - 1

    def _clock_to_blame(self, inp: ClockInput, i: int) -> bool:
        """Whether the SLO near now would have had room at the top clock: p95 TPOT over level
        i's measured step factor, p95 TTFT over its clock ratio (prefill is compute-bound, SM
        time ~ 1/f), under the guard's thresholds. A spike the top clock would have had too
        (a long prompt in the batch, a queue) bars nothing."""
        cfg, pol = self.config, self.policy
        step_f = self._monotone_factors()[i][1] if self.samples(i) >= MIN_SAMPLES else math.inf
        tpot, ttft = inp.tpot_p95_s, inp.ttft_p95_s
        if tpot is not None and tpot > pol.clock_tpot_margin * cfg.tpot_slo_s:
            return tpot / step_f <= pol.clock_tpot_margin * cfg.tpot_slo_s
        if ttft is not None:
            return ttft * self.levels[i] / self.levels[0] <= 0.8 * cfg.ttft_slo_s
        return True

    def _start_search(self, t_s: float | None) -> None:
        self._bracket = (0, max(len(self.levels) - 1, 0))
        self._probed = set()
        self._probe = None
        self._settled_x = None
        self.search_started_s = t_s
        self.settled_at_s = None

    def _begin_probe(self, i: int, t_s: float) -> ClockChoice:
        self._probe, self._probe_since_s, self._probe_w = i, t_s, 0.0
        return ClockChoice(self._lock(i), f"probing {self.levels[i]} MHz", exploring=True)

    def _next_probe(self, x: np.ndarray, t_s: float) -> int | None:
        """The next level the golden-section search needs measured; None: it is done. The
        bracket [a, b] (level indices, 0 the top) narrows as probes come in."""
        assert self._bracket is not None
        if 0 not in self._probed:
            return 0  # the reference every level is priced against
        a, b = self._bracket
        b = min(b, self._floor(t_s))
        for i in sorted(self._probed):  # a probed level over the step bounds cuts from below
            if a <= i <= b and not self._feasible(i, x):
                b = i - 1
                break
        a = min(a, max(b, 0))
        while b - a > 2:
            m1 = a + round((1.0 - GOLDEN) * (b - a))
            m2 = max(a + round(GOLDEN * (b - a)), m1 + 1)
            for m in (m1, m2):  # the higher clock first: the safer try
                if m not in self._probed:
                    self._bracket = (a, b)
                    return m
            if not self._feasible(m1, x):
                b = m1 - 1
            elif not self._feasible(m2, x) or self._score(m1, x)[0] <= self._score(m2, x)[0]:
                b = m2 - 1  # the minimum is not under m2 (unimodal), nor at it
            else:
                a = m1 + 1
        self._bracket = (a, b)
        for m in range(a, b + 1):
            if m not in self._probed:
                return m
        return None

    def _choose(self, inp: ClockInput, sensor_ok: bool) -> ClockChoice:
        pol = self.policy
        if not self.active:
            return ClockChoice(None, "objective throughput: the driver's clock policy")
        if not sensor_ok or inp.power_w is None:
            self._best, self._probe = 0, None
            return ClockChoice(None, "no trustworthy power reading: unlocked")
        if len(self.levels) < 2:
            return ClockChoice(None, "no supported clocks known: unlocked")
        t = inp.t_s
        if self.search_started_s is None:
            self.search_started_s = t
        guard = self._guard(inp)
        if guard is not None:
            why, slo = guard
            in_force = self._level_of(inp.top_mhz)
            if slo and in_force > 0 and self._clock_to_blame(inp, in_force):
                # The lock in force brought an SLO near: bar it and every lower level a while.
                barred = self._barred_from if t < self._barred_until_s else None
                self._barred_from = in_force if barred is None else min(in_force, barred)
                self._barred_until_s = t + SLO_MEMORY_S
            self._hold_until_s = t + pol.clock_hold_s
            self._probe = None
            self._best = min(self._best, self._floor(t))
            return ClockChoice(None, f"top clock: {why}")
        if t < self._hold_until_s:
            return ClockChoice(None, "top clock: holding after a burst")
        if inp.batch < 1:
            return ClockChoice(self._lock(self._best), "idle: clock held")
        x = _load(inp.decode_tok_s, inp.prefill_tok_s)
        if self._probe is not None:
            if self._probe_w >= pol.clock_explore_s * self._tick_hz:
                self._probed.add(self._probe)
                self._probe = None
                if self._bracket is None:  # a recheck: move to what is now best
                    self._best = self._pick(x, t)
            elif t - self._probe_since_s > PROBE_TIMEOUT_S + self.settle_s(inp):
                self._probe = None  # no readings came (load or guards): try again later
            else:
                return ClockChoice(self._lock(self._probe), "probing", exploring=True)
        if self._bracket is None and self._shifted():
            # The load's shape moved: what was learned prices another regime.
            for m in (self._log_power, self._log_step):
                m.discount(KEEP_ON_SHIFT)
            self._counts *= KEEP_ON_SHIFT
            self._start_search(t)
        room = self._room(inp)
        if self._bracket is not None:
            nxt = self._next_probe(x, t)
            if nxt is None:
                self._bracket = None
                self._best = self._pick(x, t)
                self._settled_x = self._x_avg
                self.settled_at_s = t
                self._next_check_s = t + pol.clock_explore_every_s
            elif room:
                return self._begin_probe(nxt, t)
        elif t >= self._next_check_s and room:
            self._next_check_s = t + pol.clock_explore_every_s
            self._check_up = not self._check_up
            for i in (self._best - 1, self._best + 1)[:: 1 if self._check_up else -1]:
                if 0 <= i <= self._floor(t):
                    self._probed.discard(i)
                    return self._begin_probe(i, t)
        best = self._best
        gain = self._score(best, x)[1] if best else 0.0
        reason = (
            "top clock: no lower clock is known to save energy within the SLOs"
            if best == 0
            else f"{self.levels[best]} MHz: measured {100 * gain:.0f} % fewer J/token"
        )
        return ClockChoice(self._lock(best), reason, predicted_gain=gain)

    def _pick(self, x: np.ndarray, t_s: float) -> int:
        """The best measured level allowed now; the current one unless another saves
        `clock_min_gain` more."""
        floor = self._floor(t_s)
        ok = [i for i in range(floor + 1) if self._feasible(i, x)]
        best = min(ok, key=lambda i: self._score(i, x)[0])
        cur = self._best if self._best in ok else 0
        if (
            best != cur
            and self._score(cur, x)[1] + self.policy.clock_min_gain > self._score(best, x)[1]
        ):
            return cur
        return best

    def _shifted(self) -> bool:
        if self._settled_x is None or self._x_avg is None:
            return False
        d = self._x_avg - self._settled_x
        return abs(float(d[1])) > SHIFT_DEMAND or abs(float(d[2])) > SHIFT_PREFILL

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
        energy = p / p0  # at the same tokens/s (`_load`)
        w = 1.0 if self.policy.clock_objective == "energy" else self.policy.clock_energy_weight
        return w * energy + (1.0 - w) * (s / s0), 1.0 - energy

    def summary(self) -> dict[str, object]:
        """For /status: the levels and what is known of each."""
        return {
            "objective": self.policy.clock_objective,
            "levels_mhz": self.levels,
            "samples": [round(self.samples(i), 1) for i in range(len(self.levels))],
            "chosen_mhz": self.levels[self._best] if self.levels else None,
            "searching": self._bracket is not None,
            "bracket_mhz": None
            if self._bracket is None or not self.levels
            else [self.levels[self._bracket[0]], self.levels[self._bracket[1]]],
            "settled_at_s": self.settled_at_s,
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
