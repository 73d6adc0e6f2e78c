"""`powerbatch bench`: the same seeded load through each arm, repeated, side by side.

Arms: `none` (the simulated server alone), `hwcap` (its hardware power limit at the ceiling),
`hwcap-hop` (the same cap with powerbatch in front only observing: what the extra HTTP hop and
the proxy's CPU cost the latencies on this machine, apart from any decision of powerbatch's),
`static` (a fixed batch limit, vLLM's --max-num-seqs, as an operator would tune it),
`admission` (powerbatch in front, admission alone) and `powerbatch` (powerbatch in front with
the device power limit as a second actuator, set through the simulator's zeusd API). Each arm
gets a fresh simulator, so no run warms the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from powerbatch.cli import shape_bench
from powerbatch.cli.extras import require_cli_extra
from powerbatch.cli.process import run_stopping_children
from powerbatch.cli.report import RunData, plot_runs, plot_summary, summarize
from powerbatch.cli.shape_bench import SHAPE_ARMS
from powerbatch.cli.stack import Stack, add_dcgm_interval_argument, add_slo_arguments
from powerbatch.jsonsafe import json_safe
from powerbatch.load import PROFILES, LoadProfile, run_load

if TYPE_CHECKING:
    from rich.console import Console

ARMS = ("none", "hwcap", "static", "admission", "powerbatch")  # the default comparison
# On request: hwcap-hop separates the hop's cost from the decisions'; the clock arms
# (docs/clock.md) are the cap plus the best static locked clock found by sweep, and powerbatch
# with the device limit and the SM clock.
EXTRA_ARMS = ("hwcap-hop", "hwcap-lock", "powerbatch-clock")
PROXIED = ("admission", "powerbatch", "hwcap-hop", "powerbatch-clock", *SHAPE_ARMS)
LIMITED = ("powerbatch", "powerbatch-clock")
SWEEP_MHZ = (1980, 1635, 1290, 1125, 960, 780)
"""Tops the static clock sweep tries (the simulator's H100/H200 grid, 15 MHz steps)."""
DEFAULT_CEILING_W = 600.0


def add_common(p: argparse.ArgumentParser, duration_s: float) -> None:
    p.add_argument("--ceiling-w", type=float, default=DEFAULT_CEILING_W)
    p.add_argument("--profile", default="bursty", choices=sorted(PROFILES), help="load profile")
    p.add_argument("--gpu", default="h100-llama8b", help="simulated GPU profile")
    p.add_argument("--duration-s", type=float, default=duration_s)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--stream-interval-tokens",
        type=int,
        default=4,
        help="tokens per SSE event from the simulator after the first (sent at once); CPU budget",
    )
    add_dcgm_interval_argument(p)
    add_slo_arguments(p)
    p.add_argument("--valley-fill", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument(
        "--prefill-pacing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override the proxy's prefill pacing default",
    )
    shape_bench.add_args(p)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="compare no control, hardware cap, static limit, powerbatch")
    add_common(p, 60.0)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--static-batch",
        default="auto",
        help="batch limit of the static arm, or 'auto': the largest that holds the "
        "ceiling, found by bisection as a careful operator would tune it",
    )
    p.add_argument(
        "--search-duration-s",
        type=float,
        default=30.0,
        help="length of each bisection run for --static-batch auto",
    )
    p.add_argument(
        "--static-clock-mhz",
        default="auto",
        help="top of the hwcap-lock arm's locked clock range, or 'auto': the lowest J/token "
        "whose goodput holds 0.98x the cap's, by sweep, as an operator would set nvidia-smi -lgc",
    )
    p.add_argument(
        "--cap-by-clock",
        action="store_true",
        help="the simulator meets a power limit by lowering the clock (docs/clock.md); the "
        "clock arms are judged on this physics",
    )
    p.add_argument(
        "--clock-objective",
        default="energy",
        choices=("energy", "weighted"),
        help="the powerbatch-clock arm's clock objective",
    )
    p.add_argument(
        "--scenario",
        default=None,
        metavar="SEED:K",
        help="run on scenario K of `powerbatch scenarios --seed SEED` instead of --gpu and "
        "--profile: its drawn plant, ceiling, meter and load, with the clock model's constants "
        "drawn too (powerbatch.sim.plants.with_clock_physics)",
    )
    p.add_argument("--out", type=Path, default=Path("results/bench"))
    p.set_defaults(func=main)


