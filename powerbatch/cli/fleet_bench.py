"""`powerbatch fleet-bench`: N simulated servers under one budget, shared by lease vs split evenly.

Load is skewed and moves: one server is hot (bursts of mostly high-class requests), the hot spot
moves every `--hot-period-s`. Arms, each repeated with the same seeds:

* `static`: every proxy's ceiling is budget/N;
* `fleet`: every proxy is a member of one Redis budget;
* `faults`: `fleet`, and mid-run one member is killed (SIGKILL) and Redis is killed and
  restarted.

Calibration, and why. A share is only a share if the server can hold it. On the simulated H100
(Llama-3.1-8B) decoding a single request draws about 480 W and anything less is idle (78 W):
admission alone cannot hold a ceiling in between. So by default every proxy also sets its
GPU's power limit (through the simulator's zeusd API, as `powerbatch bench`'s `powerbatch` arm
does), both arms alike, and each member keeps its share within what that limit can enforce (at
least the lowest limit the GPU accepts, at most its TDP) by itself, from the limiter's
constraints. Without `--limiter` a share is held by admission alone, and the member asks for no
less than its one-request power.

Processes: the N simulators share one process (`powerbatch.cli.fleet_sims`: a late step is
counted as idle, never as power); each proxy, the member under test, is its own process, so a
kill is a real SIGKILL; Redis is a real `redis-server`. Power is the simulators' energy counter
over each whole second, summed over all N servers (a killed member's server included).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from powerbatch.cli.bench import fetch_json, serve_args
from powerbatch.cli.extras import pyplot
from powerbatch.cli.process import Child, free_port, run_stopping_children
from powerbatch.cli.report import power_1s
from powerbatch.cli.stack import (
    add_dcgm_interval_argument,
    add_slo_arguments,
    exporter_metric,
    slo_s,
)
from powerbatch.load import LoadProfile, run_load
from powerbatch.load.client import RequestResult
from powerbatch.load.profile import Phase, PlannedRequest
from powerbatch.sim.gpu_model import DEFAULT_KV_CAPACITY_TOKENS, PROFILES
from powerbatch.sim.plants import Plant

HIGH = {"high": 0.7, "normal": 0.3, "low": 0.0}
COLD = {"high": 0.1, "normal": 0.6, "low": 0.3}
ARMS = ("static", "fleet", "faults", "hwcap", "fleet-admission")
PROXIED_LIMITED = ("static", "fleet", "faults")  # with --limiter, these set the device limit
POLL_S = 0.5
OVER_TOLERANCE = 1e-9  # a hardware cap draws exactly its limit: float rounding is not a breach
SHARE_STEP_FRAC = 0.1  # a share that moves by more than this fraction of budget/N: reallocation


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet-bench", help="one power budget over N simulated servers")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--budget-w", type=float, default=1800.0)
    p.add_argument(
        "--duration-s", type=float, default=None, help="load length (default 90 s; matrix: 20 s)"
    )
    p.add_argument("--hot-period-s", type=float, default=30.0)
    p.add_argument("--hot-rps", type=float, default=9.0)
    p.add_argument("--cold-rps", type=float, default=1.5)
    p.add_argument("--gpu", default="h100-llama8b", choices=sorted(PROFILES))
    add_slo_arguments(p)
    p.add_argument("--lease-ttl-s", type=float, default=3.0)
    add_dcgm_interval_argument(p)
    p.add_argument(
        "--limiter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each proxy also sets its GPU's power limit (both arms)",
    )
    p.add_argument(
        "--min-share-w",
        type=float,
        default=None,
        help="a member's smallest share (default: unset, the member's own: its GPU's lowest "
        "power limit, or one request's power without a limiter)",
    )
    p.add_argument(
        "--max-share-w",
        type=float,
        default=None,
        help="a member's largest share (default: unset, the member's own: its GPU's TDP)",
    )
    p.add_argument("--kill-member-at-s", type=float, default=40.0)
    p.add_argument("--kill-redis-at-s", type=float, default=65.0)
    p.add_argument("--redis-down-s", type=float, default=8.0)
    p.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated, of {', '.join(ARMS)} (default: static,fleet,faults; matrix: "
        "hwcap,fleet,fleet-admission)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="repeat r of every arm uses seed + r")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="the longest to wait for answers after the load (default: until none still "
        "running can meet the SLOs)",
    )
    p.add_argument("--out", type=Path, default=None, help="default results/fleet[-matrix]")
    p.add_argument(
        "--matrix",
        choices=("reduced", "full"),
        default=None,
        help="run the scenario matrix (powerbatch.cli.fleet_matrix) instead of one fleet",
    )
    p.add_argument("--cases", default="", help="matrix: only these cases (names or indices)")
    p.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="wait this long after start-up before the load, every arm (default 0; matrix 6)",
    )
    p.set_defaults(func=main)


def hot_member(t_s: float, a: argparse.Namespace) -> int:
    return int(t_s // a.hot_period_s) % int(a.members)


def profile_for(i: int, a: argparse.Namespace, seed: int) -> list[PlannedRequest]:
    """Member i's plan: hot (bursting, mostly high class) in its windows, cold otherwise."""
    periods = int(np.ceil(a.duration_s / a.hot_period_s))
    plan: list[PlannedRequest] = []
    for k in range(periods):
        hot = k % a.members == i
        rate = a.hot_rps if hot else a.cold_rps
        half = a.hot_period_s / 2
        phases = (
            (Phase(half, rate * 1.3), Phase(half, rate * 0.7)) if hot else (Phase(2 * half, rate),)
        )
        prof = LoadProfile(f"m{i}", phases, priority_mix=HIGH if hot else COLD)
        for r in prof.plan(a.hot_period_s, seed * 100 + i * 10 + k):
            plan.append(dataclasses.replace(r, t_s=r.t_s + k * a.hot_period_s))
    return [r for r in plan if r.t_s < a.duration_s]


