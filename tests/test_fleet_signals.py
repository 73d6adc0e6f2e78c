"""A member's bid from its control loop: want and value, and what water-filling makes of them."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from powerbatch.control import EngineLoad, QueueCounts
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.loop import TickRecord
from powerbatch.estimate import Features
from powerbatch.fleet import Bid, FleetSettings
from powerbatch.fleet.allocate import allocate
from powerbatch.fleet.member import share_bounds_w
from powerbatch.fleet.signals import (
    DEMAND_TAU_S,
    GIVE_FRAC,
    HEADROOM_FRAC,
    RATE_HALF_LIFE_S,
    RISE_SD,
    SURGE_SD,
    LoopSignals,
)

DECODE_TOK_S_PER_REQUEST = 60.0
DEVICE_MAX_W = 700.0


class LinearModel:
    """P(batch) = base + slope × batch: a stand-in for the learned power model."""

    def __init__(self, base_w: float, slope_w: float) -> None:
        self.base_w, self.slope_w = base_w, slope_w

    def predict_one(self, point: Features) -> tuple[float, float]:
        p = self.base_w + self.slope_w * point.batch
        return p, p + 10.0


def loop(
    *,
    t_s: float = 10.0,
    in_flight: int,
    queued: int,
    power_w: float,
    limit_w: float | None,
    model: LinearModel,
    bounds: tuple[float, float] | None = (200.0, DEVICE_MAX_W),
    max_w: float | None = None,
    ttft_p95_s: float | None = None,
    tpot_p95_s: float | None = 0.02,  # well inside its 0.1-s SLO
    measured: bool = True,  # False: the host has no latency window yet
    engine: EngineLoad | None = None,  # the engine's queue and step, as last scraped
    ceiling_w: float = math.nan,  # the share the loop held at its last decision
) -> Any:
    batch = float(in_flight)
    rec = TickRecord(
        t_s=t_s, power_w=power_w, raw_w=power_w, energy_j=None, predicted_w=power_w,
        predicted_upper_w=power_w, target_w=power_w, limit_requests=in_flight,
        limit_kv_tokens=10**6, prefill_tok_s=None, enforced_requests=in_flight,
        in_flight=in_flight, kv_in_flight=0.0, queued=queued, binding="power", state="enforce",
        features=Features(batch, 800.0 * batch, 0.0, DECODE_TOK_S_PER_REQUEST * batch),
        power_limit_w=limit_w,
    )  # fmt: skip
    return SimpleNamespace(
        history=[rec],
        controller=SimpleNamespace(
            config=SimpleNamespace(min_batch=1, max_w=max_w, ttft_slo_s=2.0, tpot_slo_s=0.1),
            last=SimpleNamespace(ceiling_w=ceiling_w),
        ),
        features=SimpleNamespace(
            latency=lambda t: LatencySnapshot(ttft_p95_s, tpot_p95_s, {}, 10) if measured else None
        ),
        clock=lambda: t_s,
        last_sample=SimpleNamespace(engine=engine),
        reading_span_s=2.0,  # a 1-s mean, 1 s late
        predict_w=lambda f: model.predict_one(f)[0],  # ControlLoop.predict_w
        device_limit_bounds_w=lambda: bounds,  # a limiter holds the device (None: none)
    )


def test_a_member_held_at_its_limit_with_work_wants_what_the_device_allows() -> None:
    """Held at the cap, the meter reads the cap: a model taught there says the demand draws
    about what the member already has, which would keep a hot member at its share for good."""
    taught_at_cap = LinearModel(base_w=540.0, slope_w=1.0)  # says 50 requests draw 590 W
    sig = LoopSignals(
        loop(in_flight=40, queued=20, power_w=596.0, limit_w=594.0, model=taught_at_cap)
    )()
    assert sig.want_w == pytest.approx(DEVICE_MAX_W) and sig.needy
    free = LoopSignals(
        loop(in_flight=40, queued=20, power_w=500.0, limit_w=594.0, model=taught_at_cap)
    )()
    assert free.want_w == pytest.approx(600.0)  # under its limit: the model's 60 requests


def test_value_is_demand_per_watt_of_want_so_a_backlog_outbids_a_trickle() -> None:
    """Tokens per watt of the model's slope made a cold member with a flat curve outbid the hot
    one; requests per watt of want put the watts where the requests are."""
    model = LinearModel(base_w=300.0, slope_w=2.0)
    hot = LoopSignals(loop(in_flight=40, queued=20, power_w=500.0, limit_w=None, model=model))()
    cold = LoopSignals(loop(in_flight=3, queued=0, power_w=306.0, limit_w=None, model=model))()
    assert hot.value_per_w == pytest.approx(2 * 60 / 420.0)
    assert cold.value_per_w == pytest.approx(2 * 3 / (306.0 * (1 + HEADROOM_FRAC)))
    assert hot.needy and not cold.needy  # nothing waits on the cold one: it wants its draw
    assert hot.value_per_w > 5 * cold.value_per_w
    idle = LoopSignals(loop(in_flight=0, queued=0, power_w=80.0, limit_w=None, model=model))()
    assert idle.value_per_w == 0.0


def test_the_held_hot_member_gets_near_its_maximum_and_the_cold_ones_give_what_they_can() -> None:
    """Four members, 1800 W, shares 200-700 W: the hot one, held at 600 W with 60 requests, and
    three cold ones held at 400 W with 3 each, their models taught near their caps. The cold
    ones meet their SLOs with room to spare, so they give; at risk, they would not."""
    hot_model, cold_model = LinearModel(540.0, 1.0), LinearModel(380.0, 1.0)
    hot = LoopSignals(
        loop(in_flight=40, queued=20, power_w=596.0, limit_w=594.0, model=hot_model)
    )()
    cold = LoopSignals(
        loop(in_flight=3, queued=0, power_w=395.0, limit_w=396.0, model=cold_model, ttft_p95_s=0.3)
    )()
    assert not cold.needy and cold.want_w == pytest.approx(395.0 * (1 - GIVE_FRAC))
    hot_w, cold_w = 3.1, 1.07  # the member's class weights: 70 % / 10 % high class
    bids = {"hot": Bid(hot.value_per_w * hot_w, hot.want_w, 200.0, 700.0, hot.needy)}
    for k in ("c1", "c2", "c3"):
        bids[k] = Bid(cold.value_per_w * cold_w, cold.want_w, 200.0, 700.0, cold.needy)
    shares = allocate(bids, 1800.0)
    assert shares["hot"] > 690.0
    assert shares["c1"] == pytest.approx(shares["c3"])
    assert sum(shares.values()) == pytest.approx(1800.0)
    late = LoopSignals(
        loop(in_flight=3, queued=0, power_w=395.0, limit_w=396.0, model=cold_model, ttft_p95_s=1.5)
    )()
    assert late.needy and late.want_w == pytest.approx(DEVICE_MAX_W)  # its SLO is at risk
    bids = {k: Bid(late.value_per_w, late.want_w, 200.0, 700.0, True) for k in ("c1", "c2", "c3")}
    bids["hot"] = Bid(hot.value_per_w * hot_w, hot.want_w, 200.0, 700.0, True)
    assert min(allocate(bids, 1800.0).values()) >= 450.0 - 1e-6  # none under a static split


def test_the_demand_bid_rises_at_once_and_falls_slowly() -> None:
    """A light load's snapshot swings between none and a few requests; the bid must not."""
    model = LinearModel(base_w=300.0, slope_w=2.0)
    sig = LoopSignals(
        loop(t_s=10.0, in_flight=6, queued=0, power_w=320.0, limit_w=None, model=model)
    )
    first = sig()
    sig.loop.history[-1] = loop(
        t_s=11.0, in_flight=0, queued=0, power_w=80.0, limit_w=None, model=model
    ).history[-1]
    later = sig()
    kept = 6 * math.exp(-1.0 / DEMAND_TAU_S)
    room = 1 + HEADROOM_FRAC  # nothing queued: its draw (or model) plus headroom
    assert later.value_per_w == pytest.approx(2 * kept / ((300.0 + 2.0 * kept) * room))
    assert 0 < later.value_per_w < first.value_per_w
    sig.loop.history[-1] = loop(
        t_s=12.0, in_flight=20, queued=0, power_w=400.0, limit_w=None, model=model
    ).history[-1]
    assert sig().value_per_w == pytest.approx(2 * 20 / (400.0 * room))  # the meter's 400 W


