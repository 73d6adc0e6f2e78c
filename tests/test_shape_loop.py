"""Shape in the host: the queue's deferrable modes, the per-second accounting, the planner task."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from powerbatch.admission import AdmissionQueue
from powerbatch.control import AdmissionLimits, ControlConfig, QueueCounts
from powerbatch.control.config import ShapeSettings
from powerbatch.control.controller import Controller
from powerbatch.proxy import Governor, ProxyMetrics
from powerbatch.shape.runner import PlanRunner
from powerbatch.telemetry import PowerMonitor, PowerSample


class Timed:
    name = "timed"

    def __init__(self) -> None:
        self.t = 1000.0
        self.w = 300.0

    async def read(self) -> PowerSample:
        return PowerSample(self.t, self.w)

    async def close(self) -> None:
        return None


def governor(src: Timed, shape: ShapeSettings, *, planned: bool = False, **kw: Any) -> Governor:
    config = ControlConfig(ceiling_w=1000.0, warmup_s=0.0)
    queue = AdmissionQueue(AdmissionLimits(8, config.max_kv_tokens, None), valley_fill=True)
    monitor = PowerMonitor(src, interval_s=0.1, stale_after_s=1.0, clock=lambda: src.t)
    controller = Controller(config, shape=shape)
    if planned:
        kw["plan"] = PlanRunner(shape, controller, queue.counts, clock=lambda: src.t)
    return Governor(controller, queue, monitor, ProxyMetrics(), **kw)


def run_seconds(gov: Governor, src: Timed, watts: list[float]) -> None:
    """Each entry is one second of constant power, polled at 10 Hz and ticked at 5 Hz."""
    for w in watts:
        for i in range(10):
            src.t += 0.1
            src.w = w
            asyncio.run(gov.monitor.poll_once())
            if i % 2:
                gov.tick(src.t)


def test_queue_holds_and_releases_deferrable_work() -> None:
    async def go() -> list[int]:
        q = AdmissionQueue(AdmissionLimits(10, 10**9, None), valley_fill=True)
        seen = []
        slots = [await q.admit("high", 1, 1) for _ in range(9)]  # one place left
        low = asyncio.create_task(q.admit("low", 1, 1))
        await asyncio.sleep(0)
        seen.append(q.in_flight)  # default: the reserve keeps the last place from low work
        q.set_deferrable("hold")
        slots[0].release()
        await asyncio.sleep(0)
        seen.append(q.in_flight)  # hold: low work waits while anything runs
        q.set_deferrable("release")
        await asyncio.sleep(0)
        seen.append(q.in_flight)  # release: no reserve
        assert low.done()
        return seen

    assert asyncio.run(go()) == [9, 8, 9]


def test_status_and_metrics_count_ramp_violations_and_floor_shortfall() -> None:
    src = Timed()
    gov = governor(src, ShapeSettings(ramp_up_w_per_s=50.0, ramp_down_w_per_s=50.0, floor_w=400))
    run_seconds(gov, src, [300.0] * 3 + [420.0] * 3 + [300.0] * 3)
    shape = gov.status()["shape"]
    assert shape["ramp_violations"] == {"up": 1, "down": 1}
    # The 120 W step lands across two whole-second samples of the 1-second mean.
    assert 50.0 < shape["largest_ramp_w_per_s"]["up"] <= 120.0 + 1e-6
    reg = gov.metrics.registry
    assert reg.get_sample_value("powerbatch_shape_ramp_violations_total", {"direction": "up"}) == 1
    # No deferrable work waited, so being under the floor is no shortfall.
    assert shape["floor_shortfall_s"] == 0
    assert reg.get_sample_value("powerbatch_shape_floor_shortfall_seconds_total") == 0


def test_planner_task_plans_and_the_tick_follows_it() -> None:
    src = Timed()
    shape = ShapeSettings(ramp_up_w_per_s=20.0, floor_w=350.0, planner="on", plan_horizon_s=30)
    gov = governor(src, shape, planned=True)
    runner = gov.loop.plan
    assert isinstance(runner, PlanRunner)
    run_seconds(gov, src, [300.0] * 3)
    assert asyncio.run(runner.replan()) is None  # the first call starts the rate window
    run_seconds(gov, src, [300.0])
    plan = asyncio.run(runner.replan())
    assert plan is not None and plan.status == "optimal"
    assert len(plan.power_w) == 30
    assert plan.power_w[0] <= 300.0 + 20.0 + 1e-6  # the ramp from the measured power
    run_seconds(gov, src, [300.0])
    d = gov.last
    assert d is not None
    planned = runner.plan_w(src.t)
    assert planned is not None and d.power_w is not None
    assert d.deferrable == ("hold" if d.power_w > planned else "release")
    status = gov.status()["shape"]
    assert status["plan"]["status"] == "optimal"
    assert status["planned_w"] == pytest.approx(planned)
    assert gov.metrics.registry.get_sample_value("powerbatch_shape_plan_solve_seconds") > 0


def test_first_plan_waits_for_an_arrival_rate() -> None:
    """A plan from one sample of the counts would see no arrivals, put the interactive load at
    idle, and pull power down to it; the runner waits until the counts span a second."""
    src = Timed()
    shape = ShapeSettings(ramp_down_w_per_s=30.0, planner="on", plan_horizon_s=30)
    gov = governor(src, shape)
    run_seconds(gov, src, [300.0] * 3)
    arrived = [0]

    def counts() -> QueueCounts:
        n = arrived[0]
        return QueueCounts({"high": n, "low": 0}, n, 8, {"high": 0, "low": 0})

    runner = PlanRunner(shape, gov.controller, counts, clock=lambda: src.t)
    assert runner.inputs(src.t) is None
    arrived[0] = 20  # 10 requests a second over the next 2 s
    x = runner.inputs(src.t + 2.0)
    assert x is not None
    assert x.interactive_w[0] > x.idle_w + 10.0  # ten requests in flight are work, not idle
