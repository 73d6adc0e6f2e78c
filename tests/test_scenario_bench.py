"""The randomized scenario bench: plants and loads drawn per seed over their whole ranges, the
simulator features they need (meter lag, slow noise, GPU imbalance, cap cost), and a 2-scenario
run of `powerbatch scenarios` end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from powerbatch.cli.scenarios import distribution, draw_scenario
from powerbatch.load.drawn import LOAD_RANGES, MAX_PEAK_RPS, draw_load
from powerbatch.sim.engine import SimEngine
from powerbatch.sim.gpu_model import (
    PROFILES,
    decode_power_w,
    mean_noise_factor,
    step_time_s,
)
from powerbatch.sim.plants import RANGES, Plant, draw_plant
from powerbatch.sim.server import _SimCollector

DRAWS = 200


def _plants(seed: int = 0) -> list[Plant]:
    return [draw_plant(np.random.default_rng([seed, k])) for k in range(DRAWS)]


def _hits_both_ends(values: list[float], lo: float, hi: float, tol: float = 0.1) -> None:
    width = hi - lo
    assert min(values) >= lo - 1e-9 and max(values) <= hi + 1e-9, (min(values), max(values))
    assert min(values) <= lo + tol * width, f"low end of [{lo}, {hi}] missed: {min(values)}"
    assert max(values) >= hi - tol * width, f"high end of [{lo}, {hi}] missed: {max(values)}"


def test_plants_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    a = draw_plant(np.random.default_rng([7, 3]))
    b = draw_plant(np.random.default_rng([7, 3]))
    c = draw_plant(np.random.default_rng([7, 4]))
    assert a == b
    assert a != c
    assert Plant.from_json(json.loads(a.dumps())) == a  # a rerun rebuilds the same plant


def test_plant_draws_cover_every_range_at_both_ends() -> None:
    plants = _plants()
    d = [p.draw for p in plants]
    for key in ("base_frac", "top_over_headroom", "decode_cap_exponent", "imbalance"):
        vals = [x[key] for x in d if key != "imbalance" or x["num_gpus"] > 1]
        _hits_both_ends(vals, *RANGES[key])
    _hits_both_ends([x["noise_sigma_w_per_gpu"] for x in d], *RANGES["noise_sigma_w_per_gpu"])
    _hits_both_ends([math.log2(x["bind_batch"]) for x in d], *RANGES["bind_log2_batch"])
    _hits_both_ends([x["idle_frac"] for x in d], 0.10, 0.85, tol=0.15)
    log_ranges = {
        "dec_k": [p.profile.dec_k for p in plants],
        "prefill_tok_s_per_gpu": [p.profile.prefill_tok_s / p.profile.num_gpus for p in plants],
        "itl_base_s": [p.profile.itl_base_s for p in plants],
        "itl_span_s": [p.profile.itl_span_s for p in plants],
        "noise_tau_s": [x["noise_tau_s"] for x in d if x["noise_tau_s"] > 0],
    }
    for key, vals in log_ranges.items():
        lo, hi = RANGES[key]
        _hits_both_ends([math.log(v) for v in vals], math.log(lo), math.log(hi))
    assert {x["num_gpus"] for x in d} == set(RANGES["num_gpus"])
    assert {p.meter for p in plants} == set(RANGES["meter"])
    assert {x["kv_binds"] for x in d} == {True, False}
    assert {x["curve"] for x in d} == {"flat", "near-linear", "saturates-early", "saturates-late"}
    assert any(x["noise_tau_s"] == 0 for x in d) and any(x["noise_tau_s"] > 0 for x in d)
    j = [x["prefill_j_per_token"] for x in d]
    assert max(j) / min(j) > 10  # light to heavy prompts


def test_every_drawn_ceiling_binds_between_base_and_top_draw() -> None:
    for p in _plants(seed=1):
        prof = p.profile
        base, top = prof.dec_base_w, prof.dec_base_w + prof.dec_span_w
        assert prof.idle_w <= base + 1e-9
        assert base + prof.dec_span_w / 3.5 - 1e-6 <= p.ceiling_w < top <= prof.tdp_w + 1e-6
        assert p.ceiling_w / prof.num_gpus >= prof.min_limit_w_per_gpu  # a limiter can reach it
        b = p.draw["bind_batch"]  # decode alone meets the ceiling at the drawn batch
        assert decode_power_w(prof, math.floor(b)) <= p.ceiling_w + 1e-6
        assert decode_power_w(prof, math.ceil(b)) >= p.ceiling_w - 1e-6
        if prof.gpu_power_shares:
            assert len(prof.gpu_power_shares) == prof.num_gpus
            assert math.isclose(sum(prof.gpu_power_shares), 1.0)
        if p.draw["kv_binds"]:
            assert p.kv_capacity_tokens < 200_000
        assert p.sustain_rps(600.0, 200.0) > 0


def test_load_draws_are_seeded_and_cover_their_ranges() -> None:
    loads = []
    for k in range(DRAWS):
        rng = np.random.default_rng([0, k])
        plant = draw_plant(rng)
        loads.append(draw_load(rng, plant.sustain_rps))
    again = draw_scenario(0, 5)
    assert again.load.draw == loads[5].draw
    assert again.load.profile.phases == loads[5].profile.phases
    assert again.load.profile.plan(10.0, 3) == loads[5].profile.plan(10.0, 3)
    d = [x.draw for x in loads]
    assert {x["arrival"] for x in d} == set(LOAD_RANGES["arrival"])
    assert {x["lengths"] for x in d} == set(LOAD_RANGES["lengths"])
    bursty = [x for x in d if x["arrival"] == "bursty"]
    for key in ("burst_period_s", "burst_ratio"):
        _hits_both_ends([x[key] for x in bursty], *LOAD_RANGES[key])
    _hits_both_ends([x["stream_fraction"] for x in d], *LOAD_RANGES["stream_fraction"])
    _hits_both_ends([x["priority_mix"]["high"] for x in d], *LOAD_RANGES["high_share"])
    for load in loads:
        rates = [ph.rate_rps for ph in load.profile.phases]
        assert max(rates) <= MAX_PEAK_RPS + 1e-9
        assert math.isclose(sum(load.profile.priority_mix.values()), 1.0)
        if load.draw["arrival"] == "bursty":
            assert math.isclose(rates[0] / rates[1], load.draw["burst_ratio"])
            assert math.isclose(
                sum(ph.duration_s for ph in load.profile.phases), load.draw["burst_period_s"]
            )
        if load.draw["arrival"] == "overload":
            assert rates[0] > load.draw["sustain_rps"]


def test_named_profiles_keep_their_cap_cost() -> None:
    """The new cap-cost exponent defaults to the square root the named profiles always had."""
    prof = PROFILES["h100-llama8b"]
    free, _ = step_time_s(prof, 64, 0)
    capped, power = step_time_s(prof, 64, 0, power_limit_w=500.0)
    p_dec = decode_power_w(prof, 64)
    assert power == 500.0
    assert capped == pytest.approx(free * math.sqrt(p_dec / 500.0), rel=1e-12)
    from dataclasses import replace

    prop = replace(prof, decode_cap_exponent=1.0)
    capped_prop, _ = step_time_s(prop, 64, 0, power_limit_w=500.0)
    assert capped_prop == pytest.approx(free * p_dec / 500.0, rel=1e-12)


def test_imbalanced_gpus_meet_their_limits_first_and_read_their_shares() -> None:
    from dataclasses import replace

    prof = replace(
        PROFILES["h100x4-llama70b"],
        gpu_power_shares=(0.4, 0.2, 0.2, 0.2),
        noise_sigma_w_per_gpu=0.0,
        spike_prob=0.0,
    )
    engine = SimEngine(prof, power_limit_w=2000.0)
    assert engine.power_limit_w == pytest.approx(500.0 / 0.4)  # the hot GPU at 500 W
    readings = engine.instant_power_per_gpu_w()
    idle = prof.idle_w
    assert readings == pytest.approx([0.4 * idle, 0.2 * idle, 0.2 * idle, 0.2 * idle])
    even = SimEngine("h100x4-llama70b", power_limit_w=2000.0)
    assert even.power_limit_w == 2000.0


def test_slow_noise_survives_the_one_second_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    assert mean_noise_factor(0.0) == 0.0
    assert mean_noise_factor(100.0) == pytest.approx(1.0, abs=0.01)
    assert mean_noise_factor(0.01) == pytest.approx(math.sqrt(0.02), rel=0.02)
    prof = replace(PROFILES["h100-llama8b"], noise_tau_s=2.0, spike_prob=0.0)
    engine = SimEngine(prof, seed=3)
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    xs = []
    for _ in range(400):
        clock[0] += 0.1
        xs.append(engine.instant_power_per_gpu_w()[0] - prof.idle_w)
    x = np.asarray(xs)
    lag1 = float(np.corrcoef(x[:-1], x[1:])[0, 1])
    assert lag1 == pytest.approx(math.exp(-0.1 / 2.0), abs=0.1)  # OU: e^(-dt/tau)
    mean = engine.mean_power_per_gpu_w()[0]
    assert mean != engine.average_power_w()  # the noise a 1-s mean keeps


def test_lagging_meter_serves_the_collection_two_seconds_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = SimEngine("h100-llama8b", seed=1)
    clock = [5000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    collector = _SimCollector(engine, "m", "h", dcgm_interval_s=1.0, dcgm_lag_s=2.0)

    def limit_w() -> float:
        for fam in collector.collect():
            if fam.name == "DCGM_FI_DEV_POWER_MGMT_LIMIT":
                return float(fam.samples[0].value)
        raise AssertionError("no limit field")

    seen = []
    for t in range(8):
        clock[0] = 5000.0 + t + 0.5
        engine.power_limit_w = 300.0 + 10 * t  # a field that changes once a second
        seen.append(limit_w())
    assert seen[3:] == [300.0 + 10 * (t - 2) for t in range(3, 8)]


def test_distribution_takes_the_worse_tail() -> None:
    d = distribution([1.0, 0.9, 0.5, None, 1.1], higher_is_better=True)
    assert d["n"] == 4 and d["worst"] == 0.5 and d["median"] == pytest.approx(0.95)
    assert d["worst_decile"] < d["median"]
    d = distribution([1.0, 3.0, 2.0], higher_is_better=False)
    assert d["worst"] == 3.0 and d["worst_decile"] > d["median"]


def test_two_scenarios_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "powerbatch", "scenarios", "-n", "2", "--seed", "3"]
    cmd += ["--duration-s", "3", "--drain-timeout-s", "6", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["index"] for s in results["scenarios"]] == [0, 1]
    for sc in results["scenarios"]:
        assert set(sc["runs"]) == {"none", "hwcap", "admission", "powerbatch"}
        assert Plant.from_json(sc["plant"]) == draw_scenario(3, sc["index"]).plant
        for arm, run in sc["runs"].items():
            assert run["requests"] > 0, arm
            assert len(run["power_1s_w"]) == 3, arm
        assert sc["figures"]["hwcap"]["tok_s"] == 1.0
    for key in ("over_pp", "tok_s", "j_per_token", "goodput", "ttft_p95", "sd_all"):
        assert set(results["distribution"][key]) == {"none", "hwcap", "admission", "powerbatch"}
    assert (tmp_path / "distributions.png").stat().st_size > 10_000
    assert "interactive streaming TTFT p95" in proc.stdout


pytestmark = pytest.mark.timeout(240)


def test_admissions_bound_follows_the_ceiling_and_one_request_over_is_a_plant_fact() -> None:
    from dataclasses import replace

    plant = draw_plant(np.random.default_rng([1, 0]))
    prompt, output = 800.0, 200.0
    bound = plant.admission_bound_tok_s(prompt, output)
    assert bound > 0
    higher = replace(plant, ceiling_w=plant.ceiling_w * 1.3)
    assert higher.admission_bound_tok_s(prompt, output) > bound
    # Under the decode power of batch 1 nothing fits, and one request alone is over.
    p = plant.profile
    starved = replace(plant, ceiling_w=0.9 * p.dec_base_w)
    assert starved.admission_bound_tok_s(prompt, output) == 0.0
    assert starved.one_request_over(prompt)
    # A prompt that takes no time to prefill puts no second over a ceiling above batch 1.
    roomy = replace(plant, ceiling_w=1.05 * (p.dec_base_w + p.dec_span_w))
    assert not roomy.one_request_over(1.0)
