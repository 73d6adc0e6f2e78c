"""benchmarks/proxy_overhead.py runs end to end with tiny counts and reports every figure.

Whether the figures meet their targets depends on the machine; that is for the full run, not
for the test suite. Run as a subprocess: the benchmark starts its own children and raises the
open-file limit for its flood.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(90)
def test_quick_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/proxy_overhead.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "added/ratio" in proc.stdout and "SSE events/s" in proc.stdout
    r = json.loads(out.read_text())

    idle = r["idle"]
    for side in ("proxy", "bare"):
        assert 0 <= idle[side]["cpu_pct"] < 200 and idle[side]["threads"] >= 1

    for kind in ("json", "sse"):
        lat = r["latency"][kind]
        assert set(lat["bare_added_ms"]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
        assert lat["bare_cpu_ms_per_request"] > 0
        for side in ("direct", "bare", "proxy"):
            st = lat[side]
            assert st["n"] > 0 and st["errors"] == 0
            assert 0 < st["p50_ms"] <= st["p99_ms"] < 30_000
        assert set(lat["added_ms"]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
        assert lat["proxy_cpu_ms_per_request"] > 0

    if shutil.which("wrk"):  # the closed-loop part needs wrk; without it the part is left out
        for side in ("direct", "bare", "proxy"):
            (best,) = r["wrk"][side]["rounds"]
            assert best["rps"] > 0 and best["non_2xx"] == 0 and best["cpu_ms_per_request"] > 0
        assert r["wrk"]["proxy_vs_bare"] > 0 and "most req/s" in proc.stdout
    else:
        assert "wrk" not in r

    sse = r["sse_relay"]
    assert sse["proxy"]["events"] > 0 and sse["direct"]["events"] > 0
    assert sse["proxy"]["cpu_us_per_event"] > 0

    q = r["queue_memory"]
    assert q["queued"] >= 0.9 * q["target_queued"]
    assert 10 < q["rss_idle_mb"] <= q["rss_queued_mb"]
    assert math.isfinite(q["kb_per_queued_request"]) and q["clear_s"] >= 0
    assert set(r["targets"]) == {
        "p50_added_under_0_5ms",
        "p99_added_under_2ms",
        "p99_added_within_1ms_of_bare_hop",
    }
