"""Stop 59's scratch runs: the clock law with every prefill unlocked (`clock_plants.run(...,
boost=True)`) against the cap on the harness's drawn plants, with the law's reasons, searches
and probes counted. Run from a tree with the law to judge (e.g. recheck-backoff.patch applied):

    PYTHONPATH=. python results/clock/stop59/tried/variant.py base bursty 24 900
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import numpy as np

sys.path.insert(0, "benchmarks")
import clock_plants as cp

from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws import clock as lawmod


def main() -> None:
    name, load = sys.argv[1], sys.argv[2]
    plants = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 240.0
    reasons: collections.Counter[str] = collections.Counter()
    searches: collections.Counter[int] = collections.Counter()
    probes: collections.Counter[tuple[int, bool]] = collections.Counter()
    tick, start, begin = (
        lawmod.ClockLaw.tick,
        lawmod.ClockLaw._start_search,
        lawmod.ClockLaw._begin_probe,
    )

    def counted_tick(self: Any, inp: Any, ok: bool) -> Any:
        c = tick(self, inp, ok)
        top = c.reason.startswith("top clock")
        reasons[c.reason[:40] if top else c.reason.split(":")[0].split(" MHz")[0]] += 1
        return c

    def counted_start(self: Any, t: Any) -> None:
        searches[id(self)] += 1
        start(self, t)

    def counted_begin(self: Any, i: int, t: float) -> Any:
        probes[(id(self), i == 0)] += 1
        return begin(self, i, t)

    lawmod.ClockLaw.tick = counted_tick  # type: ignore[method-assign]
    lawmod.ClockLaw._start_search = counted_start  # type: ignore[method-assign]
    lawmod.ClockLaw._begin_probe = counted_begin  # type: ignore[method-assign]
    rows = []
    for seed in range(plants):
        profile, ceiling_w, kv = cp.draw(seed)
        base = cp.run(profile, ceiling_w, kv, seed, seconds, load=load)
        law = lawmod.ClockLaw(
            ClockPolicy(clock_objective="energy"), ControlConfig(ceiling_w=ceiling_w)
        )
        r = cp.run(
            profile, ceiling_w, kv, seed, seconds, law=law, boost=True, meter_lag_s=2.0, load=load
        )
        row = (
            r["j_per_token"] / base["j_per_token"],
            r["ttft_p95_s"] / base["ttft_p95_s"],
            r["tokens"] / base["tokens"],
        )
        rows.append(row)
        print(
            f"plant {seed}: searches {searches[id(law)]} probes {probes[(id(law), False)]} "
            f"top-probes {probes[(id(law), True)]} J {row[0]:.3f} ttft {row[1]:.2f} "
            f"tok {row[2]:.3f}",
            flush=True,
        )
    a = np.array(rows)
    print(
        f"{name} {load}: J/token vs cap median {np.median(a[:, 0]):.3f} mean {a[:, 0].mean():.4f} "
        f"worst {a[:, 0].max():.3f}; ttft median {np.median(a[:, 1]):.2f} "
        f"worst {a[:, 1].max():.2f}; tokens min {a[:, 2].min():.3f}"
    )
    total = sum(reasons.values())
    for k, v in reasons.most_common(12):
        print(f"  {100 * v / total:5.1f}% {k}")


if __name__ == "__main__":
    main()