def test_the_default_bounds_are_what_the_member_can_honour() -> None:
    """Unset bounds: with a limiter, the device's limit range; without, one request's power up
    to the GPUs' highest draw. A setting narrows them; none widens them."""
    model = LinearModel(base_w=450.0, slope_w=2.0)
    settings = FleetSettings(fleet_budget="b", fleet_budget_w=1300.0)
    limited = LoopSignals(loop(in_flight=3, queued=0, power_w=300.0, limit_w=320.0, model=model))()
    assert share_bounds_w(settings, limited) == (200.0, DEVICE_MAX_W)
    alone = LoopSignals(
        loop(
            in_flight=3,
            queued=0,
            power_w=460.0,
            limit_w=None,
            model=model,
            bounds=None,
            max_w=DEVICE_MAX_W,
        )
    )()
    assert share_bounds_w(settings, alone) == (pytest.approx(452.0), DEVICE_MAX_W)
    told = FleetSettings(
        fleet_budget="b", fleet_budget_w=1300.0, fleet_min_share_w=250, fleet_max_share_w=600
    )
    assert share_bounds_w(told, limited) == (250.0, 600.0)
    unknown = LoopSignals(
        loop(in_flight=0, queued=0, power_w=80.0, limit_w=None, model=model, bounds=None)
    )()
    assert share_bounds_w(settings, unknown)[1] == 1300.0  # nothing known: the budget


