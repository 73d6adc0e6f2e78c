"""The shape arms of `powerbatch bench` and the figures the grid cares about.

Arms (each powerbatch in front, with valley filling so low-class work is deferrable):
`reactive` (no shape limits), `reactive-shape` (ramp limits and floor in the reactive
controller), `planner` (the same limits, following the receding-horizon plan).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from powerbatch.cli.extras import pyplot
from powerbatch.cli.report import RunData, power_1s


def _limits(a: argparse.Namespace) -> list[str]:
    return [
        "--ramp-up-w-per-s",
        str(a.ramp_w_per_s),
        "--ramp-down-w-per-s",
        str(a.ramp_w_per_s),
        "--floor-w",
        str(a.floor_w),
    ]


SHAPE_ARMS: dict[str, Any] = {
    "reactive": lambda a: ["--valley-fill"],
    "reactive-shape": lambda a: ["--valley-fill", *_limits(a)],
    "planner": lambda a: [
        "--valley-fill",
        *_limits(a),
        "--planner",
        "on",
        "--plan-horizon-s",
        str(a.plan_horizon_s),
    ],
}
"""Arm name -> the proxy arguments it adds (from the bench's arguments)."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ramp-w-per-s", type=float, default=30.0, help="shape arms' ramp limit")
    p.add_argument("--floor-w", type=float, default=450.0, help="shape arms' floor")
    p.add_argument("--plan-horizon-s", type=float, default=60.0)
    p.add_argument("--swing-band-hz", default="0.2,3.0", help="band of the swing figure, Hz")


def power_at(run: RunData, dt_s: float) -> np.ndarray:
    """Mean power in each `dt_s` of the load, exact from the simulator's energy counter."""
    t_end = np.asarray(run.trace["t_s"], float) + np.asarray(run.trace["step_s"], float)
    energy = np.asarray(run.trace["energy_j"], float)
    edges = run.t0_s + np.arange(0.0, run.load_s + 1e-9, dt_s)
    if len(t_end) < 2 or len(edges) < 3:
        return np.empty(0)
    power: np.ndarray = np.diff(np.interp(edges, t_end, energy)) / dt_s
    return power


def swing_rms_w(p: np.ndarray, dt_s: float, lo_hz: float, hi_hz: float) -> float | None:
    """RMS of the power's swing in [lo, hi] Hz (Parseval over the one-sided FFT)."""
    if len(p) < 8:
        return None
    x = np.fft.rfft(p - p.mean())
    f = np.fft.rfftfreq(len(p), dt_s)
    band = (f >= lo_hz) & (f <= hi_hz)
    power = 2.0 * np.abs(x[band]) ** 2 / len(p) ** 2
    return float(np.sqrt(power.sum()))


SETTLE_S = 5
"""Seconds from the load's start that the "settled" ramp figures leave out: the proxy's silent
warm-up (5 s at the initial batch) and the step from idle into the load, which every arm takes."""


def figures(run: RunData, a: argparse.Namespace) -> dict[str, Any]:
    """Ramp, swing and floor figures of one run (the same for every arm, proxy or not)."""
    _, p1 = power_1s(run.trace, run.t0_s, run.t0_s + run.load_s)
    ramp = np.diff(p1)
    settled = np.abs(ramp[SETTLE_S:])
    lo, hi = (float(x) for x in str(a.swing_band_hz).split(","))
    p10 = power_at(run, 0.1)
    # A second in which a low-class request was waiting for its first token.
    waiting = np.zeros(len(p1), bool)
    for r in run.results:
        if r.priority == "low":
            end = r.t_start_s + (r.ttft_s if r.ttft_s is not None else r.e2e_s)
            waiting[int(max(r.t_start_s, 0)) : int(min(end, len(p1)))] = True
    below = (p1 < a.floor_w) & waiting
    return {
        "ramp_violation_s": int(np.sum(np.abs(ramp) > a.ramp_w_per_s)) if len(ramp) else None,
        "largest_ramp_w_per_s": float(np.abs(ramp).max()) if len(ramp) else None,
        "ramp_violation_settled_pct": (
            100.0 * float(np.mean(settled > a.ramp_w_per_s)) if len(settled) else None
        ),
        "largest_ramp_settled_w_per_s": float(settled.max()) if len(settled) else None,
        "swing_rms_w": swing_rms_w(p10, 0.1, lo, hi),
        "swing_rms_1s_w": swing_rms_w(p1, 1.0, lo, min(hi, 0.5)),
        "below_floor_waiting_s": int(below.sum()),
        "floor_shortfall_ws": float(np.sum(np.maximum(a.floor_w - p1, 0.0)[waiting])),
    }


ROWS: tuple[tuple[str, str, str], ...] = (
    ("seconds over the ramp limit", "ramp_violation_s", ".1f"),
    ("largest 1-s ramp, W/s", "largest_ramp_w_per_s", ".1f"),
    ("% of seconds over the ramp limit after 5 s", "ramp_violation_settled_pct", ".1f"),
    ("largest 1-s ramp after 5 s, W/s", "largest_ramp_settled_w_per_s", ".1f"),
    ("swing RMS in band (0.1-s power), W", "swing_rms_w", ".1f"),
    ("swing RMS in band (1-s power), W", "swing_rms_1s_w", ".1f"),
    ("s below floor, low work waiting", "below_floor_waiting_s", ".1f"),
    ("floor shortfall, W·s", "floor_shortfall_ws", ".0f"),
)
"""Rows the bench table adds for these figures: label, key, format."""


def plot_plan(runs: list[RunData], path: Any, title: str) -> Any:
    """Measured 1-s power against the planned power (the proxy's history) per shaped run."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for run in runs:
        t, p = power_1s(run.trace, run.t0_s, run.t0_s + run.load_s)
        ax.plot(t, p, lw=1.3, label=f"{run.arm}: measured 1-s power")
        h = run.history
        if h and h.get("plan_w") and any(v is not None for v in h["plan_w"]):
            th = np.asarray(h["t_s"], float) - run.t0_s
            pw = np.asarray([np.nan if v is None else v for v in h["plan_w"]], float)
            ax.plot(th, pw, ls="--", lw=1.2, label=f"{run.arm}: planned")
    ax.axhline(runs[0].ceiling_w, color="red", ls=":", label="ceiling")
    ax.set_xlim(0, runs[0].load_s)
    ax.set_xlabel("seconds since load start")
    ax.set_ylabel("W")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ARM_ORDER = ("none", "hwcap", "reactive", "reactive-shape", "planner")

TABLE_ROWS: tuple[tuple[str, str, str, float], ...] = (
    ("% of seconds over the {ramp} W/s ramp, after 5 s", "ramp_violation_settled_pct", ".1f", 1),
    ("largest 1-s ramp after 5 s, W/s", "largest_ramp_settled_w_per_s", ".0f", 1),
    ("seconds over the ramp, whole run", "ramp_violation_s", ".1f", 1),
    ("largest 1-s ramp, whole run, W/s", "largest_ramp_w_per_s", ".0f", 1),
    ("swing RMS {band} Hz (0.1-s power), W", "swing_rms_w", ".1f", 1),
    ("s below the {floor} W floor while low work waited", "below_floor_waiting_s", ".1f", 1),
    ("time above the ceiling, %", "frac_above_ceiling", ".2f", 100),
    ("largest overshoot, W", "max_overshoot_w", ".1f", 1),
    ("sd of 1-s power, W", "power_std_w", ".1f", 1),
    ("goodput, req/s in SLO", "goodput_rps", ".2f", 1),
    ("output tokens/s", "output_tok_s", ".0f", 1),
    ("J per output token", "j_per_token", ".3f", 1),
)
"""The markdown table's rows: label (formatted with the bench's settings), key, format, scale."""


def _stat(xs: list[float], spec: str, scale: float) -> str:
    xs = [x * scale for x in xs]
    if not xs:
        return "—"
    mean = float(np.mean(xs))
    sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0
    return f"{mean:{spec}} ± {sd:{spec}}"


def markdown_table(docs: list[dict[str, Any]]) -> str:
    """One markdown table, arms as columns, from one or more `powerbatch bench` results.json
    documents of the same load (an arm in several takes its last): mean ± sd over repeats."""
    runs: dict[str, list[dict[str, Any]]] = {}
    args: dict[str, str] = {}
    for doc in docs:
        same = ("profile", "duration_s", "ceiling_w", "seed", "ramp_w_per_s", "floor_w")
        if args and any(doc["args"].get(k) != args.get(k) for k in same):
            raise ValueError(f"results of different benches: {args} and {doc['args']}")
        runs.update(doc["runs"])
        args = doc["args"]
    arms = [a for a in ARM_ORDER if a in runs] + [a for a in runs if a not in ARM_ORDER]

    def num(key: str) -> str:
        return f"{float(args[key]):g}" if key in args else "?"

    names = {
        "ramp": num("ramp_w_per_s"),
        "floor": num("floor_w"),
        "band": str(args.get("swing_band_hz", "?")).replace(",", "–"),
    }
    repeats = {len(runs[a]) for a in arms}
    lines = [
        f"**{args.get('profile', '?')} load, {num('duration_s')} s, ceiling "
        f"{num('ceiling_w')} W, {args.get('gpu', '?')}, seeds from "
        f"{args.get('seed', '?')}, {'/'.join(str(n) for n in sorted(repeats))} repeat(s); "
        "mean ± sd over repeats**",
        "",
        "| figure | " + " | ".join(arms) + " |",
        "|---|" + "---:|" * len(arms),
    ]
    for label, key, spec, scale in TABLE_ROWS:
        cells = [
            _stat([r[key] for r in runs[a] if r.get(key) is not None], spec, scale) for a in arms
        ]
        lines.append(f"| {label.format(**names)} | " + " | ".join(cells) + " |")
    for p in ("high", "normal", "low"):
        cells = []
        for a in arms:
            xs = [v for r in runs[a] if (v := r["latency"][p]["ttft_p95_s"]) is not None]
            cells.append(_stat(xs, ".2f", 1))
        lines.append(f"| p95 TTFT {p}, s | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
