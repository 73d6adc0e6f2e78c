"""`powerbatch fleet-bench --matrix reduced|full`: the fleet against a static split on many fleets.

Each case is a fleet (2, 4 or 8 members; 8B- and 70B-class, H100- and A100-like GPU sets; the
instant, 1-s mean and 2-s late meters of `powerbatch.sim.plants.METERS`), a budget (35-80 % of
the members' summed TDP) and a load: a hot spot that moves every 5-60 s at 2-10x the cold
rate, diurnal days out of phase, uncorrelated bursts, or even load. Every case runs three arms
on the same seeds, repeat by repeat: `hwcap` (no proxy, each GPU set capped at budget / N: the
static split), `fleet` (leases, each proxy also sets its GPU's limit) and `fleet-admission`
(leases, admission alone). A fleet can win only on a load the split cannot serve and a
better spread of the budget can: each member's load keeps its shape (the hot rates of
`sizing`, from each member's capped capacity C(w), `powerbatch.sim.capacity`: its peak at
`Case.hot_position` inside [C(split), C(w_max)], w_max the most the budget can give it: its TDP,
or the budget less the lowest limits that serve the others' cold rates; its cold rate the hot
over `hot_over_cold`), and its scale is measured (`LoadScale`): the case's own plans run
through the simulated engine in virtual time find the largest factor on those rates that the
static split serves and the largest that each member at its w_max serves, and the run takes
`hot_position` of the way between (the even case `hot_position` of what the split serves:
nothing to move, it must cost nothing). C alone is a steady state: a hot spell shorter than
the queue's TTFT allowance is absorbed, and loads placed by it left the split nothing to lose.
A case whose measured room (the two factors' ratio) is under `NOTHING_TO_WIN` is reported as
"nothing to win" and left out of the matrix's median and worst case. Answers are lengthened
where the fleet's peak arrivals would pass what two CPU cores can drive (`MAX_FLEET_RPS`), up
to `MAX_OUTPUT_MEDIAN` (an answer longer than the run measures how many requests a server
holds, not what it serves); the peak a case reaches is in its JSON (`load_scale.peak_rps`).

Per case: goodput over the static split's (per repeat), seconds over the budget, mean summed
power while any member has work waiting over the budget, and the median time for watts to
reach a new hot spot. `reduced` is six cases (about nine minutes per repeat at 20 s a run);
`full` draws `FULL_CASES` from the grid above (docs/fleet.md gives its time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from powerbatch.cli import fleet_bench
from powerbatch.cli.extras import pyplot
from powerbatch.cli.process import ChildFailed
from powerbatch.cli.stack import slo_default_s
from powerbatch.load.drawn import DIURNAL_SHAPE
from powerbatch.load.profile import LoadProfile, Phase, PlannedRequest
from powerbatch.sim.capacity import capped_rps, need_w, served_in_slo
from powerbatch.sim.gpu_model import (
    DEFAULT_KV_CAPACITY_TOKENS,
    PROFILES,
    GpuProfile,
    decode_power_w,
)
from powerbatch.sim.plants import METERS, Plant

MATRIX_ARMS = ("hwcap", "fleet", "fleet-admission")
REPORTED_ARMS = ("hwcap", "static", "fleet", "fleet-admission")  # `static`: by --arms only
FULL_CASES = 24
SETTLE_S = 6.0  # every arm waits this long before its load: past the proxies' 5-s warm-up
MAX_FLEET_RPS = 36.0  # the whole fleet's peak arrivals: above it the load client binds
MAX_OUTPUT_MEDIAN = 1_000.0  # answers lengthened to keep under it, up to this median (tokens)
PROMPT_MEDIAN, PROMPT_SIGMA, OUTPUT_SIGMA = 600.0, 0.8, 0.6  # LoadProfile's defaults
MIX = {"high": 0.3, "normal": 0.5, "low": 0.2}
# Goodput's time-per-token bound, as fleet-bench's: the sizing counts a batch only while its
# capped step keeps it.
TPOT_SLO_S = slo_default_s("tpot_slo_s")
TTFT_SLO_S = slo_default_s("ttft_slo_s")
BURST_PEAK = 1.3  # a moving hot spot's first half over its mean (then 0.7x), as fleet-bench's
NOTHING_TO_WIN = 1.05  # a room (measured, else C(w_max) / C(split)) under this: nothing to move
EVEN_POSITION = 0.8  # the even load at this share of C(split): served by the split, with margin
SIZING_ITERATIONS = 6  # hot rates -> cold rates -> w_max -> hot rates, to a fixed point
SERVED = 0.98  # a load is served while this share of its answers is within the SLOs
SIZING_SEED = 0  # the plans the load's scale is measured on (no run's own seed)
SCALE_RANGE = (0.25, 8.0)  # the factors on the analytic rates the measurement searches
SCALE_STEPS = 7  # bisection steps on the factor's log: 1.03x at the end

# An A100-like set: the 8B fit scaled to a 400-W board (A100 SXM4: TDP 400 W, NVML limit
# constraints 100-400 W) and to its slower memory (2.0 against 3.35 TB/s: decode 1.7x slower)
# and compute (312 against 989 dense BF16 TFLOPS: prefill 3x slower), per NVIDIA's A100 and
# H100 datasheets. A bench member, not a calibrated profile.
_H100 = PROFILES["h100-llama8b"]
_A100 = dataclasses.replace(
    _H100,
    name="a100-llama8b",
    gpu_model_name="NVIDIA A100-SXM4-80GB",
    tdp_w_per_gpu=400.0,
    min_limit_w_per_gpu=100.0,
    dec_base_w=_H100.dec_base_w * 400.0 / 700.0,
    dec_span_w=_H100.dec_span_w * 400.0 / 700.0,
    idle_w_per_gpu=55.0,
    itl_base_s=_H100.itl_base_s * 1.7,
    itl_span_s=_H100.itl_span_s * 1.7,
    prefill_tok_s=_H100.prefill_tok_s / 3.0,
    noise_sigma_w_per_gpu=12.0,
)
KINDS: dict[str, GpuProfile] = {
    "h100-8b": _H100,
    "a100-8b": _A100,
    "h100x4-70b": PROFILES["h100x4-llama70b"],
}


@dataclass(frozen=True)
class Case:
    """One fleet, budget and load of the matrix."""

    name: str
    kinds: tuple[str, ...]  # KINDS, one per member
    meters: tuple[str, ...]  # plants.METERS, one per member
    budget_frac: float  # of the members' summed TDP
    load: str  # moving | diurnal | bursts | even
    period_s: float  # hot spot's period; a day's length; bursts' mean spacing
    hot_over_cold: float
    hot_position: float  # 0..1: the load this far from what the split serves to what the best
    # spread serves (C's interval for the shape, `LoadScale` for the scale); even: x the split's

    @property
    def members(self) -> int:
        return len(self.kinds)

    def budget_w(self) -> float:
        """budget_frac of the summed TDP, raised where the split would fall under a member's
        lowest limit (the static split must be a cap each GPU set accepts)."""
        profs = [KINDS[k] for k in self.kinds]
        budget = self.budget_frac * sum(p.tdp_w for p in profs)
        floor = max(p.min_limit_w for p in profs) * len(profs) * 1.05
        return max(budget, floor)

    def plants(self) -> list[Plant]:
        """Each member's plant, its ceiling the static split's cap (the load is sized by it)."""
        budget = self.budget_w()
        out = []
        for k, meter in zip(self.kinds, self.meters, strict=True):
            prof = KINDS[k]
            ceiling = min(max(budget / self.members, prof.min_limit_w),
                          prof.tdp_w)  # fmt: skip
            out.append(Plant(prof, ceiling, DEFAULT_KV_CAPACITY_TOKENS, meter, {"kind": k}))
        return out

    def admission_can_hold(self) -> bool:
        """Whether admission alone can hold the split at all: admission cannot preempt, so a
        member with any work draws at least one request's decode power (on the 8B H100 fit,
        480 W of its 700 W); where the members' sum of that is over the budget, no admission
        law can stay under it, and `fleet-admission` is not run."""
        one = sum(decode_power_w(KINDS[k], 1) for k in self.kinds)
        return one <= self.budget_w()

    def sizing(self) -> list[MemberSizing]:
        """Each member's capacity interval and rates (`sizing`), at the case's answer length."""
        plants = self.plants()
        return sizing(self, plants, output_median(self, plants))

    def room(self) -> float:
        """C's estimate of the most a fleet can win: the widest C(w_max) / C(split) over the
        members (`LoadScale.room` is the measured one)."""
        return max(m.room for m in self.sizing())

    def nothing_to_win(self, room: float | None = None) -> bool:
        """No member's rate can be served better by moving watts, by `room` (C's where not
        given); even load is judged on its own goal: it must cost nothing."""
        return self.load != "even" and (self.room() if room is None else room) < NOTHING_TO_WIN

    def to_json(self) -> dict[str, Any]:
        plants = self.plants()
        out = output_median(self, plants)
        return {
            **dataclasses.asdict(self),
            "budget_w": self.budget_w(),
            "admission_can_hold": self.admission_can_hold(),
            "output_median": out,
            "sizing": [dataclasses.asdict(m) for m in sizing(self, plants, out)],
            "room": self.room(),
            "nothing_to_win": self.nothing_to_win(),
        }


@dataclass(frozen=True)
class MemberSizing:
    """One member's capacity interval and the rates its load reaches (requests/s, watts)."""

    split_w: float  # its static-split limit (the plant's ceiling)
    at_split_rps: float  # C(split)
    max_share_w: float  # w_max: its TDP, or the budget less the cold members' lowest limits
    at_max_rps: float  # C(w_max)
    peak_rps: float  # the highest rate its load reaches
    hot_rps: float  # the hot rate `member_phases` takes (moving: peak / BURST_PEAK)
    cold_rps: float  # hot / hot_over_cold

    @property
    def room(self) -> float:
        return self.at_max_rps / self.at_split_rps if self.at_split_rps > 0 else 1.0


