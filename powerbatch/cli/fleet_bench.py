"""`powerbatch fleet-bench`: N simulated servers under one budget, shared by lease vs split evenly.

Load is skewed and moves: one server is hot (bursts of mostly high-class requests), the hot spot
moves every `--hot-period-s`. Arm `static`: every proxy's ceiling is budget/N. Arm `fleet`: every
proxy is a member of one Redis budget; mid-run one member is killed (SIGKILL) and Redis is
killed and restarted. Everything listens on 127.0.0.1. Kept light for a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from powerbatch.cli.process import Child, free_port
from powerbatch.cli.report import power_1s
from powerbatch.load import LoadProfile, run_load
from powerbatch.load.client import RequestResult
from powerbatch.load.profile import Phase

HIGH = {"high": 0.7, "normal": 0.3, "low": 0.0}
COLD = {"high": 0.1, "normal": 0.6, "low": 0.3}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet-bench", help="one power budget over N simulated servers")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--budget-w", type=float, default=1800.0)
    p.add_argument("--duration-s", type=float, default=90.0)
    p.add_argument("--hot-period-s", type=float, default=30.0)
    p.add_argument("--hot-rps", type=float, default=9.0)
    p.add_argument("--cold-rps", type=float, default=1.5)
    p.add_argument("--gpu", default="h100-llama8b")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-s", type=float, default=0.1)
    p.add_argument("--lease-ttl-s", type=float, default=3.0)
    p.add_argument("--kill-member-at-s", type=float, default=40.0)
    p.add_argument("--kill-redis-at-s", type=float, default=65.0)
    p.add_argument("--redis-down-s", type=float, default=8.0)
    p.add_argument("--arms", default="static,fleet")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results/fleet"))
    p.set_defaults(func=main)


def profile_for(i: int, a: argparse.Namespace) -> list[Any]:
    """Member i's plan: hot (bursting, mostly high class) in its windows, cold otherwise."""
    periods = int(np.ceil(a.duration_s / a.hot_period_s))
    plan: list[Any] = []
    for k in range(periods):
        hot = k % a.members == i
        rate = a.hot_rps if hot else a.cold_rps
        half = a.hot_period_s / 2
        phases = (
            (Phase(half, rate * 1.3), Phase(half, rate * 0.7)) if hot else (Phase(2 * half, rate),)
        )
        prof = LoadProfile(f"m{i}", phases, priority_mix=HIGH if hot else COLD)
        for r in prof.plan(a.hot_period_s, a.seed * 100 + i * 10 + k):
            plan.append(_shift(r, k * a.hot_period_s))
    return [r for r in plan if r.t_s < a.duration_s]


def _shift(r: Any, dt: float) -> Any:
    import dataclasses

    return dataclasses.replace(r, t_s=r.t_s + dt)


