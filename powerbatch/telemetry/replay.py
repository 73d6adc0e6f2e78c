"""Replay a recorded power trace as a PowerSource, for tests and offline tuning."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from powerbatch.errors import ReplayError
from powerbatch.telemetry.base import PowerSample
from powerbatch.telemetry.trace import TraceRow, read_trace


class TraceExhausted(ReplayError):
    """Every row of the trace has been served; the replay is over, not broken."""


class ReplayPowerSource:
    """Serve a trace's rows one per `read()`, in file order.

    The whole trace is parsed up front so a malformed file fails at construction, not minutes into
    a run. With `clock="trace"` samples keep the trace's `t_s` (offline runs faster than real
    time); with `clock="wall"` they are stamped with time.monotonic() at `read()`, so staleness
    checks against the live clock behave as with a real sensor.
    """

    def __init__(
        self,
        path_or_rows: str | Path | Iterable[TraceRow],
        *,
        clock: Literal["trace", "wall"] = "trace",
    ) -> None:
        if clock not in ("trace", "wall"):
            raise ValueError(f"clock must be 'trace' or 'wall', got {clock!r}")
        if isinstance(path_or_rows, str | Path):
            self.name = f"replay:{path_or_rows}"
            rows = list(read_trace(path_or_rows))
        else:
            self.name = "replay:rows"
            rows = list(path_or_rows)
        rows = [r for r in rows if r.power_w is not None]  # ticks recorded while failed closed
        for index, row in enumerate(rows[1:], start=1):
            if row.t_s < rows[index - 1].t_s:
                raise ReplayError(
                    f"trace time goes backwards at row {index}: {row.t_s} < {rows[index - 1].t_s}"
                )
        self._rows = rows
        self._clock = clock
        self._next = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def remaining(self) -> int:
        """Rows not served yet."""
        return len(self._rows) - self._next

    async def read(self) -> PowerSample:
        if self._next >= len(self._rows):
            raise TraceExhausted("trace exhausted")
        row = self._rows[self._next]
        self._next += 1
        t_s = row.t_s if self._clock == "trace" else time.monotonic()
        assert row.power_w is not None  # filtered at construction
        return PowerSample(t_s=t_s, power_w=row.power_w, energy_j=row.energy_j)

    async def close(self) -> None:
        """Nothing to release: the trace was read into memory at construction."""
