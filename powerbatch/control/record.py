"""What each tick leaves behind: the record `/status/history`, the trace and the demo's plots are
made of, kept in memory and, where asked, appended to a rotating CSV trace as it goes."""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from powerbatch.control.config import TraceSettings
from powerbatch.estimate import Features
from powerbatch.jsonsafe import json_safe
from powerbatch.telemetry.trace import TraceRow, TraceWriter

log = logging.getLogger("powerbatch.control")


@dataclass(frozen=True, slots=True)
class TickRecord:
    """One tick. `power_w` is the 1-second power the controller acted on; `raw_w` the latest
    sample as the source reported it, unfiltered."""

    t_s: float
    power_w: float | None
    raw_w: float | None
    energy_j: float | None
    predicted_w: float
    predicted_upper_w: float
    target_w: float
    limit_requests: int  # proposed
    limit_kv_tokens: int  # proposed
    prefill_tok_s: float | None  # proposed pace; None: unpaced
    enforced_requests: int
    in_flight: int
    kv_in_flight: float
    queued: int
    binding: str
    state: str
    features: Features
    plan_w: float | None = None  # the shape planner's power for this second
    power_limit_w: float | None = None  # the device limit in force (None: none, or degraded)
    clock_top_mhz: float | None = None  # the clock law's chosen top (None: unlocked, or no law)
    clock_reason: str | None = None  # why the clock law chose it (None: no clock law)

    def as_dict(self) -> dict[str, Any]:
        """Flat and strict-JSON-safe (non-finite numbers become None)."""
        out = {k: v for k, v in asdict(self).items() if k != "features"}
        out.update({f"feature_{k}": v for k, v in asdict(self.features).items()})
        safe: dict[str, Any] = json_safe(out)
        return safe

    def trace_row(self) -> TraceRow:
        f = self.features
        return TraceRow(
            t_s=self.t_s,
            power_w=self.power_w,
            energy_j=self.energy_j,
            requests_in_flight=f.batch,
            kv_tokens_in_flight=f.kv_tokens,
            prefill_tok_s=f.prefill_tok_s,
            decode_tok_s=f.decode_tok_s,
            queued=float(self.queued),
            raw_w=self.raw_w,
            limit_requests=float(self.limit_requests),
            limit_kv_tokens=float(self.limit_kv_tokens),
            enforced_requests=float(self.enforced_requests),
            state=self.state,
            binding=self.binding,
        )


HISTORY_COLUMNS: tuple[str, ...] = (
    *(n for n in TickRecord.__dataclass_fields__ if n != "features"),
    *(f"feature_{n}" for n in Features.__dataclass_fields__),
)


def open_trace(settings: TraceSettings) -> TraceWriter | None:
    """The trace's writer, or None (logged) where the file cannot be opened: the ceiling
    matters more than its record."""
    if not settings.record_trace:
        return None
    try:
        return TraceWriter(
            settings.record_trace,
            max_bytes=int(settings.trace_rotate_mib * 1024 * 1024),
            keep=settings.trace_keep,
        )
    except OSError as exc:
        log.error("cannot write the control trace to %s: %s", settings.record_trace, exc)
        return None


class History:
    """The last `maxlen` ticks in memory, and the trace on disk (a full disk stops the trace,
    never the tick)."""

    def __init__(self, maxlen: int, trace: TraceWriter | None = None) -> None:
        self.records: deque[TickRecord] = deque(maxlen=maxlen)
        self.trace = trace

    def append(self, record: TickRecord) -> None:
        self.records.append(record)
        if self.trace is not None:
            try:
                self.trace.write(record.trace_row())
            except OSError as exc:
                log.error("trace writing stopped: %s", exc)
                self.trace = None

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()

    def trace_rows(self) -> list[TraceRow]:
        """The ticks kept in memory as a replayable trace (see powerbatch.telemetry.trace)."""
        return [r.trace_row() for r in self.records]

    def rows(self, since_s: float = -math.inf) -> list[dict[str, Any]]:
        return [r.as_dict() for r in list(self.records) if r.t_s > since_s]

    def columns(self, since_s: float = -math.inf) -> dict[str, list[Any]]:
        """The history as columns (one list per field), for plots."""
        rows = self.rows(since_s)
        return {c: [r[c] for r in rows] for c in HISTORY_COLUMNS}
