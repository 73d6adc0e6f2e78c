"""Randomized loads for the scenario bench, built from `LoadProfile` phases and a seed.

Arrivals are bursty (periods of 5-60 s, burst-to-calm ratios of 2-6x), diurnal (a day in
20-60 s) or a steady overload; lengths are chat-like, prompt-heavy or decode-heavy; the streaming
share and the class mix are drawn too. Rates are set against what the plant sustains at its
ceiling (a number the caller gives), so that power binds part of the time on any plant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from powerbatch.load.profile import LoadProfile, Phase

__all__ = ["LOAD_RANGES", "DrawnLoad", "draw_load"]

LOAD_RANGES: dict[str, Any] = {
    "arrival": ("bursty", "diurnal", "overload"),
    "burst_period_s": (5.0, 60.0),
    "burst_ratio": (2.0, 6.0),
    "burst_duty": (0.3, 0.7),  # share of the period in the burst
    "peak_over_sustain": (1.2, 2.5),  # burst or diurnal peak over what the ceiling sustains
    "overload_over_sustain": (1.1, 1.8),
    "diurnal_cycle_s": (20.0, 60.0),
    "lengths": ("chat", "prompt-heavy", "decode-heavy"),
    "stream_fraction": (0.1, 0.9),
    "high_share": (0.2, 0.8),  # the interactive class; the rest split between normal and low
}
LENGTHS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    # (prompt median range, output median range), tokens; chat brackets the ShareGPT-like
    # defaults of LoadProfile (600 / 180)
    "chat": ((300.0, 900.0), (120.0, 250.0)),
    "prompt-heavy": ((1_500.0, 3_000.0), (20.0, 80.0)),
    "decode-heavy": ((50.0, 200.0), (300.0, 500.0)),
}
DIURNAL_SHAPE = (8.0, 12.0, 12.0, 9.0, 5.0, 2.0, 2.0, 4.0)
"""powerbatch.load.profile.diurnal's day, started at the morning ramp so a short run sees a peak."""
MAX_PEAK_RPS = 30.0
"""Above this the load client and the simulator's streams, not the plant, would bind on two
CPU cores: longer answers carry the same tokens in fewer requests instead."""


@dataclass(frozen=True)
class DrawnLoad:
    profile: LoadProfile
    draw: dict[str, Any]
    """The drawn dimensions, for the report and a rerun."""


def _u(rng: np.random.Generator, key: str) -> float:
    lo, hi = LOAD_RANGES[key]
    return float(rng.uniform(lo, hi))


def _lognormal_mean(median: float, sigma: float) -> float:
    return median * math.exp(sigma * sigma / 2.0)


def draw_load(
    rng: np.random.Generator,
    sustain_rps: Callable[[float, float], float],
    name: str = "drawn",
) -> DrawnLoad:
    """One load. `sustain_rps(prompt_mean, output_mean)`: requests/s the plant serves at its
    ceiling for those mean lengths (`Plant.sustain_rps`)."""
    arrival = str(rng.choice(LOAD_RANGES["arrival"]))
    lengths = str(rng.choice(LOAD_RANGES["lengths"]))
    (p_lo, p_hi), (o_lo, o_hi) = LENGTHS[lengths]
    prompt_median = float(rng.uniform(p_lo, p_hi))
    output_median = float(rng.uniform(o_lo, o_hi))
    stream = _u(rng, "stream_fraction")
    high = _u(rng, "high_share")
    split = float(rng.uniform(0.0, 1.0))
    mix = {"high": high, "normal": (1.0 - high) * split, "low": (1.0 - high) * (1.0 - split)}
    draw: dict[str, Any] = {"arrival": arrival, "lengths": lengths, "stream_fraction": stream}
    shape: tuple[float, ...]  # relative rates, the peak at 1
    durations: tuple[float, ...]
    if arrival == "bursty":
        period = _u(rng, "burst_period_s")
        ratio = _u(rng, "burst_ratio")
        duty = _u(rng, "burst_duty")
        peak = _u(rng, "peak_over_sustain")
        shape, durations = (1.0, 1.0 / ratio), (period * duty, period * (1.0 - duty))
        draw.update(burst_period_s=period, burst_ratio=ratio, burst_duty=duty)
    elif arrival == "diurnal":
        cycle = _u(rng, "diurnal_cycle_s")
        peak = _u(rng, "peak_over_sustain")
        shape = tuple(r / max(DIURNAL_SHAPE) for r in DIURNAL_SHAPE)
        durations = (cycle / len(DIURNAL_SHAPE),) * len(DIURNAL_SHAPE)
        draw.update(diurnal_cycle_s=cycle)
    else:
        peak = _u(rng, "overload_over_sustain")
        shape, durations = (1.0,), (60.0,)
    sigma_p, sigma_o = 0.8, 0.6  # LoadProfile's defaults
    for _ in range(8):  # lengthen answers until the peak fits the CPU budget
        sustain = sustain_rps(
            _lognormal_mean(prompt_median, sigma_p), _lognormal_mean(output_median, sigma_o)
        )
        peak_rps = peak * sustain
        if peak_rps <= MAX_PEAK_RPS:
            break
        output_median = min(output_median * peak_rps / MAX_PEAK_RPS, 1_000.0)
    peak_rps = min(peak_rps, MAX_PEAK_RPS)
    draw.update(
        prompt_median=prompt_median,
        output_median=output_median,
        peak_over_sustain=peak,
        sustain_rps=sustain,
        peak_rps=peak_rps,
        priority_mix=mix,
    )
    profile = LoadProfile(
        name,
        tuple(Phase(d, r * peak_rps) for d, r in zip(durations, shape, strict=True)),
        prompt_median=prompt_median,
        prompt_sigma=sigma_p,
        output_median=output_median,
        output_sigma=sigma_o,
        priority_mix=mix,
        stream_fraction=stream,
    )
    return DrawnLoad(profile, draw)
