"""`powerbatch scenarios`: the arms on N plants and loads drawn from a seed, none of them tuned.

Each scenario draws a plant (powerbatch.sim.plants: power curve, prefill, noise, GPUs, cap cost,
meter, step time, KV capacity, and a ceiling that binds part of the time) and a load
(powerbatch.load.drawn) from one seed, then runs `none`, `hwcap`, `admission` and `powerbatch` on
it with the same seed, each on a fresh simulator, as `powerbatch bench` runs its arms. The report
is each arm's ratio to the hardware cap over the scenarios: median, worst decile and worst.
Every scenario's parameters go into results.json; `--only K` reruns scenario K alone.

The simulator of a drawn plant is this module run as a program (`python -m
powerbatch.cli.scenarios sim ...`): `powerbatch sim` with the plant read from a JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from powerbatch.cli.bench import run_traces, serve_args
from powerbatch.cli.extras import pyplot, require_cli_extra
from powerbatch.cli.process import Child, run_stopping_children
from powerbatch.cli.report import RunData, plot_runs, summarize
from powerbatch.cli.stack import Stack, slo_s
from powerbatch.jsonsafe import json_safe
from powerbatch.load import run_load
from powerbatch.load.drawn import DrawnLoad, draw_load
from powerbatch.sim.plants import Plant, draw_plant, with_clock_physics

if TYPE_CHECKING:
    from rich.console import Console

ARMS = ("none", "hwcap", "admission", "powerbatch")
CLOCK_ARM = "powerbatch-clock"
"""powerbatch with the SM clock as well (`--clock-objective energy`), on request only: judged
with `--cap-by-clock`, where every arm's simulator meets a limit by its clock."""
PROXIED = ("admission", "powerbatch", CLOCK_ARM)
LIMITED = ("powerbatch", CLOCK_ARM)
PLANT_SIM = (sys.executable, "-m", "powerbatch.cli.scenarios")

FIGURES: dict[str, tuple[str, str, bool]] = {
    # key -> (label, how it compares with the cap, higher is better)
    "over_pp": ("seconds over the ceiling, points above the cap's", "diff", False),
    "tok_s": ("output tokens/s over the cap's", "ratio", True),
    # The cap slows decode where admission must stop it: on most drawn plants the best any
    # admission law sustains is well under the cap's. This is admission's distance to that.
    "tok_s_reach": (
        "output tokens/s over what admission can reach (offered or bound)",
        "ratio",
        True,
    ),
    "j_per_token": ("J per output token over the cap's", "ratio", False),
    "goodput": ("goodput over the cap's", "ratio", True),
    "ttft_p95": ("interactive streaming TTFT p95 over the cap's", "ratio", False),
    # The cap holds power-bound seconds at its limit (sd ~0), so a ratio to it means nothing:
    # the sd figures are watts, for every arm, the cap's and no control's included.
    "sd_bound": ("sd of 1-s power in power-bound seconds, W", "abs", False),
    "sd_all": ("sd of 1-s power, whole run, W", "abs", False),
}
MIN_TTFT_SAMPLES = 3  # fewer interactive streams than this: no p95 worth a ratio


@dataclass
class Scenario:
    index: int
    seed: int  # the run seed: the load's plan and the simulator's RNG
    plant: Plant
    load: DrawnLoad
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def one_request_over(self) -> bool:
        """One request alone puts a second over the ceiling (`Plant.one_request_over`)."""
        prof = self.load.profile
        prompt_mean = prof.prompt_median * math.exp(prof.prompt_sigma**2 / 2.0)
        return self.plant.one_request_over(prompt_mean)

    def admission_reach_tok_s(self, duration_s: float) -> float:
        """What admission alone could serve here: the offered output tokens/s, or the plant's
        fluid bound under the ceiling (`Plant.admission_bound_tok_s`) where that is less."""
        prof = self.load.profile
        plan = prof.plan(duration_s, self.seed)
        offered = sum(r.max_tokens for r in plan) / duration_s
        means = [
            m * math.exp(sd**2 / 2.0)
            for m, sd in (
                (prof.prompt_median, prof.prompt_sigma),
                (prof.output_median, prof.output_sigma),
            )
        ]
        return min(offered, self.plant.admission_bound_tok_s(means[0], means[1]))

    def params(self) -> dict[str, Any]:
        prof = self.load.profile
        return {
            "index": self.index,
            "seed": self.seed,
            "one_request_over": self.one_request_over,
            "plant": self.plant.to_json(),
            "load": {
                "draw": self.load.draw,
                "phases": [[ph.duration_s, ph.rate_rps] for ph in prof.phases],
            },
        }


