"""The fleet scenario matrix's machinery: its cases, their loads and the figures it reports,
and one short static-split run of a case through fleet-bench's own runner."""

from __future__ import annotations

import argparse
import asyncio
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from powerbatch.cli import fleet_bench, fleet_matrix
from powerbatch.cli.main import build_parser
from powerbatch.cli.process import ChildFailed
from powerbatch.sim import capacity

SLO = fleet_matrix.TPOT_SLO_S


def matrix_args(*extra: str) -> Any:
    a = build_parser().parse_args(["fleet-bench", "--matrix", "reduced", *extra])
    a.duration_s = 20.0 if a.duration_s is None else a.duration_s
    return a


@pytest.mark.parametrize("cases", [fleet_matrix.reduced_cases(), fleet_matrix.full_cases(1)])
def test_every_case_has_a_static_split_each_gpu_set_accepts(cases: list[Any]) -> None:
    assert {c.load for c in cases} == {"moving", "diurnal", "bursts", "even"}
    for c in cases:
        budget = c.budget_w()
        limits = []
        for plant in c.plants():
            prof = plant.profile
            assert prof.min_limit_w_per_gpu * prof.num_gpus <= budget / c.members
            limit = fleet_bench.split_limit_w(plant, budget, c.members)
            assert limit <= prof.tdp_w and limit <= budget / c.members + 1e-9
            limits.append(limit)
        assert sum(limits) <= budget  # as NVML takes them (mW): no float slack over
    full = fleet_matrix.full_cases(1)
    assert {c.members for c in full} == {2, 4, 8}
    assert {c.period_s for c in full if c.load == "moving"} >= {5.0, 15.0, 30.0, 60.0}
    assert any(len(set(c.kinds)) > 1 for c in full) and any(len(set(c.meters)) > 1 for c in full)


def c_scale(case: Any, factor: float = 1.0) -> Any:
    """A `LoadScale` at `factor` on the C-sized rates (the measured factor is tested apart)."""
    plants = case.plants()
    out = fleet_matrix.output_median(case, plants)
    hot = tuple(factor * m.hot_rps for m in fleet_matrix.sizing(case, plants, out))
    return fleet_matrix.LoadScale(out, factor, factor, factor, hot, 0.0)


def sized_plans(case: Any, duration_s: float, factor: float = 1.0) -> Any:
    scale = c_scale(case, factor)
    ns = argparse.Namespace(duration_s=duration_s)
    return lambda i, seed: fleet_matrix.plan_for(case, scale)(i, ns, seed)


def test_the_loads_are_what_each_case_says() -> None:
    moving, _, diurnal, bursts, even, _ = fleet_matrix.reduced_cases()
    plan = sized_plans(moving, 40.0)
    plans = [plan(i, 1) for i in range(moving.members)]
    assert plans == [plan(i, 1) for i in range(moving.members)]  # same seeds
    for k in range(4):  # the hot member of each window gets the most requests
        counts = [sum(1 for r in p if k * 10 <= r.t_s < (k + 1) * 10) for p in plans]
        assert int(np.argmax(counts)) == k % moving.members
    plan = sized_plans(even, 40.0)
    counts = [len(plan(i, 1)) for i in range(even.members)]
    assert max(counts) < 1.3 * min(counts)  # even: nothing to move
    for case in (diurnal, bursts):  # out of phase: the members' busiest seconds differ
        starts = [
            [
                (ph.duration_s, ph.rate_rps)
                for ph in fleet_matrix.member_phases(case, i, 10.0, 1, 40.0)
            ]
            for i in range(case.members)
        ]
        assert len({tuple(s) for s in starts}) > 1
    for case in fleet_matrix.reduced_cases():  # every plan ends (phase boundaries add up)
        plan = sized_plans(case, 40.0, 1.7)
        assert all(plan(i, 1) for i in range(case.members))
    # the fleet's peak is the most sent at once: a moving hot spot's members are hot in turn
    hot = [m.hot_rps for m in moving.sizing()]
    assert fleet_matrix.fleet_peak_rps(moving, hot) == pytest.approx(
        max(hot) * fleet_matrix.BURST_PEAK + sum(hot[1:]) / moving.hot_over_cold, rel=1e-6
    )
    even_hot = [m.hot_rps for m in even.sizing()]
    assert fleet_matrix.fleet_peak_rps(even, even_hot) == pytest.approx(sum(even_hot))


