"""The clock law's choices in one bench run: each change of the top in force or of the law's
reason (with the proxy's queue and work in flight), then the ticks per reason.

    python results/clock/stop63/reasons.py RUN/logs/powerbatch-clock/traces.json
"""

import collections
import json
import re
import sys
from pathlib import Path


def main() -> None:
    d = json.loads(Path(sys.argv[1]).read_text())
    c, t0 = d["control"], d["t0"]
    counts: collections.Counter[str] = collections.Counter()
    last = None
    for i, t in enumerate(c["t_s"]):
        reason = c["clock_reason"][i] or ""
        kind = re.sub(r"[0-9.]+ ?(s|MHz|%)", "#", reason)
        counts[kind] += 1
        if (c["clock_top_mhz"][i], kind) != last and kind != "probing":
            print(
                f"{t - t0:7.1f} s  top {c['clock_top_mhz'][i]}  queued {c['queued'][i]}  "
                f"in flight {c['in_flight'][i]}  {reason}"
            )
        last = (c["clock_top_mhz"][i], kind)
    for kind, n in counts.most_common():
        print(f"{n:5d} ticks  {kind}")


if __name__ == "__main__":
    main()
