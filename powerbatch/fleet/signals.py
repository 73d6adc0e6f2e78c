"""A member's bid from its own control loop: the marginal value of a watt and its demand's power.

Estimate (docs/fleet.md): at the loop's operating point (the last tick's 1-s features, batch b),
the power model gives the watts one more request in flight costs,
dP/db ~ P(shape * (b + 1)) - P(shape * b), and the loop measures each request's decode rate,
r = decode tok/s / b. A watt more buys about 1 / (dP/db) more requests, so

    value_per_w = r / (dP/db)      tokens/s per W,

and `want_w` = P(shape * (in flight + queued)): what serving all the demand would draw. With
no demand there is nothing to buy: value 0, want the idle power.

Without a device power limit, admission holds a ceiling only by the batch, and the batch's
smallest step is one request: `floor_w` = P(shape * min_batch) is the least such a member can
hold while it serves at all, so it asks for no smaller share. With a limit in force the device
caps the power at any share, and the floor is left to `fleet_min_share_w`.
"""

from __future__ import annotations

from collections.abc import Callable

from powerbatch.control.loop import ControlLoop
from powerbatch.estimate import Features
from powerbatch.fleet.member import MemberSignals

MIN_SLOPE_W = 0.5  # W per request: a floor so a flat early model does not promise the moon


class LoopSignals:
    """Callable: the bid, computed when the member publishes (once a period, off the tick)."""

    def __init__(
        self, loop: ControlLoop, queued_by_class: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.loop = loop
        self.queued_by_class = queued_by_class
        self._shape: Features | None = None  # the last per-request shape seen under load

    def __call__(self) -> MemberSignals:
        loop = self.loop
        rec = loop.history[-1] if loop.history else None
        if rec is None:
            return MemberSignals()
        by_class = self.queued_by_class() if self.queued_by_class else {"normal": rec.queued}
        demand = rec.in_flight + rec.queued
        f = rec.features
        if f.batch >= 1:
            self._shape = f.per_request()
        value, want, floor = 0.0, 0.0, 0.0
        model = loop.controller.model
        shape = self._shape
        if shape is not None:
            want = model.predict_one(shape.scaled(float(demand)))[0]
            if loop.actuator is None:
                floor = model.predict_one(shape.scaled(float(loop.controller.config.min_batch)))[0]
            if demand > 0 and f.batch >= 1:
                b = f.batch
                slope = (
                    model.predict_one(shape.scaled(b + 1))[0]
                    - model.predict_one(shape.scaled(b))[0]
                )
                value = (f.decode_tok_s / b) / max(slope, MIN_SLOPE_W)
            elif demand > 0:  # queued but nothing running (held at the minimum): worth a lot
                value = shape.decode_tok_s / MIN_SLOPE_W
        return MemberSignals(
            power_w=rec.power_w,
            in_flight=rec.in_flight,
            queued_by_class=by_class,
            value_per_w=max(value, 0.0),
            want_w=max(want, 0.0),
            floor_w=max(floor, 0.0),
        )