def reduced_cases() -> list[Case]:
    """Six cases that between them touch every dimension but the 8-member fleet; every uneven
    load's peak at the middle of its capacity interval (`hot_position` 0.5), the even load at
    `EVEN_POSITION` of C(split)."""
    m1 = "mean-1s"
    return [
        Case("moving-4x8b-p10-10x-46%", ("h100-8b",) * 4, (m1,) * 4, 0.46, "moving", 10.0,
             10.0, 0.5),
        Case("moving-2mixed-p5-4x-55%", ("h100-8b", "h100x4-70b"), ("instant", "lag-2s"),
             0.55, "moving", 5.0, 4.0, 0.5),
        Case("diurnal-4mixed-65%", ("h100-8b", "a100-8b", "h100-8b", "a100-8b"),
             (m1, "instant", "lag-2s", m1), 0.65, "diurnal", 20.0, 6.0, 0.5),
        Case("bursts-4x8b-35%", ("h100-8b",) * 4, (m1,) * 4, 0.35, "bursts", 10.0, 6.0, 0.5),
        Case("even-4x8b-75%", ("h100-8b",) * 4, (m1,) * 4, 0.75, "even", 30.0, 1.0,
             EVEN_POSITION),
        Case("moving-4x8b-p15-5x-78%", ("h100-8b",) * 4, ("instant", m1, m1, "lag-2s"), 0.78,
             "moving", 15.0, 5.0, 0.5),
    ]  # fmt: skip