async def _poll(
    urls: list[str],
    sim_urls: list[str],
    t0: float,
    rows: list[dict[str, Any]],
    sim_rows: list[dict[str, Any]],
    stop: asyncio.Event,
) -> None:
    """Every `POLL_S`: each proxy's /status (share, power, limit, batch, queue, bid) and each
    simulator's queue (`sim` rows: requests waiting in the engine, for the arms without one)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:

        async def sim(i: int, u: str) -> None:
            try:
                async with s.get(u + "/sim/state") as resp:
                    doc = await resp.json()
            except Exception:
                return
            sim_rows.append(
                {"t_s": time.monotonic() - t0, "member": i,
                 "sim_waiting": doc.get("waiting"), "sim_running": doc.get("running")}
            )  # fmt: skip

        async def one(i: int, u: str) -> None:
            try:
                async with s.get(u + "/status") as resp:
                    doc = await resp.json()
            except Exception:
                return
            fleet = doc.get("fleet") or {}
            bid = fleet.get("bid") or {}
            limit = doc.get("power_limit") or {}
            queue = doc.get("queue") or {}
            rows.append(
                {
                    "t_s": time.monotonic() - t0,
                    "member": i,
                    "share_w": fleet.get("share_w", doc["power"]["ceiling_w"]),
                    "ceiling_w": doc["power"]["ceiling_w"],  # shown to the loop (a share falls)
                    "state": fleet.get("state"),
                    "leader": fleet.get("leader"),
                    "power_w": doc["power"]["measured_w"],
                    "limit_w": limit.get("in_force_w"),
                    "batch": (doc["limits"]["enforced"] or {}).get("max_requests"),
                    "in_flight": queue.get("in_flight"),
                    "queued": queue.get("queued_total"),
                    "binding": doc.get("binding"),
                    "predicted_w": doc["power"].get("predicted_w"),
                    "token_s": (doc.get("upstream") or {}).get("token_s"),
                    "step_s": (doc.get("upstream") or {}).get("step_s"),
                    "lambda_latency": (doc.get("multipliers") or {}).get("latency"),
                    **{f"bid_{k}": v for k, v in bid.items()},
                }
            )

        while not stop.is_set():
            await asyncio.gather(
                *(one(i, u) for i, u in enumerate(urls)),
                *(sim(i, u) for i, u in enumerate(sim_urls)),
            )
            await asyncio.sleep(POLL_S)


def _start_redis(port: int, log_dir: Path) -> subprocess.Popen[bytes]:
    exe = shutil.which("redis-server")
    assert exe, "fleet-bench needs redis-server on PATH"
    log = (log_dir / "redis.log").open("ab")
    argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    return subprocess.Popen([*argv, "--appendonly", "no"], stdout=log, stderr=log)


def member_plants(a: argparse.Namespace) -> list[Plant]:
    """Each member's simulated GPU set and meter: the matrix's (`a.plants`), else N of `--gpu`
    on the `--dcgm-interval-s` meter."""
    plants: list[Plant] | None = getattr(a, "plants", None)
    if plants:
        return plants
    meter = "instant" if a.dcgm_interval_s <= 0 else "mean-1s"
    prof = PROFILES[a.gpu]
    return [Plant(prof, a.budget_w / a.members, DEFAULT_KV_CAPACITY_TOKENS, meter, {})] * a.members


def split_limit_w(plant: Plant, budget_w: float, n: int) -> float:
    """A static split's hardware cap: budget / N, within what the GPU set accepts, rounded
    down to NVML's milliwatt (rounded up, N caps would sum to more than the budget)."""
    prof = plant.profile
    return math.floor(min(max(budget_w / n, prof.min_limit_w), prof.tdp_w) * 1000) / 1000


