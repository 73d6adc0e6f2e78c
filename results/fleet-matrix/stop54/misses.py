"""Per member of each fleet-bench run: requests sent, answered within the SLOs, and missed on the
first token (TTFT over 2 s, or none) or on the time per token (over 0.1 s).

    python results/fleet-matrix/stop54/misses.py OUT   # OUT: a fleet-bench --out with its logs/
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

for path in sorted(Path(sys.argv[1]).glob("logs/*/*/run.json")):
    run = json.loads(path.read_text())
    per: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for member, _, _, _, ttft, tpot, ok in run["request_rows"]:
        n = per[member]
        n[0] += 1
        n[1] += bool(ok)
        n[2] += ttft is None or ttft > 2.0
        n[3] += tpot is not None and tpot > 0.1
    cells = " | ".join(
        f"m{m} {n[1]}/{n[0]} ttft {n[2]} tpot {n[3]}" for m, n in sorted(per.items())
    )
    print(f"{path.parent.parent.name} {path.parent.name}: {run['goodput_rps']:.2f} req/s | {cells}")
