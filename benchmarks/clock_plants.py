"""The clock law on drawn plants, in virtual time: J/token against the unlocked cap and against
the best single locked clock, side by side on each plant, and the worst cases.

Each plant is `powerbatch.sim.plants.draw_plant` with its clock physics drawn too (voltage knee
and floor, the clock-driven power share, the clock under which memory-bound work slows, the
roofline's overlap: docs/clock.md), so no law can be tuned to the named profiles' constants,
and both regimes the sources describe are drawn (VoltanaLLM, arXiv 2509.04827: a U with a sweet
spot; arXiv 2501.08219: decode flat down to the lowest clock). A Poisson load of chat-sized
requests runs on `SimEngine` (a power limit at the plant's ceiling, met by the clock) for
`--seconds` of virtual time per arm:

    unlocked   the cap alone (the driver's clock policy)
    static     each candidate lock in turn; the best is the one with the fewest J/token whose
               tokens served stay >= 0.98x unlocked's (what an operator finds by sweep)
    law        powerbatch.control.laws.clock, objective energy, fed 1-second windows

The meter is exact here (no exporter lag); `powerbatch bench --cap-by-clock` runs the same law
through the real proxy, zeusd and dcgm paths.

    python benchmarks/clock_plants.py --plants 6 --seconds 300
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

import numpy as np

import powerbatch.sim.engine as sim_engine
from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws.clock import ClockInput, ClockLaw
from powerbatch.sim import SimEngine
from powerbatch.sim.gpu_model import GpuProfile
from powerbatch.sim.plants import draw_plant


class VirtualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def draw(seed: int) -> tuple[GpuProfile, float, int]:
    plant = draw_plant(np.random.default_rng(1000 + seed))
    r = np.random.default_rng(5000 + seed)
    profile = replace(
        plant.profile,
        cap_by_clock=True,
        voltage_knee_frac=float(r.uniform(0.4, 0.8)),
        voltage_floor_frac=float(r.uniform(0.55, 0.95)),
        clock_power_frac=float(r.uniform(0.0, 0.8)),
        mem_issue_clock_frac=float(r.uniform(0.0, 0.9)),
        roofline_p=float(r.uniform(1.0, 4.0)),
    )
    return profile, plant.ceiling_w, plant.kv_capacity_tokens


def run(
    profile: GpuProfile,
    ceiling_w: float,
    kv_tokens: int,
    seed: int,
    seconds: float,
    *,
    law: ClockLaw | None = None,
    lock: tuple[int, int] | None = None,
) -> dict[str, float]:
    clock = VirtualClock()
    sim_engine.time.monotonic = clock  # type: ignore[attr-defined]
    eng = SimEngine(
        profile,
        seed=seed,
        power_limit_w=min(ceiling_w, profile.tdp_w),
        kv_capacity_tokens=kv_tokens,
    )
    supported = eng.supported_clocks_mhz()[::-1]
    if law is not None:
        law.set_supported(supported, 5.0)
    for g in range(profile.num_gpus):
        if lock is not None:
            eng.set_gpu_locked_clocks(g, *lock)
    rng = np.random.default_rng(seed)
    # About 60 % of what the plant serves at a 16-request batch (a sizing guess, not a figure).
    rate = 0.6 * 16 / (profile.itl_base_s * 300 + 800 / profile.prefill_tok_s) / 2
    next_arrival, changed_s, top = clock.t, -1e9, float(supported[-1])
    window: list[tuple[float, float, int, int, int]] = []
    steps: list[float] = []
    t_tick = clock.t
    for _ in range(int(seconds * 5)):
        t_end = t_tick + 0.2
        while True:
            while next_arrival <= clock.t:
                eng.add_request(int(rng.integers(100, 1500)), int(rng.integers(100, 500)))
                next_arrival += rng.exponential(1 / rate)
            rec = eng.step()
            if rec is None:
                clock.t = min(next_arrival, t_end)
            else:
                clock.t = eng._clock_s
                if rec.decode_tokens:
                    steps.append(rec.step_s)
            if clock.t >= t_end:
                break
        t_tick = clock.t
        e = eng.energy_j(eng._clock_s)
        window.append(
            (t_tick, e, eng.prompt_tokens_total, eng.generation_tokens_total, eng.num_running)
        )
        while window[0][0] < t_tick - 1.0:
            window.pop(0)
        dt = window[-1][0] - window[0][0]
        if law is None or dt <= 0:
            continue
        power = (window[-1][1] - window[0][1]) / dt
        decode = (window[-1][3] - window[0][3]) / dt
        prefill = (window[-1][2] - window[0][2]) / dt
        batch = float(np.mean([w[4] for w in window]))
        tpot = float(np.percentile(steps[-200:], 95)) if steps else None
        inp = ClockInput(
            t_tick, power, batch, decode, prefill, eng.num_waiting, None, tpot, top, changed_s
        )
        choice = law.tick(inp, True)
        new = float(choice.lock[1]) if choice.lock else float(supported[-1])
        if new != top:
            top, changed_s = new, t_tick
            for g in range(profile.num_gpus):
                if choice.lock:
                    eng.set_gpu_locked_clocks(g, *choice.lock)
                else:
                    eng.reset_gpu_locked_clocks(g)
    tokens = eng.generation_tokens_total
    return {
        "j_per_token": eng.energy_j(eng._clock_s) / max(tokens, 1),
        "tokens": float(tokens),
        "step_p95_ms": 1000 * float(np.percentile(steps, 95)) if steps else math.nan,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--plants", type=int, default=6)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--out", default=None, help="also write the rows here as JSON")
    a = p.parse_args()
    rows: list[dict[str, Any]] = []
    for seed in range(a.first, a.first + a.plants):
        profile, ceiling_w, kv = draw(seed)
        base = run(profile, ceiling_w, kv, seed, a.seconds)
        law = ClockLaw(ClockPolicy(clock_objective="energy"), ControlConfig(ceiling_w=ceiling_w))
        learned = run(profile, ceiling_w, kv, seed, a.seconds, law=law)
        floor = profile.sm_clock_min_mhz
        best = base
        for top in law.levels[1:]:
            static = run(profile, ceiling_w, kv, seed, a.seconds, lock=(floor, top))
            if static["tokens"] >= 0.98 * base["tokens"] and (
                static["j_per_token"] < best["j_per_token"]
            ):
                best = {**static, "top_mhz": top}
        row = {
            "seed": seed,
            "num_gpus": profile.num_gpus,
            "law_vs_cap": learned["j_per_token"] / base["j_per_token"],
            "static_vs_cap": best["j_per_token"] / base["j_per_token"],
            "law_vs_static": learned["j_per_token"] / best["j_per_token"],
            "best_static_mhz": best.get("top_mhz", profile.sm_clock_max_mhz),
            "tokens_law_vs_cap": learned["tokens"] / base["tokens"],
            "step_p95_ms": (base["step_p95_ms"], learned["step_p95_ms"]),
        }
        rows.append(row)
        print(
            f"plant {seed} ({profile.num_gpus} GPU): J/token law {row['law_vs_cap']:.3f}x cap, "
            f"best static ({row['best_static_mhz']} MHz) {row['static_vs_cap']:.3f}x cap, "
            f"law {row['law_vs_static']:.3f}x static; tokens {row['tokens_law_vs_cap']:.3f}x; "
            f"p95 step {base['step_p95_ms']:.1f} -> {learned['step_p95_ms']:.1f} ms",
            flush=True,
        )
    worst = max(rows, key=lambda r: r["law_vs_cap"])
    worst_static = max(rows, key=lambda r: r["law_vs_static"])
    print(
        f"worst: law {worst['law_vs_cap']:.3f}x cap (plant {worst['seed']}); "
        f"law {worst_static['law_vs_static']:.3f}x best static (plant {worst_static['seed']}); "
        f"median law vs cap {float(np.median([r['law_vs_cap'] for r in rows])):.3f}"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
