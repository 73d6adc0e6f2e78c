"""The README's main job and the comparison bench, end to end, in short runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "powerbatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_demo_runs_and_writes_a_summary_and_a_plot(tmp_path: Path) -> None:
    proc = _run(["demo", "--duration-s", "8", "--no-live", "--out", str(tmp_path)], 120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] > 0 and summary["output_tokens"] > 0
    assert summary["seconds"] == 8
    assert (tmp_path / "powerbatch-demo.png").stat().st_size > 10_000
    assert "time above ceiling" in proc.stdout


def test_bench_compares_arms_and_writes_results(tmp_path: Path) -> None:
    proc = _run(
        [
            "bench",
            "--arms",
            "none,static,admission,powerbatch",
            "--repeats",
            "1",
            "--duration-s",
            "6",
            "--static-batch",
            "8",
            "--out",
            str(tmp_path),
        ],
        240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["aggregate"]) == {"none", "static", "admission", "powerbatch"}
    for arm, runs in results["runs"].items():
        assert runs[0]["requests"] > 0, arm
        assert len(runs[0]["power_1s_w"]) == 6, arm
    for png in ("power.png", "summary.png"):
        assert (tmp_path / png).stat().st_size > 10_000
