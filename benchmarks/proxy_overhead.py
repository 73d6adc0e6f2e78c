"""What the powerbatch proxy itself costs, measured against a fake upstream that answers at once.

The same load goes straight to the fake upstream, through a bare aiohttp pass-through
(benchmarks/bare_hop.py: a second hop on aiohttp's client and server) and through the proxy in one
run, interleaved request by request where it matters, so machine noise hits every side alike:

  idle cpu   the proxy's and the bare hop's CPU, % of a core, over 10 s with no traffic
  latency    added p50/p90/p99 per request at a fixed open-loop rate (JSON and SSE answers),
             through the bare hop and through the proxy
  max rate   the most requests/s a closed loop of 64 connections gets (wrk) straight, through
             the bare hop and through the proxy: a Python client cannot offer that much
  sse relay  SSE events per second relayed, with events spaced so each is its own chunk
  cpu        the proxy process's CPU seconds per request and per relayed event (/proc, psutil)
  memory     the proxy's RSS with 10,000 requests queued (batch limit 1, the one admitted
             request held by the upstream), and after the clients give up

The proxy runs in enforce mode with a ceiling far above the fake 100 W reading and a batch limit
above the load, so admission never holds a request in the latency parts. It starts with its power
model's 1,500-sample window already full (benchmarks/serve_full_window.py; --fresh-model for an
empty one), the steady state of any proxy up five minutes, which would otherwise take those five
minutes at 5 Hz. Writes a table to stdout and JSON to --out (default
results/overhead/overhead.json).

    python benchmarks/proxy_overhead.py                 # the full run, about two minutes
    python benchmarks/proxy_overhead.py --quick         # a few seconds: does it work
    python benchmarks/proxy_overhead.py --profile results/overhead/proxy.prof   # cProfile it
    python benchmarks/proxy_overhead.py --rate 1000 --skip wrk,sse,memory       # idle + latency
    python benchmarks/proxy_overhead.py --baseline /tmp/old   # a second proxy, the code of
                                                              # another checkout, beside this one

With --baseline, a proxy run from that checkout's code (its powerbatch and its
serve_full_window.py) takes its turn beside this one in the latency and wrk parts, so a change
is measured before and after in one run, each against the same bare hop.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import platform
import pstats
import re
import resource
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from powerbatch.cli.process import Child, free_port
from powerbatch.jsonsafe import json_safe

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPT = [{"role": "user", "content": "Say hello in a few words, please."}]


# -- child processes -------------------------------------------------------------------------


def child(name: str, argv: list[str], log_dir: Path) -> Child:
    """A child process given its full argv (the fake upstream, the proxy under cProfile)."""
    return Child(name, argv, log_dir, command=(), cwd=REPO)


def ps_of(c: Child) -> psutil.Process:
    return psutil.Process(c.pid)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def proxy_argv(
    upstream: str,
    port: int,
    extra: list[str],
    profile: Path | None,
    full_window: bool = True,
    tree: Path = REPO,
) -> list[str]:
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    full = tree / "benchmarks" / "serve_full_window.py"
    run = [str(full)] if full_window else ["-m", "powerbatch"]
    return [
        sys.executable,
        *prof,
        *run,
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--power-source",
        "dcgm",
        "--dcgm-url",
        upstream + "/metrics",
        "--ceiling-w",
        "10000",
        "--no-upstream-metrics",
        "--log-level",
        "warning",
        *extra,
    ]


# Admission never binds: the default batch limit (256, vLLM's default --max-num-seqs) from the
# first moment, no prompt pacing. (The control tick's cost grows with --max-batch.)
OPEN_ARGS = [
    "--max-batch",
    "256",
    "--initial-batch",
    "256",
    "--warmup-s",
    "0",
    "--no-prefill-pacing",
    "--max-queue-len",
    "20000",
]
# One request at a time and a silent warm-up that outlasts the run: everything else queues.
QUEUE_ARGS = [
    "--max-batch",
    "1",
    "--initial-batch",
    "1",
    "--min-batch",
    "1",
    "--safe-batch",
    "1",
    "--warmup-s",
    "1000",
    "--max-queue-len",
    "20000",
    "--max-wait-s",
    "600",
    "--drain-grace-s",
    "1",
]


# -- load ------------------------------------------------------------------------------------


def body(stream: bool, tokens: int) -> bytes:
    b: dict[str, Any] = {"model": "fake", "messages": PROMPT, "max_tokens": tokens}
    if stream:
        b["stream"] = True
    return json.dumps(b).encode()


@dataclass(frozen=True, slots=True)
class Result:
    latency_s: float
    ok: bool
    events: int
    lag_s: float  # how late the client sent it: the harness's own limit shows here


async def one(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    stream: bool,
    headers: dict[str, str],
    lag_s: float = 0.0,
) -> Result:
    t0 = time.perf_counter()
    events = 0
    try:
        async with session.post(url, data=data, headers=headers) as r:
            if stream:
                async for chunk in r.content.iter_any():
                    events += chunk.count(b"data: {")
            else:
                await r.read()
            ok = r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        ok = False
    return Result(time.perf_counter() - t0, ok, events, lag_s)


async def open_loop(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    rate: float,
    duration_s: float,
    data: bytes,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> tuple[list[list[Result]], float]:
    """Send at `rate` requests/s in all, taking `urls` in turn; results per URL and the time
    until the last answer. Requests that fell due while the loop was busy go out together."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    total = max(len(urls), int(rate * duration_s))
    tasks: list[asyncio.Task[Result]] = []
    t0 = time.perf_counter()
    i = 0
    while i < total:
        now = time.perf_counter()
        due = min(total, int((now - t0) * rate) + 1)
        while i < due:
            lag = now - (t0 + i / rate)
            url = urls[i % len(urls)]
            tasks.append(asyncio.create_task(one(session, url, data, stream, hdrs, lag)))
            i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return [list(results[k :: len(urls)]) for k in range(len(urls))], elapsed


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def lat_stats(rs: Sequence[Result]) -> dict[str, float]:
    ok = [r.latency_s * 1000 for r in rs if r.ok]
    return {
        "n": len(rs),
        "errors": sum(not r.ok for r in rs),
        "mean_ms": sum(ok) / len(ok) if ok else float("nan"),
        "p50_ms": pct(ok, 50),
        "p90_ms": pct(ok, 90),
        "p99_ms": pct(ok, 99),
        "max_ms": max(ok, default=float("nan")),
    }