async def run_traces(stack: Stack, t0: float) -> tuple[Any, Any]:
    """(the simulator's trace, the proxy's control history or None) of a run begun at `t0`."""
    async with aiohttp.ClientSession() as session:
        trace = await fetch_json(session, f"{stack.sim_url}/sim/trace?since_s={t0 - 1}")
        if not stack.proxy:
            return trace, None
        history = await fetch_json(session, f"{stack.proxy_url}/status/history?since_s={t0 - 10}")
        return trace, history


def apply_scenario(a: argparse.Namespace) -> LoadProfile | None:
    """`--scenario SEED:K`: the drawn plant goes on `a.plant` (its ceiling on `a.ceiling_w`,
    its name on `a.gpu`); returns its load, or None without the flag."""
    if not getattr(a, "scenario", None):
        a.plant = None
        return None
    from powerbatch.cli.scenarios import draw_scenario  # it imports this module

    seed, index = (int(x) for x in str(a.scenario).split(":"))
    sc = draw_scenario(seed, index, clock_physics=getattr(a, "cap_by_clock", False))
    plant = sc.plant
    a.plant, a.ceiling_w, a.gpu = plant, plant.ceiling_w, plant.profile.name
    return sc.load.profile


async def fetch_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


def serve_args(num_gpus: int, ceiling_w: float, a: argparse.Namespace) -> list[str]:
    """What every bench's proxy is started with: its GPUs, the ceiling and the SLOs."""
    gpus = ",".join(str(i) for i in range(num_gpus))
    return [
        "--gpus", gpus, "--ceiling-w", str(ceiling_w),
        "--ttft-slo-s", str(a.ttft_slo_s), "--tpot-slo-s", str(a.tpot_slo_s),
        "--log-level", "warning",
    ]  # fmt: skip


def proxy_args(a: argparse.Namespace) -> list[str]:
    from powerbatch.sim.gpu_model import PROFILES as GPUS

    plant = getattr(a, "plant", None)
    num_gpus = plant.profile.num_gpus if plant else GPUS[a.gpu].num_gpus if a.gpu in GPUS else 1
    args = serve_args(num_gpus, a.ceiling_w, a)
    if a.valley_fill:
        args.append("--valley-fill")
    if a.prefill_pacing is not None:
        args.append("--prefill-pacing" if a.prefill_pacing else "--no-prefill-pacing")
    return args


