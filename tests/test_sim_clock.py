"""The simulator's SM clock: the roofline split, the voltage knee, the cap met by the clock, and
zeusd's clock routes with zeusd's own shapes (zeusd/src/routes/gpu.rs, routes/mod.rs, error.rs).

Sources behind the expected shapes: "Illusion of Power Capping in LLM Decode" (arXiv 2605.11999),
VoltanaLLM (arXiv 2509.04827), arXiv 2501.08219 (decode insensitive to the clock, prefill ~ 1/f).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from conftest import run
from prometheus_client.parser import text_string_to_metric_families

from powerbatch.errors import ClockError
from powerbatch.sim import SimEngine
from powerbatch.sim.gpu_model import (
    PROFILES,
    clocked_part,
    steady_state,
    step_at_clock,
    step_time_s,
    supported_clocks_mhz,
)
from powerbatch.sim.server import start_sim_server

LIGHT = PROFILES["h200-decode-light"]
HEAVY = PROFILES["h100-llama8b"]


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("limit_w", [None, 400.0, 600.0])
def test_the_top_clock_is_the_unlocked_profile_exactly(name: str, limit_w: float | None) -> None:
    p = PROFILES[name]
    for batch, prefill in ((0, 0), (1, 0), (16, 0), (256, 0), (8, 2048), (0, 4096)):
        free = step_time_s(p, batch, prefill, 1000, limit_w)
        locked = step_time_s(p, batch, prefill, 1000, limit_w, sm_clock_mhz=p.sm_clock_max_mhz)
        assert locked == free


def test_supported_clocks_are_a_15_mhz_grid_from_the_top() -> None:
    clocks = supported_clocks_mhz(HEAVY)
    assert clocks[0] == 1980 and clocks == sorted(clocks, reverse=True)
    assert {a - b for a, b in itertools.pairwise(clocks)} == {15}
    assert clocks[-1] >= HEAVY.sm_clock_min_mhz


def test_small_batch_decode_barely_slows_while_prefill_slows_as_one_over_f() -> None:
    half = 990.0
    dec_free, dec_half = steady_state(LIGHT, 8), steady_state(LIGHT, 8, sm_clock_mhz=half)
    assert dec_half.step_s / dec_free.step_s < 1.05  # memory-bound
    pre_free = step_at_clock(HEAVY, 0, 4096)
    pre_half = step_at_clock(HEAVY, 0, 4096, sm_clock_mhz=half)
    assert pre_half.step_s / pre_free.step_s == pytest.approx(2.0, rel=1e-6)  # SM-bound
    # Large-batch decode sits between the two.
    big = steady_state(HEAVY, 256, sm_clock_mhz=half).step_s / steady_state(HEAVY, 256).step_s
    assert dec_half.step_s / dec_free.step_s < big < 2.0


def test_sm_power_falls_faster_than_the_clock_above_the_knee() -> None:
    p = HEAVY
    top = p.sm_clock_max_mhz
    t0, p0 = 1.0, 665.0
    dyn0 = p0 - p.idle_w
    knee = p.voltage_knee_frac * top
    for f in (knee + 30, 0.8 * top, 0.95 * top):
        _, power_w = clocked_part(p, t0, p0, 1.0, f)
        assert (power_w - p.idle_w) / dyn0 < 0.95 * f / top
    # Under the knee the voltage is at its floor: dynamic power goes linearly with f.
    a = clocked_part(p, t0, p0, 1.0, 0.5 * knee)[1] - p.idle_w
    b = clocked_part(p, t0, p0, 1.0, 0.25 * knee)[1] - p.idle_w
    assert a / b == pytest.approx(2.0, rel=1e-6)


def test_decode_energy_against_clock_is_u_shaped_with_a_saving_near_ipc() -> None:
    """arXiv 2605.11999: up to 32 % of decode energy saved by a lower lock on H200; VoltanaLLM:
    too low a clock costs more time than it saves power."""
    for batch in (8, 32, 128):
        base = steady_state(LIGHT, batch).j_per_token
        curve = {
            f: steady_state(LIGHT, batch, sm_clock_mhz=f).j_per_token for f in range(345, 1981, 15)
        }
        best = min(curve, key=lambda f: curve[f])
        assert 0.62 * base < curve[best] < 0.85 * base, (batch, curve[best] / base)
        assert curve[345] > 1.1 * curve[best]  # the left arm of the U
        assert 345 < best < 1980


def test_a_cap_met_by_the_clock_costs_decode_little_and_prefill_more() -> None:
    p = dataclasses.replace(HEAVY, cap_by_clock=True)
    dec_free, dec_cap = step_at_clock(p, 64, 0), step_at_clock(p, 64, 0, power_limit_w=500.0)
    pre_free, pre_cap = step_at_clock(p, 0, 4096), step_at_clock(p, 0, 4096, power_limit_w=500.0)
    assert dec_cap.power_w == pytest.approx(500.0, abs=1.0)
    assert pre_cap.power_w == pytest.approx(500.0, abs=1.0)
    assert dec_cap.sm_clock_mhz < 1980 and pre_cap.sm_clock_mhz < 1980
    dec_slow = dec_cap.step_s / dec_free.step_s
    pre_slow = pre_cap.step_s / pre_free.step_s
    assert dec_slow < 1.05 < pre_slow
    # A lock low enough that its power fits leaves the cap nothing to do.
    low = step_at_clock(p, 64, 0, power_limit_w=500.0, sm_clock_mhz=1200)
    assert low == step_at_clock(p, 64, 0, sm_clock_mhz=1200)


def test_engine_locks_refuse_unsupported_clocks_and_set_the_step_clock() -> None:
    engine = SimEngine("h100x4-llama70b", seed=1)
    with pytest.raises(ClockError):
        engine.set_gpu_locked_clocks(0, 100, 1980)
    with pytest.raises(ClockError):
        engine.set_gpu_locked_clocks(0, 1500, 1200)
    with pytest.raises(ClockError):
        engine.set_gpu_locked_clocks(4, 345, 1200)
    assert engine.locked_top_mhz() is None
    engine.set_gpu_locked_clocks(1, 345, 1200)
    engine.set_gpu_locked_clocks(2, 345, 1500)
    assert engine.locked_top_mhz() == 1200.0  # lockstep: the slowest GPU paces the set
    engine.add_request(64, 8)
    rec = engine.step()
    assert rec is not None and rec.sm_clock_mhz == pytest.approx(1200.0)
    for gpu in range(4):
        engine.reset_gpu_locked_clocks(gpu)
    assert engine.locked_top_mhz() is None


def _decode_run(lock: tuple[int, int] | None) -> tuple[float, int, float]:
    engine = SimEngine("h200-decode-light", seed=2)
    if lock is not None:
        engine.set_gpu_locked_clocks(0, *lock)
    for _ in range(16):
        engine.add_request(200, 200)
    while engine.step() is not None:
        pass
    span = engine.trace[-1].t_s + engine.trace[-1].step_s - engine.trace[0].t_s
    return engine.energy_j(engine._clock_s), engine.generation_tokens_total, span


def test_a_locked_engine_spends_fewer_joules_per_token_on_decode() -> None:
    e_free, n_free, t_free = _decode_run(None)
    e_lock, n_lock, t_lock = _decode_run((345, 1005))
    assert n_free == n_lock == 16 * 200
    assert e_lock / n_lock < 0.85 * e_free / n_free
    assert t_lock < 1.25 * t_free


# ---- zeusd's clock routes --------------------------------------------------------------------


async def _post(url: str, params: dict[str, str]) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.post(url, params=params) as r:
        return r.status, r.content_type, await r.text()


def test_zeusd_clock_routes_answer_in_zeusds_shapes() -> None:
    async def main() -> list[Any]:
        engine = SimEngine("h100x4-llama70b", seed=3)
        server = await start_sim_server(engine, zeusd_apply_delay_s=0.01)
        set_url = server.url + "/gpu/set_gpu_locked_clocks"
        reset_url = server.url + "/gpu/reset_gpu_locked_clocks"
        try:
            ok = await _post(
                set_url,
                {
                    "gpu_ids": "0,1",
                    "min_clock_mhz": "345",
                    "max_clock_mhz": "1200",
                    "block": "true",
                },
            )
            locks = engine.gpu_locked_clocks_mhz
            async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
                text = await r.text()
            missing = await _post(set_url, {"gpu_ids": "0", "min_clock_mhz": "345"})
            unknown = await _post(reset_url, {"gpu_ids": "0", "block": "true", "x": "1"})
            bad_ids = await _post(reset_url, {"gpu_ids": "a", "block": "true"})
            no_gpu = await _post(reset_url, {"gpu_ids": "9", "block": "true"})
            refused = await _post(
                set_url,
                {"gpu_ids": "2", "min_clock_mhz": "345", "max_clock_mhz": "2500", "block": "true"},
            )
            reset = await _post(reset_url, {"gpu_ids": "0,1", "block": "true"})
            return [ok, locks, text, missing, unknown, bad_ids, no_gpu, refused, reset, engine]
        finally:
            await server.close()

    ok, locks, text, missing, unknown, bad_ids, no_gpu, refused, reset, engine = run(main())
    assert ok == (200, "application/octet-stream", "")
    assert locks[:2] == [(345, 1200), (345, 1200)] and locks[2:] == [None, None]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "DCGM_FI_DEV_SM_CLOCK" in families
    assert len(families["DCGM_FI_DEV_SM_CLOCK"].samples) == 4
    assert missing[:2] == (400, "text/plain")
    assert missing[2].startswith("Query deserialize error: missing field")
    assert unknown[:2] == (400, "text/plain") and "unknown field `x`" in unknown[2]
    assert bad_ids[:2] == (400, "application/json")
    assert bad_ids[2] == '{"error": "Invalid GPU index: a"}'
    assert no_gpu == (400, "text/plain", "GPU index 9 does not exist.")
    assert refused[0] == 400 and list(json.loads(refused[2])["errors"]) == ["2"]
    assert reset[0] == 200 and engine.gpu_locked_clocks_mhz == [None] * 4


def test_bench_scenario_takes_the_drawn_plant_with_clock_physics_drawn_in_range() -> None:
    """`powerbatch bench --scenario SEED:K`: the scenario's plant, ceiling and load, the clock
    model's constants drawn inside `CLOCK_RANGES` and a limit met by the clock."""
    import argparse

    from powerbatch.cli.bench import apply_scenario, proxy_args
    from powerbatch.cli.scenarios import draw_scenario
    from powerbatch.sim.plants import CLOCK_RANGES

    a = argparse.Namespace(
        scenario="1:1", cap_by_clock=True, ceiling_w=600.0, gpu="h100-llama8b",
        ttft_slo_s=2.0, tpot_slo_s=0.1, valley_fill=False, prefill_pacing=None,
    )  # fmt: skip
    load = apply_scenario(a)
    sc = draw_scenario(1, 1)
    assert load is not None and load.name == sc.load.profile.name
    assert a.ceiling_w == sc.plant.ceiling_w and a.gpu == sc.plant.profile.name
    prof = a.plant.profile
    assert prof.cap_by_clock
    for key, (lo, hi) in CLOCK_RANGES.items():
        assert lo <= getattr(prof, key) <= hi
        assert getattr(prof, key) != getattr(sc.plant.profile, key)  # drawn, not the default
    gpus = proxy_args(a)[proxy_args(a).index("--gpus") + 1]
    assert gpus.count(",") + 1 == prof.num_gpus
    b = argparse.Namespace(scenario=None)
    assert apply_scenario(b) is None and b.plant is None


