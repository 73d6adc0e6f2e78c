"""The aiohttp reverse proxy: GPU routes through admission, everything else passed through.

Every generating route of vLLM's goes through admission, each answered in its own API's shape
(powerbatch.proxy.dialects); a POST under /v1 that powerbatch does not know is refused in
enforce mode unless the `pass_routes` setting names it, since it may generate unseen.

The hot path reads the body once, parses only what the decision needs, waits for a slot, and
relays the upstream's bytes as they come (SSE chunk by chunk, never buffered whole). The slot is
released in a `finally`, so a client that disconnects, an upstream that fails or a bug all free it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from powerbatch.admission import DEFAULT_PRIORITY, PRIORITIES, Rejected, parse_priority
from powerbatch.control.clock import Boost
from powerbatch.control.config import Mode
from powerbatch.energy.attribution import Labels, RequestEnergy
from powerbatch.energy.labels import ANONYMOUS, OTHER, Bounded
from powerbatch.energy.usage import (
    HEADER,
    events_with_energy,
    json_usage,
    split_events,
    usage_event_at,
    usage_int,
    with_energy,
)
from powerbatch.proxy.auth import TENANT, ApiKeys, auth_middleware
from powerbatch.proxy.dialects import ANTHROPIC, OPENAI, RESPONSES, Dialect
from powerbatch.proxy.governor import Governor
from powerbatch.proxy.hop import (
    Answer,
    HopClient,
    UpstreamBroken,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from powerbatch.proxy.metrics import ClassSeries
from powerbatch.proxy.parse import (
    BadRequest,
    RequestInfo,
    parse_audio_request,
    parse_chat_batch_request,
    parse_messages_request,
    parse_pooling_request,
    parse_request,
    parse_responses_request,
)
from powerbatch.proxy.settings import ProxySettings

log = logging.getLogger("powerbatch.proxy")
access_log = logging.getLogger("powerbatch.access")

# Hop-by-hop headers (RFC 9110 section 7.6.1), those each hop writes itself, and Expect (the
# proxy has read the body already: a 100 Continue from upstream would mean nothing to anyone).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers"}
    | {"transfer-encoding", "upgrade", "host", "content-length", "expect"}
)
# vLLM's pooling routes (https://docs.vllm.ai/en/stable/serving/online_serving.html): each runs
# a prefill on the GPU and decodes nothing, so each goes through admission like a completion.
# A module constant until settings can name routes.
POOLING_PATHS = (
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
# vLLM routes that touch no GPU: relayed as they are, like every other /v1 route.
METADATA_PATHS = ("/version", "/tokenize", "/detokenize")
# vLLM's generating routes beside chat and completions (vllm/entrypoints/, v0.33.0): the
# Responses API, Anthropic's Messages API, the chat batch and speech to text.
AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
# POST routes under /v1 that vLLM 0.33 serves without generating (they render or count
# tokens, or manage adapters and stored responses): relayed without admission. Any other POST
# under /v1 is refused in enforce mode unless the pass_routes setting names it.
SAFE_POSTS = (
    "/v1/messages/count_tokens",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/responses/*/cancel",
)
# An SSE event ends at a blank line; the relay forwards whole events only (see StreamRelay).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_MAX_PARTIAL_EVENT = 64 * 1024
# Under this many bytes waiting in a client's socket buffer a write cannot wait: asyncio pauses
# a writer only above its transport's high-water mark, 64 KiB unless set otherwise.
_WRITE_NOW_BYTES = 16 * 1024


def _forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


def _event_end(buf: bytes) -> int:
    """Length of the prefix of `buf` that ends with a complete SSE event (0: none yet)."""
    ends = [buf.rfind(sep) + len(sep) for sep in _EVENT_ENDS if sep in buf]
    return max(ends, default=0)


def _upstream_outcome(status: int) -> str:
    """The outcome of a non-200 upstream answer.

    A 4xx is the upstream refusing this request (unknown model, `n` it does not support): the
    client's mistake relayed, which an alert on upstream failures must not page for. RFC 9110
    section 15.5 puts every 4xx on the client's side.
    """
    return "upstream_client_error" if 400 <= status < 500 else "upstream_error"


def _is_json_error(body: bytes) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except (ValueError, RecursionError):
        return False


async def read_body(
    request: web.Request, settings: ProxySettings, dialect: Dialect = OPENAI
) -> bytes | web.Response:
    """The body, or the answer to give: 413 over the limit, 408 if it trickles in (either
    closes the connection: the rest of the body may never come, so nothing waits for it)."""
    try:
        if request.content.is_eof():  # all of it is here already: no timer to arm
            return await request.read()
        async with asyncio.timeout(settings.client_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        msg = f"request body over {settings.max_body_bytes} bytes"
        resp = dialect.error(413, msg, code="too_large")
    except TimeoutError:
        msg = f"request body not received within {settings.client_timeout_s:g} s"
        resp = dialect.error(408, msg, code="client_timeout")
    resp.force_close()
    return resp


class Upstream:
    """The configured upstream: where a request goes, the headers it takes, and the answer to
    give when it cannot be reached, does not answer or breaks off (one mapping for every route)."""

    def __init__(self, settings: ProxySettings, *, client_keys: bool) -> None:
        self.settings = settings
        key = settings.upstream_api_key
        # With client keys on, the client's Authorization is the proxy's key: it is not passed on.
        self.drop = (
            _HOP_BY_HOP | {"authorization"} if key is not None or client_keys else _HOP_BY_HOP
        )
        self.auth = f"Bearer {key}" if key is not None else None
        self.client = HopClient(
            settings.upstream_url,
            connect_timeout_s=settings.connect_timeout_s,
            headers_timeout_s=settings.headers_timeout_s,
            read_timeout_s=settings.read_timeout_s,
        )

    def headers(self, request: web.Request) -> list[tuple[str, str]]:
        """The client's headers, less hop-by-hop ones, with the upstream's key put in if set."""
        out = [(k, v) for k, v in request.headers.items() if k.lower() not in self.drop]
        if self.auth is not None:
            out.append(("Authorization", self.auth))
        return out

    async def send(
        self, request: web.Request, raw: bytes, dialect: Dialect = OPENAI
    ) -> Answer | web.Response:
        """The upstream's response once its headers are in, or the answer to give instead: 504
        past headers_timeout_s, 503 when it cannot be reached, 502 on any other failure.

        Only ever to the configured upstream: the path comes from the request's origin form,
        and an absolute-URI target or a Host header names nothing here (Host is not forwarded
        either), so the proxy is no open relay.
        """
        try:
            return await self.client.request(
                request.method, request.rel_url.raw_path_qs, self.headers(request), raw
            )
        except UpstreamTimeout:
            msg = f"upstream did not answer within {self.settings.headers_timeout_s:g} s"
            return dialect.error(504, msg, code="upstream_timeout")
        except UpstreamUnreachable as exc:
            return dialect.error(503, f"upstream unavailable: {exc}", code="upstream_unavailable")
        except UpstreamBroken as exc:
            return dialect.error(502, f"upstream error: {exc}", code="upstream_error")

    async def read(self, up: Answer, dialect: Dialect = OPENAI) -> bytes | web.Response:
        """The whole body, or a 502 when the upstream breaks off or is silent for read_timeout_s."""
        if up.complete:  # all of it is here already: no timer to arm
            return up.body()
        parts: list[bytes] = []
        try:
            while (part := await up.chunk()) is not None:
                parts.append(part)
            return b"".join(parts)
        except UpstreamBroken as exc:
            msg = f"upstream failed while answering: {exc}"
            return dialect.error(502, msg, code="upstream_error")


class EnergyLabels:
    """The (priority, tenant, model) a request's energy is counted under. Values come from
    configuration, never from what a client sends, so the label sets stay bounded."""

    def __init__(self, settings: ProxySettings, api_keys: ApiKeys | None) -> None:
        keys = api_keys.names() if api_keys is not None else [ANONYMOUS]
        self.settings = settings
        self.tenants = Bounded(settings.tenants or keys)
        self.models = Bounded(settings.models, settings.max_models)

    def __call__(self, request: web.Request, priority: str, model: str) -> Labels:
        return priority, self.tenants(request.get(TENANT, ANONYMOUS)), self.models(model)

    def known(self) -> list[Labels]:
        """The label sets known at start, for series at zero (only with `models` set)."""
        if not self.settings.models:
            return []
        tenants = self.tenants.known() + ([OTHER] if self.settings.tenants else [])
        models = [*self.models.known(), OTHER]
        return [(p, t, m) for p in PRIORITIES for t in tenants for m in models]


@dataclass(slots=True)
class Call:
    """One admitted request on its way upstream: what a relay needs to answer and count it."""

    request: web.Request
    info: RequestInfo
    priority: str
    series: ClassSeries
    t0: float
    rec: RequestEnergy
    generates: bool
    dialect: Dialect = OPENAI
    boost: Boost | None = None  # the prefill at the top clock, ended by the first token


class Accounting:
    """What an answered request leaves: its outcome `ok`, latencies, tokens and access line."""

    def __init__(self, gov: Governor, settings: ProxySettings) -> None:
        self.gov = gov
        self.access_log = settings.access_log

    def ok(self, call: Call, *, first_s: float | None, last_s: float, tokens: int | None) -> None:
        """`first_s` None: a whole answer, whose first token the proxy never saw. Its end is
        no first token: counted as one, a 500-token answer's 15 s read as a TTFT far over its
        SLO, and the laws that guard the first token (the SM clock's, the fleet bid's risk)
        held the top clock and bid at risk on loads whose streams started in 0.4 s (docs/clock.md,
        stop 53)."""
        s, t0 = call.series, call.t0
        ttft_s = None if first_s is None else first_s - t0
        tpot_s = (
            (last_s - first_s) / (tokens - 1)
            if first_s is not None and tokens and tokens > 1 and last_s > first_s
            else None
        )
        s.outcomes["ok"].inc()
        if ttft_s is not None:
            s.ttft_s.observe(ttft_s)
        s.e2e_s.observe(last_s - t0)
        if tpot_s is not None:
            s.tpot_s.observe(tpot_s)
        if tokens:
            s.output_tokens.inc(tokens)
        self.gov.latency.record(last_s, call.priority, ttft_s, tpot_s)

    def access(
        self, call: Call, prompt: int, completion: int, energy_j: float, e2e_s: float
    ) -> None:
        """One compact line per answered request (setting access_log): no keys, no content."""
        if self.access_log:
            p, t, model = call.rec.labels
            access_log.info(
                "%s %s %d class=%s tenant=%s model=%s prompt=%d completion=%d energy_j=%.3f "
                "e2e_s=%.3f",
                *(call.request.method, call.request.path, 200, p, t, model),
                *(prompt, completion, energy_j, e2e_s),
            )


class BodyRelay:
    """A whole (non-streamed) answer: read, its usage given the request's joules, sent at once."""

    def __init__(self, gov: Governor, settings: ProxySettings, upstream: Upstream, acc: Accounting):
        self.gov = gov
        self.energy_header = settings.energy_header
        self.upstream = upstream
        self.acc = acc

    async def __call__(self, call: Call, up: Answer) -> web.StreamResponse:
        dialect = call.dialect
        body = await self.upstream.read(up, dialect)
        if isinstance(body, web.Response):
            call.series.outcomes["upstream_error"].inc()
            return body
        now = time.monotonic()
        headers = _forward_headers(up.headers)
        if up.status == 200:
            if dialect.openai_usage:
                doc, usage = json_usage(body)
                tokens = usage_int(usage, "completion_tokens")
                prompt = usage_int(usage, "prompt_tokens")
            else:  # relayed as it is: the counts are read off the bytes, nothing is parsed
                doc, usage = None, None
                tokens, prompt = dialect.final_tokens(body), dialect.final_prompt_tokens(body)
            # A whole answer: no first token seen, so no TTFT or TPOT sample (nor output tokens
            # where nothing is generated, as for an embedding).
            self.acc.ok(call, first_s=None, last_s=now, tokens=tokens if call.generates else None)
            prompt = prompt or call.info.prompt_tokens
            energy_j = self.gov.energy.finish(call.rec)
            self.gov.energy.count_tokens(call.rec.labels, prompt, tokens or 0)
            if usage is not None and ("prompt_tokens" in usage or "completion_tokens" in usage):
                # energy_j goes beside OpenAI's token counts only (an audio answer's usage is
                # its duration, and stays as it came)
                body = with_energy(body, doc, usage, energy_j)
            if self.energy_header:
                headers[HEADER] = f"{energy_j:.6f}"
            self.acc.access(call, prompt, tokens or 0, energy_j, now - call.t0)
        else:
            call.series.outcomes[_upstream_outcome(up.status)].inc()
            if up.status >= 500 and not _is_json_error(body):
                # A crashed server or a load balancer in between: say so in the OpenAI shape.
                snippet = body[:200].decode("utf-8", "replace")
                msg = f"upstream answered {up.status}: {snippet}"
                return dialect.error(502, msg, code="upstream_error")
        return web.Response(body=body, status=up.status, headers=headers)


