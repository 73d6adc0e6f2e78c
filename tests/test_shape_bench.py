"""The shape bench's figures from a made-up run, and its markdown table over split invocations."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest

from powerbatch.cli.report import RunData
from powerbatch.cli.shape_bench import figures, markdown_table
from powerbatch.load import LoadProfile, Phase


def _run(power_w: list[float]) -> RunData:
    """A simulator trace whose energy counter gives `power_w` in each whole second."""
    t = np.arange(len(power_w) + 1, dtype=float)
    energy = np.concatenate([[0.0], np.cumsum(power_w)])
    trace = {"t_s": list(t - 1.0), "step_s": [1.0] * len(t), "energy_j": list(energy)}
    profile = LoadProfile("flat", (Phase(float(len(power_w)), 1.0),))
    return RunData("reactive", 600.0, profile, 0.0, float(len(power_w)), [], trace)


def test_settled_ramp_figures_leave_out_the_first_seconds() -> None:
    a = argparse.Namespace(ramp_w_per_s=30.0, floor_w=450.0, swing_band_hz="0.2,3.0")
    # The step into the load (100 -> 500 W) is in the first seconds; later, one 40 W rise.
    watts = [100.0, 500.0] + [500.0] * 8 + [540.0] + [540.0] * 9
    f = figures(_run(watts), a)
    assert f["ramp_violation_s"] == 2 and f["largest_ramp_w_per_s"] == pytest.approx(400.0)
    assert f["largest_ramp_settled_w_per_s"] == pytest.approx(40.0)
    assert f["ramp_violation_settled_pct"] == pytest.approx(100.0 / 14)


def _doc(arms: dict[str, list[float]], **args: str) -> dict[str, Any]:
    base = {"profile": "bursty", "duration_s": "60.0", "ceiling_w": "600.0", "seed": "1"}
    lat = {p: {"ttft_p95_s": 0.5} for p in ("high", "normal", "low")}
    runs = {
        arm: [{"goodput_rps": g, "frac_above_ceiling": 0.0, "latency": lat} for g in goodputs]
        for arm, goodputs in arms.items()
    }
    return {"args": base | {"ramp_w_per_s": "30.0", "floor_w": "450.0"} | args, "runs": runs}


def test_markdown_table_merges_arms_in_order_with_their_spread() -> None:
    text = markdown_table([_doc({"planner": [2.0, 4.0]}), _doc({"none": [7.0, 7.0]})])
    header = next(line for line in text.splitlines() if line.startswith("| figure"))
    assert header == "| figure | none | planner |"
    assert "| goodput, req/s in SLO | 7.00 ± 0.00 | 3.00 ± 1.41 |" in text
    assert "30 W/s ramp" in text and "2 repeat(s)" in text
    with pytest.raises(ValueError, match="different benches"):
        markdown_table([_doc({"none": [1.0]}), _doc({"planner": [1.0]}, floor_w="400.0")])