def draw_scenario(seed: int, index: int, *, clock_physics: bool = False) -> Scenario:
    """Scenario `index` of bench seed `seed`: the plant, then the load, from one generator.
    `clock_physics`: the plant's clock constants drawn too, from a generator of their own (so
    that the plant and load are the same either way), and its limit met by the clock
    (`with_clock_physics`)."""
    rng = np.random.default_rng([seed, index])
    plant = draw_plant(rng, name=f"drawn-{seed}-{index}")
    load = draw_load(rng, plant.sustain_rps, name=f"drawn-{seed}-{index}")
    if clock_physics:
        physics = with_clock_physics(plant.profile, np.random.default_rng([seed, index, 24]))
        plant = replace(plant, profile=physics)
    return Scenario(index, seed * 1000 + index, plant, load)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "scenarios",
        help="run the arms on N randomized plants and loads; report ratios to the cap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--scenarios", type=int, default=20, help="how many to draw")
    p.add_argument("--seed", type=int, default=1, help="the bench seed all draws come from")
    p.add_argument(
        "--only", default=None, help="comma-separated scenario indices to run alone (a rerun)"
    )
    p.add_argument("--duration-s", type=float, default=15.0, help="load length of each arm's run")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="the longest each run waits for answers after the load (the rest are dropped); "
        "default: until none still running can meet the SLOs",
    )
    p.add_argument(
        "--finish-s",
        type=float,
        default=60.0,
        help="then the longest each run goes on waiting for the answers that can no longer "
        "count: they count in tokens/s and J/token, so that both arms are judged on the same "
        "answers, never in goodput (0: drop them unanswered)",
    )
    p.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma-separated, of {', '.join((*ARMS, CLOCK_ARM))}; hwcap is required",
    )
    p.add_argument(
        "--cap-by-clock",
        action="store_true",
        help=f"draw each plant's clock physics too (docs/clock.md): every arm's simulator meets "
        f"a limit by lowering its clock; required by {CLOCK_ARM}",
    )
    p.add_argument("--stream-interval-tokens", type=int, default=4)
    p.add_argument("--ttft-slo-s", type=float, default=2.0, help="goodput's TTFT bound")
    p.add_argument("--tpot-slo-s", type=float, default=0.1, help="goodput's time/token bound")
    p.add_argument("--out", type=Path, default=Path("results/scenarios"))
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="recompute the distributions, table and distributions.png from --out's results.json",
    )
    p.set_defaults(func=main)