class StreamRelay:
    """Relay SSE as it comes, whole events at a time, byte for byte.

    A partial event is held until its end arrives, so when the upstream dies mid-event the
    client gets a clean error event instead of half an event glued to it. Upstream silence
    (read_timeout_s) and a client that stops reading (client_timeout_s) both end the stream
    and free the slot.
    """

    def __init__(self, gov: Governor, settings: ProxySettings, acc: Accounting) -> None:
        self.gov = gov
        self.write_s = settings.client_timeout_s
        self.acc = acc

    async def __call__(self, call: Call, up: Answer) -> web.StreamResponse:
        request, info, rec, outcomes = call.request, call.info, call.rec, call.series.outcomes
        dialect = call.dialect
        count = dialect.tokens_in
        resp = web.StreamResponse(status=up.status, headers=_forward_headers(up.headers))
        write_s = self.write_s
        first_s: float | None = None
        events = 0
        tail = b""
        pending = b""
        held: bytes | None = None  # the usage chunk on: sent once the energy is known
        write = partial(self._write, request, resp)
        try:
            await resp.prepare(request)  # buffers the headers: they go with the first write
            # up.chunk() raises UpstreamBroken, or UpstreamTimeout past read_timeout_s.
            while (chunk := await up.chunk()) is not None:
                if first_s is None:
                    first_s = time.monotonic()
                    if call.boost is not None:
                        call.boost.end()
                tail = (tail + chunk)[-4096:]
                pending += chunk
                cut = _event_end(pending)
                if cut == 0 and len(pending) <= _MAX_PARTIAL_EVENT:
                    continue
                out, pending = (pending[:cut], pending[cut:]) if cut else (pending, b"")
                n = count(out)
                events += n
                self.gov.output_tokens_total += n
                rec.add(decode_tokens=n)
                if held is not None:
                    held, out = held + out, b""
                elif info.include_usage and b'"usage"' in out:
                    parts = split_events(out)
                    at = usage_event_at(parts)
                    if at is not None:
                        out, held = b"".join(parts[:at]), b"".join(parts[at:])
                if out:
                    await write(out)
            tokens = dialect.final_tokens(tail)
            prompt = dialect.final_prompt_tokens(tail)  # None for OpenAI: its usage is in `held`
            if tokens is not None:
                self.gov.output_tokens_total += tokens - events
            else:  # OpenAI: the role event and [DONE] carry no token
                tokens = max(events - dialect.overhead, 0)
            now = time.monotonic()
            self.acc.ok(call, first_s=first_s or now, last_s=now, tokens=tokens)
            energy_j = self.gov.energy.finish(rec)
            if held is not None:
                pending, prompt = events_with_energy(held + pending, energy_j)
            prompt = prompt or info.prompt_tokens
            self.gov.energy.count_tokens(rec.labels, prompt, tokens)
            if pending:
                await write(pending)
            self.acc.access(call, prompt, tokens, energy_j, now - call.t0)
            async with asyncio.timeout(write_s):
                await resp.write_eof()
        except UpstreamBroken as exc:
            log.warning("upstream stream failed: %s", exc)
            outcomes["upstream_error"].inc()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(write_s):
                    msg = f"upstream failed mid-stream: {exc}"
                    await resp.write(dialect.stream_error(502, msg, "upstream_error", events))
                    await resp.write_eof()
        except TimeoutError:
            # The client stopped reading: drop it rather than hold its slot and buffers.
            log.info("client stopped reading a stream for %g s; dropping it", write_s)
            outcomes["cancelled"].inc()
            if request.transport is not None:
                request.transport.abort()
        except (ConnectionError, asyncio.CancelledError):
            outcomes["cancelled"].inc()
            raise
        return resp

    async def _write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """Write to the client, timed out past client_timeout_s only where the write can wait
        (a timer armed and cancelled per event costs about 6 µs)."""
        t = request.transport
        if t is not None and t.get_write_buffer_size() + len(data) <= _WRITE_NOW_BYTES:
            await resp.write(data)
            return
        async with asyncio.timeout(self.write_s):
            await resp.write(data)