async def run_arm(
    arm: str,
    a: argparse.Namespace,
    profile: LoadProfile,
    log_dir: Path,
    *,
    static_batch: int = 32,
    static_clock_mhz: int = 1980,
    during: Callable[[Stack, float], Coroutine[Any, Any, None]] | None = None,
) -> RunData:
    """One run of one arm: fresh simulator (and proxy), the seeded load, the traces."""
    plant = getattr(a, "plant", None)
    sim_args = [] if plant else ["--profile", a.gpu]
    sim_args += ["--stream-interval-tokens", str(a.stream_interval_tokens), "--seed", str(a.seed)]
    if arm in ("hwcap", "hwcap-hop", "hwcap-lock"):
        sim_args += ["--power-limit-w", str(a.ceiling_w)]
    if getattr(a, "cap_by_clock", False):
        sim_args.append("--cap-by-clock")
    if arm == "hwcap-lock":
        sim_args += ["--lock-clocks-mhz", f"{CLOCK_RANGE_MHZ[0]},{static_clock_mhz}"]
    if arm == "static":
        sim_args += ["--max-num-seqs", str(static_batch)]
    plan = profile.plan(a.duration_s, a.seed)
    extra = SHAPE_ARMS[arm](a) if arm in SHAPE_ARMS else []
    if arm == "hwcap-hop":
        extra = ["--mode", "observe"]
    if arm == "powerbatch-clock":
        objective = getattr(a, "clock_objective", "energy")
        extra = [
            "--clock-control", "zeusd", "--clock-objective", objective,
            "--clock-range-mhz", ",".join(map(str, CLOCK_RANGE_MHZ)),
        ]  # fmt: skip
    stack_args: dict[str, Any] = {
        "sim_args": sim_args,
        "proxy_args": proxy_args(a) + extra,
        "with_proxy": arm in PROXIED,
        "limiter": arm in LIMITED,
    }
    if plant:
        from powerbatch.cli.scenarios import PlantStack  # it imports this module

        sim_args += ["--kv-capacity-tokens", str(plant.kv_capacity_tokens)]
        new_stack: Stack = PlantStack(log_dir / arm, plant, **stack_args)
    else:
        new_stack = Stack(log_dir / arm, dcgm_interval_s=a.dcgm_interval_s, **stack_args)
    async with new_stack as stack:
        t0 = time.monotonic()
        load = asyncio.create_task(run_load(stack.entry_url, plan))
        watcher = asyncio.create_task(during(stack, t0)) if during else None
        results = await load
        if watcher:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        trace, history = await run_traces(stack, t0)
    # Beside the arm's logs, so that a bad case can be read tick by tick without a rerun.
    traces = {"t0": t0, "sim": trace, "control": history}
    (log_dir / arm / "traces.json").write_text(json.dumps(json_safe(traces)))
    return RunData(arm, a.ceiling_w, profile, t0, a.duration_s, results, trace, history)


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread (stdev over repeats) of each scalar figure."""
    out: dict[str, Any] = {}
    for key, value in summaries[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs = [s[key] for s in summaries if s[key] is not None]
            out[key] = {
                "mean": statistics.fmean(xs) if xs else None,
                "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            }
    lat: dict[str, Any] = {}
    for p, figures in summaries[0]["latency"].items():
        lat[p] = {}
        for k in figures:
            xs = [s["latency"][p][k] for s in summaries if s["latency"][p][k] is not None]
            lat[p][k] = statistics.fmean(xs) if xs else None
    out["latency"] = lat
    out["j_per_token_by_class"] = aggregate_energy(summaries)
    return out


def table(results: dict[str, dict[str, Any]], console: Console, title: str) -> None:
    from rich.table import Table

    t = Table(title=title)
    t.add_column("figure")
    for arm in results:
        t.add_column(arm, justify="right")

    def row(label: str, key: str, spec: str = ".1f", scale: float = 1.0) -> None:
        cells = []
        for agg in results.values():
            v = agg.get(key)
            if v is None or v["mean"] is None:
                cells.append("—")
            else:
                cells.append(f"{v['mean'] * scale:{spec}} ± {v['sd'] * scale:{spec}}")
        t.add_row(label, *cells)

    row("time above ceiling, %", "frac_above_ceiling", ".2f", 100)
    row("  of it forced by one second's prefill, %", "forced_above_frac", ".2f", 100)
    row("largest overshoot, W", "max_overshoot_w")
    row("sd of 1-s power in bursts, W", "power_std_high_w")
    row("sd of 1-s power, whole run, W", "power_std_w")
    row("mean power, W", "power_mean_w")
    row("mean power where power binds, W", "power_bound_mean_w")
    row("output tokens/s", "output_tok_s", ".0f")
    row("J per output token", "j_per_token", ".3f")
    energy_rows(results, t)
    row("goodput, req/s in SLO", "goodput_rps", ".2f")
    row("429 answers", "http_429", ".0f")
    row("503 answers", "http_503", ".0f")
    for label, key, spec in shape_bench.ROWS:
        row(label, key, spec)
    for p in ("high", "normal", "low"):
        cells = [_fmt(agg["latency"][p]["ttft_p95_s"], ".2f") for agg in results.values()]
        t.add_row(f"p95 TTFT {p}, s", *cells)
    for p in ("high", "normal", "low"):
        cells = [_fmt(agg["latency"][p]["tpot_p95_s"], ".3f") for agg in results.values()]
        t.add_row(f"p95 time/token {p}, s", *cells)
    console.print(t)


def aggregate_energy(summaries: list[dict[str, Any]]) -> dict[str, float | None]:
    """Mean over repeats of each class's attributed J per output token."""
    out: dict[str, float | None] = {}
    for p in ("high", "normal", "low"):
        xs = [v for s in summaries if (v := s.get("j_per_token_by_class", {}).get(p)) is not None]
        out[p] = statistics.fmean(xs) if xs else None
    return out


