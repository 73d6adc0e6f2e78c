"""A share that falls on a member with a device limit: the limit first, the ceiling after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from powerbatch.control.loop import ControlLoop
from powerbatch.fleet import FleetSettings
from powerbatch.fleet.lowering import LIMIT_SET_GRACE_S, MAX_S, Lowering, Meter
from powerbatch.fleet.member import Lease

MARGIN = 0.01


def meter(power_w: float, limit_w: float | None, limited: bool = True) -> Meter:
    return Meter(power_w, limit_w, MARGIN, limited)


def test_the_ceiling_follows_the_meter_down_while_the_limit_falls_at_once() -> None:
    low = Lowering()
    assert low.show(0.0, 700.0, True, 700.0, meter(690.0, 693.0)) == 700.0
    # The share falls to 300 W: the loop keeps a ceiling over the meter (no breach, no cut)
    # and is asked for the new share's limit.
    shown = low.show(0.2, 300.0, True, 700.0, meter(690.0, 693.0))
    assert 690.0 < shown <= 700.0
    assert low.limit_w == pytest.approx(300.0 * (1 - MARGIN)) and not low.limit_holds
    # The limit is in force; the meter comes down; the ceiling follows it, never up.
    shown2 = low.show(0.4, 300.0, True, 700.0, meter(500.0, 297.0))
    assert low.limit_holds and 300.0 < shown2 < shown
    assert low.show(0.6, 300.0, True, 700.0, meter(600.0, 297.0)) == shown2  # never up
    # The meter reads the share: the share is the ceiling, and the loop's own limit rules.
    assert low.show(1.5, 300.0, True, 700.0, meter(296.0, 297.0)) == 300.0
    assert low.show(1.7, 300.0, True, 700.0, meter(296.0, 297.0)) == 300.0
    assert low.limit_w is None


def test_a_limit_that_does_not_come_or_a_meter_that_does_not_fall_ends_it() -> None:
    low = Lowering()
    low.show(0.0, 700.0, True, 700.0, meter(690.0, 693.0))
    assert low.show(0.1, 300.0, True, 700.0, meter(690.0, 693.0)) > 300.0
    # The set never took (a degraded limiter): after the grace, the share at once.
    assert low.show(0.1 + LIMIT_SET_GRACE_S, 300.0, True, 700.0, meter(690.0, 693.0)) == 300.0
    low = Lowering()
    low.show(0.0, 700.0, True, 700.0, meter(690.0, 693.0))
    low.show(0.1, 300.0, True, 700.0, meter(690.0, 297.0))
    assert low.show(0.1 + MAX_S, 300.0, True, 700.0, meter(350.0, 297.0)) == 300.0
    low = Lowering()
    low.show(0.0, 700.0, True, 700.0, meter(690.0, 693.0))
    assert low.show(0.1, 300.0, False, 700.0, meter(690.0, 693.0)) == 300.0  # not live
    low = Lowering()
    low.show(0.0, 700.0, True, 500.0, meter(690.0, 693.0))
    assert low.show(0.1, 300.0, True, 500.0, meter(690.0, 693.0)) <= 500.0  # never over held


def test_a_renewal_reports_the_limit_in_force_not_the_lagging_meter() -> None:
    s = FleetSettings(fleet_budget="b", fleet_budget_w=1400.0, fleet_lease_ttl_s=3.0)
    lease = Lease(s)
    lease.confirmed(0.0, 300.0, 700.0, 2)  # cut from 700 W to 300 W
    assert lease.held_w == 700.0
    # The meter still shows 690 W and the loop was shown 650 W: not freed yet.
    assert lease.using_w(0.5, 690.0, 650.0) == pytest.approx(690.0)
    # The 297 W limit is in force: that bounds the draw, so the watts are free now.
    assert lease.using_w(0.5, 690.0, 650.0, limit_w=297.0) == pytest.approx(300.0)
    assert lease.using_w(2.5, 690.0, 650.0) == pytest.approx(300.0)  # no live lease: usable


def test_the_loop_asks_for_the_lower_of_its_limit_and_the_falling_shares() -> None:
    """The one hook in the control loop: a ceiling source may ask for a lower device limit."""

    class Source:
        def __init__(self, below: float | None) -> None:
            self.below = below

        def ceiling_w(self, t_s: float) -> float | None:
            return 500.0

        def device_limit_w(self, t_s: float) -> float | None:
            return self.below

    def request(below: float | None, limit: float | None) -> float | None:
        host = SimpleNamespace(ceiling=Source(below))
        return ControlLoop._limit_request_w(host, limit, 0.0)  # type: ignore[arg-type]

    assert request(297.0, 495.0) == 297.0
    assert request(None, 495.0) == 495.0
    assert request(297.0, None) is None  # observing: no limit at all