class AdmittedRoute:
    """A GPU route: parse what the decision needs, wait for a slot, relay, free the slot."""

    def __init__(
        self,
        gov: Governor,
        settings: ProxySettings,
        upstream: Upstream,
        labels: EnergyLabels,
        relays: tuple[BodyRelay, StreamRelay],
        parse: Callable[[bytes, str], RequestInfo],
        *,
        generates: bool,
        dialect: Dialect = OPENAI,
    ) -> None:
        self.gov, self.settings, self.upstream, self.labels = gov, settings, upstream, labels
        self.body, self.stream = relays
        self.parse = parse
        self.generates = generates
        self.dialect = dialect

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        m = self.gov.metrics
        errors = self.dialect
        try:
            priority = parse_priority(request.headers.get("x-priority"))
        except ValueError as exc:
            m.by_class[DEFAULT_PRIORITY].outcomes["bad_request"].inc()
            return errors.error(400, str(exc), param="x-priority", code="invalid_priority")
        series = m.by_class[priority]
        raw = await read_body(request, self.settings, errors)
        if isinstance(raw, web.Response):
            series.outcomes["bad_request"].inc()
            return raw
        try:
            info = self.parse(raw, request.headers.get("Content-Type", ""))
        except BadRequest as exc:
            series.outcomes["bad_request"].inc()
            return errors.error(400, str(exc), param=exc.param, code="invalid_request")
        queue = self.gov.queue
        try:
            slot = queue.try_admit(
                priority, info.kv_tokens, info.prompt_tokens, info.requests
            ) or await queue.admit(
                priority, info.kv_tokens, info.prompt_tokens, info.requests, stream=info.stream
            )
        except Rejected as rej:
            m.rejections.labels(priority, rej.reason).inc()
            series.outcomes["rejected"].inc()
            return errors.error(
                rej.status, rej.message, code=rej.reason, retry_after_s=rej.retry_after_s
            )
        # A stream's tokens are seen as they come; a whole answer's are estimated until it ends.
        rec = self.gov.energy.begin(
            self.labels(request, priority, info.model),
            observed=info.stream or not self.generates,
            prefill_tokens=info.prompt_tokens,
        )
        boost = self.gov.prefill_boost(priority) if info.stream and self.generates else None
        try:
            series.queue_wait_s.observe(time.monotonic() - t0)
            m.prompt_tokens.inc(info.prompt_tokens)
            call = Call(request, info, priority, series, t0, rec, self.generates, errors, boost)
            return await self._forward(call, raw)
        finally:
            if boost is not None:
                boost.end()
            slot.release()
            rec.finished = True  # a failed request is charged up to its end at the next tick

    async def _forward(self, call: Call, raw: bytes) -> web.StreamResponse:
        try:
            up = await self.upstream.send(call.request, raw, call.dialect)
        except asyncio.CancelledError:
            call.series.outcomes["cancelled"].inc()
            raise
        if isinstance(up, web.Response):
            call.series.outcomes["upstream_error"].inc()
            return up
        async with up:
            ctype = up.headers.get("Content-Type", "")
            if call.info.stream and up.status == 200 and ctype.startswith("text/event-stream"):
                return await self.stream(call, up)
            return await self.body(call, up)