def test_the_measured_load_lies_between_what_the_split_and_the_best_spread_serve() -> None:
    """The run's load is measured in the simulated engine (virtual time): the split serves
    its `split` factor and loses answers above its `most`, and at the run's own load the
    members at their w_max serve more than the split does."""
    moving = fleet_matrix.reduced_cases()[0]
    scale = fleet_matrix.load_scale(moving, 20.0)
    plants = moving.plants()
    out = scale.out_median
    base = [m.hot_rps for m in fleet_matrix.sizing(moving, plants, out)]
    split_w = [p.ceiling_w for p in plants]

    def share(factor: float, limits: list[float] | None = None) -> float:
        hot = [factor * h for h in base]
        if limits is None:  # each member at its w_max for the others' cold rates
            cold = [h / moving.hot_over_cold for h in hot]
            limits = fleet_matrix.most_w_all(moving, plants, cold, out)
        return fleet_matrix.served_share(moving, plants, hot, out, 20.0, limits)

    assert scale.split < scale.run < scale.most and scale.room > 1.3
    assert share(scale.split, split_w) >= fleet_matrix.SERVED
    assert share(scale.most) >= fleet_matrix.SERVED
    assert share(scale.most * 1.2, split_w) < fleet_matrix.SERVED
    assert share(scale.run, split_w) < share(scale.run)  # something to win
    assert scale.hot_rps == pytest.approx(tuple(scale.run * h for h in base))
    assert fleet_matrix.fleet_peak_rps(moving, scale.hot_rps) <= fleet_matrix.MAX_FLEET_RPS * 1.01


@pytest.mark.parametrize("cases", [fleet_matrix.reduced_cases(), fleet_matrix.full_cases(1)])
def test_each_peak_lies_inside_what_the_member_serves_at_its_split_and_at_its_max(
    cases: list[Any],
) -> None:
    for c in cases:
        plants = c.plants()
        out = fleet_matrix.output_median(c, plants)
        prompt, output = fleet_matrix._means(out)
        sized = fleet_matrix.sizing(c, plants, out)
        budget = c.budget_w()
        for i, (p, m) in enumerate(zip(plants, sized, strict=True)):
            assert m.at_split_rps == pytest.approx(
                capacity.capped_rps(p, p.ceiling_w, prompt, output, tpot_slo_s=SLO)
            )
            assert m.at_split_rps > 0
            if c.load == "even":  # nothing to move: at or under what the split serves
                assert m.peak_rps == m.hot_rps == m.cold_rps <= m.at_split_rps
                continue
            assert p.ceiling_w <= m.max_share_w <= p.profile.tdp_w
            assert m.at_max_rps == pytest.approx(
                capacity.capped_rps(p, m.max_share_w, prompt, output, tpot_slo_s=SLO)
            )
            assert m.at_split_rps <= m.peak_rps <= m.at_max_rps + 1e-9
            assert m.peak_rps == pytest.approx(
                m.at_split_rps + c.hot_position * (m.at_max_rps - m.at_split_rps)
            )
            assert m.cold_rps == pytest.approx(m.hot_rps / c.hot_over_cold)
            # w_max leaves the others what their cold rates need (at the sizing's fixed point)
            others = sum(
                capacity.need_w(q, s.cold_rps, prompt, output, tpot_slo_s=SLO)
                for j, (q, s) in enumerate(zip(plants, sized, strict=True))
                if j != i
            )
            if m.max_share_w > p.ceiling_w:
                assert m.max_share_w + others <= budget * 1.01
        # a peak is what its load reaches
        ns_hot = max(range(c.members), key=lambda i: sized[i].hot_rps)
        span_s = c.members * c.period_s * 2  # every member's turn at a moving hot spot
        phases = fleet_matrix.member_phases(c, ns_hot, sized[ns_hot].hot_rps, 1, span_s)
        rates = [ph.rate_rps for ph in phases]
        assert max(rates) == pytest.approx(sized[ns_hot].peak_rps, rel=1e-6)
        peak = fleet_matrix.fleet_peak_rps(c, [m.hot_rps for m in sized])
        assert peak <= fleet_matrix.MAX_FLEET_RPS * 1.01 or out >= fleet_matrix.MAX_OUTPUT_MEDIAN


def test_capacity_rises_with_the_limit_and_need_w_inverts_it() -> None:
    for kind, prof in fleet_matrix.KINDS.items():
        plant = fleet_matrix.Case("x", (kind,), ("instant",), 1.0, "even", 30.0, 1.0, 0.8).plants()[
            0
        ]
        prompt, output = fleet_matrix._means(250.0)
        lo = prof.min_limit_w_per_gpu * prof.num_gpus
        limits = np.linspace(lo, prof.tdp_w, 12)
        caps = [
            capacity.capped_rps(plant, float(w), prompt, output, tpot_slo_s=SLO) for w in limits
        ]
        assert all(b >= a for a, b in itertools.pairwise(caps)), kind
        assert caps[-1] > caps[0] > 0, kind  # the limit matters
        for rate in (caps[2], (caps[4] + caps[8]) / 2):
            w = capacity.need_w(plant, rate, prompt, output, tpot_slo_s=SLO)
            assert capacity.capped_rps(plant, w, prompt, output, tpot_slo_s=SLO) >= rate
            below_w = w - 2 * capacity.NEED_RESOLUTION_W
            assert capacity.capped_rps(plant, below_w, prompt, output, tpot_slo_s=SLO) < rate
        assert capacity.need_w(plant, caps[-1] * 2, prompt, output, tpot_slo_s=SLO) == prof.tdp_w


