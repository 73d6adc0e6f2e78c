"""What a run measured: 1-second power from the simulator's own energy counter, latency from
the client's side, and the figures the comparison reports. Plots go to PNG with matplotlib."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from powerbatch.admission import PRIORITIES
from powerbatch.cli.extras import pyplot, require_cli_extra
from powerbatch.cli.stats import pct
from powerbatch.load import LoadProfile, RequestResult

ABOVE_TOLERANCE_W = 0.01


@dataclass
class RunData:
    arm: str
    ceiling_w: float
    profile: LoadProfile
    t0_s: float  # monotonic time the load started (the clock the simulator's trace uses)
    load_s: float  # how long arrivals ran
    results: list[RequestResult]
    trace: dict[str, list[float]]  # the simulator's /sim/trace columns
    history: dict[str, list[Any]] | None = None  # the proxy's /status/history, if any
    extra: dict[str, Any] = field(default_factory=dict)


def power_1s(
    trace: dict[str, list[float]], t0_s: float, t1_s: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Mean power in each whole second of [t0, t1], exact from the cumulative energy counter."""
    # A record is stamped at its step's start and carries the energy counter at its end.
    t_end = np.asarray(trace["t_s"], float) + np.asarray(trace["step_s"], float)
    energy = np.asarray(trace["energy_j"], float)
    if len(t_end) < 2:
        return np.empty(0), np.empty(0)
    edges = t0_s + np.arange(0, int(t1_s - t0_s) + 1, 1.0)
    e = np.interp(edges, t_end, energy)
    return edges[:-1] - t0_s + 0.5, np.diff(e) / np.diff(edges)


def forced_above_seconds(
    trace: dict[str, list[float]], t0_s: float, t1_s: float, ceiling_w: float
) -> NDArray[np.bool_]:
    """The seconds over the ceiling that no admission could have held under it: the steps in
    that second that ran prefill, with the rest of the second at the lowest power of any busy
    step of the run, are over the ceiling already. Admission can delay a prompt but not split
    it; on a plant whose prefill draws far more than its decode, a long prompt alone can put a
    second over. Read from the simulator's steps, not from any formula of its."""
    t = np.asarray(trace["t_s"], float)
    step_s = np.asarray(trace["step_s"], float)
    power_w = np.asarray(trace["power_w"], float)
    busy = np.asarray(trace["running"], float) > 0
    n = int(t1_s - t0_s)
    if n <= 0 or not busy.any():
        return np.zeros(max(n, 0), bool)
    floor_w = float(power_w[busy].min())
    energy_j, time_s = np.zeros(n), np.zeros(n)
    for i in np.nonzero(np.asarray(trace["prefill_tokens"], float) > 0)[0]:
        a, b = t[i] - t0_s, t[i] + step_s[i] - t0_s
        for k in range(max(int(a), 0), min(math.ceil(b), n)):
            overlap = min(b, k + 1) - max(a, k)
            if overlap > 0:
                energy_j[k] += power_w[i] * overlap
                time_s[k] += overlap
    return energy_j + (1.0 - np.minimum(time_s, 1.0)) * floor_w > ceiling_w + ABOVE_TOLERANCE_W


def power_bound_seconds(run: RunData, n_seconds: int) -> NDArray[np.bool_]:
    """The seconds in which power bound the batch on most ticks (from the proxy's history)."""
    bound = np.zeros(n_seconds, bool)
    h = run.history
    if not h or not h.get("t_s"):
        return bound
    t = np.asarray(h["t_s"], float) - run.t0_s
    is_power = np.asarray([b == "power" for b in h["binding"]], bool)
    for i in range(n_seconds):
        sel = (t >= i) & (t < i + 1)
        bound[i] = bool(sel.any() and is_power[sel].mean() >= 0.5)
    return bound


def binding_share(run: RunData) -> dict[str, float]:
    """Share of the proxy's ticks on which each constraint bound the batch: what held work
    back, where a figure falls short (empty without a proxy)."""
    h = run.history
    if not h or not h.get("binding"):
        return {}
    names = list(h["binding"])
    return {b: names.count(b) / len(names) for b in sorted(set(names))}