def proxy_args(
    a: argparse.Namespace, i: int, arm: str, sim_url: str, port: int, redis_port: int, log: Path
) -> list[str]:
    n = a.members
    plant = member_plants(a)[i]
    meter = exporter_metric(plant.dcgm_interval_s)
    args = ["serve", "--upstream", sim_url, "--port", str(port), "--power-source", "dcgm",
            "--dcgm-url", sim_url + "/metrics", "--dcgm-metric", meter,
            *serve_args(plant.profile.num_gpus, a.budget_w / n, a)]  # fmt: skip
    if a.limiter and arm in PROXIED_LIMITED:
        args += ["--power-limiter", "zeusd", "--zeusd-url", sim_url,
                 "--limit-state-dir", str(log / f"limits{i}")]  # fmt: skip
    if arm != "static":
        args += ["--fleet-budget", "bench", "--fleet-budget-w", str(a.budget_w),
                 "--fleet-redis-url", f"redis://127.0.0.1:{redis_port}/0",
                 "--fleet-members", str(n), "--fleet-member-id", f"m{i}",
                 "--fleet-lease-ttl-s", str(a.lease_ttl_s)]  # fmt: skip
        # Unset, a member takes its bounds from its device (or its admission): the defaults
        # are what is measured.
        if a.min_share_w is not None:
            args += ["--fleet-min-share-w", str(a.min_share_w)]
        if a.max_share_w is not None:
            args += ["--fleet-max-share-w", str(a.max_share_w)]
    return args


async def run_arm(arm: str, a: argparse.Namespace, seed: int, log_dir: Path) -> dict[str, Any]:
    n = a.members
    redis_port = free_port()
    sim_ports = [free_port() for _ in range(n)]
    sim_urls = [f"http://127.0.0.1:{p}" for p in sim_ports]
    plants = member_plants(a)
    files = []
    for i, plant in enumerate(plants):
        files.append(log_dir / f"plant{i}.json")
        files[-1].write_text(plant.dumps())
    sim_args = ["-m", "powerbatch.cli.fleet_sims", "--ports", ",".join(map(str, sim_ports)),
                "--seeds", ",".join(str(seed + i) for i in range(n)),
                "--stream-interval-tokens", "8",
                "--plant-files", ",".join(map(str, files))]  # fmt: skip
    if arm == "hwcap":  # no proxy: each GPU set capped at its split, as an operator would
        limits = [split_limit_w(pl, a.budget_w, n) for pl in plants]
        sim_args += ["--power-limits-w", ",".join(f"{w:.3f}" for w in limits)]
    sims = Child("sims", sim_args, log_dir, command=(sys.executable,))
    proxies, urls = [], []
    for i in range(n):
        if arm == "hwcap":
            urls.append(sim_urls[i])
            continue
        pp = free_port()
        args = proxy_args(a, i, arm, sim_urls[i], pp, redis_port, log_dir)
        proxies.append(Child(f"proxy{i}", args, log_dir))
        urls.append(f"http://127.0.0.1:{pp}")
    redis_procs: list[subprocess.Popen[bytes]] = []
    if arm not in ("static", "hwcap"):
        redis_procs.append(_start_redis(redis_port, log_dir))
    events: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    sim_rows: list[dict[str, Any]] = []
    try:
        await sims.start(sim_urls[0] + "/health")
        for c, u in zip(proxies, urls[: len(proxies)], strict=True):
            await c.start(u + "/ready")
        await asyncio.sleep(a.settle_s or 0.0)  # every arm alike: past a proxy's warm-up
        plan_for = getattr(a, "plan_for", None) or profile_for
        plans = [plan_for(i, a, seed) for i in range(n)]
        # Each counter before the load: a server with no step in the run reads idle.
        async with aiohttp.ClientSession() as s:
            starts = [await fetch_json(s, f"{su}/sim/state") for su in sim_urls]
        t0 = time.monotonic()
        stop = asyncio.Event()
        poller = asyncio.create_task(
            _poll(urls if proxies else [], sim_urls, t0, rows, sim_rows, stop)
        )
        loads = [
            asyncio.create_task(run_load(u, p, drain_timeout_s=a.drain_timeout_s, slo_s=slo_s(a)))
            for u, p in zip(urls, plans, strict=True)
        ]

        async def chaos() -> None:
            if arm != "faults":
                return
            await asyncio.sleep(a.kill_member_at_s)
            proxies[n - 1].send_signal(9)
            events["member_killed_s"] = time.monotonic() - t0
            await asyncio.sleep(a.kill_redis_at_s - a.kill_member_at_s)
            redis_procs[0].kill()
            events["redis_killed_s"] = time.monotonic() - t0
            await asyncio.sleep(a.redis_down_s)
            redis_procs.append(_start_redis(redis_port, log_dir))
            events["redis_restarted_s"] = time.monotonic() - t0

        chaos_task = asyncio.create_task(chaos())
        results: list[list[RequestResult]] = await asyncio.gather(*loads)
        await chaos_task
        stop.set()
        await poller
        traces = []
        async with aiohttp.ClientSession() as s:
            for su, start in zip(sim_urls, starts, strict=True):
                trace = await fetch_json(s, f"{su}/sim/trace?since_s={t0 - 1}")
                state = await fetch_json(s, f"{su}/sim/state")
                traces.append(with_energy_now(trace, state, start))
    finally:
        for c in proxies:
            await c.stop()
        await sims.stop()
        for proc in redis_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    out = summarize(arm, a, t0, traces, results, rows, events, sim_rows)
    out["seed"] = seed
    return out