def test_the_even_case_sends_less_than_the_split_serves() -> None:
    even = fleet_matrix.Case("even-2", ("h100-8b",) * 2, ("mean-1s",) * 2, 0.6, "even", 30.0,
                             1.0, fleet_matrix.EVEN_POSITION)  # fmt: skip
    scale = fleet_matrix.load_scale(even, 20.0)
    assert scale.most == scale.split and scale.run == pytest.approx(
        fleet_matrix.EVEN_POSITION * scale.split
    )
    plants = even.plants()
    split_w = [p.ceiling_w for p in plants]
    share = fleet_matrix.served_share(even, plants, list(scale.hot_rps), scale.out_median, 20.0,
                                      split_w)  # fmt: skip
    assert share >= fleet_matrix.SERVED  # in virtual time the split serves all of it
    plan = fleet_matrix.plan_for(even, scale)
    for i, hot in enumerate(scale.hot_rps):
        sent = len(plan(i, argparse.Namespace(duration_s=60.0), 1)) / 60.0
        assert sent == pytest.approx(hot, rel=0.2)
    assert not even.nothing_to_win()


def test_a_case_with_no_room_reports_nothing_to_win() -> None:
    # each member's split is its TDP: no share can be raised
    flat = fleet_matrix.Case("flat", ("h100-8b",) * 2, ("instant",) * 2, 1.0, "moving", 10.0,
                             4.0, 0.5)  # fmt: skip
    assert flat.room() == pytest.approx(1.0) and flat.nothing_to_win()
    roomy = fleet_matrix.reduced_cases()[0]
    assert roomy.room() > 1.3 and not roomy.nothing_to_win()
    s_flat = fleet_matrix.case_summary(flat, {"hwcap": [_run(4.0, 0, 0.8, [])],
                                              "fleet": [_run(3.0, 0, 0.9, [])]})  # fmt: skip
    s_roomy = fleet_matrix.case_summary(roomy, {"hwcap": [_run(4.0, 0, 0.8, [])],
                                                "fleet": [_run(5.0, 0, 0.9, [])]})  # fmt: skip
    over = fleet_matrix.overall([s_flat, s_roomy])["fleet"]
    assert over["worst_goodput_over_static"] == pytest.approx(1.25)  # flat's 0.75 not counted
    assert over["nothing_to_win"] == ["flat"]
    text = fleet_matrix.table([s_flat, s_roomy])
    assert "nothing to win (0.75)" in text and "1.00x" in text


def _run(
    goodput: float, over: int, pq: float | None, moves: list[float], sent: float | None = None
) -> dict[str, Any]:
    return {
        "goodput_rps": goodput,
        "sent_rps": sent,
        "seconds_over_budget": over,
        "seconds": 20,
        "power_while_queued_over_budget": pq,
        "reach_while_queued_over_budget": None if pq is None else min(1.0, pq + 0.04),
        "mean_total_w": 1000.0,
        "seconds_to_move_watts": moves,
    }


