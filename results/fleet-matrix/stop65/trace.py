"""A fleet run's status rows, member by member every half second: share, power, work in
flight and queued, the engine's step, needy, `keep_w` (where bid) and the bid's value.

    python results/fleet-matrix/stop65/trace.py LOG_DIR/run.json [until_s]
"""

import collections
import json
import sys
from pathlib import Path


def main() -> None:
    doc = json.loads(Path(sys.argv[1]).read_text())
    until_s = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    by: dict[float, dict[int, dict]] = collections.defaultdict(dict)
    for r in doc["status_rows"]:
        by[round(r["t_s"] * 2) / 2][r["member"]] = r
    members = sorted({m for rows in by.values() for m in rows})
    print(f"goodput {doc['goodput_rps']} req/s (hot {doc['hot_goodput_rps']}, cold "
          f"{doc['cold_goodput_rps']}); per member: share W, power W, in flight, queued, "
          "step s, needy, keep_w W, value")  # fmt: skip
    for t in sorted(by):
        if t > until_s:
            break
        cells = []
        for m in members:
            r = by[t].get(m)
            if r is None:
                cells.append("-")
                continue
            keep = r.get("bid_keep_w") or 0.0
            cells.append(
                f"{r['share_w']:5.0f} {r['power_w']:5.0f} {r['in_flight']:4d} {r['queued']:3d} "
                f"{r['step_s'] or 0:.2f} {int(r['bid_needy'] or 0)} {keep:4.0f} "
                f"{r['bid_value_per_w'] or 0:.3f}"
            )
        print(f"{t:5.1f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
