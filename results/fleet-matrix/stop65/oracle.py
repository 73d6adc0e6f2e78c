"""A clairvoyant follower of the load, in virtual time: what hardware caps that knew every
member's arrival rate at each instant would serve, beside the static split, on a matrix case.

Each member's plan is the one a real run of `powerbatch fleet-bench --matrix full --seed S`
sends (`fleet_matrix.member_plan` at the case's measured scale). Every `STEP_S` of virtual time
each member's cap is set to a blend of its static split and a need-proportional share: its
need `capacity.need_w` (the lowest limit whose capped capacity covers its rate then), clipped
to its device's range, with the part above the device's lowest limit scaled so that the caps
sum to the budget (a surplus spread evenly up to each TDP). `beta` = 0 is the split itself;
the best `beta` over `BETAS` is the oracle, knowing the rates at once (lag 0) or 1 s late.
Each member runs through `capacity.replay` (the benches' `SimEngine`) with its cap schedule. No
proxy, network or CPU stands between: its ratio over the split is a reach for a law that
follows the arrivals, not a bound on every law (one that drains a backlog can do better).

    PYTHONPATH=. python results/fleet-matrix/stop65/oracle.py SEED CASE[,CASE...] [DURATION_S]
"""

import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from powerbatch.cli.fleet_bench import split_limit_w
from powerbatch.cli.fleet_matrix import (
    TPOT_SLO_S,
    TTFT_SLO_S,
    Case,
    _means,
    full_cases,
    load_scale,
    member_phases,
    member_plan,
)
from powerbatch.fleet.allocate import Bid, _spread
from powerbatch.load.profile import Phase, PlannedRequest
from powerbatch.sim.capacity import _within_slo, need_w, replay
from powerbatch.sim.engine import SimEngine
from powerbatch.sim.plants import Plant

STEP_S = 0.25
BETAS = (0.0, 0.25, 0.5, 0.75, 1.0)
LAGS_S = (0.0, 1.0)


def rate_at(phases: Sequence[Phase], t_s: float) -> float:
    ends = np.cumsum([ph.duration_s for ph in phases])
    k = min(int(np.searchsorted(ends, t_s, "right")), len(phases) - 1)
    return phases[k].rate_rps


def follow(needs: list[float], lo: list[float], hi: list[float], budget_w: float) -> list[float]:
    """Needs within the devices' ranges, scaled above the lowest limits to fit the budget, or
    the surplus spread evenly up to each TDP (the allocator's `_spread`)."""
    need = [min(max(n, a), b) for n, a, b in zip(needs, lo, hi, strict=True)]
    if sum(need) > budget_w:
        over = [n - a for n, a in zip(need, lo, strict=True)]
        k = (budget_w - sum(lo)) / sum(over) if sum(over) > 0 else 0.0
        return [a + k * o for a, o in zip(lo, over, strict=True)]
    bids = {i: Bid(0.0, 0.0, a, b) for i, (a, b) in enumerate(zip(lo, hi, strict=True))}
    shares = _spread(dict(enumerate(need)), bids, budget_w)
    return [shares[i] for i in range(len(need))]


def run_member(
    plant: Plant, plan: list[PlannedRequest], limit_at: Callable[[float], float], seed: int
) -> int:
    """Answers within both SLOs when `plan` runs on the plant with its cap at `limit_at(t)`
    (`capacity.replay`, the cap reset every `STEP_S` of virtual time)."""

    def cap(t_s: float, eng: SimEngine, sent: object) -> None:
        eng.power_limit_w = limit_at(t_s)

    sent = replay(plant, limit_at(0.0), plan, seed=seed, every_s=STEP_S, each=cap)
    return sum(_within_slo(r, TTFT_SLO_S, TPOT_SLO_S) for r in sent)


class Oracle:
    """One case at its measured scale, on the plans of `seed`."""

    def __init__(self, case: Case, seed: int, duration_s: float) -> None:
        scale = load_scale(case, duration_s)
        self.case, self.seed, self.duration_s = case, seed, duration_s
        self.plants = case.plants()
        n, self.budget_w = case.members, case.budget_w()
        self.prompt, self.output = _means(scale.out_median)
        self.phases = [member_phases(case, i, scale.hot_rps[i], seed, duration_s) for i in range(n)]
        self.plans = [
            member_plan(case, i, scale.hot_rps[i], scale.out_median, seed, duration_s)
            for i in range(n)
        ]
        self.split = [split_limit_w(p, self.budget_w, n) for p in self.plants]
        self.lo = [p.profile.min_limit_w for p in self.plants]
        self.hi = [p.profile.tdp_w for p in self.plants]

    def caps_at(self, t_s: float, lag_s: float) -> list[float]:
        """The caps that follow the rates `lag_s` late (none sent after the load's end)."""
        late = t_s - lag_s
        rates = [rate_at(ph, max(late, 0.0)) if t_s < self.duration_s else 0.0
                 for ph in self.phases]  # fmt: skip
        needs = [need_w(p, r, self.prompt, self.output, tpot_slo_s=TPOT_SLO_S)
                 for p, r in zip(self.plants, rates, strict=True)]  # fmt: skip
        return follow(needs, self.lo, self.hi, self.budget_w)

    def goodput(self, lag_s: float, beta: float) -> int:
        grid = np.arange(0.0, self.duration_s + 120.0, STEP_S)
        caps = [self.caps_at(float(t), lag_s) for t in grid]
        total = 0
        for i, (plant, plan) in enumerate(zip(self.plants, self.plans, strict=True)):
            sched = [math.floor(((1 - beta) * self.split[i] + beta * c[i]) * 1000) / 1000
                     for c in caps]  # fmt: skip

            def limit_at(t_s: float, sched: list[float] = sched) -> float:
                return sched[min(int(t_s / STEP_S), len(sched) - 1)]

            total += run_member(plant, plan, limit_at, self.seed + i)
        return total


def main() -> None:
    seed = int(sys.argv[1])
    duration_s = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    cases = full_cases(seed)
    betas = " ".join(f"b{b:<4}" for b in BETAS)
    print(f"{'case':32s} {'split':>6s} {betas}  best(lag0) best(lag1)")
    for key in sys.argv[2].split(","):
        case = cases[int(key)] if key.isdigit() else next(c for c in cases if c.name == key)
        o = Oracle(case, seed, duration_s)
        base = max(o.goodput(0.0, 0.0), 1)
        by_lag = {lag: [o.goodput(lag, b) / base for b in BETAS] for lag in LAGS_S}
        ratios = " ".join(f"{r:5.2f}" for r in by_lag[0.0])
        best = " ".join(f"{max(by_lag[lag]):9.2f}" for lag in LAGS_S)
        print(f"{case.name:32s} {base / duration_s:6.2f} {ratios}  {best}", flush=True)


if __name__ == "__main__":
    main()
