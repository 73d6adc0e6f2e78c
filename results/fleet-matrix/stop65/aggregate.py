"""A matrix run's fleet figures besides goodput: seconds over the budget, power while work
waited over the budget (mean, lowest), and the seconds watts took to reach a new hot spot
(median over the cases' medians), from each matrix.json given.

    python results/fleet-matrix/stop65/aggregate.py RUN/matrix.json [...]
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    over, queued, moves = 0, [], []
    for p in sys.argv[1:]:
        for c in json.loads(Path(p).read_text())["cases"]:
            f = c["fleet"]
            over += sum(f["seconds_over_budget"])
            queued += [x for x in f["power_while_queued_over_budget"] if x is not None]
            if f.get("median_seconds_to_move_watts") is not None:
                moves.append(f["median_seconds_to_move_watts"])
    print(
        f"seconds over the budget {over}; power while queued / budget mean "
        f"{statistics.fmean(queued):.2f}, lowest {min(queued):.2f}; watts to a hot spot "
        f"{statistics.median(moves):.2f} s (median of {len(moves)} cases' medians)"
    )


if __name__ == "__main__":
    main()