@pytest.mark.parametrize(
    ("measured", "ttft_p95_s", "tpot_p95_s"),
    [(False, None, None), (True, None, None), (True, 0.3, None), (True, None, 0.02)],
)
def test_a_held_member_gives_watts_only_once_its_latency_is_measured_inside_its_slos(
    measured: bool, ttft_p95_s: float | None, tpot_p95_s: float | None
) -> None:
    """Held at its 396-W limit with 3 requests and no answers timed yet (no window, or too few
    samples for a p95): it has not shown it can spare a watt, so it bids as a held member
    (its device's highest limit: its capped draw says nothing of its demand) rather than
    `GIVE_FRAC` less. Measured inside, it gives."""
    model = LinearModel(380.0, 1.0)
    kw: dict[str, Any] = {"in_flight": 3, "queued": 0, "power_w": 395.0, "limit_w": 396.0}
    unmeasured = LoopSignals(
        loop(**kw, model=model, measured=measured, ttft_p95_s=ttft_p95_s, tpot_p95_s=tpot_p95_s)
    )()
    assert not unmeasured.needy
    assert unmeasured.want_w == pytest.approx(DEVICE_MAX_W)
    inside = LoopSignals(loop(**kw, model=model, ttft_p95_s=0.3, tpot_p95_s=0.02))()
    assert not inside.needy and inside.want_w == pytest.approx(395.0 * (1 - GIVE_FRAC))
    late = LoopSignals(loop(**kw, model=model, ttft_p95_s=None, tpot_p95_s=0.08))()
    assert late.needy  # one p95 measured past half its SLO is enough to be at risk


def test_only_a_held_member_measured_inside_with_nothing_waiting_keeps_less_than_its_split() -> (
    None
):
    """`keep_w`, the most the member's fair floor keeps: a give under its draw while its
    limit holds it, nothing waits and its latency is measured inside; its whole split while
    anything says it is short (work waits, a p95 past `RISK_FRAC`, not yet measured)."""
    model = LinearModel(540.0, 1.0)
    kw: dict[str, Any] = {"in_flight": 30, "power_w": 321.0, "limit_w": 322.0, "model": model}
    inside = LoopSignals(loop(queued=0, ttft_p95_s=0.3, **kw))()
    assert inside.keep_w == pytest.approx(321.0 * (1 - GIVE_FRAC))
    for short in (
        loop(queued=20, ttft_p95_s=0.3, **kw),  # work waits (`work_waits`)
        loop(queued=0, ttft_p95_s=0.3, tpot_p95_s=0.08, **kw),  # a p95 past half its SLO
        loop(queued=0, measured=False, **kw),  # not yet shown it can spare a watt
        loop(queued=0, ttft_p95_s=0.3, **{**kw, "power_w": 250.0}),  # its limit does not hold
    ):
        assert LoopSignals(short)().keep_w == math.inf


