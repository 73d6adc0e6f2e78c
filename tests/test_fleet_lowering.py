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
    # The limit is in force; the meter comes down; the ceiling follows it. The limit bounds
    # the draw, so a reading that rises again shows what was drawn before it took: the
    # ceiling follows it up too, never over the old one.
    shown2 = low.show(0.4, 300.0, True, 700.0, meter(500.0, 297.0))
    assert low.limit_holds and 300.0 < shown2 < shown
    assert low.show(0.6, 300.0, True, 700.0, meter(600.0, 297.0)) == pytest.approx(612.0)
    # Without the limit in force, never up.
    low2 = Lowering()
    low2.show(0.0, 700.0, True, 700.0, meter(690.0, 693.0))
    first = low2.show(0.2, 300.0, True, 700.0, meter(500.0, 693.0))
    assert low2.show(0.4, 300.0, True, 700.0, meter(600.0, 693.0)) == first
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
    low.show(0.1, 300.0, True, 700.0, meter(690.0, None, limited=False))  # admission alone
    assert low.show(0.1 + MAX_S, 300.0, True, 700.0, meter(350.0, None, limited=False)) == 300.0
    low = Lowering()
    low.show(0.0, 700.0, True, 700.0, meter(690.0, 693.0))
    assert low.show(0.1, 300.0, False, 700.0, meter(690.0, 693.0)) == 300.0  # not live
    low = Lowering()
    low.show(0.0, 700.0, True, 500.0, meter(690.0, 693.0))
    assert low.show(0.1, 300.0, True, 500.0, meter(690.0, 693.0)) <= 500.0  # never over held


def test_a_share_that_falls_again_gives_its_new_limit_its_own_grace() -> None:
    """351 W, then 227 W (its limit takes), then 301 W, then 245 W 1.5 s after the first fall
    while the meter reads 284 W under the 298-W limit in force: the limit for 245 W was just
    asked for, so the ceiling stays over the meter until it holds. Timed from the first fall,
    its grace had run out and the share was shown at once: a breach on a reading drawn under
    the old limit, and the batch cut from 51 to 3 (the bursts case, stop 44)."""
    low = Lowering()

    def meter(power_w: float, limit_w: float) -> Meter:  # a 1-s mean, 2 s late
        return Meter(power_w, limit_w, MARGIN, True, span_s=3.0)

    low.show(0.0, 351.0, True, 351.0, meter(290.0, 347.0))
    low.show(0.1, 227.0, True, 351.0, meter(290.0, 347.0))  # falls: its limit asked for
    low.show(0.6, 227.0, True, 351.0, meter(286.0, 224.7))  # and in force
    low.show(1.1, 301.0, True, 351.0, meter(286.0, 224.7))  # partly back
    low.show(1.3, 301.0, True, 351.0, meter(286.0, 298.0))
    shown = low.show(1.6, 245.0, True, 351.0, meter(284.0, 298.0))  # falls again
    assert shown >= 284.0 and low.limit_w == pytest.approx(245.0 * (1 - MARGIN))
    assert not low.limit_holds
    # its own grace runs out without the limit: the share at once, as for a first fall
    assert low.show(1.6 + LIMIT_SET_GRACE_S, 245.0, True, 351.0, meter(284.0, 298.0)) == 245.0


def test_while_the_lower_limit_is_due_the_ceiling_stays_at_the_limit_in_force() -> None:
    """A member lent out at the start of its burst: 245 -> 200 W, the device's lowest limit,
    the 243-W limit still in force and the meter at 229 W. Shown a ceiling under 243 W the
    loop reads no limit over it, and its admission law cut the batch from 8 to 2 before the
    new limit landed (the bursts case, stop 44); the limit in force bounds the draw and Redis
    holds the old share, so the ceiling stays at that limit until the new one holds. The ask
    under the device's lowest limit is set at that limit, which then holds."""
    low = Lowering()

    def meter(power_w: float, limit_w: float) -> Meter:
        return Meter(power_w, limit_w, MARGIN, True, span_s=3.0, lowest_w=200.0)

    low.show(0.0, 245.0, True, 245.0, meter(229.0, 242.6))
    shown = low.show(0.2, 200.0, True, 245.0, meter(229.0, 242.6))
    assert shown >= 242.6 - 0.5  # the loop's test for a limit holding its ceiling
    assert low.show(0.4, 200.0, True, 245.0, meter(190.0, 242.6)) >= 242.6 - 0.5
    low.show(0.6, 200.0, True, 245.0, meter(229.0, 200.0))  # the device's lowest: it holds
    assert low.limit_holds