# -- phases ----------------------------------------------------------------------------------


async def wait_for_limit(
    session: aiohttp.ClientSession, url: str, at_least: int, timeout_s: float
) -> dict[str, Any]:
    """The proxy's enforced batch limit once it reaches `at_least` or `timeout_s` passes.

    With no warm-up the controller starts small and grows in bounded steps each tick; the
    latency parts should start once the limit is far above the load, so nothing queues."""
    t0 = time.perf_counter()
    while True:
        async with session.get(url + "/status") as r:
            st = await r.json()
        limit = int(st["limits"]["enforced"]["max_requests"])
        if limit >= at_least or time.perf_counter() - t0 >= timeout_s:
            return {
                "max_requests": limit,
                "binding": st["binding"],
                "waited_s": time.perf_counter() - t0,
            }
        await asyncio.sleep(0.5)


async def phase_idle(procs: dict[str, psutil.Process], seconds: float) -> dict[str, Any]:
    """CPU of each process, % of one core, over `seconds` with no traffic; and, for each, the
    share of its busiest thread other than the main one (a BLAS pool spinning shows there)."""

    def threads(ps: psutil.Process) -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in ps.threads()}

    c0 = {name: (cpu_s(ps), threads(ps)) for name, ps in procs.items()}
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {"seconds": elapsed}
    for name, ps in procs.items():
        cpu0, th0 = c0[name]
        th1 = threads(ps)
        others = [v - th0.get(tid, 0.0) for tid, v in th1.items() if tid != ps.pid]
        out[name] = {
            "cpu_pct": 100 * (cpu_s(ps) - cpu0) / elapsed,
            "threads": len(th1),
            "busiest_other_thread_pct": 100 * max(others, default=0.0) / elapsed,
        }
    return out


_ADDED = ("mean_ms", "p50_ms", "p90_ms", "p99_ms")


