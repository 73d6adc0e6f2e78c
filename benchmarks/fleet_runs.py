"""Each run of a `powerbatch fleet-bench` results.json, arm by arm, against the hwcap arm of the
same seed: goodput and its ratio, hot/cold goodput, seconds over the budget, mean summed power
and while work waited, answers by status, the hot server's high-class p95 TTFT, the p95 time per
token of the streamed answers, and the seconds watts took to reach each new hot spot.

`--moves` (the fleet arm alone, no hwcap needed): the seconds after each move of fleet-bench's
own 15-s hot spot until the new hot member's share first reaches 400 W and 500 W, and its
largest share then. The bench's own figure (90 % of that largest) grows with the largest, so
a fleet that gives the hot member more reads slower on it (docs/fleet.md, stop 44).

    python benchmarks/fleet_runs.py results/fleet/stop42-issue-scenario/results.json
    python benchmarks/fleet_runs.py --moves results/fleet/stop44-issue-scenario-final/results.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

ARMS = ("hwcap", "static", "fleet", "fleet-admission", "faults")
PERIOD_S = 15.0  # fleet-bench's default hot-spot period
THRESHOLDS_W = (400.0, 500.0)


def lines(results: dict) -> list[str]:
    arms = [a for a in ARMS if a in results]
    out = []
    for i, base in enumerate(results["hwcap"]["runs"]):
        for arm in arms:
            run = results[arm]["runs"][i]
            rows = run["request_rows"]  # member, t, class, status, ttft, tpot, within SLO
            tpots = sorted(r[5] for r in rows if r[5] is not None)
            tpot_p95 = tpots[int(0.95 * len(tpots))] if tpots else float("nan")
            moves = [round(m, 1) for m in run.get("seconds_to_move_watts", [])]
            out.append(
                f"seed {run['seed']} {arm:15s} goodput {run['goodput_rps']:.2f}"
                f" ({run['goodput_rps'] / base['goodput_rps']:.2f}x)"
                f" hot {run['hot_goodput_rps']:.2f} cold {run['cold_goodput_rps']:.2f}"
                f" over {run['seconds_over_budget']} s, mean {run['mean_total_w']:.0f} W"
                f" ({run['power_while_queued_over_budget']:.2f} of the budget while queued)"
                f" status {dict(Counter(r[3] for r in rows))}"
                f" hot high TTFT p95 {run['hot_high_ttft_p95_s']:.1f} s"
                f" TPOT p95 {tpot_p95:.3f} s moves {moves}"
            )
    return out


def move_lines(results: dict[str, Any]) -> list[str]:
    out = []
    for run in results["fleet"]["runs"]:
        rows, moves = run["status_rows"], []
        for k in range(1, 4):
            t0, hot = k * PERIOD_S, k % 4
            trace = sorted(
                (r["t_s"] - t0, r["share_w"])
                for r in rows
                if r["member"] == hot and t0 <= r["t_s"] < t0 + PERIOD_S
            )
            firsts = [next((f"{t:.1f}" for t, w in trace if w >= x), "-") for x in THRESHOLDS_W]
            most = max((w for _, w in trace), default=float("nan"))
            reach = f"400 W at {firsts[0]} s, 500 W at {firsts[1]} s"
            moves.append(f"move {k}: {reach}, largest {most:.0f} W")
        out.append(f"seed {run['seed']}: " + " | ".join(moves))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--moves", action="store_true", help="watts to each new hot spot only")
    a = ap.parse_args()
    results = json.loads(a.results.read_text())
    print("\n".join(move_lines(results) if a.moves else lines(results)))


if __name__ == "__main__":
    main()