def test_the_scenario_bench_draws_the_same_clock_plant_as_bench_scenario() -> None:
    """`powerbatch scenarios --cap-by-clock` judges the clock arm on the plant that `powerbatch
    bench --scenario SEED:K --cap-by-clock` runs alone: the same draw, load and clock constants,
    so that a bad case is rerun with every baseline arm."""
    import argparse

    from powerbatch.cli.bench import apply_scenario
    from powerbatch.cli.scenarios import clock_args, draw_scenario

    plain, clocked = draw_scenario(1, 4), draw_scenario(1, 4, clock_physics=True)
    assert clocked.plant.profile.cap_by_clock and not plain.plant.profile.cap_by_clock
    assert clocked.plant.draw == plain.plant.draw and clocked.load.draw == plain.load.draw
    a = argparse.Namespace(scenario="1:4", cap_by_clock=True)
    apply_scenario(a)
    assert a.plant == clocked.plant
    args = clock_args(clocked.plant)
    prof = clocked.plant.profile
    assert args[args.index("--clock-range-mhz") + 1] == (
        f"{prof.sm_clock_min_mhz},{prof.sm_clock_max_mhz}"
    )


def test_the_scenario_clock_arm_needs_the_clock_physics() -> None:
    """The clock arm's J/token means something only against a cap on the same physics: asked
    for without `--cap-by-clock`, the bench says so and runs nothing."""
    cmd = [sys.executable, "-m", "powerbatch", "scenarios", "-n", "1"]
    proc = subprocess.run(
        [*cmd, "--arms", "hwcap,powerbatch-clock"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--cap-by-clock" in proc.stdout, proc.stdout + proc.stderr
