"""`powerbatch replay TRACE.csv`: the estimator and controller offline over a recorded trace.

Each row is one tick: its power is the measurement, its feature columns the operating point.
The decisions are printed as CSV, so decision logic is tested without a GPU; a summary (time over
the ceiling, peak power, the batch limits proposed) follows on stderr. A rotated trace set
(`trace.csv`, `trace.csv.1`, ...) is read whole, oldest first.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from powerbatch.control import ControlConfig, Decision, Observation
from powerbatch.control.controller import Controller
from powerbatch.control.window import ReadingAligner
from powerbatch.estimate import Features
from powerbatch.telemetry.trace import TraceRow, read_trace


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="run the estimator and controller over a recorded trace")
    p.add_argument("trace", help="CSV trace (t_s, power_w, feature columns)")
    p.add_argument("--ceiling-w", type=float, required=True)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--every", type=int, default=1, help="print every Nth decision")
    p.set_defaults(func=main)


def replay(rows: Iterator[TraceRow], config: ControlConfig) -> Iterator[tuple[TraceRow, Decision]]:
    """Feed each row to a fresh controller, as if measured live; the queue is taken as empty
    unless the trace says otherwise. Rows without power (recorded failed closed) are skipped."""
    controller = Controller(config)
    # A held reading repeats its raw watts and energy.
    clock = ReadingAligner(every_tick=False, max_weight=config.tick_hz)
    for row in rows:
        if row.power_w is None:
            continue
        features = Features(
            batch=row.requests_in_flight or 0.0,
            kv_tokens=row.kv_tokens_in_flight or 0.0,
            prefill_tok_s=row.prefill_tok_s or 0.0,
            decode_tok_s=row.decode_tok_s or 0.0,
        )
        weight, measured = clock.update(row.raw_w, row.energy_j, features, row.t_s, row.power_w)
        obs = Observation(
            t_s=row.t_s,
            power_w=row.power_w,
            sensor_ok=True,
            features=features,
            in_flight=int(row.requests_in_flight or 0),
            queued=int(row.queued or 0),
            reading_features=measured,
            reading_weight=weight,
            relearn=tuple(clock.relearn),
        )
        yield row, controller.tick(obs)


@dataclass(frozen=True, slots=True)
class Summary:
    seconds: int  # whole seconds of trace with power
    over_ceiling_pct: float  # share of those seconds whose mean power was over the ceiling
    peak_1s_w: float  # highest 1-second mean power
    batch_min: int  # batch limits the controller proposed
    batch_median: float
    batch_max: int

    def text(self, ceiling_w: float) -> str:
        return (
            f"summary: {self.seconds} s replayed; over the {ceiling_w:.0f} W ceiling "
            f"{self.over_ceiling_pct:.1f}% of seconds; peak 1-s power {self.peak_1s_w:.1f} W; "
            f"proposed batch limit {self.batch_min}..{self.batch_max} "
            f"(median {self.batch_median:g})"
        )


class Summarizer:
    """Power by whole second of the trace's clock (mean of the rows in it) and the limits
    proposed, kept as numbers only, so a day's trace summarises in little memory."""

    def __init__(self) -> None:
        self._second: int | None = None
        self._sum = 0.0
        self._n = 0
        self._means: list[float] = []
        self._limits: list[int] = []

    def add(self, row: TraceRow, d: Decision) -> None:
        self._limits.append(d.proposed.max_requests)
        if row.power_w is None:
            return
        second = math.floor(row.t_s)
        if second != self._second:
            self._close_second()
            self._second = second
        self._sum += row.power_w
        self._n += 1

    def _close_second(self) -> None:
        if self._n:
            self._means.append(self._sum / self._n)
        self._sum, self._n = 0.0, 0

    def result(self, ceiling_w: float) -> Summary | None:
        self._close_second()
        means, limits = self._means, self._limits
        if not means or not limits:
            return None
        return Summary(
            seconds=len(means),
            over_ceiling_pct=100.0 * sum(m > ceiling_w for m in means) / len(means),
            peak_1s_w=max(means),
            batch_min=min(limits),
            batch_median=float(statistics.median(limits)),
            batch_max=max(limits),
        )


def summarize(decided: Iterable[tuple[TraceRow, Decision]], ceiling_w: float) -> Summary | None:
    acc = Summarizer()
    for row, d in decided:
        acc.add(row, d)
    return acc.result(ceiling_w)


def main(a: argparse.Namespace) -> int:
    config = ControlConfig(
        ceiling_w=a.ceiling_w,
        max_batch=a.max_batch,
        warmup_s=a.warmup_s,
        initial_batch=min(8, a.max_batch),
    )
    out = csv.writer(sys.stdout)
    out.writerow(
        [
            "t_s",
            "power_w",
            "batch",
            "limit_requests",
            "limit_kv_tokens",
            "prefill_tok_s",
            "predicted_upper_w",
            "target_w",
            "binding",
            "state",
            "lambda_power",
        ]
    )
    acc = Summarizer()
    for i, (row, d) in enumerate(replay(read_trace(a.trace), config)):
        acc.add(row, d)
        if i % a.every:
            continue
        out.writerow(
            [
                f"{row.t_s:.3f}",
                f"{row.power_w or 0.0:.1f}",
                f"{row.requests_in_flight or 0:.1f}",
                d.proposed.max_requests,
                d.proposed.max_kv_tokens,
                "" if d.proposed.prefill_tok_s is None else f"{d.proposed.prefill_tok_s:.0f}",
                f"{d.predicted_upper_w:.1f}",
                f"{d.target_w:.1f}",
                d.binding,
                d.state,
                f"{d.multipliers['power']:.1f}",
            ]
        )
    summary = acc.result(config.ceiling_w)
    text = summary.text(config.ceiling_w) if summary else "summary: no rows with power"
    print(text, file=sys.stderr)
    return 0