class PlantStack(Stack):
    """`Stack` with the simulator of a drawn plant: the same proxy, a plant from a JSON file."""

    def __init__(self, log_dir: Path, plant: Plant, *, sim_args: list[str], **kwargs: Any) -> None:
        super().__init__(
            log_dir, sim_args=sim_args, dcgm_interval_s=plant.dcgm_interval_s, **kwargs
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        plant_file = log_dir / "plant.json"
        plant_file.write_text(plant.dumps())
        args = [*self.sim.args, "--plant-file", str(plant_file)]
        args += ["--dcgm-lag-s", str(plant.dcgm_lag_s)]
        self.sim = Child("sim", args, log_dir, command=PLANT_SIM)


def proxy_args(plant: Plant, a: argparse.Namespace) -> list[str]:
    return serve_args(plant.profile.num_gpus, plant.ceiling_w, a)


def clock_args(plant: Plant) -> list[str]:
    """The clock arm's flags: the energy objective, within the plant's supported clocks."""
    p = plant.profile
    return [
        "--clock-control", "zeusd", "--clock-objective", "energy",
        "--clock-range-mhz", f"{p.sm_clock_min_mhz},{p.sm_clock_max_mhz}",
    ]  # fmt: skip


async def run_arm(arm: str, sc: Scenario, a: argparse.Namespace, log_dir: Path) -> RunData:
    """One arm on one scenario: a fresh simulator of its plant (and a proxy), the seeded load."""
    sim_args = ["--stream-interval-tokens", str(a.stream_interval_tokens), "--seed", str(sc.seed)]
    sim_args += ["--kv-capacity-tokens", str(sc.plant.kv_capacity_tokens)]
    if arm == "hwcap":
        sim_args += ["--power-limit-w", str(sc.plant.ceiling_w)]
    plan = sc.load.profile.plan(a.duration_s, sc.seed)
    extra = clock_args(sc.plant) if arm == CLOCK_ARM else []
    async with PlantStack(
        log_dir / arm,
        sc.plant,
        sim_args=sim_args,
        proxy_args=proxy_args(sc.plant, a) + extra,
        with_proxy=arm in PROXIED,
        limiter=arm in LIMITED,
    ) as stack:
        t0 = time.monotonic()
        results = await run_load(
            stack.entry_url,
            plan,
            drain_timeout_s=a.drain_timeout_s,
            slo_s=slo_s(a),
            finish_s=a.finish_s or None,
        )
        trace, history = await run_traces(stack, t0)
    # Beside plant.json, so that a bad case can be read tick by tick without a rerun.
    traces = {"t0": t0, "sim": trace, "control": history}
    (log_dir / arm / "traces.json").write_text(json.dumps(json_safe(traces)))
    run = RunData(
        arm, sc.plant.ceiling_w, sc.load.profile, t0, a.duration_s, results, trace, history
    )
    run.extra["planned"] = len(plan)
    return run


def interactive_stream_ttft(run: RunData) -> tuple[float | None, int]:
    """p95 time to the first token of the interactive (high) class's streams, and their count.
    A stream's first token comes before its end; a whole answer's client records both at once
    (powerbatch.load.client), which tells them apart without the plan."""
    xs = [
        r.ttft_s
        for r in run.results
        if r.ok and r.priority == "high" and r.ttft_s is not None and r.ttft_s < r.e2e_s
    ]
    return (float(np.percentile(xs, 95)) if xs else None), len(xs)


def bound_seconds(none_p1: np.ndarray | None, n: int, ceiling_w: float) -> np.ndarray | None:
    """The seconds in which power binds whatever the arm: where the uncontrolled plant, on the
    same load, drew more than the ceiling. None without a `none` run."""
    if none_p1 is None:
        return None
    mask = np.zeros(n, bool)
    k = min(n, len(none_p1))
    mask[:k] = none_p1[:k] > ceiling_w
    return mask


def arm_summary(run: RunData, a: argparse.Namespace) -> dict[str, Any]:
    s = summarize(run, a.ttft_slo_s, a.tpot_slo_s)
    ttft, n = interactive_stream_ttft(run)
    s["ttft_p95_interactive_stream_s"] = ttft
    s["interactive_streams"] = n
    # Requests still unanswered when the finish ended are dropped, not counted.
    s["dropped"] = int(run.extra.get("planned", len(run.results))) - len(run.results)
    return s


def add_bound_sd(sc: Scenario) -> None:
    """sd of each arm's 1-s power over the seconds where the uncontrolled plant is over."""
    none = sc.runs.get("none")
    none_p1 = np.asarray(none["power_1s_w"], float) if none else None
    for s in sc.runs.values():
        p1 = np.asarray(s["power_1s_w"], float)
        mask = bound_seconds(none_p1, len(p1), sc.plant.ceiling_w)
        s["power_bound_seconds"] = int(mask.sum()) if mask is not None else None
        s["power_std_bound_w"] = (
            float(np.std(p1[mask])) if mask is not None and mask.sum() > 1 else None
        )


def _ratio(x: float | None, cap: float | None) -> float | None:
    if x is None or cap is None or not math.isfinite(x) or cap <= 0:
        return None
    return x / cap


def scenario_figures(sc: Scenario, duration_s: float) -> dict[str, dict[str, float | None]]:
    """Each arm's figures against the cap's on this scenario."""
    cap = sc.runs.get("hwcap")
    if cap is None:
        return {}
    reach = sc.admission_reach_tok_s(duration_s)
    out: dict[str, dict[str, float | None]] = {}
    for arm, s in sc.runs.items():
        ok_ttft = (s.get("interactive_streams") or 0) >= MIN_TTFT_SAMPLES and (
            cap.get("interactive_streams") or 0
        ) >= MIN_TTFT_SAMPLES
        over = s["frac_above_ceiling"]
        cap_over = cap["frac_above_ceiling"]
        out[arm] = {
            "over_pp": None if over is None or cap_over is None else 100.0 * (over - cap_over),
            "over_pct": None if over is None else 100.0 * over,
            "tok_s": _ratio(s["output_tok_s"], cap["output_tok_s"]),
            "tok_s_reach": _ratio(s["output_tok_s"], reach),
            "j_per_token": _ratio(s["j_per_token"], cap["j_per_token"]),
            "goodput": _ratio(s["goodput_rps"], cap["goodput_rps"]),
            "ttft_p95": _ratio(
                s["ttft_p95_interactive_stream_s"], cap["ttft_p95_interactive_stream_s"]
            )
            if ok_ttft
            else None,
            "sd_bound": s["power_std_bound_w"],
            "sd_all": s["power_std_w"],
        }
    return out


def distribution(
    values: list[float | None], higher_is_better: bool
) -> dict[str, float | int | None]:
    """Median, worst decile (the 10th or 90th percentile, whichever is worse) and worst."""
    xs = np.asarray([v for v in values if v is not None], float)
    if len(xs) == 0:
        return {"n": 0, "median": None, "worst_decile": None, "worst": None}
    return {
        "n": len(xs),
        "median": float(np.median(xs)),
        "worst_decile": float(np.percentile(xs, 10 if higher_is_better else 90)),
        "worst": float(xs.min() if higher_is_better else xs.max()),
    }


def distributions(
    per_scenario: list[dict[str, dict[str, float | None]]], arms: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (_label, _kind, higher) in {
        **FIGURES,
        "over_pct": ("seconds over the ceiling, %", "abs", False),
    }.items():
        out[key] = {
            arm: distribution([f[arm][key] for f in per_scenario if arm in f], higher)
            for arm in arms
        }
    return out


def absolute_medians(scenarios: list[Scenario], arms: list[str]) -> dict[str, dict[str, Any]]:
    """The medians of the sd figures in watts, per arm: the variance against no control too."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        runs = [sc.runs[arm] for sc in scenarios if arm in sc.runs]
        med: dict[str, Any] = {}
        for key in ("power_std_bound_w", "power_std_w", "http_429", "dropped"):
            xs = [r[key] for r in runs if r.get(key) is not None]
            med[key] = float(np.median(xs)) if xs else None
        out[arm] = med
    return out


def _w(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} W"


def print_table(dist: dict[str, Any], arms: list[str], console: Console, title: str) -> None:
    from rich.table import Table

    t = Table(title=title)
    t.add_column("figure (median / worst decile / worst)")
    for arm in arms:
        t.add_column(arm, justify="right")
    labels = {"over_pct": ("seconds over the ceiling, %", "", False), **FIGURES}
    for key, (label, _kind, _higher) in labels.items():
        cells = []
        for arm in arms:
            d = dist[key][arm]
            if not d["n"]:
                cells.append("—")
                continue
            spec = ".1f" if FIGURES.get(key, ("", "abs", False))[1] == "abs" else ".2f"
            cells.append(f"{d['median']:{spec}} / {d['worst_decile']:{spec}} / {d['worst']:{spec}}")
        t.add_row(label, *cells)
    console.print(t)


def plot_distributions(
    per_scenario: list[dict[str, dict[str, float | None]]], arms: list[str], path: Path, title: str
) -> Path:
    """One panel per figure: each scenario's value per arm, with the median marked."""
    require_cli_extra("plotting", ("matplotlib",))
    plt = pyplot()

    keys = ["over_pct", *FIGURES]
    labels = {"over_pct": "seconds over the ceiling, %", **{k: v[0] for k, v in FIGURES.items()}}
    cols = 4
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    rng = np.random.default_rng(0)  # jitter only
    for ax, key in zip(axes.flat, keys, strict=False):
        for i, arm in enumerate(arms):
            ys = np.asarray(
                [f[arm][key] for f in per_scenario if f.get(arm, {}).get(key) is not None], float
            )
            if len(ys) == 0:
                continue
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(ys)), ys, s=12, alpha=0.7)
            ax.hlines(np.median(ys), i - 0.3, i + 0.3, color="black", lw=2)
        ax.set_xticks(range(len(arms)), arms, fontsize=8)
        ax.set_title(labels[key], fontsize=8)
        if FIGURES.get(key, ("", "abs", False))[1] == "ratio":
            ax.axhline(1.0, color="red", ls="--", lw=0.8)
            if key == "ttft_p95":
                ax.set_yscale("log")
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def fits_title(n: int, total: int) -> str:
    return (
        f"the {n} of {total} scenarios where one request alone fits the ceiling "
        "(on the others only idle gaps around each prompt hold every second)"
    )


