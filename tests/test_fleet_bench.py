"""The fleet bench's own arithmetic: calibration bounds, reallocation spans, the figures."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from powerbatch.cli import fleet_bench
from powerbatch.cli.main import build_parser


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["fleet-bench", *extra])


def test_members_take_their_share_bounds_from_their_devices_unless_told() -> None:
    a = args()
    proxy = fleet_bench.proxy_args(a, 0, "fleet", "http://s", 1, 2, fleet_bench.Path("/tmp"))
    assert "--power-limiter" in proxy and "--fleet-budget" in proxy
    assert "--fleet-min-share-w" not in proxy and "--fleet-max-share-w" not in proxy
    told = fleet_bench.proxy_args(
        args("--min-share-w", "480"), 0, "fleet", "http://s", 1, 2, fleet_bench.Path("/tmp")
    )
    assert told[told.index("--fleet-min-share-w") + 1] == "480.0"
    static = fleet_bench.proxy_args(a, 0, "static", "http://s", 1, 2, fleet_bench.Path("/tmp"))
    assert "--power-limiter" in static and "--fleet-budget" not in static  # same actuator
    plain = fleet_bench.proxy_args(
        args("--no-limiter"), 0, "static", "http://s", 1, 2, fleet_bench.Path("/tmp")
    )
    assert "--power-limiter" not in plain


def test_both_arms_get_the_same_load_and_the_hot_spot_moves() -> None:
    a = args("--duration-s", "90")
    plans = [fleet_bench.profile_for(i, a, seed=1) for i in range(a.members)]
    assert plans == [fleet_bench.profile_for(i, a, seed=1) for i in range(a.members)]
    for k in range(3):  # in each 30-s window, the hot member gets the most requests
        counts = [sum(1 for r in p if k * 30 <= r.t_s < (k + 1) * 30) for p in plans]
        assert int(np.argmax(counts)) == k % a.members
        assert fleet_bench.hot_member(k * 30 + 1, a) == k % a.members


def test_reallocation_spans_and_figures() -> None:
    a = args("--duration-s", "20", "--hot-period-s", "10", "--members", "2", "--budget-w", "1000")
    rows = []
    for t in np.arange(0, 20, 0.5):
        hot = int(t // 10)
        for m in range(2):
            share = 700.0 if (m == hot and t >= 10 + 2 * hot) or (m == 0 and t < 10) else 300.0
            rows.append({"t_s": float(t), "member": m, "share_w": share, "state": "live"})
    spans = fleet_bench.reallocation_windows(rows, a)
    assert spans and all(t0 <= 12.0 <= t1 for t0, t1 in spans)  # given at 10 s, taken at 12 s
    mask = fleet_bench.seconds_in(spans, 20)
    assert mask[11] and mask[14] and not mask[5] and not mask[19]
    figs = fleet_bench.fleet_figures(a, rows, {}, np.full(20, 900.0))
    assert figs["seconds_to_move_watts"] == [2.0]


def test_a_server_idle_since_its_last_step_reads_its_idle_draw() -> None:
    from powerbatch.cli.report import power_1s

    trace = {"t_s": [0.0, 1.0], "step_s": [0.5, 0.5], "energy_j": [300.0, 900.0]}
    idle_w = 78.0
    state = {"t_s": 5.5, "energy_j": 900.0 + idle_w * 4.0}  # idle from 1.5 s on
    _, bare = power_1s(trace, 0.0, 5.0)
    _, full = power_1s(fleet_bench.with_energy_now(trace, state), 0.0, 5.0)
    assert bare[-1] == 0.0  # what the trace alone says
    assert full[-1] == np.float64(idle_w)


def test_a_server_with_no_step_in_the_run_reads_its_idle_draw() -> None:
    from powerbatch.cli.report import power_1s

    idle_w = 78.0
    start = {"t_s": 0.0, "energy_j": 500.0}
    end = {"t_s": 5.0, "energy_j": 500.0 + idle_w * 5.0}
    empty: dict[str, list[float]] = {"t_s": [], "step_s": [], "energy_j": []}
    _, p = power_1s(fleet_bench.with_energy_now(empty, end, start), 0.0, 5.0)
    assert p == pytest.approx([idle_w] * 5)


def test_the_reach_counts_queued_members_at_their_sets_maximum_within_the_budget() -> None:
    """Two 700-W sets, a 1,000-W budget. Second 0: member 0 queues at 600 W beside 300 W drawn:
    it could take 700, so the reach is the budget. Second 1: member 0 queues at its 700-W
    maximum beside 100 W: no allocation reaches past 800. Second 2: nothing waits."""
    rows = [
        {"t_s": 0.2, "member": 0, "queued": 3},
        {"t_s": 0.7, "member": 1, "queued": 0},
        {"t_s": 1.5, "member": 0, "queued": 1},
        {"t_s": 2.5, "member": 0, "queued": 0},
    ]
    sim_rows = [{"t_s": 2.9, "member": 1, "sim_waiting": 0}]
    queued = fleet_bench.queued_by_member(rows, sim_rows, 2, 3)
    assert queued.tolist() == [[True, False], [True, False], [False, False]]
    plants = fleet_bench.member_plants(args("--members", "2", "--budget-w", "1000"))
    member_w = [[600.0, 700.0, 200.0], [300.0, 100.0, 200.0]]
    reach = fleet_bench.reach_w(queued, member_w, plants, 1000.0)
    assert reach.tolist() == [1000.0, 800.0, 400.0]
