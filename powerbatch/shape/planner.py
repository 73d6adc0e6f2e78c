"""Receding-horizon power plan: per-second watts over the next 30-120 s, as one linear program.

Variables, per second k of the horizon H: planned power p_k, deferrable (low-class) power u_k,
interactive power deferred q_k, floor shortfall s_k, ramp slack r_k, and |p_k - L| as e_k
around a free flat level L. With i_k the watts the forecast interactive batch needs (the model's
power at the batch Little's law gives: arrival rate x service time) and m_k the model's marginal
watts per request there:

    minimise   Σ w_dev e_k + w_q q_k + w_floor s_k + w_ramp r_k - w_work (1 - ε k/H) u_k
    subject to p_k = i_k - q_k + u_k,           0 <= q_k <= i_k - idle
               p_k <= ceiling - margin
               p_k - p_{k-1} <= ramp_up + r_k,  p_{k-1} - p_k <= ramp_down + r_k   (p_{-1}: now)
               p_k + s_k >= floor
               Σ_{j<=k} u_j / m_j <= queued_low x S + λ_low x S x (k + 1)   (work that exists)
               -e_k <= p_k - L <= e_k

Serving deferrable work pays more (w_work) than its deviation costs (w_dev), so all of it is
served; *where* it goes is what flattens the profile: into troughs, paced by the ramps. L1, not
squared, deviation because the grid's complaint is swings, and an L1 cost leaves flat stretches
rather than spreading small wiggles everywhere; it also keeps the problem an LP that HiGHS
(scipy.optimize.linprog) solves in milliseconds, so no convex-optimisation package is needed.
Ramp and floor slacks keep the problem feasible from any starting power (over the ceiling, or a
floor with no work to hold it): the plan then says how far it must miss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import sparse
from scipy.optimize import linprog

W_DEV = 0.5  # per W·s away from the flat level
W_WORK = 1.0  # per W·s of deferrable work served (earlier slightly preferred: ε)
EARLY = 0.2
W_DEFER = 10.0  # per W·s of interactive work the plan would hold back
W_FLOOR = 2.0  # per W·s under the floor
W_RAMP = 100.0  # per W/s over a ramp limit


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the plan is made from; all forecasts are flat at the recent rate."""

    now_w: float  # measured 1-second power
    cap_w: float  # ceiling less margin
    idle_w: float  # the model's power at no work
    interactive_w: NDArray[np.float64]  # watts the forecast interactive batch needs, per second
    marginal_w: NDArray[np.float64]  # watts per request in flight there, per second
    deferrable_batch_s: NDArray[np.float64]  # cumulative low-class batch-seconds that exist by k
    ramp_up_w_per_s: float | None = None
    ramp_down_w_per_s: float | None = None
    floor_w: float | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    t0_s: float  # the plan's second 0 starts here
    power_w: NDArray[np.float64]
    deferrable_w: NDArray[np.float64]
    flat_w: float
    solve_s: float
    status: str  # "optimal", or linprog's message

    def at(self, t_s: float) -> float | None:
        """The planned power for the second holding `t_s`; None outside the horizon."""
        k = int((t_s - self.t0_s) // 1.0)
        if self.status == "optimal" and 0 <= k < len(self.power_w):
            return float(self.power_w[k])
        return None


def solve(x: PlanInputs, t0_s: float = 0.0) -> Plan:
    """The plan for `x`. A failed solve returns a plan that reads None: no plan, reactive only."""
    started = time.perf_counter()
    h = len(x.interactive_w)
    i_w = np.minimum(np.asarray(x.interactive_w, float), x.cap_w)
    m_w = np.maximum(np.asarray(x.marginal_w, float), 1e-3)
    n = 6 * h + 1  # p, u, q, s, r, e, L
    P, U, Q, S, R, E = (slice(j * h, (j + 1) * h) for j in range(6))
    L = 6 * h
    c = np.zeros(n)
    c[U] = -W_WORK * (1.0 - EARLY * np.arange(h) / h)
    c[Q], c[S], c[R], c[E] = W_DEFER, W_FLOOR, W_RAMP, W_DEV
    eye = sparse.identity(h, format="csr")
    zero = sparse.csr_matrix((h, h))
    col = sparse.csr_matrix(np.ones((h, 1)))
    zcol = sparse.csr_matrix((h, 1))

    def row(
        p: Any = zero,
        u: Any = zero,
        q: Any = zero,
        s: Any = zero,
        r: Any = zero,
        e: Any = zero,
        lv: Any = zcol,
    ) -> Any:
        return sparse.hstack([p, u, q, s, r, e, lv])

    # p - u + q = i
    a_eq = row(p=eye, u=-eye, q=eye)
    b_eq = i_w
    blocks, rhs = [], []
    diff = sparse.diags([np.ones(h), -np.ones(h - 1)], [0, -1], format="csr")  # p_k - p_{k-1}
    first = np.zeros(h)
    first[0] = x.now_w
    if x.ramp_up_w_per_s:
        blocks.append(row(p=diff, r=-eye))
        rhs.append(x.ramp_up_w_per_s + first)
    if x.ramp_down_w_per_s:
        blocks.append(row(p=-diff, r=-eye))
        rhs.append(x.ramp_down_w_per_s - first)
    if x.floor_w is not None:
        blocks.append(row(p=-eye, s=-eye))  # -(p + s) <= -floor
        rhs.append(np.full(h, -x.floor_w))
    cum = sparse.csr_matrix(np.tril(np.ones((h, h))) / m_w[None, :])
    blocks.append(row(u=cum))
    rhs.append(np.asarray(x.deferrable_batch_s, float))
    blocks.append(row(p=eye, e=-eye, lv=-col))  # p - L <= e
    rhs.append(np.zeros(h))
    blocks.append(row(p=-eye, e=-eye, lv=col))  # L - p <= e
    rhs.append(np.zeros(h))
    bounds = (
        [(0.0, x.cap_w)] * h
        + [(0.0, None)] * h
        + [(0.0, max(float(v) - x.idle_w, 0.0)) for v in i_w]
        + [(0.0, None)] * (3 * h)
        + [(0.0, x.cap_w)]
    )
    res = linprog(
        c,
        A_ub=sparse.vstack(blocks, format="csr"),
        b_ub=np.concatenate(rhs),
        A_eq=a_eq.tocsr(),
        b_eq=b_eq,
        bounds=bounds,
        method="highs",
    )
    elapsed = time.perf_counter() - started
    if res.status != 0 or res.x is None:
        return Plan(t0_s, i_w, np.zeros(h), float(np.mean(i_w)), elapsed, str(res.message))
    sol = res.x
    return Plan(t0_s, sol[P], sol[U], float(sol[L]), elapsed, "optimal")


def forecast(
    *,
    horizon_s: int,
    curve_w: NDArray[np.float64],
    min_batch: int,
    interactive_rps: float,
    deferrable_rps: float,
    service_s: float,
    queued_interactive: int,
    queued_deferrable: int,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Interactive watts, marginal watts per request and cumulative deferrable batch-seconds.

    Little's law: a class arriving at λ per second with service time S keeps λ S in flight. The
    interactive backlog is served over the first S seconds; the deferrable work that exists by
    second k is the queue plus what arrives until then, each needing S batch-seconds.
    """
    k = np.arange(horizon_s, dtype=float)
    backlog = np.where(k < max(service_s, 1.0), queued_interactive, 0.0)
    batch = interactive_rps * service_s + backlog
    hi = min_batch + len(curve_w) - 1
    b = np.clip(batch, min_batch, hi)
    idx = np.rint(b).astype(int) - min_batch
    power = np.interp(b, np.arange(min_batch, hi + 1), curve_w)
    slope = np.gradient(curve_w) if len(curve_w) > 1 else np.ones(1)
    marginal = np.maximum(slope[idx], 1e-3)
    available = (queued_deferrable + deferrable_rps * (k + 1.0)) * service_s
    return power, marginal, available