async def _poll(
    urls: list[str], t0: float, rows: list[dict[str, Any]], stop: asyncio.Event
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
        while not stop.is_set():
            t = time.monotonic() - t0
            for i, u in enumerate(urls):
                try:
                    async with s.get(u + "/status") as resp:
                        doc = await resp.json()
                except Exception:
                    continue
                fleet = doc.get("fleet") or {}
                rows.append(
                    {
                        "t_s": t,
                        "member": i,
                        "share_w": fleet.get("share_w", doc["power"]["ceiling_w"]),
                        "state": fleet.get("state"),
                        "leader": fleet.get("leader"),
                        "power_w": doc["power"]["measured_w"],
                    }
                )
            await asyncio.sleep(0.5)


async def run_arm(arm: str, a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    n = a.members
    redis_port = free_port()
    redis_proc: subprocess.Popen[bytes] | None = None

    def start_redis() -> subprocess.Popen[bytes]:
        exe = shutil.which("redis-server")
        assert exe, "fleet-bench needs redis-server on PATH"
        log = (log_dir / "redis.log").open("ab")
        argv = [exe, "--bind", "127.0.0.1", "--port", str(redis_port), "--save", ""]
        return subprocess.Popen([*argv, "--appendonly", "no"], stdout=log, stderr=log)

    sims, proxies, urls, sim_urls = [], [], [], []
    redis_procs: list[subprocess.Popen[bytes]] = []
    for i in range(n):
        sp, pp = free_port(), free_port()
        sim_url = f"http://127.0.0.1:{sp}"
        sim_urls.append(sim_url)
        sims.append(
            Child(
                f"sim{i}",
                [
                    "sim",
                    "--port",
                    str(sp),
                    "--profile",
                    a.gpu,
                    "--stream-interval-tokens",
                    "8",
                    "--seed",
                    str(a.seed + i),
                ],
                log_dir,
            )
        )
        args = ["serve", "--upstream", sim_url, "--port", str(pp), "--power-source", "dcgm",
                "--dcgm-url", sim_url + "/metrics", "--dcgm-metric",
                "DCGM_FI_DEV_POWER_USAGE_INSTANT", "--ceiling-w", str(a.budget_w / n),
                "--ttft-slo-s", str(a.ttft_slo_s), "--tpot-slo-s", str(a.tpot_slo_s),
                "--log-level", "warning"]  # fmt: skip
        if arm == "fleet":
            args += ["--fleet-budget", "bench", "--fleet-budget-w", str(a.budget_w),
                     "--fleet-redis-url", f"redis://127.0.0.1:{redis_port}/0",
                     "--fleet-members", str(n), "--fleet-member-id", f"m{i}",
                     "--fleet-lease-ttl-s", str(a.lease_ttl_s),
                     "--fleet-publish-interval-s", str(a.lease_ttl_s / 3),
                     "--fleet-max-share-w", str(0.6 * a.budget_w)]  # fmt: skip
        proxies.append(Child(f"proxy{i}", args, log_dir))
        urls.append(f"http://127.0.0.1:{pp}")
    if arm == "fleet":
        redis_proc = start_redis()
        redis_procs.append(redis_proc)
    events: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    try:
        for c, su in zip(sims, sim_urls, strict=True):
            await c.start(su + "/health")
        for c, u in zip(proxies, urls, strict=True):
            await c.start(u + "/ready")
        plans = [profile_for(i, a) for i in range(n)]
        t0 = time.monotonic()
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(urls, t0, rows, stop))
        loads = [
            asyncio.create_task(run_load(u, p, drain_timeout_s=20))
            for u, p in zip(urls, plans, strict=True)
        ]

        async def chaos() -> None:
            if arm != "fleet":
                return
            await asyncio.sleep(a.kill_member_at_s)
            victim = n - 1
            proxies[victim].send_signal(9)
            events["member_killed_s"] = time.monotonic() - t0
            await asyncio.sleep(a.kill_redis_at_s - a.kill_member_at_s)
            assert redis_proc is not None
            redis_proc.kill()
            events["redis_killed_s"] = time.monotonic() - t0
            await asyncio.sleep(a.redis_down_s)
            redis_procs.append(start_redis())
            events["redis_restarted_s"] = time.monotonic() - t0

        chaos_task = asyncio.create_task(chaos())
        results: list[list[RequestResult]] = await asyncio.gather(*loads)
        await chaos_task
        stop.set()
        await poller
        traces = []
        async with aiohttp.ClientSession() as s:
            for su in sim_urls:
                async with s.get(f"{su}/sim/trace?since_s={t0 - 1}") as r:
                    traces.append(await r.json())
    finally:
        for c in proxies + sims:
            await c.stop()
        for proc in redis_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return summarize(arm, a, t0, traces, results, rows, events)


def summarize(
    arm: str,
    a: argparse.Namespace,
    t0: float,
    traces: list[Any],
    results: list[list[RequestResult]],
    rows: list[dict[str, Any]],
    events: dict[str, float],
) -> dict[str, Any]:
    per = [power_1s(tr, t0, t0 + a.duration_s)[1] for tr in traces]
    k = min(len(p) for p in per)
    total = np.sum([p[:k] for p in per], axis=0)
    good = 0
    hot_ttft: list[float] = []
    for i, rs in enumerate(results):
        for r in rs:
            if r.ok and r.ttft_s is not None and r.ttft_s <= a.ttft_slo_s:
                tpot = r.tpot_s
                if tpot is None or tpot <= a.tpot_slo_s:
                    good += 1
            hot = int(r.t_start_s // a.hot_period_s) % a.members == i
            if hot and r.priority == "high" and r.ok and r.ttft_s is not None:
                hot_ttft.append(r.ttft_s)
    out: dict[str, Any] = {
        "arm": arm,
        "seconds": int(k),
        "pct_seconds_over_budget": float(100 * np.mean(total > a.budget_w)),
        "max_total_w": float(total.max()),
        "mean_total_w": float(total.mean()),
        "goodput_rps": good / a.duration_s,
        "hot_high_ttft_p95_s": float(np.percentile(hot_ttft, 95)) if hot_ttft else None,
        "requests": sum(len(r) for r in results),
        "events": events,
        "total_w": total.tolist(),
        "member_w": [p[:k].tolist() for p in per],
        "status_rows": rows,
    }
    if arm == "fleet":
        out.update(fleet_figures(a, rows, events))
    return out


def _share(rows: list[dict[str, Any]], member: int, t: float) -> float | None:
    xs = [r["share_w"] for r in rows if r["member"] == member and r["t_s"] <= t]
    return xs[-1] if xs else None


def fleet_figures(
    a: argparse.Namespace, rows: list[dict[str, Any]], events: dict[str, float]
) -> dict[str, Any]:
    """Seconds to move watts: from each hot-spot move until the new hot member's share is
    within 10% of its final share in that window; seconds until a killed member's share is
    reused: until the survivors' shares sum to 90% of the budget."""
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
        goal = 0.9 * max(r["share_w"] or 0 for r in window)
        hit = next((r["t_s"] for r in window if (r["share_w"] or 0) >= goal), None)
        moves.append(None if hit is None else hit - t_move)
    reuse = None
    tk = events.get("member_killed_s")
    if tk is not None:
        times = sorted({r["t_s"] for r in rows if r["t_s"] >= tk})
        for t in times:
            s = [_share(rows, m, t) for m in range(n - 1)]
            if all(x is not None for x in s) and sum(s) >= 0.9 * a.budget_w:  # type: ignore[arg-type]
                reuse = t - tk
                break
    return {"seconds_to_move_watts": moves, "seconds_until_killed_members_watts_reused": reuse}


def plot(res: dict[str, Any], a: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for arm, ax in zip(("static", "fleet"), axes, strict=False):
        r = res.get(arm)
        if r is None:
            continue
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
            ax.text(te, a.budget_w * 1.02, name.replace("_s", ""), fontsize=7, rotation=90)
        ax.set_title(f"{arm}: {a.members} servers, budget {a.budget_w:.0f} W")
        ax.set_ylabel("W (1-s mean)")
        ax.legend(fontsize=6, ncol=5, loc="lower left")
    axes[-1].set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _bench(a: argparse.Namespace) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    for arm in [x.strip() for x in a.arms.split(",") if x.strip()]:
        print(f"arm {arm}: {a.members} servers x {a.duration_s:.0f} s", flush=True)
        (a.out / "logs" / arm).mkdir(parents=True, exist_ok=True)
        res[arm] = await run_arm(arm, a, a.out / "logs" / arm)
        brief = {
            k: v for k, v in res[arm].items() if k not in ("total_w", "member_w", "status_rows")
        }
        print(json.dumps(brief, indent=1), flush=True)
    if "static" in res and "fleet" in res and res["static"]["goodput_rps"]:
        res["goodput_ratio_fleet_over_static"] = (
            res["fleet"]["goodput_rps"] / res["static"]["goodput_rps"]
        )
        print(f"goodput ratio fleet/static: {res['goodput_ratio_fleet_over_static']:.3f}")
    args = {k: str(v) for k, v in vars(a).items() if k != "func"}
    (a.out / "results.json").write_text(json.dumps({"args": args, **res}, indent=1))
    plot(res, a, a.out / "fleet.png")
    print(f"wrote {a.out / 'results.json'} and {a.out / 'fleet.png'}")
    return 0


def main(a: argparse.Namespace) -> int:
    return asyncio.run(_bench(a))