def test_a_held_member_whose_work_rises_gives_nothing_while_its_answers_are_still_inside() -> None:
    """A member turning hot under its 322-W limit: its work grows from 19 to 80 requests while
    the answers of its window (requests that arrived while it was cold) are well inside the
    SLOs. It must not bid `GIVE_FRAC` under its capped draw while its arrivals outrun it (a
    member that did ratcheted its share down with its draw), and is needy while its work
    climbs past its recent high by more than 2 sd of a Poisson count (19 -> 35 -> 58 -> 80);
    once its work stops rising it may give again."""
    model = LinearModel(540.0, 1.0)
    kw: dict[str, Any] = {"queued": 0, "power_w": 321.0, "limit_w": 322.0, "model": model}
    kw["ttft_p95_s"] = 0.3  # with the default 20-ms time per token: measured, well inside
    host = loop(t_s=10.0, in_flight=19, **kw)
    sig = LoopSignals(host)
    assert sig().want_w == pytest.approx(321.0 * (1 - GIVE_FRAC))  # steady: it gives
    for t_s, n in ((11.0, 35), (12.0, 58), (13.0, 80)):
        host.history = loop(t_s=t_s, in_flight=n, **kw).history
        bid = sig()
        # at least its draw, so its floor stays; climbing past its recent high by more than
        # a Poisson count's noise, held: needy (its arrivals outrun it)
        assert bid.needy and bid.want_w >= 321.0
    host.history = loop(t_s=14.0, in_flight=78, **kw).history  # no longer rising
    assert sig().want_w == pytest.approx(321.0 * (1 - GIVE_FRAC))


def test_a_lent_member_held_under_its_split_gets_its_split_back_at_once() -> None:
    """An A100-like member lent its split while idle and is held at a 175-W limit when its day
    rises: 36 requests in flight, none queued in the proxy, too few answers timed for a p95
    (the diurnal case). Its capped draw says nothing of its demand, so it must not bid it plus
    headroom (main's law gave it a floor of 201 W, and it climbed back 15 % a period while its
    answers missed their SLOs): it bids its device's highest limit, and with another member
    needy its fair floor is its whole split."""
    model = LinearModel(150.0, 0.5)
    lent = LoopSignals(
        loop(
            in_flight=36, queued=0, power_w=174.0, limit_w=175.0, model=model,
            bounds=(100.0, 400.0), measured=False,
        )
    )()  # fmt: skip
    assert not lent.needy and lent.want_w == pytest.approx(400.0)
    split = 1430.0 / 4
    bids = {
        "lent": Bid(lent.value_per_w, lent.want_w, 100.0, 400.0, lent.needy),
        "hot": Bid(0.3, 700.0, 200.0, 700.0, needy=True),
        "a": Bid(0.05, 300.0, 200.0, 700.0),
        "b": Bid(0.05, 300.0, 100.0, 400.0),
    }
    assert allocate(bids, 1430.0)["lent"] >= split - 1e-6


class Host:
    """A host's counts over time: `arrive` requests per second, `waiting` queued, the oldest
    of them `oldest_s` old."""

    def __init__(self, loop: Any, rps: float, waiting: int = 0, oldest_s: float = 0.0) -> None:
        self.loop, self.rps, self.waiting, self.oldest_s = loop, rps, waiting, oldest_s
        self.arrived = 0.0

    def counts(self) -> QueueCounts:
        q = {"normal": self.waiting}
        return QueueCounts({"normal": int(self.arrived)}, 0, 0, q, self.oldest_s)

    def advance(self, t_s: float, dt_s: float = 0.5) -> None:
        self.arrived += self.rps * dt_s
        self.loop.history[-1] = replace(self.loop.history[-1], t_s=t_s)