def worst_scenarios(
    scenarios: list[Scenario],
    per_scenario: list[dict[str, dict[str, float | None]]],
    arm: str,
    k: int = 3,
) -> list[int]:
    """The indices (into `scenarios`) worst for `arm`: most seconds over, then lowest tokens/s."""

    def badness(i: int) -> tuple[float, float]:
        f = per_scenario[i].get(arm, {})
        return (f.get("over_pp") or 0.0, -(f.get("tok_s") or 0.0))

    order = sorted(range(len(scenarios)), key=badness, reverse=True)
    return order[:k]


async def run_all(
    scenarios: list[Scenario], arms: list[str], a: argparse.Namespace, out: Path, console: Console
) -> dict[int, dict[str, RunData]]:
    """Every arm on every scenario, one run at a time; fills each scenario's `runs`."""
    kept: dict[int, dict[str, RunData]] = {}
    for n, sc in enumerate(scenarios, 1):
        d, ld = sc.plant.draw, sc.load.draw
        console.print(
            f"[{n}/{len(scenarios)}] scenario {sc.index}: {d['num_gpus']} GPU(s), ceiling "
            f"{sc.plant.ceiling_w:.0f} W, {d['curve']}, base {100 * d['base_frac']:.0f} %, "
            f"meter {sc.plant.meter}, KV {'binds' if d['kv_binds'] else 'free'}; "
            f"{ld['arrival']} {ld['lengths']} load, peak {ld['peak_rps']:.1f} req/s"
        )
        runs: dict[str, RunData] = {}
        for arm in arms:
            run = await run_arm(arm, sc, a, out / "logs" / f"scenario-{sc.index}")
            runs[arm] = run
            s = arm_summary(run, a)
            sc.runs[arm] = s
            console.print(
                f"    {arm:10s} over {100 * (s['frac_above_ceiling'] or 0):5.1f} %  "
                f"tok/s {s['output_tok_s']:7.0f}  J/tok {s['j_per_token'] or 0:6.3f}  "
                f"goodput {s['goodput_rps']:5.2f}  ttft95(int,stream) "
                f"{s['ttft_p95_interactive_stream_s'] or float('nan'):6.2f} s  "
                f"ok {s['ok']}/{s['requests']} ({s['late']} late), dropped {s['dropped']}"
            )
        add_bound_sd(sc)
        kept[sc.index] = runs
    return kept


