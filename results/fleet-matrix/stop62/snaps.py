"""Snaps: a member with work queued (more than 2) whose share fell by over 20 W at a status row
where another member with at most 2 queued bid needy, per case, with the watts it lost (the
fair floor's pull that stop 62 traced), from each run's logs/<case>/fleet-*/run.json:

    python results/fleet-matrix/stop62/snaps.py RUN_DIR

Rows are sampled twice a second, so a needy bid that came and went between two rows is missed.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    total_n, total_w = 0, 0.0
    for d in sorted((Path(sys.argv[1]) / "logs").iterdir()):
        found = sorted(d.glob("fleet-*/run.json"))
        if not found:
            continue
        rows = json.loads(found[0].read_text())["status_rows"]
        members = max(s["member"] for s in rows) + 1
        last: dict[int, dict] = {}
        n, lost_w = 0, 0.0
        for s in rows:
            before = last.get(s["member"])
            last[s["member"]] = s
            if before is None or len(last) < members:
                continue
            fell = before["share_w"] - s["share_w"]
            others = [o for k, o in last.items() if k != s["member"]]
            pulled = any(o["bid_needy"] and o["queued"] <= 2 for o in others)
            if s["queued"] > 2 and fell > 20 and pulled:
                n, lost_w = n + 1, lost_w + fell
        total_n, total_w = total_n + n, total_w + lost_w
        print(f"{d.name:30s} snaps {n:3d}  share lost {lost_w:6.0f} W")
    print(f"{'all':30s} snaps {total_n:3d}  share lost {total_w:6.0f} W")


if __name__ == "__main__":
    main()
