"""The recorded-trace format shared by the simulator, the control loop's recorder and `replay`.

A trace is a CSV file with a header row. `t_s` is required; the rest are optional and empty
where unknown. `power_w` is the power the controller acted on (the 1-second mean, or the
source's own average); it is empty on ticks without a trusted reading (failed closed), which
replay skips. The feature columns are what the host saw over the same second; `state`,
`binding` and the limit columns are what the recording controller decided.

The control loop writes traces as it goes (`TraceWriter`): rows are flushed about once a
second and files rotate by size, `trace.csv` newest, then `trace.csv.1`, `trace.csv.2`, ...
`read_trace` reads such a set oldest first, or a single file.
"""

from __future__ import annotations

import csv
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO

from powerbatch.errors import ReplayError


@dataclass(frozen=True, slots=True)
class TraceRow:
    t_s: float
    power_w: float | None
    energy_j: float | None = None
    requests_in_flight: float | None = None
    kv_tokens_in_flight: float | None = None
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    queued: float | None = None
    raw_w: float | None = None  # the latest sample as the source reported it, unfiltered
    limit_requests: float | None = None  # proposed by the recording controller
    limit_kv_tokens: float | None = None
    enforced_requests: float | None = None
    state: str | None = None
    binding: str | None = None


TRACE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(TraceRow))
TEXT_COLUMNS: frozenset[str] = frozenset({"state", "binding"})
RENAMED: dict[str, str] = {"queued": "queue_len"}  # the column's name in traces before 2026-12


def _parse(value: str | None, column: str, line: int, required: bool) -> float | None:
    if value is None or value.strip() == "":
        if required:
            raise ReplayError(f"line {line}: column {column!r} is empty")
        return None
    try:
        number = float(value)
    except ValueError as exc:
        raise ReplayError(f"line {line}: column {column!r} is not a number: {value!r}") from exc
    if column in ("t_s", "power_w") and not math.isfinite(number):
        raise ReplayError(f"line {line}: column {column!r} is not finite: {value!r}")
    return number


def trace_files(path: str | Path) -> list[Path]:
    """The files of a trace, oldest first: `path.N` ... `path.1`, then `path` itself."""
    base = Path(path)
    rotated: list[tuple[int, Path]] = []
    for p in base.parent.glob(base.name + ".*"):
        suffix = p.name[len(base.name) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    return [p for _, p in sorted(rotated, reverse=True)] + ([base] if base.exists() else [])


def _read_one(path: Path) -> Iterator[TraceRow]:
    try:
        handle = open(path, newline="")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise ReplayError(f"cannot open trace {path}: {exc}") from exc
    with handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        for column in ("t_s", "power_w"):
            if column not in header:
                raise ReplayError(f"trace {path} has no {column!r} column (header: {header})")
        for line, record in enumerate(reader, start=2):
            values: dict[str, object] = {}
            for name in TRACE_COLUMNS:
                raw = record.get(name, record.get(RENAMED.get(name, name)))
                if name in TEXT_COLUMNS:
                    values[name] = raw or None
                else:
                    values[name] = _parse(raw, name, line, required=name == "t_s")
            yield TraceRow(**values)  # type: ignore[arg-type]


def read_trace(path: str | Path) -> Iterator[TraceRow]:
    """Yield rows oldest first, across a rotated set when there is one; raise ReplayError on
    a missing file or column or a bad number. Rows with empty `power_w` are kept."""
    files = trace_files(path)
    if not files:
        raise ReplayError(f"cannot open trace {path}: no such file")
    for f in files:
        yield from _read_one(f)


def _cells(row: TraceRow) -> dict[str, object]:
    return {
        k: ("" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v)
        for k, v in asdict(row).items()
    }


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> int:
    """Write rows with the full header; return how many were written."""
    count = 0
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=TRACE_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(_cells(row))
            count += 1
    return count


class TraceWriter:
    """Appends rows as they come, flushed every `flush_every_s`, so a crash keeps the trace.

    When the file passes `max_bytes` it becomes `path.1` (older ones shift up, the oldest beyond
    `keep` is deleted) and a fresh `path` starts. A file left at `path` by an earlier run is
    rotated away on open, not overwritten. At 5 ticks a second a row is ~150 bytes, ~65 MB a
    day, so the defaults keep about four days.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        keep: int = 4,
        flush_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0 or keep < 0:
            raise ValueError("max_bytes must be positive and keep not negative")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.flush_every_s = flush_every_s
        self._clock = clock
        self._handle: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._flushed_at = -math.inf
        if self.path.exists():
            self._rotate()
        self._open()

    def _open(self) -> None:
        self._handle = open(self.path, "w", newline="")  # noqa: SIM115 - closed in close()
        self._writer = csv.DictWriter(self._handle, fieldnames=TRACE_COLUMNS)
        self._writer.writeheader()
        self._handle.flush()

    def _rotate(self) -> None:
        oldest = Path(f"{self.path}.{self.keep}")
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
            return
        oldest.unlink(missing_ok=True)
        for i in range(self.keep - 1, 0, -1):
            src = Path(f"{self.path}.{i}")
            if src.exists():
                os.replace(src, f"{self.path}.{i + 1}")
        if self.path.exists():
            os.replace(self.path, f"{self.path}.1")

    def write(self, row: TraceRow) -> None:
        if self._handle is None or self._writer is None:
            return  # closed
        self._writer.writerow(_cells(row))
        now = self._clock()
        if now - self._flushed_at >= self.flush_every_s:
            self._handle.flush()
            self._flushed_at = now
        if self._handle.tell() >= self.max_bytes:
            self._handle.close()
            self._rotate()
            self._open()

    def flush(self) -> None:
        if self._handle is not None:
            self._handle.flush()

    def close(self) -> None:
        handle, self._handle, self._writer = self._handle, None, None
        if handle is not None:
            handle.close()