async def phase_latency(
    session: aiohttp.ClientSession,
    direct: str,
    hops: dict[str, tuple[str, psutil.Process]],
    cfg: Config,
    stream: bool,
) -> dict[str, Any]:
    """Direct requests and those through each hop (the bare one, the proxy, a --baseline
    proxy) take turns at `cfg.rate` each for `cfg.duration_s`: the added latency, side by side.
    """
    rate, tokens = cfg.rate, cfg.sse_tokens
    t0 = {name: ps.cpu_times() for name, (_, ps) in hops.items()}
    urls = [direct, *(url for url, _ in hops.values())]
    (rd, *rs), elapsed = await open_loop(
        session, urls, len(urls) * rate, cfg.duration_s, body(stream, tokens), stream
    )
    d = lat_stats(rd)
    out: dict[str, Any] = {
        "rate_rps_each": rate,
        "answer": f"sse x{tokens}" if stream else "json",
        "direct": d,
    }
    for (name, (_, ps)), results in zip(hops.items(), rs, strict=True):
        t1, n = ps.cpu_times(), max(1, len(results))
        user, system = t1.user - t0[name].user, t1.system - t0[name].system
        h = out[name] = lat_stats(results)
        out["added_ms" if name == "proxy" else f"{name}_added_ms"] = {
            k: h[k] - d[k] for k in _ADDED
        }
        out[f"{name}_cpu_ms_per_request"] = 1000 * (user + system) / n
        # The kernel's share: on loopback every send also runs the receiver's TCP path.
        out[f"{name}_cpu_system_ms_per_request"] = 1000 * system / n
    out["client_lag_p99_ms"] = 1000 * pct([r.lag_s for rs_ in (rd, *rs) for r in rs_], 99)
    out["elapsed_s"] = elapsed
    return out


async def sse_relay(
    session: aiohttp.ClientSession,
    url: str,
    ps: psutil.Process | None,
    cfg: Config,
) -> dict[str, Any]:
    """`cfg.sse_streams` clients each pull streams of `cfg.sse_events` events, spaced
    `cfg.sse_interval_ms` apart, back to back for `cfg.sse_duration_s`."""
    data = body(True, cfg.sse_events)
    hdrs = {"Content-Type": "application/json", "x-fake-interval-ms": str(cfg.sse_interval_ms)}
    c0 = cpu_s(ps) if ps else 0.0
    t0 = time.perf_counter()
    results: list[Result] = []

    async def worker() -> None:
        while time.perf_counter() - t0 < cfg.sse_duration_s:
            results.append(await one(session, url, data, True, hdrs))

    await asyncio.gather(*(worker() for _ in range(cfg.sse_streams)))
    elapsed = time.perf_counter() - t0
    n_events = sum(r.events for r in results if r.ok)
    out: dict[str, Any] = {
        "streams": len(results),
        "errors": sum(not r.ok for r in results),
        "events": n_events,
        "events_per_s": n_events / elapsed,
        "stream_p50_ms": pct([r.latency_s * 1000 for r in results if r.ok], 50),
    }
    if ps:
        cpu = cpu_s(ps) - c0
        out["cpu_util"] = cpu / elapsed
        out["cpu_us_per_event"] = 1e6 * cpu / max(1, n_events)
    return out