def with_energy_now(
    trace: dict[str, list[float]], state: dict[str, Any], start: dict[str, Any] | None = None
) -> dict[str, list[float]]:
    """The step trace with the energy counter read now appended (and, given, the one read
    before the load prepended): the trace has a row per step only, so without them a server
    idle since its last step (a killed member's), or for the whole run, would read 0 W or
    nothing instead of its idle draw."""
    out = {k: list(trace[k]) for k in ("t_s", "step_s", "energy_j")}
    if start is not None and (not out["t_s"] or float(start["t_s"]) < out["t_s"][0]):
        out["t_s"].insert(0, float(start["t_s"]))
        out["step_s"].insert(0, 0.0)
        out["energy_j"].insert(0, float(start["energy_j"]))
    out["t_s"].append(float(state["t_s"]))
    out["step_s"].append(0.0)
    out["energy_j"].append(float(state["energy_j"]))
    return out


def summarize(
    arm: str,
    a: argparse.Namespace,
    t0: float,
    traces: list[Any],
    results: list[list[RequestResult]],
    rows: list[dict[str, Any]],
    events: dict[str, float],
    sim_rows: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    per = [power_1s(tr, t0, t0 + a.duration_s)[1] for tr in traces]
    k = min(len(p) for p in per)
    total = np.sum([p[:k] for p in per], axis=0)
    over = total > a.budget_w * (1 + OVER_TOLERANCE)
    queued_by = queued_by_member(rows, sim_rows or [], len(per), k)
    queued = queued_by.any(axis=1)
    reach = reach_w(queued_by, [p[:k] for p in per], member_plants(a), a.budget_w)
    slo = (a.ttft_slo_s, a.tpot_slo_s)
    sent = sum(len(rs) for rs in results)
    good = 0
    hot_good = 0
    hot_ttft: list[float] = []
    windows_n = int(np.ceil(a.duration_s / a.hot_period_s))
    by_window = np.zeros((windows_n, a.members, 2), int)  # [window, member] = (good, sent)
    for i, rs in enumerate(results):
        for r in rs:
            hot = hot_member(r.t_start_s, a) == i
            w = min(int(r.t_start_s // a.hot_period_s), windows_n - 1)
            by_window[w, i, 1] += 1
            if r.within_slo(*slo):
                good += 1
                hot_good += hot
                by_window[w, i, 0] += 1
            if hot and r.priority == "high" and r.ok and r.ttft_s is not None:
                hot_ttft.append(r.ttft_s)
    windows = reallocation_windows(rows, a) if arm not in ("static", "hwcap") else []
    during = seconds_in(windows, k)
    out: dict[str, Any] = {
        "arm": arm,
        "seconds": int(k),
        "pct_seconds_over_budget": float(100 * np.mean(over)),
        "seconds_over_budget": int(over.sum()),
        "max_total_w": float(total.max()),
        "mean_total_w": float(total.mean()),
        "queued_seconds": int(queued.sum()),
        "power_while_queued_over_budget": (
            float(total[queued].mean() / a.budget_w) if queued.any() else None
        ),
        "reach_while_queued_over_budget": (
            float(reach[queued].mean() / a.budget_w) if queued.any() else None
        ),
        "reallocation_seconds": int(during.sum()),
        "seconds_over_budget_during_reallocation": int((over & during).sum()),
        "goodput_rps": good / a.duration_s,
        "sent_rps": sent / a.duration_s,
        "hot_goodput_rps": hot_good / a.duration_s,
        "cold_goodput_rps": (good - hot_good) / a.duration_s,
        "good_and_sent_by_window_and_member": by_window.tolist(),
        "hot_high_ttft_p95_s": float(np.percentile(hot_ttft, 95)) if hot_ttft else None,
        "requests": sent,
        "events": events,
        "total_w": total.tolist(),
        "member_w": [p[:k].tolist() for p in per],
        "status_rows": rows,
        # per request: member, start (s), priority, HTTP status, TTFT, time per token, within SLO
        "request_rows": [
            [i, round(r.t_start_s, 3), r.priority, r.status, r.ttft_s, r.tpot_s, r.within_slo(*slo)]
            for i, rs in enumerate(results)
            for r in rs
        ],
    }
    if arm not in ("static", "hwcap"):
        out.update(fleet_figures(a, rows, events, total))
    return out


def queued_by_member(
    rows: list[dict[str, Any]], sim_rows: list[dict[str, Any]], members: int, n_seconds: int
) -> np.ndarray[Any, Any]:
    """[second, member]: whether the member had work waiting in that whole second, in its
    proxy's queue or, where a server has no proxy (or its batch is full), in its engine's."""
    mask = np.zeros((n_seconds, members), bool)
    for rs, key in ((rows, "queued"), (sim_rows, "sim_waiting")):
        for r in rs:
            if (r.get(key) or 0) > 0 and 0 <= r["t_s"] < n_seconds:
                mask[int(r["t_s"]), r["member"]] = True
    return mask


def reach_w(
    queued: np.ndarray[Any, Any], member_w: list[Any], plants: list[Plant], budget_w: float
) -> np.ndarray[Any, Any]:
    """Per second, the most the fleet could have drawn usefully: what each member without
    waiting work drew, plus each member with waiting work at its set's maximum limit, within
    the budget. Where a queued member is already at its device's maximum, the watts its
    budget leaves are out of any allocation's reach, and power while queued over the budget
    cannot be 1."""
    drawn = np.asarray(member_w, float).T  # [second, member]
    top = np.array([p.profile.tdp_w for p in plants], float)
    reach: np.ndarray[Any, Any] = np.minimum(np.where(queued, top, drawn).sum(axis=1), budget_w)
    return reach


def reallocation_windows(
    rows: list[dict[str, Any]], a: argparse.Namespace
) -> list[tuple[float, float]]:
    """Spans in which watts were moving: from a poll before any member's share changed by more
    than a step until a lease TTL after it (long enough for the giver to confirm)."""
    step = SHARE_STEP_FRAC * a.budget_w / a.members
    last: dict[int, tuple[float, float]] = {}
    spans: list[tuple[float, float]] = []
    for r in sorted(rows, key=lambda x: x["t_s"]):
        share = r["share_w"]
        if share is None:
            continue
        prev = last.get(r["member"])
        if prev is not None and abs(share - prev[1]) > step:
            spans.append((prev[0], r["t_s"] + a.lease_ttl_s))
        last[r["member"]] = (r["t_s"], share)
    return spans


def seconds_in(spans: list[tuple[float, float]], n_seconds: int) -> np.ndarray[Any, Any]:
    """Which whole seconds [k, k + 1) overlap any span."""
    mask = np.zeros(n_seconds, bool)
    for t0, t1 in spans:
        lo, hi = max(int(np.floor(t0)), 0), min(int(np.ceil(t1)), n_seconds)
        mask[lo:hi] = True
    return mask


def _share(rows: list[dict[str, Any]], member: int, t: float) -> float | None:
    xs = [r["share_w"] for r in rows if r["member"] == member and r["t_s"] <= t]
    return xs[-1] if xs else None


def fleet_figures(
    a: argparse.Namespace,
    rows: list[dict[str, Any]],
    events: dict[str, float],
    total: np.ndarray[Any, Any],
) -> dict[str, Any]:
    """Seconds to move watts: from each hot-spot move until the new hot member's share is
    within 10% of its largest share in that window. Seconds until a killed member's watts are
    reused: until the survivors' shares sum to 90% of the budget. Seconds until live shares
    after Redis returns: until every surviving member polls `live` again."""
    moves = []
    n = a.members
    for k in range(1, int(a.duration_s // a.hot_period_s) + 1):
        t_move = k * a.hot_period_s
        hot = k % n
        window = [
            r for r in rows if r["member"] == hot and t_move <= r["t_s"] < t_move + a.hot_period_s
        ]
        if not window or t_move >= a.duration_s:
            continue
        if "member_killed_s" in events and hot == n - 1 and t_move > events["member_killed_s"]:
            continue  # the dead member's window: nothing to move to
        goal = 0.9 * max(r["share_w"] or 0 for r in window)
        hit = next((r["t_s"] for r in window if (r["share_w"] or 0) >= goal), None)
        moves.append(None if hit is None else hit - t_move)
    out: dict[str, Any] = {"seconds_to_move_watts": moves}
    tk = events.get("member_killed_s")
    if tk is not None:
        reuse = None
        for t in sorted({r["t_s"] for r in rows if r["t_s"] >= tk}):
            s = [_share(rows, m, t) for m in range(n - 1)]
            if all(x is not None for x in s) and sum(s) >= 0.9 * a.budget_w:  # type: ignore[arg-type]
                reuse = t - tk
                break
        out["seconds_until_killed_members_watts_reused"] = reuse
        lo = int(tk)
        out["seconds_over_budget_after_member_killed"] = int((total[lo:] > a.budget_w).sum())
    tr = events.get("redis_restarted_s")
    tkr = events.get("redis_killed_s")
    if tr is not None and tkr is not None:
        back = None
        for t in sorted({r["t_s"] for r in rows if r["t_s"] >= tr}):
            latest = [
                next((r for r in reversed(rows) if r["member"] == m and r["t_s"] <= t), None)
                for m in range(n - 1)
            ]
            if all(x is not None and x["state"] == "live" for x in latest):
                back = t - tr
                break
        out["seconds_until_live_shares_after_redis_restart"] = back
        span = total[int(tkr) : int(np.ceil(tr + 2 * a.lease_ttl_s)) + 1]
        out["seconds_over_budget_redis_down"] = int((span > a.budget_w).sum())
        states = [r["state"] for r in rows if tkr <= r["t_s"] < tr]
        out["states_while_redis_down"] = sorted(set(s for s in states if s))
    return out


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, sd and each run's value of every scalar figure over the repeats."""
    out: dict[str, Any] = {}
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and k != "seed"]
    for k in keys:
        xs = [float(r[k]) for r in runs if r.get(k) is not None]
        if xs:
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            out[k] = {"mean": statistics.fmean(xs), "sd": sd, "runs": xs}
    moves = [m for r in runs for m in r.get("seconds_to_move_watts", [])]
    if moves:
        got = [m for m in moves if m is not None]
        out["seconds_to_move_watts"] = {
            "runs": moves,
            "median": statistics.median(got) if got else None,
            "max": max(got) if got else None,
        }
    return out


def goodput_ratios(res: dict[str, Any]) -> dict[str, Any]:
    """Each controlled arm's goodput over the static split's, repeat by repeat (same seeds):
    the hardware cap's where it ran, else the fixed-ceiling proxies'."""
    base = "hwcap" if "hwcap" in res else "static"
    out: dict[str, Any] = {}
    if base not in res:
        return out
    for arm in ("fleet", "fleet-admission", "faults"):
        if arm not in res:
            continue
        pairs = zip(res[arm]["runs"], res[base]["runs"], strict=False)
        ratios = [f["goodput_rps"] / b["goodput_rps"] for f, b in pairs if b["goodput_rps"]]
        if ratios:
            key = f"goodput_ratio_{arm.replace('-', '_')}_over_{base}"
            out[key] = {"mean": statistics.fmean(ratios), "runs": ratios}
    return out


def plot(res: dict[str, Any], a: argparse.Namespace, path: Path) -> None:
    """The first repeat of each arm: per-member share and power, total against the budget."""
    plt = pyplot()

    arms = [arm for arm in ARMS if res.get(arm)]
    fig, axes = plt.subplots(len(arms), 1, figsize=(11, 3.4 * len(arms)), sharex=True)
    axes = np.atleast_1d(axes)
    for arm, ax in zip(arms, axes, strict=True):
        r = res[arm]["runs"][0]
        t = np.arange(len(r["total_w"])) + 0.5
        for i, p in enumerate(r["member_w"]):
            (line,) = ax.plot(t, p, lw=0.8, label=f"m{i} power")
            rows = [x for x in r["status_rows"] if x["member"] == i]
            ax.step([x["t_s"] for x in rows], [x["share_w"] for x in rows], where="post",
                    ls="--", lw=0.8, color=line.get_color(), label=f"m{i} share")  # fmt: skip
        ax.plot(t, r["total_w"], color="k", lw=1.4, label="total power")
        ax.axhline(a.budget_w, color="r", ls=":", label="budget")
        for name, te in r["events"].items():
            ax.axvline(te, color="grey", lw=0.6)
            ax.text(te, a.budget_w * 0.6, name.replace("_s", ""), fontsize=7, rotation=90)
        for k in range(1, int(a.duration_s // a.hot_period_s) + 1):
            ax.axvline(k * a.hot_period_s, color="orange", lw=0.6, ls="-.")
        ax.set_title(
            f"{arm} (seed {r['seed']}): {a.members} servers, budget {a.budget_w:.0f} W, "
            f"hot spot moves every {a.hot_period_s:.0f} s"
        )
        ax.set_ylabel("W (1-s mean)")
        ax.legend(fontsize=6, ncol=5, loc="lower left")
    axes[-1].set_xlabel("s")
    axes[-1].set_xlim(0, a.duration_s)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def brief(run: dict[str, Any]) -> dict[str, Any]:
    bulky = {
        "total_w",
        "member_w",
        "status_rows",
        "request_rows",
        "good_and_sent_by_window_and_member",
    }
    return {k: v for k, v in run.items() if k not in bulky}


async def _bench(a: argparse.Namespace) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    res: dict[str, Any] = {}
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
    for rep in range(a.repeats):  # arms interleaved: a slow spell on the machine hits all
        for arm in arms:
            seed = a.seed + rep
            print(f"arm {arm} seed {seed}: {a.members} servers x {a.duration_s:.0f} s", flush=True)
            log = a.out / "logs" / f"{arm}-{seed}"
            log.mkdir(parents=True, exist_ok=True)
            run = await run_arm(arm, a, seed, log)
            res.setdefault(arm, {"runs": []})["runs"].append(run)
            print(json.dumps(brief(run)), flush=True)
    for arm in res:
        res[arm]["summary"] = aggregate(res[arm]["runs"])
    res.update(goodput_ratios(res))
    summary = {arm: res[arm]["summary"] for arm in res if arm in ARMS}
    summary.update({k: v for k, v in res.items() if k.startswith("goodput_ratio_")})
    print(json.dumps(summary, indent=1), flush=True)
    args = {k: str(v) for k, v in vars(a).items() if k != "func"}
    argv = " ".join(sys.argv[1:]) if sys.argv[1:2] == ["fleet-bench"] else None
    doc = {"args": args, "argv": argv, **res}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1))
    (a.out / "summary.json").write_text(json.dumps({"args": args, **summary}, indent=1))
    plot(res, a, a.out / "fleet.png")
    print(f"wrote {a.out / 'results.json'}, summary.json and fleet.png")
    return 0


def main(a: argparse.Namespace) -> int:
    if a.matrix:
        from powerbatch.cli.fleet_matrix import run_matrix

        a.duration_s = 20.0 if a.duration_s is None else a.duration_s
        a.out = Path("results/fleet-matrix") if a.out is None else a.out
        return run_stopping_children(run_matrix(a))
    a.duration_s = 90.0 if a.duration_s is None else a.duration_s
    a.out = Path("results/fleet") if a.out is None else a.out
    a.arms = "static,fleet,faults" if a.arms is None else a.arms
    return run_stopping_children(_bench(a))
