"""A fleet-arm-only matrix run over the split of an earlier run of the same seed, beside that
run's fleet: goodput over the split per case, and the counted cases' median, worst and mean.

    python results/scenarios/stop64/fleet/fleet_vs.py NEW/matrix.json OLD/matrix.json [...]
"""

import json
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    new = {c["case"]["name"]: c for c in json.loads(Path(sys.argv[1]).read_text())["cases"]}
    old = {}
    for p in sys.argv[2:]:
        for c in json.loads(Path(p).read_text())["cases"]:
            old[c["case"]["name"]] = c
    rows = []
    for name, c in new.items():
        o = old.get(name)
        if o is None:
            continue
        split = o["hwcap"]["goodput_rps"][0]
        room = o["case"].get("load_scale", {}).get("room", 9.0)
        counted = room >= 1.05 or name.startswith("even")
        a, b = o["fleet"]["goodput_rps"][0] / split, c["fleet"]["goodput_rps"][0] / split
        rows.append((counted, a, b))
        print(
            f"{name:32s} split {split:6.2f}  before {a:.2f}  after {b:.2f}"
            f"{'' if counted else '  (not counted)'}"
        )
    x = np.array([(a, b) for k, a, b in rows if k])
    print(
        f"counted {len(x)}: median before {np.median(x[:, 0]):.2f} after {np.median(x[:, 1]):.2f};"
        f" worst {x[:, 0].min():.2f} / {x[:, 1].min():.2f}; under 1.00: {(x[:, 0] < 1).sum()} /"
        f" {(x[:, 1] < 1).sum()}; mean {x[:, 0].mean():.3f} / {x[:, 1].mean():.3f}"
    )


if __name__ == "__main__":
    main()