def report_only(a: argparse.Namespace, console: Console) -> int:
    """Recompute the figures from the stored runs: a change to how they are compared needs no
    rerun."""
    path = a.out / "results.json"
    data = json.loads(path.read_text())
    arms = list(data["scenarios"][0]["runs"])
    scenarios = []
    for d in data["scenarios"]:
        sc = draw_scenario(
            a.seed if "seed" not in data["args"] else int(data["args"]["seed"]),
            d["index"],
            clock_physics=data["args"].get("cap_by_clock") == "True",
        )
        sc.runs = d["runs"]
        scenarios.append(sc)
    duration_s = float(data["args"].get("duration_s", a.duration_s))
    per_scenario = [scenario_figures(sc, duration_s) for sc in scenarios]
    for d, f in zip(data["scenarios"], per_scenario, strict=True):
        d["figures"] = f
    data["distribution"] = distributions(per_scenario, arms)
    fits = [f for sc, f in zip(scenarios, per_scenario, strict=True) if not sc.one_request_over]
    data["distribution_one_request_fits"] = distributions(fits, arms)
    for d in data["scenarios"]:
        d["one_request_over"] = next(
            sc.one_request_over for sc in scenarios if sc.index == d["index"]
        )
    data["medians_abs"] = absolute_medians(scenarios, arms)
    print_table(data["distribution"], arms, console, data["title"])
    print_table(
        data["distribution_one_request_fits"],
        arms,
        console,
        fits_title(len(fits), len(scenarios)),
    )
    path.write_text(json.dumps(data, indent=1))
    if not a.no_plots:
        plot_distributions(per_scenario, arms, a.out / "distributions.png", data["title"])
    console.print(f"rewrote {path}")
    return 0