class PassThrough:
    """Other /v1 routes and vLLM's metadata routes: relayed whole, bounded by the timeouts.

    A POST under /v1 that is neither admitted nor known not to generate (SAFE_POSTS, the
    `pass_routes` setting) is refused with 403 in enforce mode: it may be a generating route
    of a newer vLLM, which would run beside the ceiling unseen.
    """

    def __init__(self, settings: ProxySettings, upstream: Upstream, *, refuse: bool) -> None:
        self.settings = settings
        self.upstream = upstream
        self.refuse = refuse
        globs = (*SAFE_POSTS, *settings.pass_routes)
        # `*` stands for one path segment or part of one, never a `/`: a glob cannot let a
        # path through to a route other than the one it names.
        self.safe = re.compile("|".join(re.escape(g).replace(r"\*", "[^/]*") for g in globs))
        self.logged: set[str] = set()  # routes refused, each logged once (at most 64)

    def refused(self, request: web.Request) -> web.Response | None:
        path = request.path
        if not self.refuse or request.method != "POST" or not path.startswith("/v1/"):
            return None
        if self.safe.fullmatch(path):
            return None
        msg = (
            f"POST {path} is not a route powerbatch admits, and it may generate outside the "
            "power ceiling; name it in the pass_routes setting (POWERBATCH_PASS_ROUTES) to "
            "relay it unadmitted"
        )
        if path not in self.logged and len(self.logged) < 64:
            self.logged.add(path)
            log.warning("refused %s", msg)
        return OPENAI.error(403, msg, code="route_not_admitted")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        refusal = self.refused(request)
        if refusal is not None:
            return refusal
        raw = await read_body(request, self.settings)
        if isinstance(raw, web.Response):
            return raw
        up = await self.upstream.send(request, raw)
        if isinstance(up, web.Response):
            return up
        async with up:
            body = await self.upstream.read(up)
            if isinstance(body, web.Response):
                return body
            return web.Response(body=body, status=up.status, headers=_forward_headers(up.headers))