def full_cases(seed: int = 1) -> list[Case]:
    """`FULL_CASES` cases over the grid (every member count, period and load at least once),
    the rest of each drawn from `seed` (`hot_position` uniform in 0.1-0.9), plus one even-load
    case."""
    rng = np.random.default_rng([seed, 23])
    loads = ("moving", "moving", "diurnal", "bursts")
    out = []
    for i in range(FULL_CASES):
        n = (2, 4, 8)[i % 3]
        period = (5.0, 15.0, 30.0, 60.0)[(i // 3) % 4]
        load = loads[i % 4]
        mixed = rng.random() < 0.5
        kinds = tuple(str(rng.choice(list(KINDS))) if mixed else "h100-8b" for _ in range(n))
        meters = tuple(str(rng.choice(list(METERS))) for _ in range(n))
        frac = float(rng.uniform(0.35, 0.80))
        ratio = float(rng.uniform(2.0, 10.0))
        position = float(rng.uniform(0.1, 0.9))
        name = f"{load}-{n}{'mixed' if mixed else 'x8b'}-p{period:.0f}-{ratio:.0f}x-{frac:.0%}"
        out.append(Case(name, kinds, meters, frac, load, period, ratio, position))
    out.append(Case("even-4x8b-60%", ("h100-8b",) * 4, ("mean-1s",) * 4, 0.6, "even", 30.0,
                    1.0, EVEN_POSITION))  # fmt: skip
    return out


def sizing(case: Case, plants: list[Plant], out_median: float) -> list[MemberSizing]:
    """Each member's interval [C(split), C(w_max)] and its rates (module docstring). w_max
    depends on the others' cold rates, which follow their hot rates: iterated from the hot
    rates at C(split) (`SIZING_ITERATIONS` rounds; the last w_max is from the last cold rates
    but one)."""
    prompt, output = _means(out_median)
    slo = TPOT_SLO_S
    at_split = [capped_rps(p, p.ceiling_w, prompt, output, tpot_slo_s=slo) for p in plants]
    burst = BURST_PEAK if case.load == "moving" else 1.0
    if case.load == "even":
        return [
            MemberSizing(
                p.ceiling_w,
                c,
                p.ceiling_w,
                c,
                case.hot_position * c,
                case.hot_position * c,
                case.hot_position * c,
            )
            for p, c in zip(plants, at_split, strict=True)
        ]
    hot = [c / burst for c in at_split]
    out: list[MemberSizing] = []
    for _ in range(SIZING_ITERATIONS):
        cold = [h / case.hot_over_cold for h in hot]
        out = []
        for i, (p, most_w) in enumerate(zip(plants, most_w_all(case, plants, cold, out_median),
                                            strict=True)):  # fmt: skip
            at_most = capped_rps(p, most_w, prompt, output, tpot_slo_s=slo)
            peak = at_split[i] + case.hot_position * (at_most - at_split[i])
            out.append(MemberSizing(p.ceiling_w, at_split[i], most_w, at_most, peak,
                                    peak / burst, peak / burst / case.hot_over_cold))  # fmt: skip
        hot = [m.hot_rps for m in out]
    return out


def most_w_all(case: Case, plants: list[Plant], cold_rps: list[float], out_median: float
               ) -> list[float]:  # fmt: skip
    """Each member's w_max: its TDP, or the budget less the lowest limits that serve the
    others' cold rates (C's `need_w`), and never under its split."""
    prompt, output = _means(out_median)
    need = [need_w(p, c, prompt, output, tpot_slo_s=TPOT_SLO_S)
            for p, c in zip(plants, cold_rps, strict=True)]  # fmt: skip
    budget = case.budget_w()
    return [max(min(p.profile.tdp_w, budget - sum(need) + need[i]), p.ceiling_w)
            for i, p in enumerate(plants)]  # fmt: skip


@dataclass(frozen=True)
class LoadScale:
    """The case's load, measured: factors on `sizing`'s hot rates, found by running each
    member's own plan through the simulated engine in virtual time
    (`capacity.served_in_slo`). C(w) is a steady-state capacity; a hot spell shorter than a
    queue's TTFT allowance is absorbed, so a load placed by C alone can leave the split nothing
    to lose (stop 50: it answered every request in time in 11 of 12 runs)."""

    out_median: float  # the answers' median length (tokens)
    split: float  # the largest factor the static split serves (`SERVED` of its answers in SLO)
    most: float  # the largest factor each member, at its w_max, serves
    run: float  # the run's factor: `hot_position` of the way from `split` to `most`
    hot_rps: tuple[float, ...]  # each member's hot rate at `run`
    peak_rps: float  # the fleet's peak arrivals at `run` (over `MAX_FLEET_RPS` where answers
    # reached `MAX_OUTPUT_MEDIAN` first, or the lengthening did not settle in four rounds)

    @property
    def room(self) -> float:
        """The measured room: most / split (the analytic one is C(w_max) / C(split))."""
        return self.most / self.split


def served_share(case: Case, plants: list[Plant], hot_rps: list[float], out_median: float,
                 duration_s: float, limits_w: list[float]) -> float:  # fmt: skip
    """The share of the case's answers within the SLOs with member i's hot rate `hot_rps[i]`
    and its device limit `limits_w[i]` (the plans of `SIZING_SEED`, in virtual time)."""
    good = sent = 0
    for i, (p, hot, w) in enumerate(zip(plants, hot_rps, limits_w, strict=True)):
        g, n = served_in_slo(p, w, member_plan(case, i, hot, out_median, SIZING_SEED, duration_s),
                             ttft_slo_s=TTFT_SLO_S, tpot_slo_s=TPOT_SLO_S)  # fmt: skip
        good, sent = good + g, sent + n
    return good / sent if sent else 1.0


@lru_cache(maxsize=64)
def load_scale(case: Case, duration_s: float) -> LoadScale:
    """The case's measured load (`LoadScale`); answers lengthened, as `output_median`, while
    the fleet's peak arrivals pass `MAX_FLEET_RPS`."""
    plants = case.plants()
    out = output_median(case, plants)
    for _ in range(4):
        base = [m.hot_rps for m in sizing(case, plants, out)]

        def served(k: float, at_most: bool, base: list[float] = base, out: float = out) -> bool:
            hot = [k * h for h in base]
            limits = (most_w_all(case, plants, [h / case.hot_over_cold for h in hot], out)
                      if at_most else [p.ceiling_w for p in plants])  # fmt: skip
            return served_share(case, plants, hot, out, duration_s, limits) >= SERVED

        split = _largest(lambda k: served(k, False))
        if case.load == "even":
            most, run = split, case.hot_position * split  # at that share of what it serves
        else:
            most = max(_largest(lambda k: served(k, True)), split)
            run = split + case.hot_position * (most - split)
        peak = fleet_peak_rps(case, [run * h for h in base])
        if peak <= MAX_FLEET_RPS * 1.01 or out >= MAX_OUTPUT_MEDIAN:
            break
        out = min(out * peak / MAX_FLEET_RPS, MAX_OUTPUT_MEDIAN)
    return LoadScale(out, split, most, run, tuple(run * h for h in base), peak)


def _largest(ok: Callable[[float], bool]) -> float:
    """The largest factor in `SCALE_RANGE` for which `ok(factor)` holds, by bisection on its
    log (`SCALE_STEPS`); the range's ends where it holds everywhere or nowhere."""
    lo, hi = SCALE_RANGE
    if ok(hi):
        return hi
    if not ok(lo):
        return lo
    for _ in range(SCALE_STEPS):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def fleet_peak_rps(case: Case, hot_rps: list[float] | tuple[float, ...]) -> float:
    """The most requests/s the whole fleet is sent at once (a moving hot spot's members are
    hot in turn; days and bursts out of phase), over every member's turn and three seeds."""
    span_s = 2.0 * case.members * case.period_s
    grid = np.arange(0.0, span_s, 0.125)
    total = np.zeros((3, len(grid)))
    for k, seed in enumerate((1, 2, 3)):
        for i, hot in enumerate(hot_rps):
            phases = member_phases(case, i, hot, seed, span_s)
            ends = np.cumsum([ph.duration_s for ph in phases])
            at = np.minimum(np.searchsorted(ends, grid, "right"), len(phases) - 1)
            total[k] += np.asarray([ph.rate_rps for ph in phases])[at]
    return float(total.max())


def output_median(case: Case, plants: list[Plant]) -> float:
    """Answers long enough that the fleet's peak arrivals stay under `MAX_FLEET_RPS`."""
    out = 180.0
    for _ in range(8):
        peak = fleet_peak_rps(case, [m.hot_rps for m in sizing(case, plants, out)])
        if peak <= MAX_FLEET_RPS:
            break
        out = min(out * peak / MAX_FLEET_RPS, MAX_OUTPUT_MEDIAN)
    return out


def _means(output: float) -> tuple[float, float]:
    return PROMPT_MEDIAN * math.exp(PROMPT_SIGMA**2 / 2), output * math.exp(OUTPUT_SIGMA**2 / 2)


def member_phases(case: Case, i: int, hot_rps: float, seed: int, duration_s: float) -> list[Phase]:
    """Member i's rates over the run, as phases that cover it (none repeats). Durations are
    whole eighths of a second: exact in binary, so `LoadProfile.plan`'s phase boundaries add
    up (with arbitrary floats a boundary can land a rounding short and the plan never ends)."""
    return [
        Phase(max(round(ph.duration_s * 8) / 8, 0.125), ph.rate_rps)
        for ph in _phases(case, i, hot_rps, seed, duration_s)
    ]


def _phases(case: Case, i: int, hot_rps: float, seed: int, duration_s: float) -> list[Phase]:
    cold = hot_rps / case.hot_over_cold
    n, p = case.members, case.period_s
    rng = np.random.default_rng([seed, i, 7])
    if case.load == "moving":
        out = []
        for k in range(math.ceil(duration_s / p)):
            if k % n == i:  # a burst, as fleet-bench's hot spot: 1.3x then 0.7x
                out += [
                    Phase(p / 2, hot_rps * BURST_PEAK),
                    Phase(p / 2, hot_rps * (2 - BURST_PEAK)),
                ]
            else:
                out.append(Phase(p, cold))
        return out
    if case.load == "diurnal":  # the day of load.drawn, each member out of phase
        shape = [r / max(DIURNAL_SHAPE) for r in DIURNAL_SHAPE]
        start = int(rng.integers(len(shape)))
        step = p / len(shape)
        k = math.ceil(duration_s / step) + 1
        return [Phase(step, max(shape[(start + j) % len(shape)] * hot_rps, cold)) for j in range(k)]
    if case.load == "bursts":  # one burst in each period, at its own random place
        out, t = [], 0.0
        while t < duration_s:
            burst = p * float(rng.uniform(0.3, 0.5))
            before = float(rng.uniform(0.0, p - burst))
            out += [Phase(before, cold), Phase(burst, hot_rps), Phase(p - burst - before, cold)]
            t += p
        return [ph for ph in out if ph.duration_s > 0]
    return [Phase(duration_s, hot_rps)]  # even


def plan_for(case: Case, scale: LoadScale) -> Any:
    """fleet_bench's `plan_for(i, a, seed)` for this case at its measured load."""

    def plan(i: int, a: argparse.Namespace, seed: int) -> list[PlannedRequest]:
        return member_plan(case, i, scale.hot_rps[i], scale.out_median, seed, a.duration_s)

    return plan


def member_plan(
    case: Case, i: int, hot_rps: float, out_median: float, seed: int, duration_s: float
) -> list[PlannedRequest]:
    """Member i's requests over the run: its phases (`member_phases`) at `hot_rps`, answers
    of median `out_median` tokens, drawn from `seed`."""
    phases = member_phases(case, i, hot_rps, seed, duration_s)
    prof = LoadProfile(f"m{i}", tuple(phases), output_median=out_median, priority_mix=MIX)
    return [r for r in prof.plan(duration_s, seed * 100 + i) if r.t_s < duration_s]


def case_args(
    a: argparse.Namespace, case: Case, scale: LoadScale | None = None
) -> argparse.Namespace:
    """fleet_bench's arguments for one case: its fleet, budget, plants and plans (at `scale`,
    else at the load `load_scale` measures for the run's length)."""
    ns = argparse.Namespace(**vars(a))
    plants = case.plants()
    ns.members = case.members
    ns.budget_w = case.budget_w()
    ns.plants = plants
    ns.hot_period_s = case.period_s if case.load == "moving" else a.duration_s
    ns.load_scale = scale or load_scale(case, a.duration_s)
    ns.plan_for = plan_for(case, ns.load_scale)
    ns.limiter = True  # `fleet-admission` runs without it (fleet_bench.PROXIED_LIMITED)
    ns.settle_s = a.settle_s if a.settle_s is not None else SETTLE_S
    return ns


def case_summary(
    case: Case, runs: dict[str, list[dict[str, Any]]], scale: LoadScale | None = None
) -> dict[str, Any]:
    """The case's figures over its repeats (and its measured load, where given)."""
    out: dict[str, Any] = {"case": case.to_json()}
    if scale is not None:
        out["case"]["load_scale"] = {**dataclasses.asdict(scale), "room": scale.room}
        out["case"]["nothing_to_win"] = case.nothing_to_win(scale.room)
    base = runs.get("hwcap", [])
    for arm in REPORTED_ARMS:
        rs = runs.get(arm, [])
        if not rs:
            continue
        fig: dict[str, Any] = {
            "goodput_rps": [r["goodput_rps"] for r in rs],
            "seconds_over_budget": [r["seconds_over_budget"] for r in rs],
            "seconds": [r["seconds"] for r in rs],
            "power_while_queued_over_budget": [r["power_while_queued_over_budget"] for r in rs],
            # runs kept from before it was measured have none
            "reach_while_queued_over_budget": [
                r["reach_while_queued_over_budget"]
                for r in rs
                if r.get("reach_while_queued_over_budget") is not None
            ],
            "mean_total_w": [r["mean_total_w"] for r in rs],
        }
        if arm == "hwcap":
            # What a fleet that answered every request sent in time would read over the split:
            # no allocation can do better, so it bounds the case's ratio (runs kept from
            # before the bench counted what it sent leave it out).
            fig["bound_over_static"] = [
                r["sent_rps"] / r["goodput_rps"]
                for r in rs
                if r.get("sent_rps") and r["goodput_rps"]
            ]
        else:
            fig["goodput_over_static"] = [
                r["goodput_rps"] / b["goodput_rps"]
                for r, b in zip(rs, base, strict=False)
                if b["goodput_rps"]
            ]
            moves = [m for r in rs for m in r.get("seconds_to_move_watts", []) if m is not None]
            fig["seconds_to_move_watts"] = moves
            fig["median_seconds_to_move_watts"] = statistics.median(moves) if moves else None
        out[arm] = fig
    return out


def _fmt_ratio(xs: list[float]) -> str:
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.fmean(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _mean(xs: list[Any]) -> float | None:
    got = [float(x) for x in xs if x is not None]
    return statistics.fmean(got) if got else None


def table(summaries: list[dict[str, Any]]) -> str:
    """The markdown table docs/fleet.md carries."""
    head = (
        "| case | budget | room (measured) | all sent, in time / static "
        "| goodput / static, limiter "
        "| … median of repeats | … admission alone | s over budget "
        "(lim / adm) | power while queued / budget (static / lim / adm) | watts to hot spot, "
        "median s (lim / adm) | fixed-ceiling proxies / static |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        c, lim, adm, cap = (
            s["case"],
            s.get("fleet", {}),
            s.get("fleet-admission", {}),
            s.get("hwcap", {}),
        )

        def pq(f: dict[str, Any]) -> str:
            v = _mean(f.get("power_while_queued_over_budget", []))
            return "—" if v is None else f"{v:.2f}"

        def mv(f: dict[str, Any]) -> str:
            v = f.get("median_seconds_to_move_watts")
            return "—" if v is None else f"{v:.1f}"

        def med(f: dict[str, Any]) -> str:
            xs = f.get("goodput_over_static", [])
            return f"{statistics.median(xs):.2f}" if xs else "—"

        over = f"{sum(lim.get('seconds_over_budget', []))} / "
        over += f"{sum(adm.get('seconds_over_budget', []))}" if adm else "—"
        adm_ratio = _fmt_ratio(adm.get("goodput_over_static", []))
        if not c.get("admission_can_hold", True):
            adm_ratio = "cannot hold (one request each > budget)"
        lim_ratio = _fmt_ratio(lim.get("goodput_over_static", []))
        if c.get("nothing_to_win"):
            lim_ratio = f"nothing to win ({lim_ratio})"
        room = c.get("load_scale", c).get("room")
        rows.append(
            f"| {c['name']} | {c['budget_w']:.0f} W | "
            f"{'—' if room is None else f'{room:.2f}x'} | "
            f"{_fmt_ratio(cap.get('bound_over_static', []))} | {lim_ratio} | {med(lim)} | "
            f"{adm_ratio} | {over} | "
            f"{pq(cap)} / {pq(lim)} / {pq(adm)} | {mv(lim)} / {mv(adm)} | "
            f"{_fmt_ratio(s.get('static', {}).get('goodput_over_static', []))} |"
        )
    return head + "\n".join(rows) + "\n"


def overall(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Across the matrix: median and worst case of each arm's ratio (a case's mean over its
    repeats; cases with nothing to win left out and named), seconds over budget (all cases),
    power while queued, median move."""
    out: dict[str, Any] = {}
    for arm in ("fleet", "fleet-admission"):
        per_case = [
            (statistics.fmean(s[arm]["goodput_over_static"]), s["case"]["name"])
            for s in summaries
            if s.get(arm, {}).get("goodput_over_static") and not s["case"].get("nothing_to_win")
        ]
        if not per_case:
            continue
        ratios = [r for r, _ in per_case]
        counted = {name for _, name in per_case}
        bounds = [
            statistics.fmean(s["hwcap"]["bound_over_static"])
            for s in summaries
            if s["case"]["name"] in counted and s.get("hwcap", {}).get("bound_over_static")
        ]
        worst = min(per_case)
        moves = [m for s in summaries for m in s.get(arm, {}).get("seconds_to_move_watts", [])]
        pq = [_mean(s[arm]["power_while_queued_over_budget"]) for s in summaries if arm in s]
        of_reach = [
            p / r
            for s in summaries
            if arm in s
            and (p := _mean(s[arm]["power_while_queued_over_budget"])) is not None
            and (r := _mean(s[arm].get("reach_while_queued_over_budget", [])))
        ]
        out[arm] = {
            "median_goodput_over_static": statistics.median(ratios),
            # the same cases' bound: every request sent answered in time, over the split
            "median_bound_over_static": statistics.median(bounds) if bounds else None,
            "nothing_to_win": [
                s["case"]["name"] for s in summaries if s["case"].get("nothing_to_win")
            ],
            "worst_goodput_over_static": worst[0],
            "worst_case": worst[1],
            "seconds_over_budget": sum(
                sum(s[arm]["seconds_over_budget"]) for s in summaries if arm in s
            ),
            "seconds": sum(sum(s[arm]["seconds"]) for s in summaries if arm in s),
            "median_seconds_to_move_watts": statistics.median(moves) if moves else None,
            "min_power_while_queued_over_budget": min(
                (x for x in pq if x is not None), default=None
            ),
            "mean_power_while_queued_over_budget": _mean(pq),
            # the same over what the fleet could have drawn (`fleet_bench.reach_w`)
            "mean_power_while_queued_over_reach": _mean(of_reach),
        }
    return out


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Per case: goodput over the static split (mean, range of repeats) for both fleet arms
    and its bound, and power while work waits over the budget for all three."""
    plt = pyplot()

    names = [s["case"]["name"] for s in summaries]
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(names)), 7), sharex=True)
    for j, (arm, label) in enumerate((("fleet", "fleet + limiter"),
                                      ("fleet-admission", "fleet, admission alone"))):  # fmt: skip
        vals = [s.get(arm, {}).get("goodput_over_static") or [math.nan] for s in summaries]
        mean = np.array([np.mean(v) for v in vals])
        lo = mean - np.array([np.min(v) for v in vals])
        hi = np.array([np.max(v) for v in vals]) - mean
        ax1.bar(x + (j - 0.5) * 0.38, mean, 0.38, yerr=[lo, hi], capsize=3, label=label)
    bounds = [_mean(s.get("hwcap", {}).get("bound_over_static", [])) for s in summaries]
    ax1.scatter(x, [math.nan if b is None else b for b in bounds], marker="_", s=300, color="k",
                label="bound: every request sent answered in time")  # fmt: skip
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.axhline(1.3, color="g", lw=0.8, ls="--", label="goal: median 1.3x")
    ax1.set_ylabel("goodput / static split")
    ax1.legend(fontsize=8)
    for j, arm in enumerate(MATRIX_ARMS):
        vals = [_mean(s.get(arm, {}).get("power_while_queued_over_budget", [])) for s in summaries]
        ax2.bar(x + (j - 1) * 0.27, [math.nan if v is None else v for v in vals], 0.27,
                label={"hwcap": "static split (hardware cap)"}.get(arm, arm))  # fmt: skip
    reach = [_mean(s.get("fleet", {}).get("reach_while_queued_over_budget", [])) for s in summaries]
    ax2.scatter(x, [math.nan if r is None else r for r in reach], marker="_", s=300, color="k",
                label="reach: queued members at their maximum")  # fmt: skip
    ax2.axhline(0.95, color="g", lw=0.8, ls="--", label="goal: 0.95")
    ax2.set_ylabel("summed power while work waits / budget")
    ax2.set_ylim(0, 1.1)
    ax2.legend(fontsize=8, ncol=4)
    ax2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ARGS_LEFT_OUT = ("func", "plan_for", "load_scale")