def _scaled(agg: dict[str, Any] | None, scale: float) -> float | None:
    mean = agg.get("mean") if agg else None
    return None if mean is None else mean * scale


def energy_rows(results: dict[str, dict[str, Any]], t: Any) -> None:
    """J per output token per class from the requests' attributed joules, and their share of
    the measured energy (the rest is idle): the per-class figures add up to the meter."""
    t.add_row(
        "attributed share of energy, %",
        *[_fmt(_scaled(agg.get("attributed_share"), 100.0), ".1f") for agg in results.values()],
    )
    for p in ("high", "normal", "low"):
        cells = [
            _fmt(agg.get("j_per_token_by_class", {}).get(p), ".3f") for agg in results.values()
        ]
        t.add_row(f"J per output token {p} (attributed)", *cells)


async def search_static_batch(
    a: argparse.Namespace, profile: LoadProfile, console: Console, lo: int = 1, hi: int = 128
) -> int:
    """The largest max-num-seqs whose time above the ceiling is at most 0.5%, by bisection."""
    args = argparse.Namespace(**{**vars(a), "duration_s": a.search_duration_s})
    best = lo
    while lo <= hi:
        mid = (lo + hi) // 2
        run = await run_arm("static", args, profile, a.out / "logs" / "search", static_batch=mid)
        above = summarize(run, a.ttft_slo_s, a.tpot_slo_s)["frac_above_ceiling"] or 0.0
        ok = above <= 0.005
        console.print(
            f"    static search: max-num-seqs {mid:3d} -> {100 * above:.1f}% above "
            f"the ceiling ({'holds' if ok else 'breaks'})"
        )
        if ok:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


CLOCK_RANGE_MHZ = (345, 1980)
"""The simulated H100/H200's supported SM clocks (powerbatch.sim.gpu_model), what the clock
arms lock within; on a real node NVML reads them."""


async def search_static_clock(a: argparse.Namespace, profile: LoadProfile, console: Console) -> int:
    """The locked top with the fewest J/token whose goodput holds 0.98x the plain cap's, over
    `SWEEP_MHZ` (the top itself is the cap)."""
    args = argparse.Namespace(**{**vars(a), "duration_s": a.search_duration_s})
    log_dir = a.out / "logs" / "clock-sweep"
    base = summarize(await run_arm("hwcap", args, profile, log_dir), a.ttft_slo_s, a.tpot_slo_s)
    best, best_j = SWEEP_MHZ[0], base["j_per_token"] or math.inf
    for mhz in SWEEP_MHZ[1:]:
        run = await run_arm("hwcap-lock", args, profile, log_dir, static_clock_mhz=mhz)
        s = summarize(run, a.ttft_slo_s, a.tpot_slo_s)
        holds = s["goodput_rps"] >= 0.98 * base["goodput_rps"]
        j = s["j_per_token"] or math.inf
        console.print(
            f"    clock sweep: top {mhz} MHz -> {j:.3f} J/token (the cap alone "
            f"{base['j_per_token'] or math.nan:.3f}), "
            f"goodput {s['goodput_rps']:.2f} vs {base['goodput_rps']:.2f} "
            f"({'holds' if holds else 'breaks'})"
        )
        if holds and j < best_j:
            best, best_j = mhz, j
    return best


