"""An idle proxy whose power model's window is full costs next to no CPU.

A review found `powerbatch serve` at 2% of a core while the model's 1,500-sample window filled
(5 minutes at 5 Hz), then 66%: at that size the statsmodels refit each tick woke BLAS's thread
pool, whose threads then spun between ticks. This runs the controller's tick, as the proxy's
control loop does, at 5 Hz of wall-clock time with the default window already full, and measures
the whole process's CPU time (every thread, native ones included). The spin needs a BLAS pool of
more than one thread, so it shows only on a machine with at least 2 cores (CI machines have 2).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from powerbatch.control import ControlConfig, Observation
from powerbatch.control.controller import Controller
from powerbatch.estimate import Features

IDLE_CPU_LIMIT = 0.05  # of one core


def _obs(t_s: float, power_w: float) -> Observation:
    return Observation(
        t_s=t_s,
        power_w=power_w,
        sensor_ok=True,
        features=Features(0.0, 0.0, 0.0, 0.0),
        in_flight=0,
        queued=0,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_batch", [256, 4096])
def test_idle_ticks_with_a_full_model_window_cost_a_few_percent_of_a_core(max_batch: int) -> None:
    # The proxy's defaults (a 1,500-sample window); and a candidate grid of 4,096 batch sizes,
    # as the tick's cost grows with --max-batch.
    cfg = ControlConfig(ceiling_w=500.0, max_batch=max_batch)
    ctl = Controller(cfg)
    rng = np.random.default_rng(0)
    period = 1.0 / cfg.tick_hz
    # Fill the window as five idle minutes would, without waiting five minutes.
    t = 0.0
    for _ in range(cfg.model_window):
        ctl.model.observe(t, Features(0.0, 0.0, 0.0, 0.0), 78.0 + rng.normal(0, 1))
        t += period
    assert ctl.model.n_samples == cfg.model_window
    for _ in range(3):  # past the first fits' one-off costs
        ctl.tick(_obs(t, 78.0 + rng.normal(0, 1)))
        t += period

    seconds = 3.0
    cpu0, wall0 = time.process_time(), time.monotonic()
    due = wall0
    while time.monotonic() - wall0 < seconds:
        ctl.tick(_obs(t, 78.0 + rng.normal(0, 1)))
        t += period
        due += period
        time.sleep(max(0.0, due - time.monotonic()))
    share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert share < IDLE_CPU_LIMIT, (
        f"idle ticks at {cfg.tick_hz:g} Hz with a full {cfg.model_window}-sample window used "
        f"{share:.0%} of a core (limit {IDLE_CPU_LIMIT:.0%}; {os.cpu_count()} cores here)"
    )
