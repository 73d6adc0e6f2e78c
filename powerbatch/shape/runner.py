"""The planner off the tick: a small task that gathers inputs on the loop and solves in a thread.

Inputs are read on the event loop (the model is not thread-safe; the queue is the loop's), the
LP is solved with `asyncio.to_thread` (tens of milliseconds: it must not delay a 200 ms tick),
and the plan is swapped in whole. The controller reads `plan_w(t)` each tick; a plan older than
its horizon reads None, so a stuck planner leaves the reactive controller in charge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from powerbatch.control import QueueCounts
from powerbatch.control.config import ShapeSettings
from powerbatch.control.controller import Controller
from powerbatch.shape.planner import Plan, PlanInputs, forecast, solve

log = logging.getLogger("powerbatch.shape")

MIN_RATE_S = 1.0
"""The shortest span of counts the arrival and completion rates are taken over, s."""


class PlanRunner:
    def __init__(
        self,
        settings: ShapeSettings,
        controller: Controller,
        counts: Callable[[], QueueCounts],
        *,
        deferrable: str = "low",
        window_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.controller = controller
        self.counts = counts
        self.deferrable = deferrable
        self.window_s = window_s
        self.clock = clock
        self.plan: Plan | None = None
        self._summary: dict[str, Any] = {}
        self._history: deque[tuple[float, QueueCounts]] = deque()

    def plan_w(self, t_s: float) -> float | None:
        return self.plan.at(t_s) if self.plan is not None else None

    def summary(self) -> dict[str, Any]:
        return self._summary

    def inputs(self, t_s: float) -> PlanInputs | None:
        """The LP's inputs now, or None before the controller has a power reading or the
        counts span `MIN_RATE_S` (the first call only starts the rate window: a plan from no
        arrivals would put the interactive load at idle and pull the plan down to it)."""
        ctl, sh = self.controller, self.settings
        now = self.counts()
        hist = self._history
        hist.append((t_s, now))
        while len(hist) > 2 and hist[1][0] <= t_s - self.window_s:
            hist.popleft()
        d = ctl.last
        if d is None or d.power_w is None or d.state not in ("enforce", "observe"):
            return None
        t0, then = hist[0]
        if t_s - t0 < MIN_RATE_S - 1e-6:  # five 0.2-s ticks may sum to a hair under 1 s
            return None
        dt = t_s - t0
        rate = {c: (n - then.arrived.get(c, 0)) / dt for c, n in now.arrived.items()}
        done_rps = (now.completed - then.completed) / dt
        service_s = now.in_flight / done_rps if done_rps > 0 else 10.0
        service_s = float(np.clip(service_s, 1.0, 120.0))
        # The meter for here, the model for there: the model's curve shifted to pass through
        # the measured power at the batch in flight (its level may be off, its slope less so).
        curve = ctl.power_curve()
        lo = ctl.config.min_batch
        here = int(np.clip(now.in_flight, lo, lo + len(curve) - 1)) - lo
        curve = np.maximum(curve + (d.power_w - float(curve[here])), 0.0)
        interactive = [c for c in now.arrived if c != self.deferrable]
        h = int(sh.plan_horizon_s)
        inter_w, marginal_w, avail = forecast(
            horizon_s=h,
            curve_w=curve,
            min_batch=ctl.config.min_batch,
            interactive_rps=sum(rate[c] for c in interactive),
            deferrable_rps=rate.get(self.deferrable, 0.0),
            service_s=service_s,
            queued_interactive=sum(now.queued.get(c, 0) for c in interactive),
            queued_deferrable=now.queued.get(self.deferrable, 0),
        )
        slope0 = float(curve[1] - curve[0]) if len(curve) > 1 else 0.0
        cap_w = d.ceiling_w - ctl.config.margin_at(d.ceiling_w)
        return PlanInputs(
            now_w=d.power_w,
            cap_w=cap_w,
            idle_w=max(float(curve[0]) - slope0 * ctl.config.min_batch, 0.0),
            interactive_w=inter_w,
            marginal_w=marginal_w,
            deferrable_batch_s=avail,
            ramp_up_w_per_s=sh.ramp_up,
            ramp_down_w_per_s=sh.ramp_down,
            floor_w=sh.floor_w,
        )

    async def replan(self) -> Plan | None:
        t_s = self.clock()
        x = self.inputs(t_s)
        if x is None:
            return None
        plan = await asyncio.to_thread(solve, x, t_s)
        self.plan = plan
        self._summary = {
            "t0_s": plan.t0_s,
            "horizon_s": len(plan.power_w),
            "solve_s": plan.solve_s,
            "status": plan.status,
            "flat_w": plan.flat_w,
            "next_w": [round(float(w), 1) for w in plan.power_w[:10]],
        }
        return plan

    async def run_forever(self) -> None:
        """Replan every `plan_every_s`; until the first plan (warm-up, no rate yet), every
        second, so that the reactive controller is not left without a plan for a whole period."""
        every_s = self.settings.plan_every_s
        while True:
            plan = None
            try:
                plan = await self.replan()
            except Exception:  # a failed plan leaves the reactive controller in charge
                log.exception("shape planner failed; the reactive controller holds")
                self.plan = None
            await asyncio.sleep(every_s if plan is not None else min(MIN_RATE_S, every_s))


def plan_runner(
    settings: ShapeSettings, controller: Controller, counts: Callable[[], QueueCounts]
) -> PlanRunner | None:
    """A host's planner, or None when it is off. `counts` is the host's queue: the proxy's
    admission queue (`AdmissionQueue.counts`), the engine's steps in the vLLM plugin."""
    if settings.planner != "on":
        return None
    return PlanRunner(settings, controller, counts)
