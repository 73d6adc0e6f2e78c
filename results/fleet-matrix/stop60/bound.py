"""Each case's bound (the requests sent over the split's goodput: what a fleet that answered
every one in time would read) beside the fleet's ratio, from a matrix run's runs.json and
matrix.json. Runs from before stop 60 did not record `sent_rps`: their `requests` over the
load's seconds (`--duration-s`, 20 by default) stand in.

    python results/fleet-matrix/stop60/bound.py results/fleet-matrix/stop56/full [duration_s]
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    duration_s = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    runs = json.loads((root / "runs.json").read_text())
    cases = json.loads((root / "matrix.json").read_text())["cases"]
    rows = []
    print(f"{'case':32s} {'split':>6s} {'bound':>6s} {'fleet':>6s} {'of bound':>8s}")
    for c in cases:
        name = c["case"]["name"]
        split, fleet = runs[name]["hwcap"], runs[name]["fleet"]
        sent = [r.get("sent_rps") or r["requests"] / duration_s for r in split]
        bound = statistics.fmean(s / r["goodput_rps"] for s, r in zip(sent, split, strict=True))
        ratio = statistics.fmean(
            f["goodput_rps"] / s["goodput_rps"] for f, s in zip(fleet, split, strict=False)
        )
        counted = not c["case"].get("nothing_to_win")
        if counted:
            rows.append((name, bound, ratio))
        split_rps = statistics.fmean(r["goodput_rps"] for r in split)
        mark = "" if counted else "  (nothing to win: not counted)"
        print(f"{name:32s} {split_rps:6.2f} {bound:6.2f} {ratio:6.2f} {ratio / bound:8.2f}{mark}")
    bounds = [b for _, b, _ in rows]
    of = [r / b for _, b, r in rows]
    print(
        f"{len(rows)} counted: median bound {statistics.median(bounds):.2f}, "
        f"{sum(b >= 1.3 for b in bounds)} at 1.3x or more; fleet median "
        f"{statistics.median(r for *_, r in rows):.2f}, {statistics.median(of):.2f} of its bound "
        f"at the median, at 0.99 of it or more on {sum(x >= 0.99 for x in of)}"
    )


if __name__ == "__main__":
    main()
