"""The GPU model against published figures: the GPU-to-Grid fits (arXiv 2602.05116) of the
ML.ENERGY leaderboard's data, "Illusion of Power Capping in LLM Decode" (arXiv 2605.11999) and
NVIDIA Dynamo's power-planner notes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from powerbatch.sim.gpu_model import (
    PROFILES,
    decode_power_w,
    noisy_readings_w,
    prefill_power_w,
    steady_state,
    step_time_s,
)

H100_8B = PROFILES["h100-llama8b"]

# The GPU-to-Grid fits evaluated for Llama-3.1-8B on one H100: batch -> (W, ITL ms, tok/s).
PUBLISHED_8B = {8: (489.0, 8.6, 1253.0), 64: (620.0, 11.3, 5130.0), 256: (683.0, 28.0, 8715.0)}


@pytest.mark.parametrize("batch", sorted(PUBLISHED_8B))
def test_h100_8b_decode_power_and_itl_match_published(batch: int) -> None:
    power_w, itl_ms, _ = PUBLISHED_8B[batch]
    s = steady_state(H100_8B, batch)
    assert s.power_w == pytest.approx(power_w, rel=0.02)
    assert s.step_s * 1000 == pytest.approx(itl_ms, rel=0.03)


def test_h100_8b_throughput_follows_published_order() -> None:
    """batch/ITL is not the table's tok/s (the table mixes in chunked prefill), but it rises with
    batch like the table and lands within a factor of 1.5 of it."""
    tok_s = [steady_state(H100_8B, b).output_tok_s for b in sorted(PUBLISHED_8B)]
    assert tok_s == sorted(tok_s)
    for b, model in zip(sorted(PUBLISHED_8B), tok_s, strict=True):
        published = PUBLISHED_8B[b][2]
        assert published / 1.5 < model < published * 1.5, (b, model, published)


def test_70b_profile_sums_four_gpus() -> None:
    p = PROFILES["h100x4-llama70b"]
    assert p.num_gpus == 4 and p.tdp_w == 2800
    low, high = steady_state(p, 1).power_w, steady_state(p, 1024).power_w
    assert 1646 < low < 1700 and 2550 < high <= 2800
    assert p.idle_w == pytest.approx(4 * 78)


def test_prefill_heavy_step_draws_more_than_decode_at_same_batch() -> None:
    for batch in (1, 8, 32):
        _, decode_only = step_time_s(H100_8B, batch, 0)
        _, mixed = step_time_s(H100_8B, batch, 2048)
        assert mixed > decode_only + 50


def test_mixed_step_is_time_weighted_mean() -> None:
    step_s, power_w = step_time_s(H100_8B, 16, 1000)
    t_dec, p_dec = step_time_s(H100_8B, 16, 0)
    t_pre = 1000 / H100_8B.prefill_tok_s
    assert step_s == pytest.approx(t_dec + t_pre)
    expected = (p_dec * t_dec + prefill_power_w(H100_8B) * t_pre) / (t_dec + t_pre)
    assert power_w == pytest.approx(expected)


def test_power_limit_clamps_power_and_slows_prefill_in_proportion() -> None:
    step_free, p_free = step_time_s(H100_8B, 0, 4096)
    step_cap, p_cap = step_time_s(H100_8B, 0, 4096, power_limit_w=400.0)
    assert p_free == pytest.approx(0.95 * 700)
    assert p_cap == pytest.approx(400.0)
    assert step_cap / step_free == pytest.approx(p_free / 400.0)


def test_power_limit_slows_decode_by_square_root() -> None:
    step_free, p_free = step_time_s(H100_8B, 256, 0)
    step_cap, p_cap = step_time_s(H100_8B, 256, 0, power_limit_w=500.0)
    assert p_cap == pytest.approx(500.0)
    assert step_cap / step_free == pytest.approx(math.sqrt(p_free / 500.0))
    # A limit above the draw changes nothing.
    assert step_time_s(H100_8B, 256, 0, power_limit_w=690.0) == (step_free, p_free)


def test_decode_light_stays_in_published_range_and_ignores_cap() -> None:
    p = PROFILES["h200-decode-light"]
    for batch in (1, 4, 16, 64, 256, 1024, 4096):
        for kv in (0, 200_000, 400_000):
            _, w = step_time_s(p, batch, 0, kv)
            assert 137.0 <= w <= 300.0
    # "a power cap never engages during decode" at a 70%-of-TDP cap (the safe default in NVIDIA
    # Dynamo's power-planner notes).
    assert step_time_s(p, 512, 0, power_limit_w=490.0) == step_time_s(p, 512, 0)


def test_kv_term_raises_power_and_is_bounded() -> None:
    base = decode_power_w(H100_8B, 8, 0)
    full = decode_power_w(H100_8B, 8, 400_000)
    assert base < full <= base + 0.08 * H100_8B.dec_span_w + 1e-9
    assert decode_power_w(H100_8B, 8, 10**9) == full  # saturates


def test_idle_when_nothing_runs() -> None:
    assert step_time_s(H100_8B, 0, 0) == (0.0, H100_8B.idle_w)


def test_noise_statistics() -> None:
    rng = np.random.default_rng(1)
    readings = np.array([noisy_readings_w(H100_8B, 665.0, rng)[0] for _ in range(20_000)])
    spikes = readings > 665.0 + 5 * 20.0
    assert 0.005 < spikes.mean() < 0.02
    assert readings.max() < 665.0 + 185.0 + 6 * 20.0
    calm = readings[~spikes]
    assert calm.mean() == pytest.approx(665.0, abs=1.0)
    assert calm.std() == pytest.approx(20.0, rel=0.1)


def test_noise_is_per_gpu_and_sums_to_total() -> None:
    p = PROFILES["h100x4-llama70b"]
    rng = np.random.default_rng(2)
    totals = [sum(noisy_readings_w(p, 2000.0, rng)) for _ in range(5000)]
    assert len(noisy_readings_w(p, 2000.0, rng)) == 4
    assert float(np.median(totals)) == pytest.approx(2000.0, abs=5.0)
