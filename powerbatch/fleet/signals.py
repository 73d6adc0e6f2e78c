"""A member's bid from its own control loop (docs/fleet.md, "Allocation: equal marginal value").

* demand D, requests in flight plus queued: it rises at once and falls with time constant
  `DEMAND_TAU_S`, so a light load's swings do not move the share;
* want W: the power model at the last per-request shape scaled to D; while a device limit holds
  the member (meter at `PINNED_FRAC` of it or more) with work, the meter and a model taught
  there under-read the demand, and W is the device's highest limit;
* needy: work waits (beyond `QUEUE_MIN` / `QUEUE_FRAC` of the batch), or its device limit
  holds it (or a little work waits) while its TTFT or time per token (below) is past
  `RISK_FRAC` of its SLO, or its device limit holds it while its work climbs past the demand
  it last bid by more than 2 sd of a Poisson count, or its arrivals surge (the rate over its
  5-s average by 3 sd of the rate's noise): more watts would buy goodput (these say so
  seconds before a queue or a latency does: without them a new hot member turned needy 4 s
  after a move, and a member 1.7 s into its burst). Lent under its split (budget / N), a
  member at risk is not needy: it wants what two gives took back (`GIVE_FRAC`, each a period),
  not its whole split at once, so its margin flickering does not pull a hot member's share
  down to the split and back (stop 62). A member held by its limit whose
  latency is measured well inside its SLOs (both known and under `RISK_FRAC`) slows as a
  capped server does and loses nothing by slowing a little more: it wants `GIVE_FRAC` less
  than it draws, so its share steps down while its latency allows. One whose latency is not
  yet measured (too few answers in the window) gives nothing: it has not shown it can spare a
  watt. Nor does one whose work (in flight plus queued) is above the demand it last bid
  (which holds its recent highs), or whose arrivals rise (by 2 sd): its arrivals are
  outrunning it, or are about to (a burst's first second adds less work than the last burst
  left in the demand bid: members gave at the start of a burst, stop 44), and the window's
  p95s, timed on requests as they end, show that a request's length later; a member that
  gave then bid its capped draw down while its batch grew (docs/fleet.md, stop 34). Such a
  member, measured inside, keeps the share it has (bidding the device's most, cold members
  whose work wandered up took their splits back from a hot one, stop 44); a held member not
  measured inside bids the device's highest limit (want, above), so its fair floor is its
  whole split: a member lent out under its split that bid its capped draw plus headroom
  climbed back only `HEADROOM_FRAC` a period (stop 36). A member its limit does not hold
  whose work waits or is at a new high wants at least the share it has: its model
  under-reads, a share that fell on it came back a period later, and a lagging meter reads a
  lighter load's draw (stop 43). Any other member wants what it draws (or its model's
  demand, if more) plus `HEADROOM_FRAC`;
* keep_w, the most its fair floor keeps: held by its limit with nothing waiting and its
  latency measured inside, one give under its draw, even while its work climbs (needy): the
  watt it spares is worth more to a member at risk, and its bid for the surplus still counts.
  Floors at the split for every needy member held a hot spot's new member at its split
  while cold members climbing inside their SLOs kept theirs (docs/fleet.md, stop 65). The
  price: a new hot member, its work surging before its latency shows it, may be held a give
  under its split for a period or two;
* value_per_w = 2 λ / W, λ the requests arriving per second (`RATE_HALF_LIFE_S`): the modelled
  goodput at W is λ, what it could answer in time. Not D: a backlog is late work, and Little's
  law (D = λ T) counts it the more the longer it waits, so a member a hot spot had just left
  outbid the one it moved to until its backlog drained (docs/fleet.md, stop 43). A host that
  does not count arrivals bids D;
* latency, read now where the host can say: the longest wait in its queue for TTFT (the
  engine law holds work here once the engine's own queue passes 2 s of its starts, so this
  wait covers what the engine cannot start), the engine's step for time per token; the p95s of
  the window of finished requests only where it cannot (they keep a hot spot's late answers
  for the window's 30 s after it has left);
* bounds: with a device limit, its range (the lowest limit holds any share above it, a share
  above the highest is never drawn); without, floor_w = P(shape * min_batch) (admission's
  smallest step is one request: less cannot be held) and max_w the GPUs' highest draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING

from powerbatch.control import QueueCounts
from powerbatch.estimate import Features
from powerbatch.fleet.lowering import Meter
from powerbatch.fleet.member import MemberSignals, work_waits
from powerbatch.telemetry.filters import Ewma

if TYPE_CHECKING:  # only its public attributes are used
    from powerbatch.control.loop import ControlLoop
    from powerbatch.control.record import TickRecord

PINNED_FRAC = 0.95  # measured power at this share of the device limit or more: held by it
DEMAND_TAU_S = 5.0  # how slowly the demand in the bid falls
HEADROOM_FRAC = 0.15  # a member with nothing waiting wants this much over what it draws
GIVE_FRAC = 0.15  # a member held by its limit inside its SLOs wants this much less than it draws
RISK_FRAC = 0.5  # p95 latency over this share of its SLO: the member has no time to give
RATE_HALF_LIFE_S = 1.0  # the arrival rate's: a rate that jumps is 75 % read within 2 s
SLOW_RATE_HALF_LIFE_S = 5.0  # the rate it is judged against: arrivals rising outrun this
RISE_SD = 2.0  # arrivals this many sd over it stop a give (a false alarm costs one period's give)
SURGE_SD = 3.0  # and this many make a held member needy (a 2-sd alarm at a steady 2/s fires
# every 25 s or so, one at 3 sd every few minutes: tests/test_fleet_signals.py)


class Latency(Enum):
    """A member's p95 TTFT and time per token against `RISK_FRAC` of their SLOs."""

    AT_RISK = "at_risk"  # either measured p95 is over
    INSIDE = "inside"  # both measured, both under
    UNMEASURED = "unmeasured"  # too few answers in the window to say


