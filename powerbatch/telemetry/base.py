"""What every power source returns, and the one interface they share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class PowerSample:
    """One reading over the whole GPU set.

    `t_s` is time.monotonic() when the reading was taken (sources that replay a trace use the
    trace's own clock). `energy_j` is the device's cumulative energy counter where it has one:
    two readings give exact joules over a window, which averaged power cannot.
    """

    t_s: float
    power_w: float
    energy_j: float | None = None


@runtime_checkable
class PowerSource(Protocol):
    """A source of power readings: NVML, a dcgm-exporter endpoint, the simulator, a replayed trace.

    `read()` raises a `TelemetryError` subclass when no usable sample can be had; it never
    returns a made-up value. Callers (the telemetry monitor) decide what to do about failures.
    """

    name: str

    async def read(self) -> PowerSample: ...

    async def close(self) -> None: ...


class Backoff:
    """When a failed device change may be tried again: the wait doubles from `initial_s` to
    `max_s` with each failure, and a success starts it over. One for every actuator (the
    power limit, the SM clock)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        self.initial_s, self.max_s = initial_s, max_s
        self.wait_s = initial_s
        self.retry_at_s = -math.inf

    def ready(self, now_s: float) -> bool:
        return now_s >= self.retry_at_s

    def failed(self, now_s: float) -> float:
        """Schedule the retry; returns the wait it set."""
        wait_s = self.wait_s
        self.retry_at_s = now_s + wait_s
        self.wait_s = min(wait_s * 2.0, self.max_s)
        return wait_s

    def succeeded(self) -> None:
        self.wait_s = self.initial_s
