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


def test_a_second_is_forced_over_only_where_its_prefill_alone_breaches() -> None:
    from powerbatch.cli.report import forced_above_seconds

    # Decode at 1,700-1,800 W (the lowest busy step 1,700 W), a 2,000 W ceiling. Second 0: a
    # 0.5-s prefill at 2,600 W (0.5 x 2,600 + 0.5 x 1,700 = 2,150 W: forced). Second 1: a
    # 0.2-s prefill (0.2 x 2,600 + 0.8 x 1,700 = 1,880 W: avoidable, whatever the second read).
    # Second 2: a 0.5-s prefill straddling into second 3, half in each: neither is forced.
    steps = [  # (start, length, power, prefill tokens, running)
        (0.0, 0.5, 2600.0, 5000, 3),
        (0.5, 0.5, 1800.0, 0, 3),
        (1.0, 0.2, 2600.0, 2000, 3),
        (1.2, 0.8, 1700.0, 0, 1),
        (2.0, 0.75, 1750.0, 0, 2),
        (2.75, 0.5, 2600.0, 5000, 2),
        (3.25, 0.75, 1750.0, 0, 2),
    ]
    trace = {
        "t_s": [s[0] for s in steps],
        "step_s": [s[1] for s in steps],
        "power_w": [s[2] for s in steps],
        "prefill_tokens": [s[3] for s in steps],
        "running": [s[4] for s in steps],
    }
    forced = forced_above_seconds(trace, 0.0, 4.0, 2000.0)
    assert forced.tolist() == [True, False, False, False]


def test_late_answers_count_in_tokens_and_joules_not_in_goodputs_time() -> None:
    """An answer recorded `late` (after none could count) lengthens the span tokens/s and J/token
    run over, and adds its tokens; goodput keeps the span of the answers that could count."""
    from powerbatch.cli.report import RunData, summarize
    from powerbatch.load import RequestResult
    from powerbatch.load.profile import LoadProfile, Phase

    # Steps of 1 s from -1 s, stamped at their starts, the counter at their ends: 100 W.
    trace = {"t_s": [float(t - 1) for t in range(30)], "step_s": [1.0] * 30}
    trace["energy_j"] = [100.0 * t for t in range(30)]
    trace |= {"power_w": [100.0] * 30, "running": [1.0] * 30, "prefill_tokens": [0.0] * 30}
    good = RequestResult(0.0, "high", 0, 200, 0.1, 4.0, 8, 40)
    late = RequestResult(1.0, "high", 0, 200, 3.0, 19.0, 8, 60, late=True)
    profile = LoadProfile("flat", (Phase(5.0, 1.0),))
    # Within both SLOs, but after the drain's timeout: the drain cut goodput's count there.
    timed_out = RequestResult(2.0, "high", 0, 200, 0.1, 2.0, 8, 0, late=True)
    runs = [good, late, timed_out]
    s = summarize(RunData("x", 600.0, profile, 0.0, 5.0, runs, trace), 0.5, 0.1)
    assert s["goodput_rps"] == 1 / 4.0  # one good answer, over the 4 s to its end
    assert s["output_tokens"] == 100 and s["output_tok_s"] == 100 / 20.0
    assert s["j_per_token"] == 100.0 * 20.0 / 100 and s["late"] == 2
