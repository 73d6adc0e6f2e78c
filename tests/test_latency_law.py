"""The latency law: the engine's inter-token latency acts within scrapes, the finished
requests' p95 a request's length late."""

from __future__ import annotations

from powerbatch.control import ControlConfig, EngineLoad, LatencySnapshot
from powerbatch.control.laws.latency import FAST_HOLD_SCRAPES, LatencyLaw

SLO_S = 0.1


def snapshot(tpot_p95_s: float | None) -> LatencySnapshot:
    return LatencySnapshot(0.5, tpot_p95_s, {"high": 0.5}, 50)


def engine(t_s: float, token_s: float, step_s: float) -> EngineLoad:
    return EngineLoad(0, 200, 10.0, t_s, token_s, step_s)


def law() -> LatencyLaw:
    return LatencyLaw(ControlConfig(ceiling_w=600.0, max_batch=256, tpot_slo_s=SLO_S))


def test_a_slow_step_shrinks_the_batch_before_any_request_has_finished() -> None:
    fast, slow = law(), law()
    for tick in range(10):  # 2 s at 5 Hz, a scrape a second, no request finished yet
        t_s = 0.2 * tick
        fast.update(t_s, snapshot(None), 200, engine(float(int(t_s)), 2 * SLO_S, 2 * SLO_S))
        slow.update(t_s, snapshot(None), 200)
    assert fast.batch < 200 * 0.8  # shrunk by the excess, at once
    assert slow.batch == 256  # the p95 alone has nothing to say yet


def test_the_engines_measure_acts_once_per_few_scrapes() -> None:
    ll = law()
    ll.update(0.0, None, 200, engine(0.0, 1.5 * SLO_S, 1.5 * SLO_S))
    first = ll.batch
    assert first < 200
    for k in range(1, FAST_HOLD_SCRAPES):  # still over, but the shrink cannot show yet
        ll.update(float(k), None, 200, engine(float(k), 1.5 * SLO_S, 1.5 * SLO_S))
        assert ll.batch == first
    ll.update(9.0, None, 200, engine(9.0, 1.5 * SLO_S, 1.5 * SLO_S))
    assert ll.batch < first


def test_neither_a_remembered_breach_nor_a_passing_burst_shrinks_the_batch() -> None:
    ll = law()
    ll.batch = 100.0
    # The average still holds the slow steps of a larger batch (and the p95 too), the step now
    # is inside the SLO: the breach is the past, and acting on it would wind the batch down.
    for k in range(20):
        ll.update(float(k), snapshot(3 * SLO_S), 100, engine(float(k), 1.5 * SLO_S, 0.95 * SLO_S))
    assert ll.batch == 100.0  # and the step inside the dead band: no regrowth either
    # A prefill burst slows the steps now, not a request's average: nothing to act on.
    for k in range(20, 25):
        ll.update(float(k), None, 100, engine(float(k), 0.7 * SLO_S, 3 * SLO_S))
    assert ll.batch == 100.0
    for k in range(25, 45):
        ll.update(float(k), None, 100, engine(float(k), 0.5 * SLO_S, 0.5 * SLO_S))
    assert ll.batch > 100.0  # well under: regrows


def test_without_the_engines_measure_the_p95_acts_once_per_hold() -> None:
    ll = law()
    ll.update(0.0, snapshot(2 * SLO_S), 200)
    first = ll.batch
    assert first < 200
    ll.update(1.0, snapshot(2 * SLO_S), 200)
    assert ll.batch == first  # within latency_hold_s
    ll.update(ll.config.gains.latency_hold_s, snapshot(2 * SLO_S), 200)
    assert ll.batch < first


def test_with_no_average_yet_the_step_alone_shrinks_nothing_and_the_p95_is_not_read() -> None:
    ll = law()
    load = EngineLoad(0, 200, 10.0, 0.0, None, 3 * SLO_S)  # no request has finished yet
    for k in range(30):
        ll.update(float(k), snapshot(3 * SLO_S), 200, load)
    assert ll.batch == 256
