"""Each run of a `powerbatch fleet-bench` results.json, arm by arm, against the hwcap arm of the
same seed: goodput and its ratio, hot/cold goodput, seconds over the budget, mean summed power
and while work waited, answers by status, the hot server's high-class p95 TTFT, the p95 time per
token of the streamed answers, and the seconds watts took to reach each new hot spot.

    python benchmarks/fleet_runs.py results/fleet/stop42-issue-scenario/results.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

ARMS = ("hwcap", "static", "fleet", "fleet-admission", "faults")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    print("\n".join(lines(json.loads(ap.parse_args().results.read_text()))))


if __name__ == "__main__":
    main()
