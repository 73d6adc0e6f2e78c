"""How fast watts reach each new hot spot on fleet-bench's own fleet (docs/fleet.md, stop 44).

For each fleet run in a `results.json` of `powerbatch fleet-bench` (its default 15-s hot spot
over four members): the seconds after each move until the new hot member's share first reaches
400 W and 500 W, and its largest share in that period. The bench's own figure (90 % of that
largest) grows with the largest, so a fleet that gives the hot member more reads slower on it.

    python benchmarks/fleet_moves.py results/fleet/stop44-issue-scenario-final/results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PERIOD_S = 15.0
THRESHOLDS_W = (400.0, 500.0)


def lines(results: dict[str, Any]) -> list[str]:
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
    print("\n".join(lines(json.loads(ap.parse_args().results.read_text()))))


if __name__ == "__main__":
    main()