def energy_by_class(ok: list[Any], energy_j: float) -> dict[str, Any]:
    """J per output token per class from the answers' attributed joules (usage.energy_j), and
    their sum as a share of the measured total: the rest is idle energy (docs/energy.md)."""
    charged = [r for r in ok if r.energy_j is not None]
    if not charged:
        return {"attributed_j": None, "attributed_share": None, "j_per_token_by_class": {}}
    per: dict[str, float | None] = {}
    for p in PRIORITIES:
        rs = [r for r in charged if r.priority == p]
        tokens = sum(r.output_tokens for r in rs)
        per[p] = sum(r.energy_j for r in rs) / tokens if tokens else None
    attributed_j = sum(r.energy_j for r in charged)
    return {
        "attributed_j": attributed_j,
        "attributed_share": attributed_j / energy_j if energy_j > 0 else None,
        "j_per_token_by_class": per,
    }


def summarize(run: RunData, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
    t_mid, p1 = power_1s(run.trace, run.t0_s, run.t0_s + run.load_s)
    rates = [ph.rate_rps for ph in run.profile.phases]
    high = np.array([rates[run.profile.phase_at(t)] == max(rates) for t in t_mid], bool)
    ok = [r for r in run.results if r.ok]
    # Tokens and joules run to the last answer; goodput to the last that ended while one still
    # running could count (`run_load`'s finish records the later ones `late`, never good).
    end_s = max((r.t_start_s + r.e2e_s for r in run.results), default=run.load_s)
    good_end_s = max((r.t_start_s + r.e2e_s for r in run.results if not r.late), default=end_s)
    t_end = np.asarray(run.trace["t_s"], float) + np.asarray(run.trace["step_s"], float)
    e_cum = np.asarray(run.trace["energy_j"], float)
    energy_j = float(np.interp(run.t0_s + end_s, t_end, e_cum) - np.interp(run.t0_s, t_end, e_cum))
    tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if not r.late and r.within_slo(ttft_slo_s, tpot_slo_s)]
    latency: dict[str, dict[str, float | None]] = {}
    for p in PRIORITIES:
        ttft = [r.ttft_s for r in ok if r.priority == p and r.ttft_s is not None]
        tpot = [t for r in ok if r.priority == p and (t := r.tpot_s) is not None]
        latency[p] = {
            "n": len(ttft),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p95_s": pct(ttft, 95),
            "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50),
            "tpot_p95_s": pct(tpot, 95),
            "tpot_p99_s": pct(tpot, 99),
        }
    statuses = [r.status for r in run.results]
    bound = power_bound_seconds(run, len(p1))
    forced = forced_above_seconds(run.trace, run.t0_s, run.t0_s + len(p1), run.ceiling_w)
    return {
        "arm": run.arm,
        "ceiling_w": run.ceiling_w,
        "seconds": len(p1),
        # A hardware cap holds the simulated power *at* the limit; float error is not a breach.
        "frac_above_ceiling": float(np.mean(p1 > run.ceiling_w + ABOVE_TOLERANCE_W))
        if len(p1)
        else None,
        "forced_above_frac": float(forced.mean()) if len(forced) else None,
        "max_overshoot_w": float(max(0.0, (p1 - run.ceiling_w).max())) if len(p1) else None,
        "power_std_w": float(np.std(p1)) if len(p1) else None,
        "power_std_high_w": float(np.std(p1[high])) if high.any() else None,
        "power_mean_w": float(np.mean(p1)) if len(p1) else None,
        "power_max_w": float(np.max(p1)) if len(p1) else None,
        # Where power bound the batch: how much of the budget admission actually used.
        "power_bound_frac": float(bound.mean()) if len(p1) else None,
        "power_bound_mean_w": float(np.mean(p1[bound])) if bound.any() else None,
        "energy_j": energy_j,
        "output_tokens": tokens,
        "output_tok_s": tokens / end_s if end_s > 0 else 0.0,
        "j_per_token": energy_j / tokens if tokens else None,
        "goodput_rps": len(good) / good_end_s if good_end_s > 0 else 0.0,
        "requests": len(run.results),
        "late": sum(r.late for r in run.results),
        "ok": len(ok),
        "http_429": statuses.count(429),
        "http_503": statuses.count(503),
        "other_errors": len(run.results) - len(ok) - statuses.count(429) - statuses.count(503),
        "latency": latency,
        "binding_share": binding_share(run),
        **energy_by_class(ok, energy_j),
        "power_1s_w": [round(float(x), 2) for x in p1],
    }