def write(
    a: argparse.Namespace, summaries: list[dict[str, Any]], raw: dict[str, Any]
) -> dict[str, Any]:
    doc = {"args": {k: str(v) for k, v in vars(a).items() if k not in ARGS_LEFT_OUT},
           "overall": overall(summaries), "cases": summaries}  # fmt: skip
    (a.out / "matrix.json").write_text(json.dumps(doc, indent=1))
    (a.out / "runs.json").write_text(json.dumps(raw, indent=1))
    (a.out / "table.md").write_text(table(summaries))
    return doc


async def run_once(arm: str, ns: argparse.Namespace, seed: int, log: Path) -> dict[str, Any]:
    """One run, again on new ports where a child could not bind its own: a port drawn free can
    be taken before the child binds it, and one such loss ended a whole matrix."""
    try:
        return await fleet_bench.run_arm(arm, ns, seed, log)
    except ChildFailed as exc:
        if "address already in use" not in str(exc):
            raise
        print(f"{arm} seed {seed}: a port was taken before its child bound it; again", flush=True)
        return await fleet_bench.run_arm(arm, ns, seed, log)


async def run_matrix(a: argparse.Namespace) -> int:
    cases = reduced_cases() if a.matrix == "reduced" else full_cases(a.seed)
    if a.cases:
        wanted = {x.strip() for x in a.cases.split(",")}
        cases = [c for i, c in enumerate(cases) if c.name in wanted or str(i) in wanted]
    a.out.mkdir(parents=True, exist_ok=True)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()] if a.arms else list(MATRIX_ARMS)
    summaries: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    doc: dict[str, Any] = {}
    for case in cases:
        ns = case_args(a, case)
        runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(a.repeats):  # arms interleaved: a slow spell on the machine hits all
            seed = a.seed + rep
            for arm in arms:
                if arm == "fleet-admission" and not case.admission_can_hold():
                    continue
                print(f"{case.name} {arm} seed {seed}", flush=True)
                log = a.out / "logs" / case.name / f"{arm}-{seed}"
                log.mkdir(parents=True, exist_ok=True)
                run = await run_once(arm, ns, seed, log)
                (log / "run.json").write_text(json.dumps(run))  # status rows, 1-s power
                runs.setdefault(arm, []).append(run)
                print(json.dumps(fleet_bench.brief(run)), flush=True)
        summaries.append(case_summary(case, runs, ns.load_scale))
        raw[case.name] = {arm: [fleet_bench.brief(r) for r in rs] for arm, rs in runs.items()}
        print(table(summaries[-1:]), flush=True)
        doc = write(a, summaries, raw)  # after every case: a cut-short run keeps what it had
    plot(summaries, a.out / "matrix.png")
    print(table(summaries))
    print(json.dumps(doc.get("overall", {}), indent=1))
    print(f"wrote {a.out / 'matrix.json'}, runs.json, table.md and matrix.png")
    return 0