def test_watts_follow_the_arrivals_not_a_backlog_the_hot_spot_left_behind() -> None:
    """A hot spot of 20 requests/s moves from A to B. A is held at its limit with 256 in
    flight and 55 queued, all of it late now, and 2 requests/s arriving; B, at the same limit,
    has 60 in flight and 20 arriving. Both bid the device's highest limit. Valued by the work
    they hold, A outbids B until its backlog drains (the issue's fleet: 6-7 s); valued by what
    arrives, B outbids A within two seconds of the move."""
    model = LinearModel(300.0, 1.0)
    kw: dict[str, Any] = {"power_w": 321.0, "limit_w": 322.0, "model": model}
    a = Host(loop(in_flight=256, queued=55, **kw), rps=20.0, waiting=55, oldest_s=12.0)
    b = Host(loop(in_flight=20, queued=0, **kw), rps=2.0)
    sa, sb = LoopSignals(a.loop, a.counts), LoopSignals(b.loop, b.counts)
    t = 0.0
    for _ in range(20):  # ten seconds before the move
        t += 0.5
        a.advance(t), b.advance(t)
        bid_a, bid_b = sa(), sb()
    assert bid_a.value_per_w > 2 * bid_b.value_per_w
    a.rps, b.rps = 2.0, 20.0  # the hot spot moves; A's backlog stays
    for k in range(4):  # two seconds after it: B's work grows
        t += 0.5
        b.loop.history[-1] = replace(b.loop.history[-1], in_flight=40 + 20 * k)
        a.advance(t), b.advance(t)
        bid_a, bid_b = sa(), sb()
    assert bid_a.needy and bid_b.want_w == pytest.approx(DEVICE_MAX_W)  # both want the most
    assert bid_b.value_per_w > bid_a.value_per_w
    rate_b = 2.0 + 18.0 * (1 - 0.5 ** (2.0 / RATE_HALF_LIFE_S))
    assert bid_b.value_per_w == pytest.approx(2 * rate_b / DEVICE_MAX_W, rel=0.05)


def test_latency_is_read_now_not_from_the_answers_of_a_hot_spot_that_has_left() -> None:
    """Held at its 322-W limit with 5 requests in flight, nothing waiting and a 20-ms step, a
    member the hot spot left 10 s ago still has a 12-s p95 TTFT in its 30-s window of finished
    requests. It can give watts now: the window made it needy for 30 s, and every member the
    hot spot had visited kept its split (the issue's fleet, from 45 s on). Its queue waiting
    past half the TTFT SLO, or its engine's step past half the TPOT SLO, is a risk now."""
    model = LinearModel(300.0, 1.0)
    kw: dict[str, Any] = {"in_flight": 5, "power_w": 321.0, "limit_w": 322.0, "model": model}
    kw["ttft_p95_s"] = 12.0
    step = EngineLoad(queued=0.0, in_flight=5, start_rate=2.0, t_s=10.0, step_s=0.02)
    calm = Host(loop(queued=0, engine=step, **kw), rps=2.0)
    bid = LoopSignals(calm.loop, calm.counts)()
    assert not bid.needy and bid.want_w == pytest.approx(321.0 * (1 - GIVE_FRAC))
    stale = LoopSignals(loop(queued=0, engine=step, **kw))()  # no queue: the window's p95
    assert stale.needy
    waits = Host(loop(queued=1, engine=step, **kw), rps=2.0, waiting=1, oldest_s=1.5)
    assert LoopSignals(waits.loop, waits.counts)().needy
    slow = replace(step, step_s=0.07)
    stepping = Host(loop(queued=0, engine=slow, **kw), rps=2.0)
    assert LoopSignals(stepping.loop, stepping.counts)().needy


def test_a_member_just_raised_bids_as_held_until_its_meter_catches_up() -> None:
    """Its limit rose from 322 to 450 W half a second ago; its 1-s mean, 1 s late, still reads
    the 322 W drawn under the old limit. Against the limit now it reads as unheld and bids its
    model's want, taught under the old limit (here 330 W), so its share falls back and its
    limit follows: the share flapped and the limit lagged it. Against the limit its reading
    was drawn under, it is held and bids the device's highest limit."""
    model = LinearModel(300.0, 0.3)
    kw: dict[str, Any] = {"in_flight": 80, "queued": 0, "power_w": 322.0, "model": model}
    host = loop(t_s=9.0, limit_w=322.0, **kw)
    host.history.append(loop(t_s=9.5, limit_w=450.0, **kw).history[-1])
    assert LoopSignals(host)().want_w == pytest.approx(DEVICE_MAX_W)
    host.history.append(loop(t_s=11.6, limit_w=450.0, **kw).history[-1])  # 2 s on: unheld
    assert LoopSignals(host)().want_w < 400.0


