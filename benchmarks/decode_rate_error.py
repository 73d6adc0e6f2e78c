"""How far the proxy's decode rate is from the engine's, from a bench run's traces.

The control loop's features count an answer that is not streamed when it ends; the simulator's
steps say when each token was made. For each tick, the proxy's decode tok/s over the last second
(`feature_decode_tok_s`) against the simulator's over the second `--lag-s` earlier, as |log| of
their ratio (tok/s under 1 count as 1): its median and 90th percentile, and their correlation.

    python benchmarks/decode_rate_error.py OUT/logs/powerbatch-clock/traces.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("traces", help="a bench arm's traces.json (a proxied arm: it has ticks)")
    p.add_argument("--lag-s", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0])
    p.add_argument("--skip-s", type=float, default=5.0, help="leave out the warm-up")
    a = p.parse_args()
    traces = json.loads(Path(a.traces).read_text())
    ticks, steps = traces["control"], traces["sim"]
    step_t = np.array(steps["t_s"])
    made = np.cumsum(steps["decode_tokens"])
    t = np.array(ticks["t_s"])
    proxy = np.array(ticks["feature_decode_tok_s"], dtype=float)
    keep = t - traces["t0"] > a.skip_s
    for lag in a.lag_s:
        end = t - lag
        engine = np.interp(end, step_t, made) - np.interp(end - 1.0, step_t, made)
        err = np.abs(np.log(np.maximum(proxy[keep], 1.0)) - np.log(np.maximum(engine[keep], 1.0)))
        corr = np.corrcoef(proxy[keep], engine[keep])[0, 1]
        print(
            f"engine's second {lag:.1f} s back: |log ratio| median {np.median(err):.2f} "
            f"(x{np.exp(np.median(err)):.2f}), p90 {np.percentile(err, 90):.2f} "
            f"(x{np.exp(np.percentile(err, 90)):.2f}), correlation {corr:.2f}"
        )


if __name__ == "__main__":
    main()
