"""The aiohttp reverse proxy: OpenAI routes through admission, everything else passed through.

The hot path reads the body once, parses only what the decision needs, waits for a slot, and
relays the upstream's bytes as they come (SSE chunk by chunk, never buffered whole). The slot is
released in a `finally`, so a client that disconnects, an upstream that fails or a bug all free it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from powerbatch.admission import Rejected, parse_priority
from powerbatch.proxy.errors import error_response, sse_error_event
from powerbatch.proxy.governor import Governor
from powerbatch.proxy.parse import BadRequest, RequestInfo, parse_request

log = logging.getLogger("powerbatch.proxy")

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
GOVERNOR: web.AppKey[Governor] = web.AppKey("governor", Governor)
SETTINGS: web.AppKey[ProxySettings] = web.AppKey("settings", object)  # type: ignore[arg-type]
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


@dataclass(frozen=True, slots=True)
class ProxySettings:
    upstream_url: str
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 256  # KV estimate for requests that name no max_tokens
    max_tokens_limit: int = 131_072
    connect_timeout_s: float = 5.0
    headers_timeout_s: float = 600.0  # a non-streamed answer sends headers only when done
    read_timeout_s: float = 120.0  # longest silence inside a stream


def _forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


def _usage_completion_tokens(tail: bytes) -> int | None:
    """completion_tokens from the usage event at the end of a stream, if the client asked for it."""
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                usage = json.loads(event[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens")
                return int(tokens) if tokens is not None else None
            except (ValueError, AttributeError, TypeError):
                return None
    return None


class ProxyHandlers:
    def __init__(self, gov: Governor, settings: ProxySettings) -> None:
        self.gov = gov
        self.settings = settings
        self.upstream = settings.upstream_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    # -- admission-controlled routes ----------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=False)

    async def _completion(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        m = self.gov.metrics
        try:
            priority = parse_priority(request.headers.get("x-priority"))
        except ValueError as exc:
            return error_response(400, str(exc), param="x-priority", code="invalid_priority")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            m.requests.labels(priority, "bad_request").inc()
            return error_response(
                413, f"request body over {self.settings.max_body_bytes} bytes", code="too_large"
            )
        try:
            info = parse_request(
                raw,
                chat=chat,
                default_max_tokens=self.settings.default_max_tokens,
                max_tokens_limit=self.settings.max_tokens_limit,
            )
        except BadRequest as exc:
            m.requests.labels(priority, "bad_request").inc()
            return error_response(400, str(exc), param=exc.param, code="invalid_request")
        try:
            slot = await self.gov.queue.admit(priority, info.kv_tokens, info.prompt_tokens)
        except Rejected as rej:
            m.rejections.labels(priority, rej.reason).inc()
            m.requests.labels(priority, "rejected").inc()
            return error_response(
                rej.status, rej.message, code=rej.reason, retry_after_s=rej.retry_after_s
            )
        try:
            m.queue_wait_s.labels(priority).observe(time.monotonic() - t0)
            m.prompt_tokens.inc(info.prompt_tokens)
            return await self._forward(request, raw, info, priority, t0)
        finally:
            slot.release()

    async def _forward(
        self, request: web.Request, raw: bytes, info: RequestInfo, priority: str, t0: float
    ) -> web.StreamResponse:
        m = self.gov.metrics
        assert self.session is not None
        url = self.upstream + request.rel_url.raw_path_qs
        try:
            async with asyncio.timeout(self.settings.headers_timeout_s):
                up = await self.session.post(
                    url, data=raw, headers=_forward_headers(request.headers)
                )
        except asyncio.CancelledError:
            m.requests.labels(priority, "cancelled").inc()
            raise
        except TimeoutError:
            m.requests.labels(priority, "upstream_error").inc()
            return error_response(504, "upstream did not answer in time", code="upstream_timeout")
        except aiohttp.ClientConnectorError as exc:
            m.requests.labels(priority, "upstream_error").inc()
            return error_response(503, f"upstream unavailable: {exc}", code="upstream_unavailable")
        except aiohttp.ClientError as exc:
            m.requests.labels(priority, "upstream_error").inc()
            return error_response(502, f"upstream error: {exc}", code="upstream_error")
        async with up:
            ctype = up.headers.get("Content-Type", "")
            if info.stream and up.status == 200 and ctype.startswith("text/event-stream"):
                return await self._relay_stream(request, up, priority, t0)
            return await self._relay_body(up, priority, t0)

    async def _relay_body(
        self, up: aiohttp.ClientResponse, priority: str, t0: float
    ) -> web.StreamResponse:
        m = self.gov.metrics
        try:
            body = await up.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            m.requests.labels(priority, "upstream_error").inc()
            return error_response(
                502, f"upstream failed while answering: {exc}", code="upstream_error"
            )
        now = time.monotonic()
        if up.status == 200:
            tokens = None
            with contextlib.suppress(ValueError, KeyError, TypeError):
                tokens = int(json.loads(body)["usage"]["completion_tokens"])
            self._record(priority, t0, first_s=now, last_s=now, tokens=tokens, ok=True)
        else:
            m.requests.labels(priority, "upstream_error").inc()
        return web.Response(body=body, status=up.status, headers=_forward_headers(up.headers))

    async def _relay_stream(
        self, request: web.Request, up: aiohttp.ClientResponse, priority: str, t0: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, headers=_forward_headers(up.headers))
        await resp.prepare(request)
        first_s: float | None = None
        events = 0
        tail = b""
        ok = False
        try:
            async with asyncio.timeout(None) as idle:
                loop = asyncio.get_running_loop()
                async for chunk in up.content.iter_any():
                    idle.reschedule(loop.time() + self.settings.read_timeout_s)
                    if first_s is None:
                        first_s = time.monotonic()
                    n = chunk.count(b"data: ")
                    events += n
                    self.gov.output_tokens_total += n
                    tail = (tail + chunk)[-4096:]
                    await resp.write(chunk)
            ok = True
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
            log.warning("upstream stream failed: %s", exc)
            self.gov.metrics.requests.labels(priority, "upstream_error").inc()
            with contextlib.suppress(ConnectionError):
                await resp.write(sse_error_event(502, f"upstream failed mid-stream: {exc}"))
        except (ConnectionError, asyncio.CancelledError):
            self.gov.metrics.requests.labels(priority, "cancelled").inc()
            raise
        if ok:
            tokens = _usage_completion_tokens(tail)
            if tokens is not None:
                self.gov.output_tokens_total += tokens - events
            else:
                tokens = max(events - 2, 0)  # the role event and [DONE] carry no token
            now = time.monotonic()
            self._record(priority, t0, first_s=first_s or now, last_s=now, tokens=tokens, ok=True)
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        return resp

    def _record(
        self,
        priority: str,
        t0: float,
        *,
        first_s: float,
        last_s: float,
        tokens: int | None,
        ok: bool,
    ) -> None:
        m = self.gov.metrics
        ttft_s = first_s - t0
        tpot_s = (
            (last_s - first_s) / (tokens - 1)
            if tokens and tokens > 1 and last_s > first_s
            else None
        )
        m.requests.labels(priority, "ok" if ok else "upstream_error").inc()
        m.ttft_s.labels(priority).observe(ttft_s)
        m.e2e_s.labels(priority).observe(last_s - t0)
        if tpot_s is not None:
            m.tpot_s.labels(priority).observe(tpot_s)
        if tokens:
            m.output_tokens.labels(priority).inc(tokens)
        self.gov.latency.record(last_s, priority, ttft_s, tpot_s)

    # -- pass-through and operator routes -----------------------------------------------------

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        url = self.upstream + request.rel_url.raw_path_qs
        try:
            raw = await request.read()
            async with self.session.request(
                request.method, url, data=raw or None, headers=_forward_headers(request.headers)
            ) as up:
                body = await up.read()
                return web.Response(
                    body=body, status=up.status, headers=_forward_headers(up.headers)
                )
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, "request body too large", code="too_large")
        except aiohttp.ClientConnectorError as exc:
            return error_response(503, f"upstream unavailable: {exc}", code="upstream_unavailable")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, f"upstream error: {exc}", code="upstream_error")

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.gov.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when the control loop runs, admission is open and the upstream answers."""
        problems = []
        if self.gov.last is None:
            problems.append("control loop has not ticked yet")
        if self.gov.queue.draining:
            problems.append("draining")
        assert self.session is not None
        try:
            async with asyncio.timeout(2.0), self.session.get(self.upstream + "/health") as up:
                if up.status != 200:
                    problems.append(f"upstream health answered {up.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            problems.append(f"upstream unreachable: {exc or type(exc).__name__}")
        status = 503 if problems else 200
        return web.json_response({"ready": not problems, "problems": problems}, status=status)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.gov.status())

    async def history(self, request: web.Request) -> web.Response:
        """The control trace since `since_s` (monotonic), as columns: for plots and bench."""
        try:
            since = float(request.query.get("since_s", "-inf"))
        except ValueError:
            return error_response(400, "since_s must be a number", param="since_s")
        rows = [r for r in self.gov.history if r.t_s > since]
        cols = (
            "t_s",
            "power_w",
            "raw_w",
            "predicted_upper_w",
            "target_w",
            "limit_requests",
            "limit_kv_tokens",
            "prefill_tok_s",
            "in_flight",
            "kv_in_flight",
            "queued",
            "binding",
            "state",
        )
        return web.json_response({c: [getattr(r, c) for r in rows] for c in cols})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"no route {request.method} {request.path}", code="not_found")


def create_app(
    gov: Governor, settings: ProxySettings, *, session: aiohttp.ClientSession | None = None
) -> web.Application:
    """The proxy as an aiohttp application; run it with handler_cancellation=True."""
    app = web.Application(client_max_size=settings.max_body_bytes)
    h = ProxyHandlers(gov, settings)
    app[GOVERNOR] = gov

    async def lifecycle(app: web.Application) -> Any:
        own = session is None
        h.session = session or aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=settings.connect_timeout_s,
                sock_read=settings.read_timeout_s,
            ),
            auto_decompress=False,
        )
        await gov.start()
        yield
        await gov.stop()
        if own:
            await h.session.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_route("*", "/v1/{tail:.*}", h.passthrough)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ready", h.ready)
    app.router.add_get("/status", h.status)
    app.router.add_get("/status/history", h.history)
    app.router.add_route("*", "/{tail:.*}", h.not_found)
    return app
