"""Overload and soak: limits hold, 429s tell the truth, and every request is answered exactly once.

The upstream stub serves a fixed time per request and the batch is pinned, so the sustainable
rate is known (batch / service time); the load is an open loop at a multiple of it, each request
tagged with a unique id so the test can check, id by id, what reached the upstream.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import pytest
from conftest import run
from faults import Behaviour, FaultyUpstream, Proxy, chat_body, running_proxy, upstream
from helpers import async_wait_until

from powerbatch.admission import AdmissionQueue
from powerbatch.control import AdmissionLimits

CHAT = "/v1/chat/completions"
BATCH = 2
SERVICE_S = 0.1  # non-streamed: tokens x token_interval_s
CAPACITY = BATCH / SERVICE_S  # requests/s the upstream sustains
TTFT_SLO_S = 2.0
STALL_S = 0.2  # a gap in the 20-ms sampler this long is a stall of the test process


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@dataclass
class Result:
    rid: str
    priority: str
    stream: bool
    status: int = 0
    retry_after: str | None = None
    latency_s: float = math.nan
    done_s: float = math.nan  # monotonic time of the answer
    complete: bool = False  # a 200 stream that ended with [DONE], or a 200 JSON body
    error: str | None = None


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    max_queued: int = 0
    max_backlog: int = 0
    max_in_flight: int = 0
    rss_mb: list[float] = field(default_factory=list)
    stalls: list[tuple[float, float]] = field(default_factory=list)  # event-loop gaps (t0, t1)


async def _one(s: aiohttp.ClientSession, p: Proxy, r: Result) -> None:
    t0 = time.monotonic()
    try:
        async with s.post(
            p.url + CHAT,
            json=chat_body(f"req {r.rid}", user=r.rid, stream=r.stream),
            headers={"x-priority": r.priority},
        ) as resp:
            body = await resp.read()
            r.status = resp.status
            r.retry_after = resp.headers.get("Retry-After")
            if resp.status == 200:
                r.complete = body.rstrip().endswith(b"[DONE]") if r.stream else b'"id"' in body
    except Exception as exc:  # any of these fails the test: each request must get an answer
        r.error = f"{type(exc).__name__}: {exc}"
    r.done_s = time.monotonic()
    r.latency_s = r.done_s - t0


async def drive(
    p: Proxy, rate: float, duration_s: float, mix: dict[str, float], stream_frac: float
) -> Run:
    """Open-loop Poisson arrivals at `rate`/s for `duration_s`; sample the queue meanwhile.

    Arrival times are drawn up front and kept to the wall clock: when this (shared, busy)
    process falls behind, the requests already due go out at once, so the load sent is the
    load asked for, not what one core could pace request by request."""
    out = Run()
    rng = random.Random(7)
    classes, weights = zip(*mix.items(), strict=True)
    stop = asyncio.Event()

    async def sample() -> None:
        last_s = time.monotonic()
        while not stop.is_set():
            now_s = time.monotonic()
            if now_s - last_s > STALL_S:  # this process stood still (GC, a busy machine)
                out.stalls.append((last_s, now_s))
            last_s = now_s
            q = p.gov.queue
            out.max_queued = max(out.max_queued, q.queued)
            out.max_backlog = max(out.max_backlog, q.backlog)
            out.max_in_flight = max(out.max_in_flight, q.in_flight)
            out.rss_mb.append(_rss_mb())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(60)) as s:
        tasks = []
        t0 = time.monotonic()
        due_s = 0.0
        i = 0
        while due_s < duration_s:
            await asyncio.sleep(max(0.0, t0 + due_s - time.monotonic()))
            r = Result(f"r{i}", rng.choices(classes, weights)[0], rng.random() < stream_frac)
            out.results.append(r)
            tasks.append(asyncio.create_task(_one(s, p, r)))
            i += 1
            due_s += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    stop.set()
    await sampler
    return out


def _counter(p: Proxy, outcome: str) -> float:
    m = p.gov.metrics.requests
    return sum(m.labels(pr, outcome)._value.get() for pr in ("high", "normal", "low"))


async def check_books(p: Proxy, up: FaultyUpstream, out: Run) -> Counter[int]:
    """Every request answered once; the upstream saw each admitted one once; slots back to 0."""
    errors = [r.error for r in out.results if r.error]
    assert not errors, errors[:5]
    statuses = Counter(r.status for r in out.results)
    assert set(statuses) <= {200, 429}, statuses
    ok = [r for r in out.results if r.status == 200]
    assert all(r.complete for r in ok)
    upstream_ids = Counter(json.loads(s.body)["user"] for s in up.seen)
    assert max(upstream_ids.values(), default=1) == 1  # nothing forwarded twice
    assert set(upstream_ids) == {r.rid for r in ok}  # and nothing refused was forwarded
    # The proxy's own books agree: its /status and counters, after the dust settles.
    await async_wait_until(lambda: p.gov.queue.in_flight == 0, 2.0, "no slot in flight")
    async with aiohttp.ClientSession() as s, s.get(p.url + "/status") as resp:
        st = await resp.json()
    assert st["queue"]["in_flight"] == 0 and sum(st["queue"]["queued"].values()) == 0
    assert sum(st["queue"]["admitted_total"].values()) == len(ok) == _counter(p, "ok")
    assert _counter(p, "rejected") == statuses[429]
    for outcome in ("upstream_error", "cancelled", "bad_request"):
        assert _counter(p, outcome) == 0
    assert up.active == 0 and up.max_active <= BATCH
    return statuses


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]


def _answered_429(out: Run) -> list[tuple[int, float]]:
    return [(int(r.retry_after or "x"), r.done_s) for r in out.results if r.status == 429]


def _after_stall(stalls: list[tuple[float, float]], t_s: float, wake_s: float) -> bool:
    """Whether `t_s` falls in a stall or the `wake_s` after it (the grant-rate average's
    memory: at 20 grants/s its 0.2 weight forgets a stall within about 0.5 s)."""
    return any(t0 <= t_s <= t1 + wake_s for t0, t1 in stalls)


def test_ten_times_the_sustainable_rate() -> None:
    async def go() -> None:
        behaviour = Behaviour(tokens=4, token_interval_s=SERVICE_S / 4)
        async with (
            upstream(behaviour) as up,
            running_proxy(up.url, batch=BATCH, max_queue_len=20, max_wait_s=2.0) as p,
        ):
            rss0 = _rss_mb()
            mix = {"high": 0.05, "normal": 0.45, "low": 0.5}  # high alone is 0.5 x capacity
            out = await drive(p, 10 * CAPACITY, 4.0, mix, stream_frac=0.3)
            statuses = await check_books(p, up, out)
            n = len(out.results)
            assert n > 0.7 * 10 * CAPACITY * 4.0  # the load really was about 10x
            assert statuses[429] > n / 2  # most are turned away ...
            # ... while the limits hold:
            assert out.max_queued <= 20 and out.max_in_flight <= BATCH
            assert out.max_backlog <= 2 * 20 + 3 * 32  # no record kept of shed waiters
            assert max(out.rss_mb) - rss0 < 100
            # Admitted high-priority work stays inside its SLO (end to end >= TTFT).
            high = [r.latency_s for r in out.results if r.priority == "high" and r.status == 200]
            assert len(high) > 10 and _p95(high) < TTFT_SLO_S
            shed_high = [r for r in out.results if r.priority == "high" and r.status == 429]
            assert len(shed_high) < 0.05 * len(high) + 1
            # Retry-After is an integer number of seconds, and about as long as the queue
            # ahead takes to clear at the rate the upstream really sustains.
            waits = [int(r.retry_after or "x") for r in out.results if r.status == 429]
            assert min(waits) >= 1
            # Queue 20 at 20/s: ideally 2 s. The estimate follows the grant rate the proxy
            # measures, and a stall of this (shared, saturated) test process is a real stall
            # to it (a 0.6 s stall with 20 ahead says 13 s; one in CI gave 17 % of the waits
            # 8 s), so the bulk is judged, and the tail away from the stalls seen.
            ideal = math.ceil((20 + 1) / CAPACITY)
            assert ideal - 1 <= statistics.median(waits) <= ideal + 1
            calm = [w for w, t in _answered_429(out) if not _after_stall(out.stalls, t, 1.0)]
            assert len(calm) >= 0.3 * len(waits), out.stalls
            assert sum(w <= 2 * ideal for w in calm) >= 0.95 * len(calm), out.stalls
            # Truthful: once the burst is over, coming back after Retry-After is served at once.
            await asyncio.sleep(max(waits[-20:]))
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                async with s.post(p.url + CHAT, json=chat_body(user="late")) as r:
                    assert r.status == 200
                assert time.monotonic() - t0 < 2 * SERVICE_S + 0.5

    run(go())


def test_retry_after_follows_the_measured_service_rate() -> None:
    """Deterministic: grants every 0.1 s -> Retry-After = ceil((ahead + 1) x 0.1)."""

    async def go() -> None:
        now = [0.0]
        q = AdmissionQueue(AdmissionLimits(1, 10**9), max_queue_len=50, clock=lambda: now[0])
        slot = await q.admit("normal", 1, 1)
        waiting = [asyncio.create_task(q.admit("normal", 1, 1)) for _ in range(40)]
        await asyncio.sleep(0)
        for _ in range(20):  # the upstream finishes one request every 0.1 s
            now[0] += 0.1
            slot.release()
            slot = await waiting.pop(0)
        assert q.queued == 20
        assert q.retry_after_s("normal") == math.ceil(21 * 0.1)
        assert q.retry_after_s("high") == 1  # nothing of its class or above is ahead
        now[0] += 5.0  # the upstream stalls: the silence itself becomes the estimate
        assert q.retry_after_s("normal") == 60  # 21 x 5 s, capped at a minute
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert q.backlog <= 32

    run(go())


def test_waiters_that_leave_leave_no_records() -> None:
    """Cancelled, expired and shed waiters are dropped, not kept: memory is bounded by the queue."""

    async def go() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9), max_queue_len=5, max_wait_s={"low": 0.01})
        held = await q.admit("high", 1, 1)  # the only slot, never released: nothing dispatches
        keeper = asyncio.create_task(q.admit("normal", 1, 1))  # one live waiter throughout
        for _ in range(2000):
            low = asyncio.create_task(q.admit("low", 1, 1))
            await asyncio.sleep(0)
            low.cancel()  # a client that gives up
            await asyncio.gather(low, return_exceptions=True)
        expiring = [asyncio.create_task(q.admit("low", 1, 1)) for _ in range(4)]
        await asyncio.gather(*expiring, return_exceptions=True)  # 429 queue_timeout
        for _ in range(500):  # a full queue of lows, each shed by a high that then leaves
            lows = [asyncio.create_task(q.admit("low", 1, 1)) for _ in range(4)]
            await asyncio.sleep(0)
            high = asyncio.create_task(q.admit("high", 1, 1))
            await asyncio.sleep(0)
            high.cancel()
            for t in lows:
                t.cancel()
            await asyncio.gather(high, *lows, return_exceptions=True)
        assert q.queued == 1 and q.backlog <= 2 * q.queued + 32
        assert q.stats.rejected_total[("low", "shed")] >= 500
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        held.release()
        assert q.in_flight == 0 and q.queued == 0

    run(go())


async def _soak(duration_s: float) -> None:
    behaviour = Behaviour(tokens=4, token_interval_s=SERVICE_S / 4)
    async with (
        upstream(behaviour) as up,
        running_proxy(up.url, batch=BATCH, max_queue_len=50, max_wait_s=3.0) as p,
    ):
        mix = {"high": 0.2, "normal": 0.5, "low": 0.3}
        out = await drive(p, 1.5 * CAPACITY, duration_s, mix, stream_frac=0.5)
        statuses = await check_books(p, up, out)
        assert statuses[200] > 0.5 * CAPACITY * duration_s  # the upstream was kept busy
        half = len(out.rss_mb) // 2
        assert max(out.rss_mb[half:]) - max(out.rss_mb[:half]) < 30  # no steady growth


def test_soak_counts_add_up() -> None:
    run(_soak(10.0))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_soak_long() -> None:
    run(_soak(180.0))