class OperatorRoutes:
    """Probes, metrics, status and the answers for routes and methods that do not exist."""

    def __init__(self, gov: Governor, upstream: Upstream) -> None:
        self.gov = gov
        self.upstream = upstream

    async def method_not_allowed(self, request: web.Request) -> web.Response:
        msg = f"{request.method} is not allowed on {request.path}; use POST"
        resp = OPENAI.error(405, msg, code="bad_method")
        resp.headers["Allow"] = "POST"
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.gov.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when the control loop runs on a trusted power reading, admission is open and
        the upstream answers; otherwise 503 with the reasons."""
        problems = []
        if self.gov.last is None:
            problems.append("control loop has not ticked yet")
        if not self.gov.ready:
            error = self.gov.monitor.snapshot().error or "no good reading"
            problems.append(f"power sensor not ready: {error}")
        if self.gov.queue.draining:
            problems.append("draining")
        try:
            async with asyncio.timeout(2.0):
                up = await self.upstream.client.request("GET", "/health", ())
            up.close()
            if up.status != 200:
                problems.append(f"upstream health answered {up.status}")
        except (UpstreamUnreachable, UpstreamBroken, TimeoutError) as exc:
            problems.append(f"upstream unreachable: {exc or type(exc).__name__}")
        status = 503 if problems else 200
        body = {"ready": not problems, "reason": "; ".join(problems), "problems": problems}
        return web.json_response(body, status=status)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.gov.status(), dumps=_strict_dumps)

    async def history(self, request: web.Request) -> web.Response:
        """The control trace since `since_s` (monotonic), as columns: for plots and bench."""
        try:
            since = float(request.query.get("since_s", "-inf"))
        except ValueError:
            return OPENAI.error(400, "since_s must be a number", param="since_s")
        return web.json_response(self.gov.loop.history_columns(since), dumps=_strict_dumps)

    async def not_found(self, request: web.Request) -> web.Response:
        return OPENAI.error(404, f"no route {request.method} {request.path}", code="not_found")


def _strict_dumps(obj: Any) -> str:
    """JSON without NaN or Infinity, which strict parsers (and JavaScript) reject."""
    return json.dumps(obj, allow_nan=False)


def create_app(gov: Governor, settings: ProxySettings) -> web.Application:
    """The proxy as an aiohttp application; run it with handler_cancellation=True."""
    keys = ApiKeys.load(settings.api_keys, settings.api_keys_file)
    middlewares = [auth_middleware(keys)] if keys is not None else []
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    upstream = Upstream(settings, client_keys=keys is not None)
    labels = EnergyLabels(settings, keys)
    gov.metrics.energy.seed(labels.known())
    acc = Accounting(gov, settings)
    relays = (BodyRelay(gov, settings, upstream, acc), StreamRelay(gov, settings, acc))
    ops = OperatorRoutes(gov, upstream)

    admitted = partial(AdmittedRoute, gov, settings, upstream, labels, relays)

    def json_only(parse: Callable[[bytes], RequestInfo]) -> Callable[[bytes, str], RequestInfo]:
        return lambda raw, _content_type: parse(raw)

    async def lifecycle(app: web.Application) -> Any:
        await gov.start()
        yield
        await gov.stop()
        upstream.client.close()

    app.cleanup_ctx.append(lifecycle)

    sizes = {
        "default_max_tokens": settings.default_max_tokens,
        "max_tokens_limit": settings.max_tokens_limit,
    }

    def generating(parse: Callable[..., RequestInfo], dialect: Dialect = OPENAI) -> AdmittedRoute:
        return admitted(json_only(partial(parse, **sizes)), generates=True, dialect=dialect)

    messages = partial(parse_messages_request, max_tokens_limit=settings.max_tokens_limit)
    routes = {
        "/v1/chat/completions": generating(partial(parse_request, chat=True)),
        "/v1/completions": generating(partial(parse_request, chat=False)),
        "/v1/chat/completions/batch": generating(parse_chat_batch_request),
        "/v1/responses": generating(parse_responses_request, RESPONSES),
        "/v1/messages": admitted(json_only(messages), generates=True, dialect=ANTHROPIC),
    }
    audio_parse = partial(
        parse_audio_request,
        default_max_tokens=settings.default_max_tokens,
        max_tokens_limit=settings.max_tokens_limit,
    )
    audio = admitted(audio_parse, generates=True)  # multipart: it reads the Content-Type too
    routes.update(dict.fromkeys(AUDIO_PATHS, audio))
    # Decodes nothing, but its prefill draws power: admitted like a completion.
    pooling = admitted(json_only(parse_pooling_request), generates=False)
    routes.update(dict.fromkeys(POOLING_PATHS, pooling))
    for path, handler in routes.items():
        app.router.add_post(path, handler.handle)
        app.router.add_route("*", path, ops.method_not_allowed)
    refuse = gov.controller.config.mode == Mode.ENFORCE
    passthrough = PassThrough(settings, upstream, refuse=refuse)
    for path in (*METADATA_PATHS, "/v1/{tail:.*}"):
        app.router.add_route("*", path, passthrough.handle)
    app.router.add_get("/health", ops.health)
    app.router.add_get("/ready", ops.ready)
    if settings.admin_on_main:
        _add_admin_routes(app, ops)
    app.router.add_route("*", "/{tail:.*}", ops.not_found)
    return app


def _add_admin_routes(app: web.Application, ops: OperatorRoutes) -> None:
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/status", ops.status)
    app.router.add_get("/status/history", ops.history)


def create_admin_app(gov: Governor, settings: ProxySettings) -> web.Application:
    """/metrics, /status and /status/history on their own listener (--admin-port).

    No client keys here: the admin listener is meant for a private address, where Prometheus
    and operators reach it without the clients' credentials. The governor is started by the
    main app; this one only reads it.
    """
    ops = OperatorRoutes(gov, Upstream(settings, client_keys=False))
    app = web.Application()
    _add_admin_routes(app, ops)
    app.router.add_get("/health", ops.health)
    app.router.add_route("*", "/{tail:.*}", ops.not_found)
    return app