async def queue_memory(upstream: str, n: int, log_dir: Path, timeout_s: float) -> dict[str, Any]:
    """RSS of a proxy holding `n` queued requests, then after the clients disconnect."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proxy = child("proxy-queue", proxy_argv(upstream, port, QUEUE_ARGS, None), log_dir)
    await proxy.start(url + "/ready")
    ps = ps_of(proxy)
    out: dict[str, Any] = {"target_queued": n}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as flood,
            aiohttp.ClientSession() as probe,
        ):

            async def queued() -> int:
                async with probe.get(url + "/status") as r:
                    q = (await r.json())["queue"]
                    return int(sum(q["queued"].values()) + q["in_flight"])

            # One idle request first, so the connection pools and caches exist before the base.
            await one(flood, url + "/v1/chat/completions", body(False, 4), False, {})
            await asyncio.sleep(0.5)
            out["rss_idle_mb"] = ps.memory_info().rss / 2**20
            hdrs = {"Content-Type": "application/json", "x-fake-delay-s": "600"}
            data = body(False, 16)
            t0 = time.perf_counter()
            tasks = [
                asyncio.create_task(one(flood, url + "/v1/chat/completions", data, False, hdrs))
                for _ in range(n)
            ]
            held = 0
            deadline = t0 + timeout_s
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.25)
                held = await queued()
                if held >= n:
                    break
            out["queued"] = held
            out["enqueue_s"] = time.perf_counter() - t0
            await asyncio.sleep(0.5)
            rss = ps.memory_info().rss / 2**20
            out["rss_queued_mb"] = rss
            out["kb_per_queued_request"] = 1024 * (rss - out["rss_idle_mb"]) / max(1, held)
            out["proxy_fds"] = ps.num_fds()
            t1 = time.perf_counter()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Queued requests leave as their clients go; the admitted one should too (its slot freed).
        async with aiohttp.ClientSession() as probe2:
            while True:
                async with probe2.get(url + "/status") as r:
                    q = (await r.json())["queue"]
                if sum(q["queued"].values()) == 0 or time.perf_counter() - t1 > timeout_s:
                    break
                await asyncio.sleep(0.25)
            await asyncio.sleep(1.0)
            async with probe2.get(url + "/status") as r:
                q = (await r.json())["queue"]
        out["queued_after_cancel"] = sum(q["queued"].values())
        out["in_flight_after_cancel"] = q["in_flight"]
        out["clear_s"] = time.perf_counter() - t1 - 1.0
        out["rss_after_cancel_mb"] = ps.memory_info().rss / 2**20
    finally:
        await proxy.stop()
    return out


# -- run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Config:
    rate: float = 300.0
    duration_s: float = 10.0
    sse_tokens: int = 16
    sse_streams: int = 32
    sse_events: int = 64
    sse_interval_ms: float = 1.0
    sse_duration_s: float = 6.0
    flood: int = 10_000
    flood_timeout_s: float = 90.0
    warmup_requests: int = 300
    limit_wait_s: float = 30.0
    idle_s: float = 10.0
    wrk_connections: int = 64
    wrk_duration_s: float = 5.0
    wrk_rounds: int = 2
    full_window: bool = True
    skip: tuple[str, ...] = ()
    baseline: str | None = None  # another checkout whose proxy runs beside this one

    @classmethod
    def quick(cls) -> Config:
        return cls(
            rate=100,
            duration_s=1.0,
            sse_streams=4,
            sse_events=16,
            sse_duration_s=1.0,
            flood=300,
            flood_timeout_s=20,
            warmup_requests=50,
            limit_wait_s=0.0,
            idle_s=1.0,
            wrk_duration_s=1.0,
            wrk_rounds=1,
        )


async def run(cfg: Config, log_dir: Path, profile: Path | None) -> dict[str, Any]:
    up_port, bare_port, px_port = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    bare_url = f"http://127.0.0.1:{bare_port}"
    proxy_url = f"http://127.0.0.1:{px_port}"
    up = child(
        "fake-upstream",
        [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(up_port)],
        log_dir,
    )
    bare_argv = [sys.executable, str(HERE / "bare_hop.py"), "--upstream", upstream]
    bare = child("bare-hop", [*bare_argv, "--port", str(bare_port)], log_dir)
    argv = proxy_argv(upstream, px_port, OPEN_ARGS, profile, cfg.full_window)
    proxy = child("proxy", argv, log_dir)
    baseline: Child | None = None
    if cfg.baseline:
        tree = Path(cfg.baseline)  # made absolute in main
        base_port = free_port()
        base_url = f"http://127.0.0.1:{base_port}"
        base_argv = proxy_argv(upstream, base_port, OPEN_ARGS, None, cfg.full_window, tree)
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'plugins' / 'vllm'}"}
        baseline = Child("baseline", base_argv, log_dir, command=(), env=env, cwd=tree)
    log("starting the fake upstream, the bare hop and the proxy")
    await up.start(upstream + "/health")
    out: dict[str, Any] = {"config": asdict(cfg)}
    try:
        await bare.start(bare_url + "/health")
        await proxy.start(proxy_url + "/ready")
        path = "/v1/chat/completions"
        direct_c, bare_c, proxy_c = upstream + path, bare_url + path, proxy_url + path
        hops = {"bare": (bare_c, bare), "proxy": (proxy_c, proxy)}
        if baseline is not None:
            await baseline.start(base_url + "/ready")
            hops["baseline"] = (base_url + path, baseline)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            warm = cfg.warmup_requests
            urls = [direct_c, *(url for url, _ in hops.values())]
            await open_loop(session, urls, 300, warm / 200, body(False, 16), False)
            await open_loop(session, urls, 300, warm / 400, body(True, 16), True)
            out["proxy_limit"] = await wait_for_limit(session, proxy_url, 32, cfg.limit_wait_s)
            if baseline is not None:
                out["baseline_limit"] = await wait_for_limit(
                    session, base_url, 32, cfg.limit_wait_s
                )
            log(f"idle CPU, {cfg.idle_s:.0f} s without traffic")
            idle = {name: ps_of(c) for name, (_, c) in hops.items()}
            out["idle"] = await phase_idle(idle, cfg.idle_s)
            lat: dict[str, Any] = {}
            for name, stream in (("json", False), ("sse", True)):
                log(f"latency, {name} answers, {cfg.rate:.0f} rps to each side")
                hop_ps = {hop: (url, ps_of(c)) for hop, (url, c) in hops.items()}
                lat[name] = await phase_latency(session, direct_c, hop_ps, cfg, stream)
            out["latency"] = lat
            out["proxy_limit_after_latency"] = await wait_for_limit(session, proxy_url, 0, 0)
            sides = {"direct": (direct_c, up), **hops}
            if "wrk" not in cfg.skip and (w := await phase_wrk(sides, cfg, log_dir)):
                out["wrk"] = w
            if "sse" not in cfg.skip:
                out["sse_relay"] = await sse_phase(session, cfg, proxy_c, direct_c, ps_of(proxy))
        out["proxy_rss_after_load_mb"] = ps_of(proxy).memory_info().rss / 2**20
    finally:
        log("stopping the proxy and the bare hop")
        if baseline is not None:
            await baseline.stop()
        await proxy.stop()
        await bare.stop()
        try:
            if "memory" not in cfg.skip:
                log(f"queue memory: {cfg.flood:,} requests queued")
                out["queue_memory"] = await queue_memory(
                    upstream, cfg.flood, log_dir, cfg.flood_timeout_s
                )
        finally:
            await up.stop()
    return out


async def phase_wrk(
    sides: dict[str, tuple[str, Child]], cfg: Config, log_dir: Path
) -> dict[str, Any] | None:
    """The most requests/s a closed loop of `cfg.wrk_connections` connections gets (wrk, JSON
    answers), each side in turn, `cfg.wrk_rounds` times; the best round of each counts."""
    if shutil.which("wrk") is None:
        log("wrk is not on PATH: the closed-loop part is left out")
        return None
    script = log_dir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{body(False, 16).decode()}]]\n"
    )
    out: dict[str, Any] = {name: {"rounds": []} for name in sides}
    for _ in range(cfg.wrk_rounds):
        for name, (url, c) in sides.items():
            log(f"wrk, {cfg.wrk_connections} connections, {name}")
            cpu0 = cpu_s(ps_of(c))
            proc = await asyncio.create_subprocess_exec(
                *("wrk", "-t1", f"-c{cfg.wrk_connections}", f"-d{cfg.wrk_duration_s:g}s"),
                *("-s", str(script), url),
                stdout=asyncio.subprocess.PIPE,
            )
            text = (await proc.communicate())[0].decode()
            n = re.search(r"(\d+) requests in", text)
            rps = re.search(r"Requests/sec:\s*([\d.]+)", text)
            bad = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
            requests = int(n.group(1)) if n else 0
            out[name]["rounds"].append(
                {
                    "rps": float(rps.group(1)) if rps else math.nan,
                    "requests": requests,
                    "non_2xx": int(bad.group(1)) if bad else 0,
                    "cpu_ms_per_request": 1000 * (cpu_s(ps_of(c)) - cpu0) / max(1, requests),
                }
            )
    for side in out.values():
        side["best_rps"] = max(r["rps"] for r in side["rounds"])
    for name in sides.keys() - {"direct", "bare"}:
        out[f"{name}_vs_bare"] = out[name]["best_rps"] / out["bare"]["best_rps"]
    return out


async def sse_phase(
    session: aiohttp.ClientSession,
    cfg: Config,
    proxy_c: str,
    direct_c: str,
    proxy_ps: psutil.Process,
) -> dict[str, Any]:
    sse: dict[str, Any] = {}
    for name, url, ps in (("proxy", proxy_c, proxy_ps), ("direct", direct_c, None)):
        log(f"SSE relay, {name}")
        sse[name] = await sse_relay(session, url, ps, cfg)
    cpu_ev = sse["proxy"].get("cpu_us_per_event")
    sse["proxy_cpu_bound_events_per_s"] = 1e6 / cpu_ev if cpu_ev else None
    return sse


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "platform": platform.platform(),
    }


def render(r: dict[str, Any]) -> str:
    """The figures as a table: direct, through the proxy, and the difference or ratio."""

    def f(x: Any, nd: int = 2) -> str:
        if x is None:
            return "-"
        return f"{x:,.{nd}f}" if isinstance(x, float) else f"{x:,}"

    lines = [f"{'figure':<46} {'direct':>11} {'proxy':>11} {'added/ratio':>11}"]

    def row(name: str, d: str = "", p: str = "", a: str = "") -> None:
        lines.append(f"{name:<46} {d:>11} {p:>11} {a:>11}".rstrip())

    idle, px = r["idle"], r["idle"]["proxy"]
    row(f"idle CPU over {idle['seconds']:.0f} s, % of a core: proxy", "", f(px["cpu_pct"], 1))
    row("  its busiest thread but the main one, %", "", f(px["busiest_other_thread_pct"], 1))
    row("idle CPU, % of a core: bare hop", "", f(idle["bare"]["cpu_pct"], 1))
    for name, lat in r["latency"].items():
        d, b, p = lat["direct"], lat["bare"], lat["proxy"]
        a, ab = lat["added_ms"], lat["bare_added_ms"]
        head = f"latency {name} @{lat['rate_rps_each']:.0f} rps each"
        for k in ("p50_ms", "p90_ms", "p99_ms"):
            row(f"{head} {k}", f(d[k], 3), f(p[k], 3), f(a[k], 3))
            row(f"  bare hop {k}", f(d[k], 3), f(b[k], 3), f(ab[k], 3))
        if bl := lat.get("baseline"):
            for k in ("p50_ms", "p99_ms"):
                row(f"  baseline {k}", f(d[k], 3), f(bl[k], 3), f(lat["baseline_added_ms"][k], 3))
        row(f"{head} errors (bare {b['errors']})", f(d["errors"]), f(p["errors"]))
        row(f"proxy CPU per request ({name}), ms", "", f(lat["proxy_cpu_ms_per_request"], 3))
        row("  of which in the kernel, ms", "", f(lat["proxy_cpu_system_ms_per_request"], 3))
        if "baseline" in lat:
            row("  baseline CPU per request, ms", "", f(lat["baseline_cpu_ms_per_request"], 3))
        row(f"bare hop CPU per request ({name}), ms", "", f(lat["bare_cpu_ms_per_request"], 3))
    if w := r.get("wrk"):
        head = f"most req/s, {r['config']['wrk_connections']} connections (wrk)"
        best = {k: w[k]["best_rps"] for k in ("direct", "bare", "proxy")}
        row(head, f(best["direct"], 0), f(best["proxy"], 0), f(w["proxy_vs_bare"]))
        row("  bare hop (ratio: proxy / bare hop)", f(best["direct"], 0), f(best["bare"], 0))
        if "baseline" in w:
            row("  baseline", "", f(w["baseline"]["best_rps"], 0), f(w["baseline_vs_bare"]))
        for side in ("bare", "proxy", "baseline") if "baseline" in w else ("bare", "proxy"):
            cpu = max(w[side]["rounds"], key=lambda x: x["rps"])["cpu_ms_per_request"]
            row(f"  {side} CPU per request under wrk, ms", "", f(cpu, 3))
    if s := r.get("sse_relay"):
        d_ev, p_ev = s["direct"]["events_per_s"], s["proxy"]["events_per_s"]
        row("SSE events/s relayed", f(d_ev, 0), f(p_ev, 0), f(p_ev / d_ev if d_ev else None))
        row("proxy CPU per SSE event, us", "", f(s["proxy"].get("cpu_us_per_event"), 1))
        row("proxy CPU-bound SSE events/s, one core", "", f(s["proxy_cpu_bound_events_per_s"], 0))
    if q := r.get("queue_memory"):
        row("proxy RSS idle, MB", "", f(q["rss_idle_mb"], 1))
        row(f"proxy RSS with {q['queued']:,} queued, MB", "", f(q["rss_queued_mb"], 1))
        row("proxy RSS per queued request, KB", "", f(q["kb_per_queued_request"], 1))
        row("proxy RSS after the clients left, MB", "", f(q["rss_after_cancel_mb"], 1))
        row("in flight after the clients left (expect 0)", "", f(q["in_flight_after_cancel"]))
    t = r["targets"]
    lines.append(
        f"targets at {r['latency']['json']['rate_rps_each']:.0f} rps: p50 added < 0.5 ms "
        f"{'met' if t['p50_added_under_0_5ms'] else 'MISSED'}, p99 added < 2 ms "
        f"{'met' if t['p99_added_under_2ms'] else 'MISSED'}, p99 added within 1 ms of the bare "
        f"hop's {'met' if t['p99_added_within_1ms_of_bare_hop'] else 'MISSED'}"
    )
    return "\n".join(lines)


def print_profile(path: Path, n: int = 25) -> str:
    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny counts: a smoke test")
    p.add_argument("--rate", type=float, help="requests/s to each side in the latency part")
    p.add_argument("--duration", type=float, help="seconds of each latency part")
    p.add_argument("--flood", type=int, help="requests queued for the memory part")
    p.add_argument("--out", default=str(REPO / "results/overhead/overhead.json"))
    p.add_argument("--log-dir", default=None, help="child logs (default: next to --out)")
    p.add_argument("--profile", help="run the proxy under cProfile, write the stats here")
    p.add_argument("--idle", type=float, help="seconds of the idle-CPU part")
    p.add_argument(
        "--fresh-model",
        action="store_true",
        help="start the proxy with an empty model window (default: full, see serve_full_window)",
    )
    p.add_argument("--skip", default="", help="parts to leave out: wrk,sse,memory")
    p.add_argument(
        "--baseline",
        help="another checkout (a directory) whose proxy runs beside this one: before vs after",
    )
    a = p.parse_args(argv)
    cfg = Config.quick() if a.quick else Config()
    skip = tuple(x for x in a.skip.split(",") if x)
    if unknown := set(skip) - {"wrk", "sse", "memory"}:
        p.error(f"--skip: unknown parts {sorted(unknown)}")
    over = {
        "rate": a.rate,
        "duration_s": a.duration,
        "flood": a.flood,
        "idle_s": a.idle,
        "full_window": False if a.fresh_model else None,
        "skip": skip or None,
        "baseline": str(Path(a.baseline).resolve()) if a.baseline else None,
    }
    cfg = Config(**{**asdict(cfg), **{k: v for k, v in over.items() if v is not None}})
    # 10k queued requests are 10k sockets on each side of the proxy.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 2 * cfg.flood + 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(a.log_dir) if a.log_dir else out.parent / "logs"
    profile = Path(a.profile).resolve() if a.profile else None
    r = asyncio.run(run(cfg, log_dir, profile))
    r["machine"] = machine()
    j = r["latency"]["json"]["added_ms"]
    r["targets"] = {
        "p50_added_under_0_5ms": j["p50_ms"] < 0.5,
        "p99_added_under_2ms": j["p99_ms"] < 2.0,
        "p99_added_within_1ms_of_bare_hop": (
            j["p99_ms"] - r["latency"]["json"]["bare_added_ms"]["p99_ms"] < 1.0
        ),
    }
    out.write_text(json.dumps(json_safe(r), indent=2))
    print(render(r))
    print(f"\nwrote {out}")
    if profile and profile.exists():
        print(print_profile(profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
