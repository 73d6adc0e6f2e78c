"""A member's bid from its own control loop (docs/fleet.md, "Allocation: equal marginal value").

* demand D, requests in flight plus queued: it rises at once and falls with time constant
  `DEMAND_TAU_S`, so a light load's swings do not move the share;
* want W: the power model at the last per-request shape scaled to D; while a device limit holds
  the member (meter at `PINNED_FRAC` of it or more) with work, the meter and a model taught
  there under-read the demand, and W is the device's highest limit;
* needy: work waits (beyond `QUEUE_MIN` / `QUEUE_FRAC` of the batch), or its device limit
  holds it (or a little work waits) while its p95 TTFT or time per token is past `RISK_FRAC`
  of its SLO: more watts would buy goodput. A member held by its limit whose latency is
  measured well inside its SLOs (both p95s known and under `RISK_FRAC`) slows as a capped
  server does and loses nothing by slowing a little more: it wants `GIVE_FRAC` less than it
  draws, so its share steps down while its latency allows. One whose latency is not yet
  measured (too few answers in the window) gives nothing: it has not shown it can spare a
  watt. Nor does one whose work (in flight plus queued) is above the demand it last bid
  (which holds its recent highs): its arrivals are outrunning it, and the window's p95s, timed
  on requests as they end, show that a request's length later; a member that gave then bid its
  capped draw down while its batch grew (docs/fleet.md, stop 34). A held member that does not
  give bids the device's highest limit (want, above), so its fair floor is its whole split: a
  member lent out under its split that bid its capped draw plus headroom climbed back only
  `HEADROOM_FRAC` a period (stop 36). Any other member wants what it draws (or its model's
  demand, if more) plus `HEADROOM_FRAC`;
* value_per_w = 2 D / W (the modelled goodput at W is D);
* bounds: with a device limit, its range (the lowest limit holds any share above it, a share
  above the highest is never drawn); without, floor_w = P(shape * min_batch) (admission's
  smallest step is one request: less cannot be held) and max_w the GPUs' highest draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING

from powerbatch.estimate import Features
from powerbatch.fleet.lowering import Meter
from powerbatch.fleet.member import MemberSignals

if TYPE_CHECKING:  # only its public predict_w and device_limit_bounds_w are used
    from powerbatch.control.loop import ControlLoop

PINNED_FRAC = 0.95  # measured power at this share of the device limit or more: held by it
DEMAND_TAU_S = 5.0  # how slowly the demand in the bid falls
HEADROOM_FRAC = 0.15  # a member with nothing waiting wants this much over what it draws
GIVE_FRAC = 0.15  # a member held by its limit inside its SLOs wants this much less than it draws
RISK_FRAC = 0.5  # p95 latency over this share of its SLO: the member has no time to give
QUEUE_MIN, QUEUE_FRAC = 2, 0.25  # work waiting beyond this many, or this share of the batch


class Latency(Enum):
    """A member's p95 TTFT and time per token against `RISK_FRAC` of their SLOs."""

    AT_RISK = "at_risk"  # either measured p95 is over
    INSIDE = "inside"  # both measured, both under
    UNMEASURED = "unmeasured"  # too few answers in the window to say


class LoopSignals:
    """Callable: the bid, computed when the member publishes (once a period, off the tick)."""

    def __init__(
        self, loop: ControlLoop, queued_by_class: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.loop = loop
        self.queued_by_class = queued_by_class
        self._shape: Features | None = None  # the last per-request shape seen under load
        self._demand: tuple[float, float] | None = None  # (t_s, demand as bid)

    def __call__(self) -> MemberSignals:
        loop = self.loop
        rec = loop.history[-1] if loop.history else None
        if rec is None:
            return MemberSignals()
        by_class = self.queued_by_class() if self.queued_by_class else {"normal": rec.queued}
        work = float(rec.in_flight + rec.queued)
        rising = self._demand is not None and work > self._demand[1]
        demand = self._smoothed(rec.t_s, work)
        f = rec.features
        if f.batch >= 1:
            self._shape = f.per_request()
        want, floor, most = 0.0, 0.0, math.inf
        shape = self._shape
        bounds = loop.device_limit_bounds_w()
        if bounds is not None:  # the limit holds any share in the device's range
            floor, most = bounds
        elif loop.controller.config.max_w:  # admission alone: up to what the GPUs can draw
            most = float(loop.controller.config.max_w)
        if shape is not None:
            want = loop.predict_w(shape.scaled(float(demand)))
            if bounds is None:
                floor = loop.predict_w(shape.scaled(float(loop.controller.config.min_batch)))
        limit_w, power_w = rec.power_limit_w or 0.0, rec.power_w or 0.0
        pinned = bool(demand > 0 and limit_w > 0 and power_w >= PINNED_FRAC * limit_w and bounds)
        queued = sum(by_class.values())
        waiting = queued > max(QUEUE_MIN, QUEUE_FRAC * rec.in_flight)
        latency = self._latency()
        needy = waiting or ((pinned or queued > 0) and latency is Latency.AT_RISK)
        if needy and pinned and bounds:
            want = max(want, bounds[1])  # held by the limit: it would draw more than it may
        elif pinned and latency is Latency.INSIDE and not rising:  # held, measured inside, and
            # its work not above the demand it last bid: it can give
            want = power_w * (1.0 - GIVE_FRAC)
        elif pinned and bounds:  # held, and not shown it can spare a watt: its capped draw
            # says nothing of its demand, so it bids as a held member at risk does
            want = max(want, bounds[1])
        elif not needy:  # all it has is served: what it draws, and room for a few more
            want = max(want, power_w) * (1.0 + HEADROOM_FRAC)
        value = 2.0 * demand / want if demand > 0 and want > 0 else 0.0
        return MemberSignals(
            power_w=rec.power_w,
            in_flight=rec.in_flight,
            queued_by_class=by_class,
            value_per_w=max(value, 0.0),
            want_w=max(want, 0.0),
            floor_w=max(floor, 0.0),
            max_w=most,
            needy=needy,
        )

    def _latency(self) -> Latency:
        """p95 TTFT and time per token against `RISK_FRAC` of their SLOs (the host's window)."""
        loop = self.loop
        snap = loop.features.latency(loop.clock())
        if snap is None:
            return Latency.UNMEASURED
        cfg = loop.controller.config
        ttft, tpot = snap.ttft_p95_s, snap.tpot_p95_s
        if (ttft is not None and ttft > RISK_FRAC * cfg.ttft_slo_s) or (
            tpot is not None and tpot > RISK_FRAC * cfg.tpot_slo_s
        ):
            return Latency.AT_RISK
        return Latency.UNMEASURED if ttft is None or tpot is None else Latency.INSIDE

    def meter(self) -> Meter:
        """The loop's last power and device limit, read each tick (no model: cheap)."""
        loop = self.loop
        rec = loop.history[-1] if loop.history else None
        margin = loop.controller.config.gains.limit_margin_frac
        limited = loop.device_limit_bounds_w() is not None
        if rec is None:
            return Meter(limit_margin_frac=margin, limited=limited)
        return Meter(rec.power_w, rec.power_limit_w, margin, limited)

    def _smoothed(self, t_s: float, demand: float) -> float:
        """The demand as bid: a rise at once, a fall with time constant `DEMAND_TAU_S`."""
        if self._demand is not None:
            t0, prev = self._demand
            keep = math.exp(-max(t_s - t0, 0.0) / DEMAND_TAU_S)
            demand = max(demand, prev * keep + demand * (1.0 - keep))
        self._demand = (t_s, demand)
        return demand
