"""What the shape laws achieved, second by second: ramp violations, floor shortfall, plan vs meter.

Counted on whole seconds of the 1-second power the controller acts on (the quantity a ramp
limit is written in), so one slow ramp is one violation per second, not one per tick. The
tracker watches the control loop's ticks (a `TickObserver`); both hosts add one.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from powerbatch.control.config import ShapeSettings
from powerbatch.control.metrics import ShapeMetrics
from powerbatch.control.types import Decision, Deferrable, Observation


class PlanSummary(Protocol):
    def summary(self) -> dict[str, Any]: ...


class ShapeTracker:
    """Per-second accounting of the shape laws, for /status and the metrics."""

    def __init__(
        self,
        settings: ShapeSettings,
        metrics: ShapeMetrics | None = None,
        plan: PlanSummary | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.plan_source = plan
        self._second: int | None = None
        self._last_w: float | None = None
        self.violations = {"up": 0, "down": 0}
        self.largest = {"up": 0.0, "down": 0.0}
        self.shortfall_w = 0.0
        self.shortfall_s = 0
        self.planned_w: float | None = None
        self.measured_w: float | None = None
        self.deferrable = "default"
        self.plan: dict[str, Any] | None = None

    def observe(self, obs: Observation, d: Decision) -> None:
        if self.plan_source is not None:
            self.note_plan(self.plan_source.summary())
        plan_w, queued_deferrable = obs.plan_w, obs.queued_deferrable
        self.planned_w, self.deferrable = plan_w, d.deferrable
        m = self.metrics
        if m is not None:
            m.power_w.labels("planned").set(math.nan if plan_w is None else plan_w)
            for mode in Deferrable:
                m.deferrable.labels(mode).set(1.0 if mode == d.deferrable else 0.0)
        second = math.floor(d.t_s)
        if second == self._second:
            return
        self._second = second
        power_w = d.power_w
        if power_w is None or not math.isfinite(power_w):
            self._last_w = None
            return
        self.measured_w = power_w
        sh = self.settings
        if self._last_w is not None:
            change = power_w - self._last_w
            direction = "up" if change > 0 else "down"
            self.largest[direction] = max(self.largest[direction], abs(change))
            limit = sh.ramp_up if direction == "up" else sh.ramp_down
            over = limit is not None and abs(change) > limit
            if over:
                self.violations[direction] += 1
            if m is not None:
                m.largest_ramp.labels(direction).set(self.largest[direction])
                if over:
                    m.ramp_violations.labels(direction).inc()
        self._last_w = power_w
        short = 0.0
        if sh.floor_w is not None and queued_deferrable > 0:
            short = max(sh.floor_w - power_w, 0.0)
        self.shortfall_w = short
        if short > 0:
            self.shortfall_s += 1
        if m is not None:
            m.power_w.labels("measured").set(power_w)
            m.floor_shortfall_w.set(short)
            if short > 0:
                m.floor_shortfall_s.inc()

    def note_plan(self, summary: dict[str, Any]) -> None:
        self.plan = summary
        if self.metrics is not None and summary.get("solve_s") is not None:
            self.metrics.plan_solve_s.set(summary["solve_s"])

    def fail_safe(self) -> None:
        """Nothing to do: a failed tick has no second to count."""

    def status_extra(self) -> dict[str, Any]:
        return {"shape": self.status()}

    def status(self) -> dict[str, Any]:
        sh = self.settings
        return {
            "ramp_up_w_per_s": sh.ramp_up,
            "ramp_down_w_per_s": sh.ramp_down,
            "floor_w": sh.floor_w,
            "planner": sh.planner,
            "ramp_violations": dict(self.violations),
            "largest_ramp_w_per_s": dict(self.largest),
            "floor_shortfall_w": self.shortfall_w,
            "floor_shortfall_s": self.shortfall_s,
            "planned_w": self.planned_w,
            "measured_w": self.measured_w,
            "deferrable": self.deferrable,
            "plan": self.plan,
        }
