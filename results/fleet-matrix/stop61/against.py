"""Two full-matrix runs case by case: the fleet over the split, the split's goodput (req/s) and
power while work waits over the budget; then each run's overall figures.

    python results/fleet-matrix/stop61/against.py A/matrix.json B/matrix.json [LABEL_A LABEL_B]
"""

import json
import sys
from pathlib import Path
from typing import Any


def cases(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    m = json.loads(Path(path).read_text())
    return {c["case"]["name"]: c for c in m["cases"]}, m["overall"]["fleet"]


def main() -> None:
    (ca, oa), (cb, ob) = cases(sys.argv[1]), cases(sys.argv[2])
    la, lb = sys.argv[3:5] if len(sys.argv) > 4 else ("A", "B")
    for name, x in ca.items():
        y = cb.get(name)
        if y is None:
            continue
        r = [c["fleet"]["goodput_over_static"][0] for c in (x, y)]
        s = [c["hwcap"]["goodput_rps"][0] for c in (x, y)]
        q = [c["fleet"]["power_while_queued_over_budget"][0] for c in (x, y)]
        print(
            f"{name:30s} {la} {r[0]:.2f} {lb} {r[1]:.2f}   split {s[0]:.2f} / {s[1]:.2f}   "
            f"pq {q[0]:.2f} / {q[1]:.2f}"
        )
    for label, o in ((la, oa), (lb, ob)):
        print(label, {k: v for k, v in o.items() if k != "nothing_to_win"})


if __name__ == "__main__":
    main()
