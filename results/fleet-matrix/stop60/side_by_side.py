"""Two matrix runs of the same cases side by side: main (A, `--arms hwcap,fleet`) and a
change (B, `--arms fleet`), each fleet over A's split of the same seed, with the bound, power
while queued and the shares cut by over 10 % of the split and back within 3 s (from each
run's logs/<case>/fleet-<seed>/run.json; "None" where the logs were not kept).

    python results/fleet-matrix/stop60/side_by_side.py /tmp/fm-A /tmp/fm-B
"""

import json
import statistics
import sys
from pathlib import Path
from typing import Any

CUT_FRAC = 0.1  # of the split: a cut this large or more
BACK_S = 3.0  # and back to within half of it this soon


def churn(root: Path, case: dict[str, Any]) -> int | None:
    found = sorted((root / "logs" / case["name"]).glob("fleet-*/run.json"))
    if not found:
        return None
    path = found[0]
    rows = json.loads(path.read_text())["status_rows"]
    rows = [x for x in rows if x["share_w"] is not None and 0 <= x["t_s"] <= 20]
    members = len(case["kinds"])
    step = CUT_FRAC * case["budget_w"] / members
    n = 0
    for m in range(members):
        xs = [(x["t_s"], x["share_w"]) for x in rows if x["member"] == m]
        for i in range(1, len(xs)):
            if xs[i - 1][1] - xs[i][1] > step:
                back = [s for t, s in xs[i:] if t <= xs[i][0] + BACK_S]
                n += max(back) >= xs[i - 1][1] - step / 2
    return n


def main() -> None:
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    ra = json.loads((a / "runs.json").read_text())
    rb = json.loads((b / "runs.json").read_text())
    matrix = json.loads((a / "matrix.json").read_text())
    cases = {c["case"]["name"]: c["case"] for c in matrix["cases"]}
    print(
        f"{'case':30s} {'split':>6s} {'bound':>5s} {'main':>5s} {'var':>5s}"
        "  pq main/var   churn main/var"
    )
    out = []
    for name, case in cases.items():
        if name not in rb:  # B ran a subset of A's cases
            continue
        h, fa, fb = ra[name]["hwcap"][0], ra[name]["fleet"][0], rb[name]["fleet"][0]
        g = h["goodput_rps"]
        bound = h.get("sent_rps", h["requests"] / 20) / g
        ra_, rb_ = fa["goodput_rps"] / g, fb["goodput_rps"] / g
        nw = case.get("nothing_to_win")
        out.append((bound, ra_, rb_, nw))
        pa = fa["power_while_queued_over_budget"] or 0.0
        pb = fb["power_while_queued_over_budget"] or 0.0
        print(
            f"{name:30s} {g:6.2f} {bound:5.2f} {ra_:5.2f} {rb_:5.2f}  {pa:.2f}/{pb:.2f}"
            f"   {churn(a, case)}/{churn(b, case)}  over {fa['seconds_over_budget']}/"
            f"{fb['seconds_over_budget']} {'NW' if nw else ''}"
        )
    cnt = [x for x in out if not x[3]]
    med = statistics.median
    print(
        f"counted {len(cnt)} median bound {med(x[0] for x in cnt):.3f} main "
        f"{med(x[1] for x in cnt):.3f} var {med(x[2] for x in cnt):.3f} mean main/var "
        f"{statistics.fmean(x[1] for x in cnt):.3f} {statistics.fmean(x[2] for x in cnt):.3f} "
        f"worst {min(x[1] for x in cnt):.3f} {min(x[2] for x in cnt):.3f}"
    )


if __name__ == "__main__":
    main()
