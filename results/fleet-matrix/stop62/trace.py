"""One member's status rows in a fleet run (its share and bid, the latency law's cap, its two
measures, the queue) and why each member's answers missed, from a run's logs:

    python results/fleet-matrix/stop62/trace.py RUN_DIR CASE MEMBER [FROM_S TO_S]

RUN_DIR is a `fleet-bench --out` directory whose logs were kept (under /tmp: they are not
committed). A miss is counted as TTFT's where the first token came after 2 s, else as TPOT's.
"""

import json
import sys
from pathlib import Path

TTFT_SLO_S = 2.0


def main() -> None:
    root, case, member = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    lo, hi = (float(sys.argv[4]), float(sys.argv[5])) if len(sys.argv) > 5 else (0.0, 1e9)
    run = json.loads(next((root / "logs" / case).glob("fleet-*/run.json")).read_text())
    for s in run["status_rows"]:
        if s["member"] != member or not lo <= s["t_s"] <= hi:
            continue
        print(
            f"{s['t_s']:5.1f} s  share {s['share_w']:4.0f} W  needy {s['bid_needy']:.0f}  "
            f"limit {s['limit_w']:4.0f} W  power {s['power_w']:4.0f} W  "
            f"cap {s['batch']:3d}  in flight {s['in_flight']:3d}  queued {s['queued']:3d}  "
            f"{s['binding']:8s} average {s['token_s'] or 0:.3f}  step {s['step_s'] or 0:.3f}"
        )
    misses: dict[int, dict[str, int]] = {}
    for m, _t, _cls, status, ttft, _tpot, good in run["request_rows"]:
        d = misses.setdefault(m, {"sent": 0, "good": 0, "ttft": 0, "tpot": 0, "failed": 0})
        d["sent"] += 1
        if good:
            d["good"] += 1
        elif status != 200 or ttft is None:
            d["failed"] += 1
        else:
            d["ttft" if ttft > TTFT_SLO_S else "tpot"] += 1
    for m, d in sorted(misses.items()):
        print(f"member {m}: " + ", ".join(f"{k} {v}" for k, v in d.items()))


if __name__ == "__main__":
    main()
