"""1-second power from the simulator's trace: exact joules in each wall-clock second."""

from __future__ import annotations

import numpy as np

from powerbatch.cli.report import power_1s


def test_power_1s_never_exceeds_what_any_step_draws() -> None:
    # Long prefill steps held at a 600 W cap, between short decode steps at 300 W: no second
    # may read more than 600 W, and the run's mean must match the joules spent.
    steps = [(0.35, 600.0), (0.05, 300.0)] * 60
    starts, energy_end, t, e = [], [], 0.0, 0.0
    for step_s, power_w in steps:
        starts.append(t)
        t += step_s
        e += step_s * power_w
        energy_end.append(e)
    trace = {"t_s": starts, "step_s": [s for s, _ in steps], "energy_j": energy_end}
    _, p1 = power_1s(trace, 1.0, 21.0)
    assert len(p1) == 20
    assert p1.max() <= 600.0 + 1e-9
    assert abs(np.mean(p1) - e / t) < 10.0


def test_binding_share_counts_the_proxys_ticks() -> None:
    from powerbatch.cli.report import RunData, binding_share
    from powerbatch.load.profile import PROFILES

    history = {"t_s": [0.0, 0.2, 0.4, 0.6], "binding": ["power", "power", "kv", "none"]}
    run = RunData("powerbatch", 600.0, PROFILES["bursty"](), 0.0, 1.0, [], {}, history)
    assert binding_share(run) == {"kv": 0.25, "none": 0.25, "power": 0.5}
    assert binding_share(RunData("hwcap", 600.0, PROFILES["bursty"](), 0.0, 1.0, [], {})) == {}