async def _bench(a: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = set(arms) - set(ARMS) - set(EXTRA_ARMS) - set(SHAPE_ARMS)
    if unknown:
        console.print(f"[red]unknown arms: {', '.join(sorted(unknown))}")
        return 2
    profile = apply_scenario(a) or PROFILES[a.profile]()
    a.out.mkdir(parents=True, exist_ok=True)
    per_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    first_runs: list[RunData] = []

    async def setting(value: str, search: Callable[..., Awaitable[int]], searching: str) -> int:
        """An arm's fixed setting: as given, or searched for ('auto')."""
        if value != "auto":
            return int(value)
        console.print(f"{searching}…")
        return await search(a, profile, console)

    static_batch, static_clock = 32, SWEEP_MHZ[0]
    if "static" in arms:
        searching = "searching the best static batch limit that holds the ceiling"
        static_batch = await setting(a.static_batch, search_static_batch, searching)
        console.print(f"static arm: max-num-seqs {static_batch}")
    if "hwcap-lock" in arms:
        searching = "sweeping the best static locked clock under the cap"
        static_clock = await setting(a.static_clock_mhz, search_static_clock, searching)
        console.print(f"hwcap-lock arm: SM clock locked to {CLOCK_RANGE_MHZ[0]}-{static_clock} MHz")
    total = len(arms) * a.repeats
    done = 0
    for rep in range(a.repeats):
        for arm in arms:
            done += 1
            console.print(
                f"[{done}/{total}] arm [bold]{arm}[/], repeat {rep + 1}: "
                f"{a.duration_s:.0f} s of {profile.name} load at seed {a.seed + rep}"
            )
            args = argparse.Namespace(**{**vars(a), "seed": a.seed + rep})
            run = await run_arm(
                arm,
                args,
                profile,
                a.out / "logs",
                static_batch=static_batch,
                static_clock_mhz=static_clock,
            )
            s = summarize(run, a.ttft_slo_s, a.tpot_slo_s)
            s.update(shape_bench.figures(run, a))
            per_arm[arm].append(s)
            console.print(
                f"    above ceiling {100 * (s['frac_above_ceiling'] or 0):.2f}%  "
                f"sd(burst) {_fmt(s['power_std_high_w'])} W  tok/s {s['output_tok_s']:.0f}  "
                f"J/tok {_fmt(s['j_per_token'], '.3f')}  ok {s['ok']}/{s['requests']}"
            )
            if rep == 0:
                first_runs.append(run)
    results = {arm: aggregate(summaries) for arm, summaries in per_arm.items()}
    title = (
        f"{profile.name} load, {a.duration_s:.0f} s, ceiling {a.ceiling_w:.0f} W, "
        f"{a.gpu}, {a.repeats} repeat(s)"
    )
    table(results, console, title)
    (a.out / "results.json").write_text(
        json.dumps(
            {
                "title": title,
                "args": {k: str(v) for k, v in vars(a).items() if k not in ("func", "plant")},
                "plant": a.plant.to_json() if getattr(a, "plant", None) else None,
                "static_clock_mhz": static_clock if "hwcap-lock" in arms else None,
                "aggregate": results,
                "runs": per_arm,
            },
            indent=2,
        )
    )
    png = plot_runs(first_runs, a.out / "power.png", title)
    summary_png = plot_summary(per_arm, a.ceiling_w, a.out / "summary.png", title)
    shaped = [r for r in first_runs if r.arm in SHAPE_ARMS]
    if shaped:
        shape_bench.plot_plan(shaped, a.out / "plan.png", title)
    console.print(f"wrote {a.out / 'results.json'}, {png} and {summary_png}")
    return 0


def main(a: argparse.Namespace) -> int:
    require_cli_extra("powerbatch bench")  # before the runs: the tables and plots need it
    return run_stopping_children(_bench(a))
