"""Seeded load profiles: arrival phases, lognormal lengths, a priority mix.

The same seed gives the same requests at the same offsets, so arms of a comparison see the same
load. Lengths are lognormal, the usual fit for chat prompts and answers (ShareGPT-like).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Phase:
    duration_s: float
    rate_rps: float


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    t_s: float  # offset from the start of the run
    priority: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    phase: int


@dataclass(frozen=True, slots=True)
class LoadProfile:
    name: str
    phases: tuple[Phase, ...]
    prompt_median: float = 600.0
    prompt_sigma: float = 0.8
    output_median: float = 180.0
    output_sigma: float = 0.6
    max_prompt_tokens: int = 6_000
    max_output_tokens: int = 1_024
    priority_mix: dict[str, float] = field(
        default_factory=lambda: {"high": 0.3, "normal": 0.5, "low": 0.2}
    )
    stream_fraction: float = 1.0

    def phase_at(self, t_s: float) -> int:
        """Index of the phase (cycling) active at offset t_s."""
        cycle = sum(p.duration_s for p in self.phases)
        t = t_s % cycle
        for i, p in enumerate(self.phases):
            if t < p.duration_s:
                return i
            t -= p.duration_s
        return len(self.phases) - 1

    def plan(self, duration_s: float, seed: int) -> list[PlannedRequest]:
        """Poisson arrivals, phase by phase, until duration_s."""
        rng = np.random.default_rng(seed)
        names = list(self.priority_mix)
        weights = np.array([self.priority_mix[n] for n in names], dtype=float)
        weights /= weights.sum()
        out: list[PlannedRequest] = []
        t = 0.0
        while t < duration_s:
            i = self.phase_at(t)
            rate = self.phases[i].rate_rps
            phase_end = t - (t % sum(p.duration_s for p in self.phases))
            phase_end += sum(p.duration_s for p in self.phases[: i + 1])
            # At a boundary that float rounding puts a hair before itself, `phase_at` still
            # names the phase that ends there: step past it, or the draw never moves on.
            phase_end = max(phase_end, math.nextafter(t, math.inf))
            if rate <= 0:
                t = phase_end
                continue
            gap = rng.exponential(1.0 / rate)
            if t + gap >= phase_end:
                t = phase_end  # memoryless: restart the draw at the next phase's rate
                continue
            t += gap
            if t >= duration_s:
                break
            prompt = int(
                np.clip(
                    rng.lognormal(np.log(self.prompt_median), self.prompt_sigma),
                    8,
                    self.max_prompt_tokens,
                )
            )
            output = int(
                np.clip(
                    rng.lognormal(np.log(self.output_median), self.output_sigma),
                    4,
                    self.max_output_tokens,
                )
            )
            out.append(
                PlannedRequest(
                    t_s=t,
                    priority=str(rng.choice(names, p=weights)),
                    prompt_tokens=prompt,
                    max_tokens=output,
                    stream=bool(rng.random() < self.stream_fraction),
                    phase=i,
                )
            )
        return out


def bursty(
    low_rps: float = 2.0, high_rps: float = 14.0, low_s: float = 10.0, high_s: float = 10.0
) -> LoadProfile:
    """Alternating calm and burst: the burst pushes an uncontrolled GPU over a typical ceiling."""
    return LoadProfile("bursty", (Phase(low_s, low_rps), Phase(high_s, high_rps)))


def steady(rate_rps: float = 8.0) -> LoadProfile:
    return LoadProfile("steady", (Phase(60.0, rate_rps),))


def diurnal(cycle_s: float = 60.0) -> LoadProfile:
    """A day compressed into `cycle_s`: night trough, morning ramp, midday peak, evening fall,
    with half the requests deferrable (low class), as batch work in a shared cluster is."""
    rates = (2.0, 4.0, 8.0, 12.0, 12.0, 9.0, 5.0, 2.0)
    step_s = cycle_s / len(rates)
    return LoadProfile(
        "diurnal",
        tuple(Phase(step_s, r) for r in rates),
        priority_mix={"high": 0.2, "normal": 0.3, "low": 0.5},
    )


PROFILES: dict[str, Callable[[], LoadProfile]] = {
    "bursty": bursty,
    "steady": steady,
    "diurnal": diurnal,
}
