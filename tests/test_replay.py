"""`powerbatch replay`: the decision logic over a recorded trace, offline, as a user runs it."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import numpy as np

from powerbatch.cli.replay import replay
from powerbatch.control import ControlConfig
from powerbatch.telemetry.trace import TraceRow, read_trace, write_trace


def _trace(path: Path) -> None:
    """A GPU whose batch ramps up while power follows it past a 500 W ceiling."""
    rng = np.random.default_rng(4)
    rows = []
    for i in range(300):
        n = min(4 + i // 3, 90)
        rows.append(
            TraceRow(
                t_s=i * 0.2,
                power_w=150 + 5.0 * n + rng.normal(0, 5),
                requests_in_flight=float(n),
                kv_tokens_in_flight=800.0 * n,
                prefill_tok_s=60.0 * n,
                decode_tok_s=30.0 * n,
                queued=20.0,
            )
        )
    write_trace(path, rows)


def test_replay_cuts_the_batch_once_the_trace_crosses_the_ceiling(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    _trace(path)
    decisions = list(replay(read_trace(path), ControlConfig(ceiling_w=500.0, warmup_s=2.0)))
    over = [(row, d) for row, d in decisions if row.power_w > 500.0]
    assert over, "the trace must cross the ceiling for this test to mean anything"
    # Once over, the controller asks for fewer requests than the trace had in flight.
    assert all(d.proposed.max_requests < (row.requests_in_flight or 0) for row, d in over[5:])
    assert {d.binding for _, d in over} == {"power"}
    # Where power fits (~70 in flight), it does not ask for less than half of that.
    first_over = decisions.index(over[0])
    limits_before = [d.proposed.max_requests for _, d in decisions[first_over - 20 : first_over]]
    assert min(limits_before) >= 20


def test_replay_command_prints_csv_decisions(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    _trace(path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "powerbatch",
            "replay",
            str(path),
            "--ceiling-w",
            "500",
            "--every",
            "10",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 30
    assert {"limit_requests", "predicted_upper_w", "binding", "lambda_power"} <= set(rows[0])
    assert rows[-1]["binding"] == "power"


def test_replay_rejects_a_malformed_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("t_s,power_w\n0,100\n0.2,not-a-number\n")
    proc = subprocess.run(
        [sys.executable, "-m", "powerbatch", "replay", str(bad), "--ceiling-w", "500"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not a number" in proc.stderr


def test_a_trace_written_before_queue_len_was_renamed_reads_its_queue(tmp_path: Path) -> None:
    path = tmp_path / "old.csv"
    path.write_text("t_s,power_w,queue_len\n0.0,300.0,7\n0.2,301.0,\n")
    rows = list(read_trace(path))
    assert [r.queued for r in rows] == [7.0, None]
