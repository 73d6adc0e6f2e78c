"""benchmarks/clock_plants.py's phase oracle: a pair of equal locks is that static lock, and the
prefill lock is the one steps with prompt tokens run at (virtual time, a second or so)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from powerbatch.sim.gpu_model import GpuProfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import clock_plants

Plant = tuple[GpuProfile, float, int]


@pytest.fixture(scope="module")
def plant() -> Plant:
    return clock_plants.draw(0)


def _run(plant: Plant, **kw: Any) -> dict[str, float]:
    profile, ceiling_w, kv = plant
    return clock_plants.run(profile, ceiling_w, kv, 0, 20.0, load="bursty", **kw)


def test_a_pair_of_equal_locks_is_that_static_lock(plant: Plant) -> None:
    floor, top = plant[0].sm_clock_min_mhz, plant[0].sm_clock_max_mhz
    assert _run(plant, phases=(960, 960)) == _run(plant, lock=(floor, 960))
    assert _run(plant, phases=(top, top)) == _run(plant)


def test_steps_with_prompt_tokens_run_at_the_prefill_lock(plant: Plant) -> None:
    low = _run(plant, phases=(780, 780))
    prefill_top = _run(plant, phases=(780, 1980))
    decode_top = _run(plant, phases=(1980, 780))
    # Prefill is compute-bound: at the top clock the first tokens come sooner...
    assert prefill_top["ttft_p95_s"] < 0.9 * low["ttft_p95_s"]
    # ...while a decode step at the top barely moves them.
    assert decode_top["ttft_p95_s"] > 0.9 * low["ttft_p95_s"]
    assert prefill_top["j_per_token"] != decode_top["j_per_token"]