def test_while_the_lower_limit_holds_the_ceiling_follows_a_lagging_meter_past_the_hold() -> None:
    """A 2-s-late meter still reads the 450 W drawn under the old 465-W share after the
    member's 354-W limit is in force and its renewal has brought what Redis holds down to the
    new share. The limit bounds the draw, so neither that hold nor `MAX_S` ends the following:
    a ceiling of the share under a reading of 450 W would read as a breach and cut the batch
    (the diurnal case: batch 16 -> 4 and 24 requests queued while the meter caught up)."""
    low = Lowering()
    low.show(0.0, 465.0, True, 465.0, meter(403.0, 460.0))
    low.show(0.2, 357.5, True, 465.0, meter(403.0, 460.0))  # the share falls; limit asked
    held = 357.5  # the early renewal reported the limit in force: Redis holds the share
    shown = low.show(0.5, 357.5, True, held, meter(448.0, 353.9))
    # A 1-s mean still rising with what was drawn under 465 W: the ceiling rises with it
    # (up to the old ceiling), as the draw it shows was bounded by that.
    assert low.limit_holds and shown == pytest.approx(448.0 * 1.02)
    later = low.show(0.2 + MAX_S + 0.5, 357.5, True, held, meter(440.0, 353.9))
    assert later == pytest.approx(440.0 * 1.02)
    assert low.show(3.9, 357.5, True, held, meter(470.0, 353.9)) == 465.0  # never over it
    assert low.show(4.5, 357.5, True, held, meter(354.0, 353.9)) == 357.5  # caught up
    assert low.show(4.7, 357.5, True, held, meter(440.0, 353.9)) == 357.5  # and done


def test_a_reading_from_before_the_fall_does_not_end_the_lowering() -> None:
    """A meter 2 s late (a reading reaches 3 s back) reads 190 W when the share falls from 465
    to 357.5 W: what was drawn two seconds before, under the old limit. Ended on it, the
    lowering showed the share itself, and the meter then rose to 450 W with what was drawn
    before the lower limit took: a breach, and the batch cut (the diurnal case, stop 36). The
    lowering lasts until a reading wholly after the fall reads the share."""
    low = Lowering()

    def late(power_w: float, limit_w: float) -> Meter:
        return Meter(power_w, limit_w, MARGIN, True, span_s=3.0)

    low.show(0.0, 465.0, True, 465.0, late(190.0, 460.0))
    low.show(0.2, 357.5, True, 465.0, late(190.0, 460.0))  # falls; the limit is asked for
    held = 357.5
    assert low.show(0.5, 357.5, True, held, late(190.0, 353.9)) == 357.5  # the limit holds
    assert low.show(1.5, 357.5, True, held, late(450.0, 353.9)) == pytest.approx(450.0 * 1.02)
    assert low.show(2.5, 357.5, True, held, late(420.0, 353.9)) == pytest.approx(420.0 * 1.02)
    assert low.show(3.5, 357.5, True, held, late(350.0, 353.9)) == 357.5  # after the span
    assert low.show(3.7, 357.5, True, held, late(440.0, 353.9)) == 357.5  # and done
    low.show(4.0, 465.0, True, 465.0, late(350.0, 460.0))  # back up: a new fall starts anew
    assert low.since is None


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

    def request(below: float | None, limit: float | None) -> tuple[float | None, float | None]:
        host = SimpleNamespace(ceiling=Source(below))
        return ControlLoop._limit_request_w(host, limit, 500.0, 0.0)  # type: ignore[arg-type]

    assert request(297.0, 495.0) == (297.0, 297.0)  # bounded by the falling share's limit
    assert request(None, 495.0) == (495.0, 500.0)  # by the ceiling
    assert request(297.0, None) == (None, 297.0)  # observing: no limit at all