def main(a: argparse.Namespace) -> int:
    require_cli_extra("powerbatch scenarios")
    from rich.console import Console

    console = Console(width=max(Console().width, 140))  # the table's five columns
    if a.report_only:
        return report_only(a, console)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if set(arms) - {*ARMS, CLOCK_ARM} or "hwcap" not in arms:
        console.print(f"[red]arms must include hwcap and be among {', '.join((*ARMS, CLOCK_ARM))}")
        return 2
    if CLOCK_ARM in arms and not a.cap_by_clock:
        console.print(f"[red]{CLOCK_ARM} is judged on the clock's physics: add --cap-by-clock")
        return 2
    indices = [int(x) for x in a.only.split(",") if x] if a.only else list(range(a.scenarios))
    out: Path = a.out
    if a.only and out == Path("results/scenarios"):  # a rerun keeps the committed results
        out = out / ("only-" + "-".join(str(i) for i in indices))
    out.mkdir(parents=True, exist_ok=True)
    scenarios = [draw_scenario(a.seed, i, clock_physics=a.cap_by_clock) for i in indices]
    t_start = time.monotonic()
    kept = run_stopping_children(run_all(scenarios, arms, a, out, console))
    wall_s = time.monotonic() - t_start
    per_scenario = [scenario_figures(sc, a.duration_s) for sc in scenarios]
    dist = distributions(per_scenario, arms)
    title = (
        f"{len(scenarios)} drawn scenarios (seed {a.seed}"
        f"{', clock physics' if a.cap_by_clock else ''}), {a.duration_s:.0f} s per arm: "
        "each arm against the hardware cap"
    )
    print_table(dist, arms, console, title)
    fits = [f for sc, f in zip(scenarios, per_scenario, strict=True) if not sc.one_request_over]
    dist_fits = distributions(fits, arms)
    print_table(dist_fits, arms, console, fits_title(len(fits), len(scenarios)))
    medians = absolute_medians(scenarios, arms)
    for arm in arms:
        m = medians[arm]
        console.print(
            f"  {arm:10s} medians: sd of 1-s power where power binds "
            f"{_w(m['power_std_bound_w'])}, whole run {_w(m['power_std_w'])}; "
            f"429s {m['http_429']}, dropped {m['dropped']}"
        )
    worst = {
        arm: [scenarios[i].index for i in worst_scenarios(scenarios, per_scenario, arm)]
        for arm in PROXIED
        if arm in arms
    }
    (out / "results.json").write_text(
        json.dumps(
            {
                "title": title,
                "args": {k: str(v) for k, v in vars(a).items() if k != "func"},
                "wall_s": wall_s,
                "distribution": dist,
                "distribution_one_request_fits": dist_fits,
                "medians_abs": medians,
                "worst": worst,
                "scenarios": [
                    {**sc.params(), "figures": f, "runs": sc.runs}
                    for sc, f in zip(scenarios, per_scenario, strict=True)
                ],
            },
            indent=1,
        )
    )
    console.print(f"wrote {out / 'results.json'} ({wall_s:.0f} s)")
    if not a.no_plots:
        console.print(
            f"wrote {plot_distributions(per_scenario, arms, out / 'distributions.png', title)}"
        )
        for arm, idx in worst.items():
            sc = next(s for s in scenarios if s.index == idx[0])
            png = plot_runs(
                list(kept[sc.index].values()),
                out / f"worst-{arm}.png",
                f"scenario {sc.index} (worst for {arm}): {sc.plant.draw['curve']}, "
                f"{sc.load.draw['arrival']} {sc.load.draw['lengths']}, meter {sc.plant.meter}",
            )
            console.print(f"wrote {png}")
    return 0


