"""`powerbatch replay TRACE.csv`: the estimator and controller offline over a recorded trace.

Each row is one tick: its power is the measurement, its feature columns the operating point.
The decisions are printed (or written as CSV), so decision logic is tested without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Iterator

from powerbatch.control import ControlConfig, Controller, Decision, Observation
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
    unless the trace says otherwise."""
    controller = Controller(config)
    for row in rows:
        features = Features(
            batch=row.requests_in_flight or 0.0,
            kv_tokens=row.kv_tokens_in_flight or 0.0,
            prefill_tok_s=row.prefill_tok_s or 0.0,
            decode_tok_s=row.decode_tok_s or 0.0,
        )
        obs = Observation(
            t_s=row.t_s,
            power_w=row.power_w,
            sensor_ok=True,
            features=features,
            in_flight=int(row.requests_in_flight or 0),
            queued=int(row.queue_len or 0),
        )
        yield row, controller.tick(obs)


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
    for i, (row, d) in enumerate(replay(read_trace(a.trace), config)):
        if i % a.every:
            continue
        out.writerow(
            [
                f"{row.t_s:.3f}",
                f"{row.power_w:.1f}",
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
    return 0
