"""`powerbatch serve`, with the power model's window already full when the proxy starts.

A proxy's model window (`ControlConfig.model_window`, 1,500 samples) takes five minutes to fill
at 5 Hz, and the control tick's cost, idle or loaded, is that of a full window from then on. So
that a benchmark run starts in that steady state, this fills the window at start-up, through
the Python API, with idle readings (100 W, the fake upstream's, ±1 W) spaced one tick apart and
ending now, then runs `python -m powerbatch` with the same arguments:

    python benchmarks/serve_full_window.py serve --upstream ... --ceiling-w ...

POWERBATCH_BENCH_MODEL_WINDOW=N sets another window size (at least ~1,400 samples to show the
BLAS thread-pool spin the statsmodels refit had; a small one fills in seconds but would not).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

import powerbatch.control.controller as controller_module
from powerbatch.cli.main import main
from powerbatch.estimate import Features, PowerModel, PowerPrior

IDLE_W = 100.0
TICK_S = 0.2


class FullWindowModel(PowerModel):
    def __init__(self, prior: PowerPrior, **kwargs: Any) -> None:
        if size := os.environ.get("POWERBATCH_BENCH_MODEL_WINDOW"):
            kwargs["window"] = int(size)
        super().__init__(prior, **kwargs)
        window = int(kwargs.get("window", 1_200))
        rng = np.random.default_rng(0)
        now = time.monotonic()  # the proxy's control loop stamps its ticks with this clock
        idle = Features(0.0, 0.0, 0.0, 0.0)
        for i in range(window):
            self.observe(now - (window - i) * TICK_S, idle, IDLE_W + rng.uniform(-1, 1))


controller_module.PowerModel = FullWindowModel  # type: ignore[misc]

if __name__ == "__main__":
    sys.exit(main())