def test_the_figures_are_ratios_to_the_static_split_of_the_same_seed(tmp_path: Path) -> None:
    case = fleet_matrix.reduced_cases()[0]
    runs = {
        "hwcap": [_run(4.0, 0, 0.8, []), _run(5.0, 0, 0.82, [])],
        "fleet": [_run(6.0, 0, 0.97, [1.0, 3.0]), _run(5.0, 1, 0.96, [2.0])],
        "fleet-admission": [_run(2.0, 0, 0.9, [4.0]), _run(4.0, 0, None, [])],
    }
    s = fleet_matrix.case_summary(case, runs)
    assert s["fleet"]["goodput_over_static"] == pytest.approx([1.5, 1.0])
    assert s["fleet"]["median_seconds_to_move_watts"] == 2.0
    s2 = fleet_matrix.case_summary(fleet_matrix.reduced_cases()[4], {
        "hwcap": [_run(4.0, 0, 0.8, [])], "fleet": [_run(3.0, 0, 0.9, [])],
        "fleet-admission": [_run(4.4, 0, 0.9, [])]})  # fmt: skip
    over = fleet_matrix.overall([s, s2])
    assert over["fleet"]["worst_goodput_over_static"] == pytest.approx(0.75)
    assert over["fleet"]["worst_case"] == s2["case"]["name"]
    assert over["fleet"]["seconds_over_budget"] == 1
    # over the reach: 0.965 / 1.0 (s), 0.9 / 0.94 (s2); 0.78 and 0.8 for the cap
    assert over["fleet"]["mean_power_while_queued_over_reach"] == pytest.approx(
        (0.965 + 0.9 / 0.94) / 2
    )
    assert over["fleet-admission"]["median_goodput_over_static"] == pytest.approx((0.65 + 1.1) / 2)
    text = fleet_matrix.table([s, s2])
    assert case.name in text and "1.25 (1.00-1.50) | 1.25 |" in text
    fleet_matrix.plot([s, s2], tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 0


def test_a_static_split_run_of_a_case_caps_each_gpu_set_and_counts_waiting_work(
    tmp_path: Path,
) -> None:
    """fleet-bench's runner on a two-member case, hardware caps only (no proxy, no Redis)."""
    a = matrix_args("--duration-s", "3", "--drain-timeout-s", "3")
    case = fleet_matrix.reduced_cases()[1]  # an 8B and a 70B-class set, two meters
    ns = fleet_matrix.case_args(a, case, c_scale(case))
    run = asyncio.run(asyncio.wait_for(fleet_bench.run_arm("hwcap", ns, 1, tmp_path), 35))
    assert run["requests"] > 0 and run["seconds"] == 3
    assert run["sent_rps"] == pytest.approx(run["requests"] / 3)  # every request sent, per s
    assert run["goodput_rps"] <= run["sent_rps"]  # so the bound is never under 1
    assert run["max_total_w"] > 0
    limits = [fleet_bench.split_limit_w(p, ns.budget_w, 2) for p in ns.plants]
    assert run["max_total_w"] <= sum(limits) * 1.02  # each capped at its split
    assert run["queued_seconds"] >= 0 and "status_rows" in run


def test_a_run_whose_child_lost_its_port_runs_again_and_other_failures_stand(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []

    async def run_arm(arm: str, *args: object) -> dict[str, object]:
        calls.append(arm)
        if len(calls) == 1 or arm == "broken":
            tail = "OSError: [Errno 98] address already in use" if arm != "broken" else "boom"
            raise ChildFailed(f"sims did not become ready:\n{tail}")
        return {"arm": arm}

    monkeypatch.setattr(fleet_bench, "run_arm", run_arm)
    ns = argparse.Namespace()
    assert asyncio.run(fleet_matrix.run_once("fleet", ns, 1, tmp_path)) == {"arm": "fleet"}
    assert calls == ["fleet", "fleet"]
    with pytest.raises(ChildFailed, match="boom"):
        asyncio.run(fleet_matrix.run_once("broken", ns, 1, tmp_path))


def test_the_bound_is_what_was_sent_over_the_splits_goodput_on_the_cases_counted() -> None:
    """A fleet cannot answer more than was sent: sent ÷ the split's goodput bounds its ratio.
    The median is over the cases the ratio's median counts (not the one with nothing to win)."""
    flat = fleet_matrix.Case("flat", ("h100-8b",) * 2, ("instant",) * 2, 1.0, "moving", 10.0,
                             4.0, 0.5)  # fmt: skip
    roomy, other = fleet_matrix.reduced_cases()[0], fleet_matrix.reduced_cases()[4]
    runs = {
        flat: ([_run(4.0, 0, 0.8, [], sent=8.0)], [_run(4.0, 0, 0.8, [])]),
        roomy: ([_run(4.0, 0, 0.8, [], sent=6.0), _run(5.0, 0, 0.8, [], sent=6.0)],
                [_run(5.0, 0, 0.9, []), _run(5.0, 0, 0.9, [])]),
        other: ([_run(10.0, 0, 0.8, [], sent=11.0)], [_run(10.5, 0, 0.9, [])]),
    }  # fmt: skip
    ss = [fleet_matrix.case_summary(c, {"hwcap": h, "fleet": f}) for c, (h, f) in runs.items()]
    assert ss[1]["hwcap"]["bound_over_static"] == pytest.approx([1.5, 1.2])
    over = fleet_matrix.overall(ss)["fleet"]
    assert over["median_bound_over_static"] == pytest.approx((1.35 + 1.1) / 2)  # flat's 2.0 out
    assert "| 1.35 (1.20-1.50) | 1.12 (1.00-1.25) |" in fleet_matrix.table(ss)
    old = fleet_matrix.case_summary(roomy, {"hwcap": [_run(4.0, 0, 0.8, [])], "fleet": []})
    assert old["hwcap"]["bound_over_static"] == []  # a run that did not count what it sent