def test_a_needy_member_its_limit_does_not_hold_keeps_the_share_it_has() -> None:
    """Just raised to a 506-W share, 37 requests waiting, drawing 404 W while its batch
    grows: its model, taught under the old limit, says its demand draws 333 W. Bidding that,
    its share fell back to about 390 W and came back a period later (the issue's fleet, stop
    43: the hot member's share went 497, 506, 391, 391, 373, 391, 442, 534 in 8 s)."""
    model = LinearModel(300.0, 0.3)
    kw: dict[str, Any] = {"in_flight": 73, "queued": 37, "power_w": 404.0, "model": model}
    bid = LoopSignals(loop(limit_w=492.0, ceiling_w=506.0, **kw))()
    assert bid.needy and bid.want_w == pytest.approx(506.0)


def test_a_member_whose_work_rises_keeps_its_share_on_a_meter_that_lags() -> None:
    """Its day rising, 9 then 17 requests in flight under a 358-W share, nothing queued: its
    meter, 2 s late, still reads the 182 W of the lighter load before. Bidding that plus
    headroom, it was lowered to 246 W, read its lagging meter over that as a breach, cut its
    batch from 17 to 9 and queued 19 requests (the diurnal case, stop 43). While its work is at
    a new high it keeps the share it has."""
    model = LinearModel(100.0, 5.0)
    kw: dict[str, Any] = {"queued": 0, "power_w": 182.0, "limit_w": 354.0, "model": model}
    host = loop(t_s=2.5, in_flight=9, ceiling_w=358.0, **kw)
    sig = LoopSignals(host)
    sig()
    host.history = loop(t_s=3.0, in_flight=17, **kw).history
    assert sig().want_w >= 358.0
    host.history = loop(t_s=3.5, in_flight=17, **kw).history  # no longer rising: its draw
    assert sig().want_w == pytest.approx((100.0 + 5.0 * 17) * (1 + HEADROOM_FRAC))


def test_work_that_wanders_within_its_noise_makes_no_member_needy() -> None:
    """Even load: a held member's work moves with its Poisson arrivals (40, then 48, within
    2 sd of its recent high); that is not a surge, and a fleet with nothing to move must keep
    its static split. 56 is past it."""
    model = LinearModel(540.0, 1.0)
    kw: dict[str, Any] = {"queued": 0, "power_w": 321.0, "limit_w": 322.0, "model": model}
    kw["ttft_p95_s"] = 0.3
    host = loop(t_s=10.0, in_flight=40, **kw)
    sig = LoopSignals(host)
    sig()
    host.history = loop(t_s=10.5, in_flight=48, **kw).history
    assert not sig().needy
    host.history = loop(t_s=11.0, in_flight=62, **kw).history
    assert sig().needy


def test_a_held_member_whose_arrivals_jump_gives_nothing_and_is_needy() -> None:
    """Held at its 204-W limit (a 206-W share) inside its SLOs, 14 requests in flight and 2
    arriving a second for 10 s after a burst of 40: it gives. Its next burst starts (10 a
    second): its work is still under the demand it last bid (the last burst's high, held for
    seconds), so by its work alone it went on giving 1-2 s into the burst while its prompts
    waited under the lower limit (the bursts case, stop 44). Within one period its arrivals
    read as rising (2 sd): it gives nothing and keeps its share; within two they surge (3 sd):
    held, it is needy."""
    model = LinearModel(150.0, 1.0)
    kw: dict[str, Any] = {"queued": 0, "power_w": 203.0, "limit_w": 204.0, "model": model}
    kw.update(ttft_p95_s=0.3, ceiling_w=206.0)
    host = Host(loop(in_flight=40, **kw), rps=2.0)
    sig = LoopSignals(host.loop, host.counts)
    sig()
    host.loop.history = loop(in_flight=14, **kw).history
    t = 10.0
    for _ in range(20):
        t += 0.5
        host.advance(t)
        bid = sig()
    assert not bid.needy and bid.want_w == pytest.approx(203.0 * (1 - GIVE_FRAC))
    host.rps = 10.0
    host.advance(t + 0.5)
    bid = sig()
    assert not bid.needy and bid.want_w == pytest.approx(206.0)
    host.advance(t + 1.0)
    bid = sig()
    assert bid.needy and bid.want_w == pytest.approx(DEVICE_MAX_W)