# ---- the simulator of a drawn plant ------------------------------------------------------------


def _sim_main(argv: list[str]) -> int:
    """`python -m powerbatch.cli.scenarios sim --plant-file F ...`: `powerbatch sim` with the
    plant from F and the meter's lag; the flags `Stack` passes, no others."""
    import logging

    from powerbatch.cli.main import _lock_arg
    from powerbatch.sim import run_sim_server

    p = argparse.ArgumentParser(prog="powerbatch.cli.scenarios sim")
    p.add_argument("command", choices=["sim"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--plant-file", type=Path, required=True)
    p.add_argument("--power-limit-w", type=float, default=None)
    p.add_argument("--kv-capacity-tokens", type=int, default=None)
    p.add_argument("--stream-interval-tokens", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dcgm-interval-s", type=float, default=0.0)
    p.add_argument("--dcgm-lag-s", type=float, default=0.0)
    p.add_argument("--cap-by-clock", action="store_true")
    p.add_argument("--lock-clocks-mhz", default=None)
    a = p.parse_args(argv)
    plant = Plant.from_json(json.loads(a.plant_file.read_text()))
    profile = replace(plant.profile, cap_by_clock=True) if a.cap_by_clock else plant.profile
    logging.basicConfig(level=logging.WARNING)
    try:
        asyncio.run(
            run_sim_server(
                a.host,
                a.port,
                stream_interval_tokens=a.stream_interval_tokens,
                profile=profile,
                kv_capacity_tokens=a.kv_capacity_tokens or plant.kv_capacity_tokens,
                power_limit_w=a.power_limit_w,
                seed=a.seed,
                dcgm_interval_s=a.dcgm_interval_s,
                dcgm_lag_s=a.dcgm_lag_s,
                locked_clocks_mhz=_lock_arg(a.lock_clocks_mhz),
            )
        )
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_sim_main(sys.argv[1:]))
