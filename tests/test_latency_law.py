"""The latency law: the engine's inter-token latency acts within scrapes, the finished
requests' p95 a request's length late."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from powerbatch.control import ControlConfig, EngineLoad, LatencySnapshot
from powerbatch.control.laws.latency import FAST_HOLD_SCRAPES, FUTILE_MEMORY_S, LatencyLaw

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


def _drive(
    ll: LatencyLaw,
    step_of: Callable[[int], float],
    seconds: int,
    demand: int = 200,
    reserve: int = 0,
) -> list[float]:
    """A plant scraped once a second under a demand of 200 requests: the engine runs
    min(cap, 200) (at least `reserve`: the top class's slots beyond the cap), its step is
    step_of(running), and a request's average is the step."""
    caps = []
    for k in range(seconds):
        running = max(min(int(ll.batch), demand), reserve)
        step_s = step_of(running)
        ll.update(float(k), None, running, EngineLoad(0, running, 10.0, float(k), step_s, step_s))
        caps.append(ll.batch)
    return caps


@pytest.mark.parametrize(
    "step_of",
    [
        # Every step carries a long prompt's prefill: a smaller batch is barely faster.
        lambda b: 2 * SLO_S * (b / 200) ** 0.05,
        # The weights' read is 1.5x the SLO by itself: no batch meets it.
        lambda b: SLO_S * (1.5 + 0.5 * b / 200),
    ],
    ids=["prefill-in-every-step", "fixed-part-over-the-slo"],
)
def test_cuts_that_cannot_reach_the_slo_are_undone_and_backed_off(
    step_of: Callable[[int], float],
) -> None:
    ll = law()
    caps = _drive(ll, step_of, 150)
    cut = [c < 200 for c in caps]
    starts = [k for k in range(1, len(cut)) if cut[k] and not cut[k - 1]] + ([0] * cut[0])
    ends = [k for k in range(1, len(cut)) if cut[k - 1] and not cut[k]]
    assert ends and ends[0] < 15  # judged on the first cut that moved the batch, and undone
    memory = int(FUTILE_MEMORY_S)
    # Tried again after the memory, then after twice it: three tries in 150 s, each undone.
    assert sorted(starts) == [0, ends[0] + memory, ends[1] + 2 * memory]
    # Each try cuts until the batch has halved: three cuts of a quarter, three scrapes apart.
    assert len(ends) == 3 and sum(cut) < 30
    assert ll.multiplier == 0.0  # latency is not what binds: no batch buys it
    assert ll.status(150.0)["cuts_undone_total"] == 3
    assert "no batch meets it" in ll.last_undo


def test_a_step_that_grows_faster_than_the_batch_is_judged_by_the_latest_halving() -> None:
    # A roofline's step: flat at small batches (the weights' read, 1.15x the SLO by itself),
    # steep at large ones. A line from where the cuts began (200 requests) underrates the fixed
    # part ever more as the batch falls, and gave up only near the floor; the line over the
    # latest halving sees the flat part while the batch is still in the forties.
    ll = law()
    caps = _drive(ll, lambda b: SLO_S * (1.15 + 1.5 * (b / 200) ** 2), 60)
    assert ll.status(60.0)["cuts_undone_total"] == 1
    assert min(caps) >= 40


def test_a_few_requests_a_little_over_the_slo_are_cut_a_request_at_a_time() -> None:
    # Five requests running (a warm-up's, the top class's reserve slots beyond the cap), each
    # step 1.25x the SLO: a cut of a quarter of the excess is 6 % of the cap, which took 14
    # cuts (42 s; the 70B plant, 44 s) to reach min_batch; one request a cut takes four.
    ll = law()
    _drive(ll, lambda b: SLO_S * (1.2 + 0.01 * b), 16, demand=5, reserve=5)
    assert ll.status(16.0)["cuts_undone_total"] == 1


def test_cuts_that_begin_at_a_small_batch_are_undone_at_the_floor() -> None:
    # Three requests (a warm-up's), two of them always running (the top class's reserve),
    # a step over the SLO at any batch: the running batch cannot halve, so the line is never
    # drawn; once the cap is at min_batch, the step there, still over, is the proof.
    ll = law()
    caps = _drive(ll, lambda b: SLO_S * (1.2 + 0.01 * b), 30, demand=3, reserve=2)
    assert ll.status(30.0)["cuts_undone_total"] == 1
    assert int(min(caps)) == 1 and caps[-1] >= 3  # cut to the floor (as enforced), given back


@pytest.mark.parametrize(
    ("step_of", "slo_batch"),
    [
        (lambda b: 2 * SLO_S * b / 200, 100),  # throttled decode: the step follows the batch
        (lambda b: SLO_S * (0.5 + 1.5 * b / 200), 67),  # a fixed part under the SLO
    ],
    ids=["proportional", "affine"],
)
def test_cuts_that_pay_go_on_until_the_step_is_inside_the_slo(
    step_of: Callable[[int], float], slo_batch: int
) -> None:
    ll = law()
    caps = _drive(ll, step_of, 120)
    assert ll.status(120.0)["cuts_undone_total"] == 0  # no cut taken for one that cannot pay
    assert max(caps[90:]) <= 1.1 * slo_batch  # cut down to the SLO's batch, and kept there
    assert min(caps) >= 0.6 * slo_batch


@pytest.mark.parametrize("seed", range(10))
def test_a_noisy_step_that_grows_less_than_in_proportion_is_cut_not_given_up(seed: int) -> None:
    # A real vLLM's step (CPU build: about 20 ms at 20 requests, 27 at 46) grows less than in
    # proportion, and its one-second mean moves by a few %: a line through a 10 % fall read a
    # 20-ms SLO it meets at about 20 requests as out of reach (docs/vllm-plugin.md). A 10 %
    # fall (JUDGE_FALL 1.1) failed 4 of these 10 seeds. Here the SLO is met at 65 of 200.
    rng = np.random.default_rng(seed)

    def step_of(b: int) -> float:
        return SLO_S * (0.55 + 0.0197 * b**0.75) * (1.0 + 0.03 * float(rng.standard_normal()))

    ll = law()
    caps = _drive(ll, step_of, 120)
    assert ll.status(120.0)["cuts_undone_total"] == 0
    assert max(caps[90:]) <= 1.1 * 65


def test_a_batch_the_engine_queues_is_not_taken_for_a_cut_that_failed() -> None:
    # Cut once; then a prefill backlog: the engine queues 40 of the 200 still admitted (its
    # running batch falls 1.25x, not by the cut) and its step rises. That is no judgement.
    ll = law()
    ll.update(0.0, None, 200, EngineLoad(0, 200, 10.0, 0.0, 2 * SLO_S, 2 * SLO_S))
    cut = ll.batch
    assert cut < 200
    for k in range(1, 10):
        ll.update(float(k), None, 200, EngineLoad(40, 200, 10.0, float(k), 2 * SLO_S, 3 * SLO_S))
    assert ll.batch < cut  # cut on, as before: nothing says the cuts could not pay
    assert ll.status(10.0)["cuts_undone_total"] == 0