def test_a_cold_member_whose_arrivals_wander_up_keeps_its_share_and_no_more() -> None:
    """A cold member held at its device's lowest limit (200 W) inside its SLOs, 1 request a
    second, then 3 in one half-second: a 2-sd rise, not a 3-sd surge; then its work wanders
    from 6 to 9. It gives nothing and keeps its share; bidding the device's most, cold members
    whose work wandered up took their splits back from the hot one as a hot spot moved (the
    issue's fleet, stop 44)."""
    model = LinearModel(150.0, 1.0)
    kw: dict[str, Any] = {"queued": 0, "power_w": 200.0, "limit_w": 200.0, "model": model}
    kw.update(ttft_p95_s=0.3, ceiling_w=202.0)
    host = Host(loop(in_flight=6, **kw), rps=1.0)
    sig = LoopSignals(host.loop, host.counts)
    t = 10.0
    for _ in range(40):
        t += 0.5
        host.advance(t)
        sig()
    host.rps = 6.0
    host.advance(t + 0.5)
    bid = sig()
    assert not bid.needy and bid.want_w == pytest.approx(202.0)
    host.rps = 1.0  # and its work wanders up, 6 to 9 in flight: within 2 sd of its high
    host.loop.history = loop(in_flight=9, **kw).history
    host.advance(t + 1.0)
    bid = sig()
    assert not bid.needy and bid.want_w == pytest.approx(202.0)


def test_poisson_arrivals_at_a_steady_rate_seldom_read_as_rising() -> None:
    """2 requests a second, Poisson, for 5 minutes of half-second periods: the rise (2 sd) fires
    on a few periods in a hundred, not on every other one (a held member would then never
    give); the surge (3 sd), which makes a held member needy, on fewer than one in a hundred."""
    rng = np.random.default_rng(44)
    model = LinearModel(150.0, 1.0)
    host = Host(loop(in_flight=14, queued=0, power_w=203.0, limit_w=204.0, model=model), 0.0)
    sig = LoopSignals(host.loop, host.counts)
    rises, surges, n = 0, 0, 600
    for k in range(n):
        host.arrived += int(rng.poisson(2.0 * 0.5))
        host.advance(10.0 + 0.5 * k)
        sig()
        rises += sig._arrivals_up(RISE_SD)
        surges += sig._arrivals_up(SURGE_SD)
    assert rises / n < 0.05 and surges / n < 0.01


def test_a_lent_member_at_its_margin_takes_back_two_gives_not_its_whole_split() -> None:
    """A cold member lent down to 229 W of its 384-W split, held there with 15 requests, its
    step past half its TPOT SLO: needy, it took the hot member's share down to the split, and
    its margin flickered back inside a period later. It wants back what two gives took; at its
    split, at risk, it is needy as before."""
    model = LinearModel(180.0, 1.0)
    kw: dict[str, Any] = {"in_flight": 15, "queued": 0, "model": model, "tpot_p95_s": 0.08}
    lent = LoopSignals(
        loop(**kw, power_w=228.0, limit_w=229.0, ceiling_w=229.0), split_w=lambda: 384.0
    )()
    assert not lent.needy and lent.want_w == pytest.approx(229.0 / (1 - GIVE_FRAC) ** 2)
    # At its split, or a limit's margin under it: needy as before.
    at_split = LoopSignals(
        loop(**kw, power_w=379.0, limit_w=380.0, ceiling_w=380.0), split_w=lambda: 384.0
    )()
    assert at_split.needy and at_split.want_w == pytest.approx(DEVICE_MAX_W)
    bids = {
        "hot": Bid(0.05, DEVICE_MAX_W, 200.0, DEVICE_MAX_W, needy=True),
        "lent": Bid(lent.value_per_w, lent.want_w, 200.0, DEVICE_MAX_W, lent.needy),
    }
    shares = allocate(bids, 768.0)
    assert shares["lent"] == pytest.approx(lent.want_w)  # not the split's 384 W
    assert shares["hot"] == pytest.approx(768.0 - lent.want_w)