def plot_runs(runs: list[RunData], path: Path, title: str) -> Path:
    """Power against the ceiling per run, and the batch limit where a proxy was in front."""
    require_cli_extra("plotting", ("matplotlib",))
    plt = pyplot()

    has_hist = any(r.history for r in runs)
    fig, axes = plt.subplots(
        2 if has_hist else 1, 1, figsize=(11, 7 if has_hist else 4), sharex=True, squeeze=False
    )
    ax = axes[0][0]
    for run in runs:
        t, p = power_1s(run.trace, run.t0_s, run.t0_s + run.load_s)
        ax.plot(t, p, label=f"{run.arm}: 1-s power", lw=1.4)
    ceiling = runs[0].ceiling_w
    ax.axhline(ceiling, color="red", ls="--", lw=1.2, label=f"ceiling {ceiling:.0f} W")
    for run in runs:  # the second actuator, where one was in force
        h = run.history
        limit = h.get("power_limit_w") if h else None
        if h and limit and any(x is not None for x in limit):
            t = np.asarray(h["t_s"], float) - run.t0_s
            y = np.asarray([np.nan if x is None else x for x in limit], float)
            ax.step(t, y, where="post", lw=1.0, ls=":", label=f"{run.arm}: device power limit")
    prof = runs[0].profile
    rates = [ph.rate_rps for ph in prof.phases]
    t_grid = np.arange(0, runs[0].load_s, 0.5)
    hi = np.array([rates[prof.phase_at(t)] == max(rates) for t in t_grid])
    ax.fill_between(
        t_grid,
        0,
        1,
        where=hi,
        transform=ax.get_xaxis_transform(),
        color="orange",
        alpha=0.12,
        label="burst phase",
    )
    ax.set_ylabel("W")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    if has_hist:
        ax2 = axes[1][0]
        for run in runs:
            h = run.history
            if not h or not h["t_s"]:
                continue
            t = np.asarray(h["t_s"]) - run.t0_s
            ax2.step(t, h["limit_requests"], where="post", label=f"{run.arm}: batch limit")
            ax2.plot(t, h["in_flight"], lw=0.8, label=f"{run.arm}: in flight")
            ax2.plot(t, h["queued"], lw=0.8, ls=":", label=f"{run.arm}: queued")
        ax2.set_ylabel("requests")
        ax2.set_xlabel("seconds since load start")
        ax2.legend(loc="upper right", fontsize=8)
        ax2.set_xlim(0, runs[0].load_s)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_summary(
    runs: dict[str, list[dict[str, Any]]], ceiling_w: float, path: Path, title: str
) -> Path:
    """Power distribution, p95 TTFT per class, and J per token, per arm over all repeats."""
    require_cli_extra("plotting", ("matplotlib",))
    plt = pyplot()

    arms = list(runs)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm in arms:
        p = np.concatenate([np.asarray(s["power_1s_w"], float) for s in runs[arm]])
        ax1.hist(p, bins=40, histtype="step", lw=1.5, label=arm, density=True)
    ax1.axvline(ceiling_w, color="red", ls="--", label="ceiling")
    ax1.set_xlabel("1-second power, W")
    ax1.set_title("power distribution")
    ax1.legend(fontsize=8)
    width = 0.8 / len(PRIORITIES)
    x = np.arange(len(arms))
    for i, prio in enumerate(PRIORITIES):
        vals = [
            np.mean([s["latency"][prio]["ttft_p95_s"] or np.nan for s in runs[a]]) for a in arms
        ]
        ax2.bar(x + i * width, vals, width, label=prio)
    ax2.set_xticks(x + width, arms)
    ax2.set_ylabel("s")
    ax2.set_yscale("log")
    ax2.set_title("p95 time to first token, by priority")
    ax2.legend(fontsize=8)
    jpt = [[s["j_per_token"] for s in runs[a] if s["j_per_token"]] for a in arms]
    ax3.bar(x, [np.mean(v) for v in jpt], yerr=[np.std(v) for v in jpt], capsize=4)
    ax3.set_xticks(x, arms)
    ax3.set_ylabel("J per output token")
    ax3.set_title("energy per output token")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
