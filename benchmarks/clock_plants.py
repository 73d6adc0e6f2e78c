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
               tokens served stay >= 0.98x unlocked's (what an operator finds by sweep), and
               the best of those whose p95 step also keeps the law's own bounds (at most
               clock_max_slowdown over unlocked's, under clock_tpot_margin of the TPOT SLO)
    law        powerbatch.control.laws.clock, objective energy, fed 1-second windows
    phases     with --phases: an oracle with two locks, one for the steps that carry prompt
               tokens and one for decode-only steps, changed between steps at no cost; every
               pair of the law's levels, the best kept as for static. No law that sets the
               clock from outside the engine can follow the phases closer, so this bounds
               what following them can save against the best single lock (VoltanaLLM, arXiv
               2509.04827, sets them apart on separate prefill and decode instances).
               "prefill at the top" is the best pair whose prefill runs unlocked: a prefill
               boost given to every request.
    boost      with --boost: the law, with every step that carries prompt tokens unlocked (the
               proxy's prefill boost for every request, at no cost per change)

Each arm's p95 TTFT is recorded (a request still waiting at the end counts its wait so far), and
the best lock (and pair) is also found among those whose p95 TTFT stays within --ttft-bound
(1.2) of the cap's: the first-token goal a lock at the floor may break.

The meter is exact by default; `--meter-lag-s 2` makes it a 1-s mean refreshed once a second
and that late (as a dcgm-exporter behind a scrape), each reading paired with the load of the
second it measured and learned once. `powerbatch bench --cap-by-clock` runs the same law through
the real proxy, zeusd and dcgm paths. Each plant's row also says when the law's search settled.

    python benchmarks/clock_plants.py --plants 6 --seconds 300 --meter-lag-s 2
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields, replace
from functools import partial
from typing import Any

import numpy as np

from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws.clock import ClockInput, ClockLaw
from powerbatch.sim import SimEngine
from powerbatch.sim.engine import SimRequest, VirtualClock
from powerbatch.sim.gpu_model import GpuProfile
from powerbatch.sim.plants import draw_plant, with_clock_physics


def draw(seed: int) -> tuple[GpuProfile, float, int]:
    plant = draw_plant(np.random.default_rng(1000 + seed))
    profile = with_clock_physics(plant.profile, np.random.default_rng(5000 + seed))
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
    phases: tuple[int, int] | None = None,
    boost: bool = False,
    rate_scale: float = 1.0,
    meter_lag_s: float = 0.0,
    load: str = "poisson",
    pair_error_s: float = 0.0,
    pair_jitter_s: float = 0.0,
) -> dict[str, float]:
    clock = VirtualClock()
    eng = SimEngine(
        profile,
        seed=seed,
        power_limit_w=min(ceiling_w, profile.tdp_w),
        kv_capacity_tokens=kv_tokens,
        clock=clock,
    )
    supported = eng.supported_clocks_mhz()[::-1]
    if law is not None:
        law.set_supported(supported, 5.0)
    floor_mhz, unlocked = profile.sm_clock_min_mhz, float(supported[-1])
    applied = unlocked  # the top the engine runs at now

    def apply(top_mhz: float) -> None:
        nonlocal applied
        if top_mhz == applied:
            return
        applied = top_mhz
        for g in range(profile.num_gpus):
            if top_mhz >= unlocked:
                eng.reset_gpu_locked_clocks(g)
            else:
                eng.set_gpu_locked_clocks(g, floor_mhz, int(top_mhz))

    if lock is not None:
        for g in range(profile.num_gpus):
            eng.set_gpu_locked_clocks(g, *lock)
    rng = np.random.default_rng(seed)
    jitter = np.random.default_rng(seed + 7)  # its own stream: the load is the same either way
    # About 60 % of what the plant serves at a 16-request batch (a sizing guess, not a figure).
    rate = rate_scale * 0.6 * 16 / (profile.itl_base_s * 300 + 800 / profile.prefill_tok_s) / 2
    start_s = clock.t

    def rate_at(t: float) -> float:
        """Arrivals/s at t: steady, or `bursty`'s shape (10 s calm at 2/8 of the mean rate,
        10 s of burst at 14/8, as `powerbatch bench --profile bursty`: 2 and 14 rps)."""
        if load == "poisson":
            return rate
        return rate * (2.0 if (t - start_s) % 20.0 < 10.0 else 14.0) / 8.0

    next_arrival, changed_s, top = clock.t, -1e9, float(supported[-1])
    window: list[tuple[float, float, int, int, int]] = []
    held: tuple[float, float, float, float] | None = None  # power, batch, decode, prefill
    read_at, ticks_since = -math.inf, 0
    extra = {f.name for f in fields(ClockInput)}  # the law before this harness had fewer
    steps: list[float] = []
    reqs: list[SimRequest] = []
    t_tick = clock.t
    for _ in range(int(seconds * 5)):
        t_end = t_tick + 0.2
        while True:
            while next_arrival <= clock.t:
                reqs.append(
                    eng.add_request(int(rng.integers(100, 1500)), int(rng.integers(100, 500)))
                )
                next_arrival += rng.exponential(1 / rate_at(next_arrival))
            if phases is not None:
                apply(phases[1] if eng.prefill_pending else phases[0])
            elif boost:  # the law's lock, lifted for steps with prompt tokens
                apply(unlocked if eng.prefill_pending else top)
            rec = eng.step()
            if rec is None:
                clock.t = min(next_arrival, t_end)
            else:
                clock.t = eng.clock_s
                if rec.decode_tokens:
                    steps.append(rec.step_s)
            if clock.t >= t_end:
                break
        t_tick = clock.t
        e = eng.energy_j(eng.clock_s)
        window.append(
            (t_tick, e, eng.prompt_tokens_total, eng.generation_tokens_total, eng.num_running)
        )
        while window[0][0] < t_tick - 1.0 - meter_lag_s - 0.2:
            window.pop(0)
        if law is None:
            continue
        ticks_since += 1
        if meter_lag_s <= 0 or held is None or t_tick - read_at >= 1.0 - 1e-9:
            # The 1-s mean that ended meter_lag_s ago.
            span = [w for w in window if t_tick - meter_lag_s - 1.0 - 1e-9 <= w[0]]
            span = [w for w in span if w[0] <= t_tick - meter_lag_s + 1e-9]
            if len(span) < 2 or span[-1][0] <= span[0][0]:
                continue
            dt = span[-1][0] - span[0][0]
            # The load paired with the reading: the same second, or one `pair_error_s` later
            # (a meter lag learned that much short).
            # (a meter lag learned that much short), give or take `pair_jitter_s` (where the
            # meter's window lies, to a fraction of a second, differs reading to reading).
            shift = pair_error_s + float(jitter.uniform(-pair_jitter_s, pair_jitter_s))
            lo, hi = t_tick - meter_lag_s - 1.0 + shift, t_tick - meter_lag_s + shift
            seen = [w for w in window if lo - 1e-9 <= w[0] <= hi + 1e-9] or span
            dt_seen = max(seen[-1][0] - seen[0][0], 1e-9)
            held = (
                (span[-1][1] - span[0][1]) / dt,
                float(np.mean([w[4] for w in seen])),
                (seen[-1][3] - seen[0][3]) / dt_seen,
                (seen[-1][2] - seen[0][2]) / dt_seen,
            )
            weight = 1.0 if meter_lag_s <= 0 else float(min(ticks_since, 5))
            read_at, ticks_since = t_tick, 0
        else:
            weight = 0.0
        power, batch, decode, prefill = held
        tpot = float(np.percentile(steps[-200:], 95)) if steps else None
        inp = ClockInput(
            t_tick, power, batch, decode, prefill, eng.num_waiting, None, tpot, top, changed_s
        )
        if "reading_weight" in extra:
            inp = replace(inp, reading_weight=weight, meter_lag_s=meter_lag_s)
        choice = law.tick(inp, True)
        new = float(choice.lock[1]) if choice.lock else float(supported[-1])
        if new != top:
            top, changed_s = new, t_tick
            apply(new)
    tokens = eng.generation_tokens_total
    # First tokens: a request still waiting at the end counts its wait so far (a lower bound),
    # so an arm that leaves more waiting is not flattered by dropping them.
    ttft = [(r.first_token_s or clock.t) - r.arrival_s for r in reqs]
    return {
        "ttft_p95_s": float(np.percentile(ttft, 95)) if ttft else math.nan,
        "j_per_token": eng.energy_j(eng.clock_s) / max(tokens, 1),
        "tokens": float(tokens),
        "step_p95_ms": 1000 * float(np.percentile(steps, 95)) if steps else math.nan,
        "settled_s": math.nan
        if law is None or getattr(law, "settled_at_s", None) is None
        else law.settled_at_s - 1000.0,  # type: ignore[operator]
    }


