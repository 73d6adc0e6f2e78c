"""The recorded-trace format shared by the simulator, the proxy's recorder and `powerbatch replay`.

A trace is a CSV file with a header row. `t_s` and `power_w` are required; the rest are optional
and empty where unknown. Power is what the source reported at `t_s` (not a 1-second average unless
the source averages); the feature columns are what the proxy saw at the same instant.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from powerbatch.errors import ReplayError


@dataclass(frozen=True, slots=True)
class TraceRow:
    t_s: float
    power_w: float
    energy_j: float | None = None
    requests_in_flight: float | None = None
    kv_tokens_in_flight: float | None = None
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    queue_len: float | None = None


TRACE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(TraceRow))


def _parse(value: str | None, column: str, line: int, required: bool) -> float | None:
    if value is None or value.strip() == "":
        if required:
            raise ReplayError(f"line {line}: column {column!r} is empty")
        return None
    try:
        number = float(value)
    except ValueError as exc:
        raise ReplayError(f"line {line}: column {column!r} is not a number: {value!r}") from exc
    if required and not math.isfinite(number):
        raise ReplayError(f"line {line}: column {column!r} is not finite: {value!r}")
    return number


def read_trace(path: str | Path) -> Iterator[TraceRow]:
    """Yield rows in file order; raise ReplayError on a missing column or a bad number."""
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
            values = {
                name: _parse(record.get(name), name, line, required=name in ("t_s", "power_w"))
                for name in TRACE_COLUMNS
            }
            yield TraceRow(**values)  # type: ignore[arg-type]


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> int:
    """Write rows with the full header; return how many were written."""
    count = 0
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=TRACE_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})
            count += 1
    return count