class LoopSignals:
    """Callable: the bid, computed when the member publishes (once a period, off the tick)."""

    def __init__(
        self,
        loop: ControlLoop,
        counts: Callable[[], QueueCounts] | None = None,
        split_w: Callable[[], float] | None = None,
    ) -> None:
        self.loop = loop
        self.counts = counts
        # The member's static split: its safe share, budget / N unless set lower (lower, fewer
        # members count as lent, as before stop 62); None: not known, none is lent.
        self.split_w = split_w
        self._shape: Features | None = None  # the last per-request shape seen under load
        self._demand: tuple[float, float] | None = None  # (t_s, demand as bid)
        self._arrived: tuple[float, int] | None = None  # (t_s, arrivals counted by then)
        self._rate = Ewma(RATE_HALF_LIFE_S)  # requests arriving per second
        self._slow_rate = Ewma(SLOW_RATE_HALF_LIFE_S)
        self._baseline: float | None = None  # the slow rate before the last count

    def __call__(self) -> MemberSignals:
        loop = self.loop
        rec = loop.history[-1] if loop.history else None
        if rec is None:
            return MemberSignals()
        counts = self.counts() if self.counts else None
        by_class = dict(counts.queued) if counts else {"normal": rec.queued}
        rate = self._arrival_rate(rec.t_s, counts)
        up, surge = self._arrivals_up(RISE_SD), self._arrivals_up(SURGE_SD)
        work = float(rec.in_flight + rec.queued)
        before = None if self._demand is None else self._demand[1]  # the demand last bid
        rising = (before is not None and work > before) or up
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
        limit_w, power_w = self._limit_read_w(rec), rec.power_w or 0.0
        pinned = bool(demand > 0 and limit_w > 0 and power_w >= PINNED_FRAC * limit_w and bounds)
        queued = sum(by_class.values())
        waiting = work_waits(queued, rec.in_flight)
        latency = self._latency(counts)
        # Held by its limit while its arrivals surge, or its work climbs past its recent high
        # by more than a Poisson count's noise (2 sd): its arrivals outrun it, and the queue
        # and the latencies that would show it come seconds later (a hot spot's new member,
        # stop 43; a burst's, stop 44).
        surging = surge or (
            before is not None and work > before + 2.0 * math.sqrt(max(before, 1.0))
        )
        at_risk = (pinned or queued > 0) and latency is Latency.AT_RISK
        held_inside = pinned and latency is Latency.INSIDE
        give_w = power_w * (1.0 - GIVE_FRAC)  # one give under what it draws
        # Lent: under its split by half a give or more (a member at its split holds a share a
        # rounding or a limit's margin under it).
        share_w = self._ceiling_w()
        lent = self.split_w is not None and share_w < (1 - GIVE_FRAC / 2) * self.split_w()
        needy = waiting or (at_risk and not lent) or (pinned and surging)
        if needy and pinned and bounds:
            want = max(want, bounds[1])  # held by the limit: it would draw more than it may
        elif needy:  # work waits and the limit does not hold it now: it spares nothing of
            # what it has (its model, taught under its limit, under-reads the demand, and a
            # share that fell back on it came back a period later: the share flapped)
            want = max(want, share_w)
        elif at_risk:  # lent under its split, its margin spent, its work neither waiting nor
            # surging: it takes back what two gives took, not its whole split at once (needy, a
            # cold member at its margin took a hot one's share down to the split and back
            # within a period: docs/fleet.md, stop 62)
            want = max(want, share_w, power_w) / (1.0 - GIVE_FRAC) ** 2
        elif held_inside and not rising:  # held, measured inside, and its work not above the
            # demand it last bid: it can give
            want = give_w
        elif held_inside:  # held and inside, its work or arrivals up
            # (not surging): it gives nothing and keeps the share it has; bidding the device's
            # most, cold members whose work wandered up took their splits back from the hot
            # one as a hot spot moved (the fleet, stop 44)
            want = max(want, share_w)
        elif pinned and bounds:  # held, and not shown it can spare a watt: its capped draw
            # says nothing of its demand, so it bids as a held member at risk does
            want = max(want, bounds[1])
        else:  # all it has is served: what it draws, and room for a few more; while its
            # work is at a new high, nothing of what it has (a meter that lags reads a lighter
            # load's draw: a member whose day rose gave watts on a reading 2 s old, then queued)
            want = max(want, power_w) * (1.0 + HEADROOM_FRAC)
            if rising:
                want = max(want, share_w)
        served = demand if rate is None else rate
        value = 2.0 * served / want if served > 0 and want > 0 else 0.0
        # Held, nothing waiting and its latency measured inside: a give less than it draws is
        # all its fair floor keeps (a watt it spares is worth more to a member at risk).
        keep_w = give_w if held_inside and not waiting else math.inf
        return MemberSignals(
            power_w=rec.power_w,
            in_flight=rec.in_flight,
            queued_by_class=by_class,
            value_per_w=max(value, 0.0),
            want_w=max(want, 0.0),
            floor_w=max(floor, 0.0),
            max_w=most,
            needy=needy,
            keep_w=keep_w,
        )

    def _ceiling_w(self) -> float:
        """The ceiling the loop held at its last decision (its share; 0 before one)."""
        d = self.loop.controller.last
        return d.ceiling_w if d is not None and math.isfinite(d.ceiling_w) else 0.0

    def _limit_read_w(self, rec: TickRecord) -> float:
        """The device limit the power reading was drawn under: the lowest in force over the
        reading's span (`ControlLoop.reading_span_s`; 0: none). Against the limit now, a member
        just raised reads as unheld until its meter catches up, bids its model's want (taught
        under the old limit, it under-reads), and its share falls back (docs/fleet.md, stop 43)."""
        since = rec.t_s - self.loop.reading_span_s
        lowest = rec.power_limit_w or 0.0
        for r in reversed(self.loop.history):
            if r.t_s < since:
                break
            if r.power_limit_w:
                lowest = min(lowest, r.power_limit_w) if lowest else r.power_limit_w
        return lowest

    def _arrival_rate(self, t_s: float, counts: QueueCounts | None) -> float | None:
        """Requests arriving per second, averaged (`RATE_HALF_LIFE_S`); None: not counted."""
        if counts is None:
            return None
        n = sum(counts.arrived.values())
        if self._arrived is None:
            self._arrived = (t_s, n)
        elif t_s > self._arrived[0]:
            t0, n0 = self._arrived
            x = max(n - n0, 0) / (t_s - t0)
            self._rate.update(x, t_s)
            self._baseline = self._slow_rate.value  # the slow rate before this period's count
            self._slow_rate.update(x, t_s)
            self._arrived = (t_s, n)
        return self._rate.value or 0.0

    def _arrivals_up(self, sd_multiple: float) -> bool:
        """Arrivals rising: the rate above its slow average (before the last count) by more
        than `sd_multiple` sd of the rate's Poisson noise (an EWMA of counts with half-life h
        has variance λ ln 2 / 2h; λ at least 1/s, so one request is no surge). The work in
        flight shows a burst only once it passes the demand last bid, which holds the last
        burst's high for seconds: a member gave watts 1-2 s into its next burst, and its
        prompts waited under the lower limit (the bursts case, docs/fleet.md, stop 44)."""
        fast, slow = self._rate.value, self._baseline
        if fast is None or slow is None:
            return False
        sd = math.sqrt(max(slow, 1.0) * math.log(2.0) / (2.0 * RATE_HALF_LIFE_S))
        return fast > slow + sd_multiple * sd

    def _latency(self, counts: QueueCounts | None) -> Latency:
        """TTFT and time per token now against `RISK_FRAC` of their SLOs (module docstring):
        the queue's longest wait and the engine's step where the host has them, else the p95s
        of the host's window of finished requests."""
        loop = self.loop
        snap = loop.features.latency(loop.clock())
        sample = loop.last_sample
        engine = sample.engine if sample is not None else None
        ttft = snap.ttft_p95_s if snap is not None else None
        tpot = snap.tpot_p95_s if snap is not None else None
        if counts is not None and counts.oldest_wait_s is not None:
            ttft = counts.oldest_wait_s  # the engine's own queue is the engine law's to bound
        if engine is not None and engine.step_s is not None:
            tpot = engine.step_s
        cfg = loop.controller.config
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
        bounds = loop.device_limit_bounds_w()
        limited, lowest = bounds is not None, bounds[0] if bounds is not None else 0.0
        if rec is None:
            return Meter(limit_margin_frac=margin, limited=limited, lowest_w=lowest)
        return Meter(
            rec.power_w,
            rec.power_limit_w,
            margin,
            limited,
            loop.reading_span_s,
            lowest,
            rec.queued,
            rec.in_flight,
        )

    def _smoothed(self, t_s: float, demand: float) -> float:
        """The demand as bid: a rise at once, a fall with time constant `DEMAND_TAU_S`."""
        if self._demand is not None:
            t0, prev = self._demand
            keep = math.exp(-max(t_s - t0, 0.0) / DEMAND_TAU_S)
            demand = max(demand, prev * keep + demand * (1.0 - keep))
        self._demand = (t_s, demand)
        return demand
