"""The receding-horizon planner: constraints hold, deferrable work fills troughs, it is fast."""

from __future__ import annotations

import numpy as np
import pytest

from powerbatch.shape.planner import PlanInputs, forecast, solve

CURVE = 150.0 + 450.0 * (1.0 - np.exp(-np.arange(1, 257) / 60.0))


def inputs(h: int = 60, **kw: object) -> PlanInputs:
    k = np.arange(h)
    interactive = np.where((k >= 20) & (k < 35), 500.0, 250.0)  # a peak mid-horizon
    base: dict[str, object] = {
        "now_w": 250.0,
        "cap_w": 588.0,
        "idle_w": 150.0,
        "interactive_w": interactive,
        "marginal_w": np.full(h, 4.0),
        "deferrable_batch_s": np.full(h, 1_000.0),  # 4 kJ of deferrable work, all waiting now
    }
    base.update(kw)
    return PlanInputs(**base)  # type: ignore[arg-type]


def test_plan_keeps_ceiling_ramps_and_floor() -> None:
    x = inputs(ramp_up_w_per_s=15.0, ramp_down_w_per_s=15.0, floor_w=300.0)
    plan = solve(x)
    assert plan.status == "optimal"
    p = np.concatenate([[x.now_w], plan.power_w])
    assert p.max() <= x.cap_w + 1e-6
    assert np.diff(p).max() <= 15.0 + 1e-6
    assert np.diff(p).min() >= -15.0 - 1e-6
    # From 250 W the ramp reaches the floor in 4 s; 4 kJ of low work then holds it.
    assert plan.power_w[3:].min() >= 300.0 - 1e-6


def test_deferrable_work_fills_the_troughs_not_the_peak() -> None:
    x = inputs()
    plan = solve(x)
    served = (plan.deferrable_w / x.marginal_w).sum()
    assert served == pytest.approx(1_000.0, rel=1e-3)  # all the work that exists is served
    peak = slice(20, 35)
    assert plan.deferrable_w[peak].sum() < 0.05 * plan.deferrable_w.sum()
    # Flatter than the interactive load alone.
    assert (
        np.abs(plan.power_w - plan.power_w.mean()).sum()
        < np.abs(x.interactive_w - x.interactive_w.mean()).sum()
    )


def test_plan_stays_feasible_from_over_the_ceiling() -> None:
    plan = solve(inputs(now_w=700.0, ramp_down_w_per_s=10.0))
    assert plan.status == "optimal"
    assert plan.power_w.max() <= 588.0 + 1e-6  # the ceiling binds; the ramp gives way


@pytest.mark.parametrize("horizon_s", [30, 60, 120])
def test_solve_fits_well_inside_a_replan(horizon_s: int) -> None:
    i, m, a = forecast(
        horizon_s=horizon_s,
        curve_w=CURVE,
        min_batch=1,
        interactive_rps=5.0,
        deferrable_rps=3.0,
        service_s=8.0,
        queued_interactive=10,
        queued_deferrable=40,
    )
    x = PlanInputs(300.0, 588.0, 150.0, i, m, a, 20.0, 20.0, 350.0)
    best = min(solve(x).solve_s for _ in range(3))
    assert best < 0.5  # measured ~10/15/30 ms on one shared core; a replan is every 5 s


def test_forecast_follows_littles_law() -> None:
    i, m, a = forecast(
        horizon_s=30,
        curve_w=CURVE,
        min_batch=1,
        interactive_rps=2.0,
        deferrable_rps=1.0,
        service_s=5.0,
        queued_interactive=0,
        queued_deferrable=4,
    )
    assert i[0] == pytest.approx(CURVE[10 - 1])  # 2 req/s x 5 s = batch 10
    assert a[0] == pytest.approx((4 + 1) * 5.0)
    assert np.all(np.diff(a) == pytest.approx(5.0))
    assert np.all(m > 0)
