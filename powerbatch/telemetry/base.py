"""What every power source returns, and the one interface they share."""

from __future__ import annotations

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
