"""User-count schedules for the profiles, as plain functions of elapsed time.

Kept apart from locust's LoadTestShape so they can be unit-tested without gevent. Every schedule
returns None at `duration_s`, which is what makes a headless run stop by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Defaults:
    """What a profile runs with when the command line names no -u / --run-time."""

    users: int
    duration_s: float


def steady(t_s: float, users: int, duration_s: float) -> int | None:
    """The same number of users throughout."""
    return None if t_s >= duration_s else users


def bursty(t_s: float, users: int, duration_s: float) -> int | None:
    """A quarter of the users, then all of them, alternating; six half-periods per run, each
    at least 2 s and at most 30 s, so a short run still sees a burst and a long one many."""
    if t_s >= duration_s:
        return None
    half = min(30.0, max(2.0, duration_s / 6))
    low = max(1, users // 4)
    return low if int(t_s // half) % 2 == 0 else users


def diurnal(t_s: float, users: int, duration_s: float) -> int | None:
    """One compressed day: a night floor of an eighth of the users, a raised-cosine climb to the
    midday peak at half time, and back down."""
    if t_s >= duration_s:
        return None
    floor = max(1, users // 8)
    level = (1 - math.cos(2 * math.pi * t_s / duration_s)) / 2
    return max(1, round(floor + (users - floor) * level))


def steps(t_s: float, users: int, duration_s: float) -> int | None:
    """A quarter, a half, then all of the users, the last step held for the second half: the
    offered load climbs past what the ceiling allows, so the priority classes separate."""
    if t_s >= duration_s:
        return None
    frac = t_s / duration_s
    share = 0.25 if frac < 0.25 else 0.5 if frac < 0.5 else 1.0
    return max(1, round(users * share))


SCHEDULES: dict[str, Callable[[float, int, float], int | None]] = {
    "steady": steady,
    "bursty": bursty,
    "diurnal": diurnal,
    "steps": steps,
}
