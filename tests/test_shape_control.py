"""The reactive controller's shape laws: ramp limits, the floor and following a plan."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from powerbatch.control import ControlConfig, LatencySnapshot, Observation
from powerbatch.control.config import ShapeSettings
from powerbatch.control.controller import Controller
from powerbatch.estimate import Features


def plant(n: float) -> float:
    return 150.0 + 4.0 * n


def drive(
    shape: ShapeSettings,
    demand: Callable[[float], int],
    *,
    seconds: float = 80.0,
    ceiling_w: float | Callable[[float], float] = 1_000.0,
    latency: Callable[[float], LatencySnapshot | None] = lambda t: None,
    deferrable: int = 0,
    plan_w: float | None = None,
) -> tuple[np.ndarray, list[str], list[float]]:
    """5 Hz ticks; power follows the admitted batch; the controller sees the 1-s mean.

    Returns the 1-s power at each whole second, each decision's deferrable mode and target.
    """
    rng = np.random.default_rng(0)
    cfg = ControlConfig(ceiling_w=1_000.0, max_batch=256, tpot_slo_s=0.1)
    ctl = Controller(cfg, shape=shape)
    limit = cfg.initial_batch
    window: deque[float] = deque(maxlen=5)
    per_s, modes, targets = [], [], []
    for i in range(int(seconds * 5)):
        t = i / 5
        batch = min(limit, demand(t))
        window.append(plant(batch) + rng.normal(0, 1.0))
        p1 = float(np.mean(window))
        if i % 5 == 4:
            per_s.append(p1)
        ceiling = ceiling_w(t) if callable(ceiling_w) else ceiling_w
        d = ctl.tick(
            Observation(
                t_s=t,
                power_w=p1,
                sensor_ok=True,
                features=Features(batch, 900.0 * batch, 40.0 * batch, 30.0 * batch),
                in_flight=batch,
                queued=max(demand(t) - batch, 0),
                latency=latency(t),
                ceiling_w=ceiling,
                queued_deferrable=deferrable,
                plan_w=plan_w,
            )
        )
        limit = d.enforced.max_requests
        modes.append(d.deferrable)
        targets.append(d.target_w)
    return np.asarray(per_s), modes, targets


def step_demand(t: float) -> int:
    return 5 if t < 30 else 150


def test_ramp_up_limits_the_rise_of_one_second_power() -> None:
    free, _, _ = drive(ShapeSettings(), step_demand)
    limited, _, _ = drive(ShapeSettings(ramp_up_w_per_s=30.0), step_demand, seconds=100)
    # Unshaped, the burst lands in a few seconds; shaped, each second rises at most the ramp
    # (plus a little for the meter's noise and one tick of lag).
    assert np.diff(free).max() > 100.0
    assert np.diff(limited).max() <= 30.0 * 1.35
    # ... and it still gets there: the ramp paces growth, it does not cap it.
    assert limited[-1] > 0.95 * free[-1]


def test_ramp_down_slows_a_latency_shrink_but_the_ceiling_wins() -> None:
    slow = LatencySnapshot(ttft_p95_s=0.1, tpot_p95_s=0.3, samples=100, ttft_by_class_s={})
    lat = lambda t: slow if t >= 40 else None  # noqa: E731

    free, _, _ = drive(ShapeSettings(), lambda t: 150, latency=lat)
    limited, _, _ = drive(ShapeSettings(ramp_down_w_per_s=20.0), lambda t: 150, latency=lat)
    assert -np.diff(free[38:]).max() < -60.0 or np.diff(free[38:]).min() < -60.0
    assert np.diff(limited[38:]).min() >= -20.0 * 1.35

    # A ceiling that drops under the power: the cut is not paced.
    ceiling = lambda t: 1_000.0 if t < 40 else 400.0  # noqa: E731
    cut, _, _ = drive(ShapeSettings(ramp_down_w_per_s=20.0), lambda t: 150, ceiling_w=ceiling)
    assert cut[45:].max() <= 400.0
    assert np.diff(cut[38:]).min() < -60.0


def test_floor_releases_deferrable_work_only_while_it_waits_and_power_is_under() -> None:
    shape = ShapeSettings(floor_w=300.0)
    _, modes, _ = drive(shape, lambda t: 10, seconds=20, deferrable=5)  # ~190 W < floor
    assert modes[-1] == "release"
    _, modes, _ = drive(shape, lambda t: 10, seconds=20, deferrable=0)
    assert set(modes) == {"default"}
    _, modes, _ = drive(shape, lambda t: 60, seconds=20, deferrable=5)  # ~390 W > floor
    assert modes[-1] == "default"


def test_plan_stops_growth_and_holds_deferrable_work_above_it() -> None:
    power, modes, targets = drive(ShapeSettings(), lambda t: 150, seconds=40, plan_w=500.0)
    assert power[-5:].max() < 560.0  # growth stops at the plan, not the 1 kW ceiling
    assert min(targets[-50:]) > 900.0  # ... without lowering the target (no forced step down)
    assert modes[-1] in ("hold", "release")
    _, modes, _ = drive(ShapeSettings(), lambda t: 150, seconds=40, plan_w=900.0)
    assert modes[-1] == "release"  # under the plan: deferrable work may fill up to it
