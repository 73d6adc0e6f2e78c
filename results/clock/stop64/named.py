"""The clock law on a named plant in the virtual-time harness (`benchmarks/clock_plants.py`), at
`powerbatch bench`'s bursty load (2 and 14 requests/s, 10 s each), against the cap and a
static lock at 1635 MHz on the same seeds, a meter 2 s late. Run from a tree with the law to
judge (main, or with `tried/join.patch` applied):

    PYTHONPATH=. python results/clock/stop64/named.py h200-decode-light 90 6 [boost]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, "benchmarks")
import clock_plants as cp

from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws.clock import ClockLaw
from powerbatch.sim.gpu_model import PROFILES

CEILING_W = 600.0


def main() -> None:
    name, secs, seeds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    boost = len(sys.argv) > 4 and sys.argv[4] == "boost"
    prof = replace(PROFILES[name], cap_by_clock=True)
    kv = 10**7
    rate = 0.6 * 16 / (prof.itl_base_s * 300 + 800 / prof.prefill_tok_s) / 2
    scale = 8.0 / rate  # the harness's mean rate to the bench's 8 requests/s
    out = []
    for seed in range(seeds):
        base = cp.run(prof, CEILING_W, kv, seed, secs, load="bursty", rate_scale=scale)
        law = ClockLaw(ClockPolicy(clock_objective="energy"), ControlConfig(ceiling_w=CEILING_W))
        r = cp.run(
            prof, CEILING_W, kv, seed, secs, law=law, boost=boost, meter_lag_s=2.0,
            load="bursty", rate_scale=scale,
        )  # fmt: skip
        lock = cp.run(
            prof, CEILING_W, kv, seed, secs, lock=(prof.sm_clock_min_mhz, 1635), boost=boost,
            load="bursty", rate_scale=scale,
        )  # fmt: skip
        j, jl = r["j_per_token"] / base["j_per_token"], lock["j_per_token"] / base["j_per_token"]
        out.append((j, jl))
        print(
            f"seed {seed}: law {j:.3f} lock1635 {jl:.3f} law/lock {j / jl:.3f} "
            f"tok {r['tokens'] / base['tokens']:.3f} settled {r['settled_s']:.0f}",
            flush=True,
        )
    a = np.array(out)
    ratio = a[:, 0] / a[:, 1]
    print(
        f"median law {np.median(a[:, 0]):.3f} worst {a[:, 0].max():.3f}; "
        f"law/lock median {np.median(ratio):.3f} worst {ratio.max():.3f}"
    )


if __name__ == "__main__":
    main()
