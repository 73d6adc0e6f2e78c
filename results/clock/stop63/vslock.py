"""Harness runs of the clock law (results/clock/stop59/tried/variant.py, every prefill
unlocked) over stop 59's best static locks of the same 24 plants and seeds: the lock held to a
p95 TTFT within 1.2x the cap's, and the best lock on tokens alone.

    python results/clock/stop63/vslock.py results/clock/stop63/harness base top-once
"""

import json
import re
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    folder = Path(sys.argv[1])
    for load in ("bursty", "poisson"):
        locks = json.loads(Path(f"results/clock/stop59/phases-{load}.json").read_text())
        print(load)
        for name in sys.argv[2:]:
            text = (folder / f"{name}-{load}.txt").read_text()
            law = np.array([float(m.group(1)) for m in re.finditer(r"J (\d\.\d+)", text)])
            ttft = law / np.array([p["ttft_static_vs_cap"] for p in locks])
            best = law / np.array([p["static_vs_cap"] for p in locks])
            print(
                f"  {name}: law / TTFT-bound lock median {np.median(ttft):.3f} mean "
                f"{ttft.mean():.3f} worst {ttft.max():.3f} (plant {ttft.argmax()}); "
                f"/ best lock median {np.median(best):.3f} worst {best.max():.3f}"
            )


if __name__ == "__main__":
    main()