Runs = dict[tuple[int, int], dict[str, float]]
"""A plant's runs by (decode top, prefill top) MHz: a static lock is (top, top)."""


def cheapest(
    runs: Runs,
    keys: list[tuple[int, int]],
    step_max_ms: float = math.inf,
    ttft_max_s: float = math.inf,
) -> tuple[int, int]:
    """The runs' key with the fewest J/token among those that serve >= 0.98x the cap's tokens
    within the bounds (the cap itself, `keys[0]`, always does)."""
    base = runs[keys[0]]
    ok = [
        k
        for k in keys
        if runs[k]["tokens"] >= 0.98 * base["tokens"]
        and runs[k]["step_p95_ms"] <= step_max_ms
        and runs[k]["ttft_p95_s"] <= ttft_max_s
    ]
    return min(ok, key=lambda k: runs[k]["j_per_token"])


def _setting(kv: str) -> tuple[str, float]:
    name, _, value = kv.partition("=")
    if name not in {f.name for f in fields(ClockPolicy)}:
        raise SystemExit(f"--set {kv}: no clock setting {name!r}")
    return name, float(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--plants", type=int, default=6)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--out", default=None, help="also write the rows here as JSON")
    p.add_argument("--meter-lag-s", type=float, default=0.0, help="0: an exact meter")
    p.add_argument(
        "--pair-error-s",
        type=float,
        default=0.0,
        help="pair each reading with the load this much later than the second it measured",
    )
    p.add_argument(
        "--pair-jitter-s",
        type=float,
        default=0.0,
        help="and a uniform error of up to this much either way, drawn per reading",
    )
    p.add_argument(
        "--load",
        choices=("poisson", "bursty"),
        default="poisson",
        help="steady Poisson arrivals, or bursty's 7x swing every 10 s at the same mean rate",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a clock setting for the law (ClockPolicy's field, a number), e.g. "
        "clock_explore_every_s=60; repeatable",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also run the two-lock oracle over every pair of levels (the phases row; "
        "levels squared runs a plant)",
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="arrivals this many times the default (about 60 %% of what a plant serves at a "
        "16-request batch)",
    )
    p.add_argument(
        "--boost",
        action="store_true",
        help="also run the law with every step that carries prompt tokens unlocked (the "
        "prefill boost given to every request, changed between steps at no cost)",
    )
    p.add_argument(
        "--ttft-bound",
        type=float,
        default=1.2,
        help="also the best lock (and pair) whose p95 TTFT stays within this many times the "
        "cap's (the clock issue's goal: 1.2)",
    )
    a = p.parse_args()
    rows: list[dict[str, Any]] = []
    for seed in range(a.first, a.first + a.plants):
        profile, ceiling_w, kv = draw(seed)
        plant = partial(
            run, profile, ceiling_w, kv, seed, a.seconds, load=a.load, rate_scale=a.rate_scale
        )
        base = plant()
        settings: dict[str, Any] = dict(_setting(kv) for kv in a.set)
        policy = ClockPolicy(clock_objective="energy", **settings)
        law = ClockLaw(policy, ControlConfig(ceiling_w=ceiling_w))
        learned = plant(
            law=law,
            meter_lag_s=a.meter_lag_s,
            pair_error_s=a.pair_error_s,
            pair_jitter_s=a.pair_jitter_s,
        )
        boosted = (
            plant(
                law=ClockLaw(policy, ControlConfig(ceiling_w=ceiling_w)),
                boost=True,
                meter_lag_s=a.meter_lag_s,
                pair_error_s=a.pair_error_s,
                pair_jitter_s=a.pair_jitter_s,
            )
            if a.boost
            else None
        )
        floor = profile.sm_clock_min_mhz
        # The best lock by tokens alone (what an operator's sweep finds), and the best held to
        # the law's own step bounds: the p95 step within clock_max_slowdown of the cap's and
        # under clock_tpot_margin of the TPOT SLO. The law never picks a clock past them, so
        # the gap to the first is partly the bounds and the gap to the second is the law's.
        # And the best whose p95 TTFT stays within --ttft-bound of the cap's (the clock issue's
        # goal for powerbatch's own first tokens, which a lock at the floor may break).
        step_bound_ms = min(
            (1.0 + policy.clock_max_slowdown) * base["step_p95_ms"],
            1000.0 * policy.clock_tpot_margin * law.config.tpot_slo_s,
        )
        runs: Runs = {(law.levels[0],) * 2: base}
        for top in law.levels[1:]:
            runs[(top, top)] = plant(lock=(floor, top))
        if a.phases:
            for d in law.levels:
                for q in law.levels:
                    if d != q:
                        runs[(d, q)] = plant(phases=(d, q))
        ttft_max_s = a.ttft_bound * base["ttft_p95_s"]

        locks = [(top, top) for top in law.levels]
        k_best, k_bounded = cheapest(runs, locks), cheapest(runs, locks, step_bound_ms)
        k_ttft = cheapest(runs, locks, ttft_max_s=ttft_max_s)
        best, bounded, ttft_lock = runs[k_best], runs[k_bounded], runs[k_ttft]
        phase_cols: dict[str, Any] = {}
        if a.phases:
            pairs = list(runs)
            pair, pair_ttft = cheapest(runs, pairs), cheapest(runs, pairs, ttft_max_s=ttft_max_s)
            lifted = cheapest(runs, [k for k in pairs if k[1] == law.levels[0]])
            phase_cols = {
                "phases_mhz": pair,
                "phases_vs_static": runs[pair]["j_per_token"] / best["j_per_token"],
                "prefill_top_mhz": lifted[0],
                "prefill_top_vs_static": runs[lifted]["j_per_token"] / best["j_per_token"],
                "phases_ttft_mhz": pair_ttft,
                "phases_vs_ttft_static": runs[pair_ttft]["j_per_token"] / ttft_lock["j_per_token"],
            }
        if boosted is not None:
            phase_cols |= {
                "boost_vs_cap": boosted["j_per_token"] / base["j_per_token"],
                "boost_vs_ttft_static": boosted["j_per_token"] / ttft_lock["j_per_token"],
                "ttft_boost_vs_cap": boosted["ttft_p95_s"] / base["ttft_p95_s"],
                "tokens_boost_vs_cap": boosted["tokens"] / base["tokens"],
            }
        row = {
            "seed": seed,
            "num_gpus": profile.num_gpus,
            "law_vs_cap": learned["j_per_token"] / base["j_per_token"],
            "static_vs_cap": best["j_per_token"] / base["j_per_token"],
            "law_vs_static": learned["j_per_token"] / best["j_per_token"],
            "best_static_mhz": k_best[0],
            "bounded_static_vs_cap": bounded["j_per_token"] / base["j_per_token"],
            "law_vs_bounded_static": learned["j_per_token"] / bounded["j_per_token"],
            "bounded_static_mhz": k_bounded[0],
            "ttft_static_vs_cap": ttft_lock["j_per_token"] / base["j_per_token"],
            "law_vs_ttft_static": learned["j_per_token"] / ttft_lock["j_per_token"],
            "ttft_static_mhz": k_ttft[0],
            "ttft_law_vs_cap": learned["ttft_p95_s"] / base["ttft_p95_s"],
            "tokens_law_vs_cap": learned["tokens"] / base["tokens"],
            "step_p95_ms": (base["step_p95_ms"], learned["step_p95_ms"]),
            "settled_s": learned["settled_s"],
            "meter_lag_s": a.meter_lag_s,
            "load": a.load,
            "rate_scale": a.rate_scale,
            "pair_error_s": a.pair_error_s,
            "pair_jitter_s": a.pair_jitter_s,
            **phase_cols,
        }
        rows.append(row)
        print(
            f"plant {seed} ({profile.num_gpus} GPU): J/token law {row['law_vs_cap']:.3f}x cap, "
            f"best static ({row['best_static_mhz']} MHz) {row['static_vs_cap']:.3f}x cap, "
            f"law {row['law_vs_static']:.3f}x static, {row['law_vs_bounded_static']:.3f}x the "
            f"best within the law's step bounds ({row['bounded_static_mhz']} MHz); "
            f"{row['law_vs_ttft_static']:.3f}x the best with p95 TTFT <= {a.ttft_bound}x the "
            f"cap's ({k_ttft[0]} MHz); tokens {row['tokens_law_vs_cap']:.3f}x; "
            f"p95 TTFT {row['ttft_law_vs_cap']:.2f}x; "
            f"p95 step {base['step_p95_ms']:.1f} -> {learned['step_p95_ms']:.1f} ms; "
            f"settled at {learned['settled_s']:.0f} s",
            flush=True,
        )
        if boosted is not None:
            print(
                f"  law with every prefill unlocked: J/token {phase_cols['boost_vs_cap']:.3f}x "
                f"the cap's, {phase_cols['boost_vs_ttft_static']:.3f}x the best lock in the TTFT "
                f"bound; p95 TTFT {phase_cols['ttft_boost_vs_cap']:.2f}x; "
                f"tokens {phase_cols['tokens_boost_vs_cap']:.3f}x",
                flush=True,
            )
        if "phases_mhz" in phase_cols:
            (d, q), top_d = phase_cols["phases_mhz"], phase_cols["prefill_top_mhz"]
            print(
                f"  phases: best pair decode {d} / prefill {q} MHz "
                f"{phase_cols['phases_vs_static']:.3f}x the best static lock; prefill at the "
                f"top (decode {top_d} MHz) {phase_cols['prefill_top_vs_static']:.3f}x; "
                f"with p95 TTFT <= {a.ttft_bound}x the cap's: {phase_cols['phases_ttft_mhz']} "
                f"MHz, {phase_cols['phases_vs_ttft_static']:.3f}x that best lock",
                flush=True,
            )
    for key, what in (
        ("law_vs_cap", "law against the cap"),
        ("law_vs_static", "law against the best static lock"),
        ("law_vs_bounded_static", "law against the best static lock within the law's bounds"),
        ("law_vs_ttft_static", "law against the best static lock within the TTFT bound"),
        ("ttft_law_vs_cap", "law's p95 TTFT against the cap's"),
        ("phases_vs_static", "the phases oracle against the best static lock"),
        ("prefill_top_vs_static", "prefill at the top against the best static lock"),
        (
            "phases_vs_ttft_static",
            "the phases oracle against the best lock, both in the TTFT bound",
        ),
        ("boost_vs_cap", "law with every prefill unlocked against the cap"),
        ("boost_vs_ttft_static", "law with every prefill unlocked against the TTFT-bound lock"),
        ("ttft_boost_vs_cap", "law with every prefill unlocked: p95 TTFT against the cap's"),
    ):
        if key not in rows[0]:
            continue
        values = [r[key] for r in rows]
        worst, best_row = max(rows, key=lambda r: r[key]), min(rows, key=lambda r: r[key])
        print(
            f"{what}: median {float(np.median(values)):.3f}x, "
            f"best {best_row[key]:.3f}x (plant {best_row['seed']}), "
            f"worst {worst[key]:.3f}x (plant {worst['seed']})"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
