"""A fault-injecting OpenAI-compatible upstream, and a proxy in front of it, for reliability tests.

`FaultyUpstream` answers chat/completions the way vLLM does (JSON, or SSE ending in [DONE]) and
misbehaves on demand through `Behaviour`: refuse (stopped), hang before headers, answer slowly,
die mid-stream or mid-body, answer 5xx, or replay a scripted SSE byte stream in given chunks. It
records every request it sees, so tests can prove what reached the upstream and what did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from helpers import async_wait_until

from powerbatch.admission import AdmissionQueue
from powerbatch.control import AdmissionLimits, ControlConfig
from powerbatch.control.config import ClockPolicy, Mode
from powerbatch.control.controller import Controller
from powerbatch.errors import SensorReadError
from powerbatch.proxy import Governor, ProxyMetrics, ProxySettings, create_app
from powerbatch.proxy.app import create_admin_app
from powerbatch.telemetry import PowerMonitor, PowerSample
from powerbatch.telemetry.clock import ClockActuator


@dataclass
class Behaviour:
    delay_s: float = 0.0  # before the response headers (large: hangs)
    status: int = 200
    body: bytes | None = None  # raw body for a non-200 answer (default: an OpenAI error)
    content_type: str = "application/json"
    tokens: int = 4  # content events in a stream
    token_interval_s: float = 0.0
    die_after_events: int | None = None  # stream: close the socket after this many events
    die_mid_body: bool = False  # non-stream: send headers and half a body, then close
    chunks: list[bytes] | None = None  # stream: write exactly these bytes, in these pieces


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes
    t_s: float = field(default_factory=time.monotonic)


def sse_events(n: int, rid: str = "chatcmpl-x") -> list[bytes]:
    """A vLLM-like chat stream: role event, n content events, usage, [DONE]."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": "stub"}

    def ev(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    out = [ev({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    out += [
        ev({**head, "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}) for i in range(n)
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
    out.append(ev({**head, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return out


class FaultyUpstream:
    """The stub upstream; `behaviour` may be swapped between (or during) requests."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.seen: list[Seen] = []
        self.active = 0
        self.max_active = 0
        self.aborted = 0  # requests whose client (the proxy) went away before the answer
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen (again, on the same port after a stop: an upstream restart)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._other)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if not self.port:
            self.port = int(runner.addresses[0][1])
        self._runner = runner

    async def stop(self) -> None:
        """Close the listener and every connection: now it refuses connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _other(self, request: web.Request) -> web.Response:
        self.seen.append(Seen(request.path_qs, dict(request.headers), await request.read()))
        return web.json_response({"object": "list", "data": [], "path": request.path_qs})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        b = self.behaviour
        raw = await request.read()
        self.seen.append(Seen(request.path_qs, dict(request.headers), raw))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        finished = False
        try:
            if b.delay_s:
                await asyncio.sleep(b.delay_s)
            if b.status != 200:
                body = b.body
                if body is None:
                    err = {"message": "stub failure", "type": "server_error", "code": b.status}
                    body = json.dumps({"error": err}).encode()
                finished = True
                return web.Response(body=body, status=b.status, content_type=b.content_type)
            stream = bool(json.loads(raw).get("stream")) if raw else False
            if stream:
                resp = await self._stream(request, b)
            else:
                resp = await self._whole(request, b, raw)
            finished = True
            return resp
        finally:
            self.active -= 1
            if not finished:
                self.aborted += 1

    async def _whole(self, request: web.Request, b: Behaviour, raw: bytes) -> web.StreamResponse:
        if b.token_interval_s:
            await asyncio.sleep(b.token_interval_s * b.tokens)
        body = json.dumps(
            {
                "id": "cmpl-x",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": b.tokens, "total_tokens": 7},
                "echo": json.loads(raw).get("user") if raw else None,
            }
        ).encode()
        if b.die_mid_body:
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        return web.Response(body=body, content_type="application/json")

    async def _stream(self, request: web.Request, b: Behaviour) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            }
        )
        await resp.prepare(request)
        pieces = b.chunks if b.chunks is not None else sse_events(b.tokens)
        for i, piece in enumerate(pieces):
            if b.die_after_events is not None and i >= b.die_after_events:
                # Half an event, then the socket goes: what a crashing server leaves behind.
                await resp.write(piece[: max(1, len(piece) // 2)])
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(piece)
            if b.token_interval_s:
                await asyncio.sleep(b.token_interval_s)
            elif b.chunks is not None:
                await asyncio.sleep(0)  # let each piece leave as its own segment
        await resp.write_eof()
        return resp


@dataclass
class Proxy:
    url: str
    gov: Governor
    settings: ProxySettings
    power: dict[str, Any]  # the ScriptedPowerSource's state: what the sensor reads now
    admin_url: str | None = None


class ScriptedPowerSource:
    """The sensor under test: `state["w"]` is watts, None (a read error) or a callable giving
    either; `state["delay_s"]` makes each read take that long (a hung or lagging exporter)."""

    name = "scripted"

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    async def read(self) -> PowerSample:
        if self.state.get("delay_s"):
            await asyncio.sleep(self.state["delay_s"])
        value = self.state["w"]
        if callable(value):
            value = value()
        if value is None:
            raise SensorReadError("scripted failure")
        return PowerSample(time.monotonic(), value, None)

    async def close(self) -> None:
        return None


@asynccontextmanager
async def running_proxy(
    upstream_url: str,
    *,
    batch: int = 4,
    safe_batch: int = 2,
    warmup_s: float = 1e6,
    ceiling_w: float = 1000.0,
    tick_hz: float = 20.0,
    max_queue_len: int = 100,
    max_wait_s: float = 10.0,
    power_interval_s: float = 0.02,
    stale_after_s: float = 0.3,
    admin_port: bool = False,
    mode: str = "enforce",
    sm_clock: ClockActuator | None = None,
    clock_policy: ClockPolicy | None = None,
    **settings: Any,
) -> AsyncIterator[Proxy]:
    """A real proxy on loopback with a scripted power sensor and a fixed batch limit.

    Warm-up pins the batch at `batch` (initial = max), so admission is deterministic while the
    sensor is good; a bad sensor drops it to `safe_batch`.
    """
    power: dict[str, Any] = {"w": 0.3 * ceiling_w, "delay_s": 0.0}
    cfg = ControlConfig(
        ceiling_w=ceiling_w,
        tick_hz=tick_hz,
        min_batch=1,
        max_batch=batch,
        initial_batch=batch,
        safe_batch=min(safe_batch, batch),
        warmup_s=warmup_s,
        prefill_pacing=False,
        mode=Mode(mode),
    )
    queue = AdmissionQueue(
        AdmissionLimits(batch, cfg.max_kv_tokens, None),
        max_queue_len=max_queue_len,
        max_wait_s={"high": max_wait_s, "normal": max_wait_s, "low": max_wait_s},
    )
    monitor = PowerMonitor(
        ScriptedPowerSource(power),
        interval_s=power_interval_s,
        stale_after_s=stale_after_s,
        max_plausible_w=3 * ceiling_w,
    )
    gov = Governor(
        Controller(cfg),
        queue,
        monitor,
        ProxyMetrics(),
        sm_clock=sm_clock,
        clock_policy=clock_policy,
    )
    await monitor.poll_once()  # a good reading before the first tick: no start-up fail-closed
    # Any admin port moves the admin routes off the main app; the listener below uses port 0.
    ps = ProxySettings(upstream=upstream_url, admin_port=9 if admin_port else None, **settings)
    runner = web.AppRunner(
        create_app(gov, ps), handler_cancellation=True, access_log=None, shutdown_timeout=0.5
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    admin_runner = None
    admin_url = None
    if admin_port:
        admin_runner = web.AppRunner(create_admin_app(gov, ps), access_log=None)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, "127.0.0.1", 0).start()
        admin_url = f"http://127.0.0.1:{admin_runner.addresses[0][1]}"
    try:
        # Wait for the first good reading and tick, so limits are the steady ones.
        async def steady() -> bool:
            d = gov.last
            return d is not None and d.state != "fail_closed" and queue.limits.max_requests == batch

        await async_wait_until(
            steady, 5.0, lambda: f"the first good tick at batch {batch}: {gov.status()['state']}"
        )
        yield Proxy(url, gov, ps, power, admin_url)
    finally:
        if admin_runner is not None:
            await admin_runner.cleanup()
        await runner.cleanup()


@asynccontextmanager
async def upstream(behaviour: Behaviour | None = None) -> AsyncIterator[FaultyUpstream]:
    up = FaultyUpstream(behaviour)
    await up.start()
    try:
        yield up
    finally:
        with contextlib.suppress(Exception):
            await up.stop()


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "stub", "messages": [{"role": "user", "content": content}], **extra}
