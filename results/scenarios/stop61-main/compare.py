"""Two scenario-bench runs scenario by scenario: the cap's and powerbatch's goodput (req/s),
and powerbatch's goodput, J/token and p95 TTFT over the cap's (first run / second run).

    python results/scenarios/stop61-main/compare.py A/results.json B/results.json
"""

import json
import sys
from pathlib import Path
from typing import Any


def scenarios(path: str) -> dict[int, Any]:
    return {s["index"]: s for s in json.loads(Path(path).read_text())["scenarios"]}


def fmt(v: float | None) -> str:
    return "  —  " if v is None else f"{v:5.2f}"


def main() -> None:
    first, second = scenarios(sys.argv[1]), scenarios(sys.argv[2])
    for i, x in sorted(first.items()):
        y = second.get(i)
        if y is None:
            continue
        cap, pb = ([s["runs"][a]["goodput_rps"] for s in (x, y)] for a in ("hwcap", "powerbatch"))
        fig = {
            k: "/".join(fmt(s["figures"]["powerbatch"].get(k)) for s in (x, y))
            for k in ("goodput", "j_per_token", "ttft_p95")
        }
        print(
            f"{i:2d} cap {cap[0]:6.2f}/{cap[1]:6.2f}  pb {pb[0]:6.2f}/{pb[1]:6.2f}"
            f"  good/cap {fig['goodput']}  J/tok {fig['j_per_token']}  ttft {fig['ttft_p95']}"
        )


if __name__ == "__main__":
    main()
