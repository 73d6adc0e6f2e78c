"""An OpenAI-compatible HTTP front for `SimEngine`, shaped like vLLM's API server.

It answers what a proxy and a benchmark touch: chat and text completions (streaming in vLLM's SSE
format), embeddings (prefill-only jobs), the Responses, Messages, chat-batch and audio APIs
(powerbatch.sim.apis), /v1/models, /health, /metrics with vLLM's names (vLLM
docs, "Production Metrics"; V1 engine: vllm/v1/metrics/loggers.py) and dcgm-exporter's
(NVIDIA/dcgm-exporter, etc/default-counters.csv), /sim/* admin routes for the power limit and the
step trace, and the zeusd daemon's GPU API (powerbatch.sim.zeusd_api) for per-GPU limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from powerbatch.errors import PowerLimitError, RequestError
from powerbatch.sim.apis import add_api_routes, next_event_at
from powerbatch.sim.engine import (
    EngineStopped,
    QueueFull,
    RequestTooLarge,
    SimEngine,
    SimRequest,
    StepRecord,
)
from powerbatch.sim.zeusd_api import (
    DEFAULT_APPLY_DELAY_S,
    add_zeusd_routes,
    sim_gpu_pci_bus_id,
    sim_gpu_uuid,
)
from powerbatch.telemetry.trace import TraceRow, write_trace

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "SimServer",
    "create_sim_app",
    "dump_trace_csv",
    "run_sim_server",
    "start_sim_server",
    "trace_rows",
]

DEFAULT_MAX_TOKENS = 256
_log = logging.getLogger("powerbatch.sim")
ENGINE_KEY = web.AppKey("sim_engine", SimEngine)
_WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " sed", " do", " magna")
_TRACE_FIELDS = tuple(f.name for f in fields(StepRecord))


def _filler(start: int, end: int) -> str:
    """Text for output tokens [start, end): one short word per token, cheap to make."""
    n = len(_WORDS)
    return "".join(_WORDS[i % n] for i in range(start, end))


class ApiError(RequestError):
    """An error answered in OpenAI's JSON shape, as vLLM's OpenAI-compatible server answers
    (its ErrorResponse): {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)


# ---- request parsing -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Parsed:
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


def _count_tokens(text: str) -> int:
    """About four characters per token: good enough for load shape, needs no tokenizer."""
    return max(1, len(text) // 4)


def _chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ApiError(400, "each message must be an object", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
        elif content is not None:
            raise ApiError(400, "message content must be a string or a list", param="messages")
    return _count_tokens("".join(parts))


def _completion_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _count_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return len(prompt)
        if len(prompt) == 1:
            (only,) = prompt
            if isinstance(only, str):
                return _count_tokens(only)
            if isinstance(only, list) and only and all(isinstance(x, int) for x in only):
                return len(only)
        raise ApiError(400, "batched prompts are not supported by the simulator", param="prompt")
    raise ApiError(
        400, "'prompt' must be a string, a token list, or a one-item list", param="prompt"
    )


def _check_model(body: Any, model_name: str) -> None:
    """A JSON object, for this model if it names one."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"The model `{model}` does not exist.", param="model", err_type="NotFoundError"
        )


def _parse(body: Any, *, chat: bool, model_name: str, max_model_len: int) -> _Parsed:
    _check_model(body, model_name)
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    prompt_tokens = _chat_prompt_tokens(body) if chat else _completion_prompt_tokens(body)
    param = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, f"'{param}' must be a positive integer", param=param)
    if prompt_tokens >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, your prompt has {prompt_tokens} tokens.",
            param="messages" if chat else "prompt",
        )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    return _Parsed(
        prompt_tokens=prompt_tokens,
        max_tokens=min(max_tokens, max_model_len - prompt_tokens),
        stream=stream,
        include_usage=include_usage,
    )


EMBEDDING_DIM = 8


def _embedding_inputs(body: Any, *, model_name: str, max_model_len: int) -> list[int]:
    """Prompt tokens of each input of an embeddings request (vLLM's /v1/embeddings shapes)."""
    _check_model(body, model_name)
    fmt = body.get("encoding_format", "float")
    if fmt != "float":
        raise ApiError(400, "the simulator only answers encoding_format 'float'", param="input")
    value = body.get("input")
    items: list[Any]
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(x, int) for x in value)
    ):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise ApiError(
            400, "'input' must be a string, token ids, or a non-empty list", param="input"
        )
    sizes = []
    for item in items:
        if isinstance(item, str):
            sizes.append(_count_tokens(item))
        elif isinstance(item, list) and item and all(isinstance(x, int) for x in item):
            sizes.append(len(item))
        else:
            raise ApiError(400, "each input must be a string or a list of token ids", param="input")
        if sizes[-1] > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, your input has {sizes[-1]} tokens.",
                param="input",
            )
    return sizes


def _embedding(seed: int) -> list[float]:
    """A unit vector that depends on its input's size only: cheap, and the same every run."""
    raw = [math.sin(seed * (i + 1) + i) for i in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc


# ---- completions -----------------------------------------------------------------------------


def _usage(*reqs: SimRequest) -> dict[str, int]:
    prompt, out = sum(r.prompt_tokens for r in reqs), sum(r.num_output for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


def _completion(model_name: str, reqs: list[SimRequest], *, chat: bool) -> dict[str, Any]:
    """A whole (chat) completion, one choice per finished request."""
    choices = []
    for i, req in enumerate(reqs):
        text = _filler(0, req.num_output)
        out = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        end = {"logprobs": None, "finish_reason": "length", "stop_reason": None}
        choices.append({"index": i, **out, **end})
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(*reqs),
    }


async def _event_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _Handlers:
    def __init__(
        self, engine: SimEngine, model_name: str, stream_interval_tokens: int, max_model_len: int
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.interval = stream_interval_tokens
        self.max_model_len = max_model_len

    def _submit(self, prompt_tokens: int, max_tokens: int, pooling: bool = False) -> SimRequest:
        try:
            return self.engine.add_request(prompt_tokens, max_tokens, pooling=pooling)
        except (QueueFull, EngineStopped) as exc:
            raise ApiError(503, str(exc), err_type="ServiceUnavailableError") from exc
        except RequestTooLarge as exc:
            raise ApiError(400, str(exc)) from exc

    @staticmethod
    async def _finish(req: SimRequest, tokens: int, reason: str) -> None:
        """Wait for `tokens` outputs; a 503 if the engine stops, a 500 for another ending."""
        try:
            await req.wait_tokens(tokens)
        except EngineStopped as exc:
            raise ApiError(503, str(exc), err_type="ServiceUnavailableError") from exc
        if req.finish_reason != reason:
            raise ApiError(
                500, f"request ended early: {req.finish_reason}", err_type="InternalError"
            )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        parsed = _parse(
            await _json_body(request),
            chat=chat,
            model_name=self.model_name,
            max_model_len=self.max_model_len,
        )
        req = self._submit(parsed.prompt_tokens, parsed.max_tokens)
        try:
            if parsed.stream:
                return await self._stream(request, req, parsed, chat=chat)
            return await self._whole(req, chat=chat)
        finally:
            if not req.finished:  # client went away (cancelled handler or failed write)
                self.engine.abort(req)

    async def _whole(self, req: SimRequest, *, chat: bool) -> web.StreamResponse:
        await self._finish(req, req.max_tokens, "length")
        return web.json_response(_completion(self.model_name, [req], chat=chat))

    async def _stream(
        self, request: web.Request, req: SimRequest, parsed: _Parsed, *, chat: bool
    ) -> web.StreamResponse:
        resp = await _event_stream(request)
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        head = {"id": rid, "object": obj, "created": created, "model": self.model_name}

        def chunk(text: str, finish: str | None) -> bytes:
            out = {"delta": {"content": text}} if chat else {"text": text}
            choice = {"index": 0, **out, "logprobs": None, "finish_reason": finish}
            return _sse({**head, "choices": [choice]})

        with contextlib.suppress(ConnectionResetError):
            sent = 0
            try:
                while True:
                    n = await req.wait_tokens(next_event_at(sent, self.interval))
                    if req.finish_reason not in (None, "length"):
                        raise EngineStopped(f"request ended early: {req.finish_reason}")
                    if sent == 0 and chat:  # vLLM sends the role once the first output exists
                        role = {"role": "assistant", "content": ""}
                        first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
                        await resp.write(_sse({**head, "choices": [first]}))
                    done = req.finished
                    await resp.write(chunk(_filler(sent, n), "length" if done else None))
                    sent = n
                    if done:
                        break
            except EngineStopped as exc:
                error = ApiError(500, str(exc), err_type="InternalError").body()
                await resp.write(_sse(error))
            else:
                if parsed.include_usage:
                    await resp.write(_sse({**head, "choices": [], "usage": _usage(req)}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """A prefill-only job per input, as vLLM runs a pooling model: it holds KV and draws
        prefill power while it runs, and produces no output tokens."""
        sizes = _embedding_inputs(
            await _json_body(request), model_name=self.model_name, max_model_len=self.max_model_len
        )
        reqs: list[SimRequest] = []
        try:
            for n in sizes:
                reqs.append(self._submit(n, 0, pooling=True))
            for req in reqs:
                await self._finish(req, 1, "stop")
        finally:
            for req in reqs:
                if not req.finished:  # the client went away
                    self.engine.abort(req)
        tokens = sum(sizes)
        return web.json_response(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": [
                    {"index": i, "object": "embedding", "embedding": _embedding(n)}
                    for i, n in enumerate(sizes)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    # ---- plain routes --------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "powerbatch-sim",
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    # ---- admin ---------------------------------------------------------------------------

    async def get_power_limit(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"power_limit_w": self.engine.power_limit_w, "tdp_w": self.engine.profile.tdp_w}
        )

    async def set_power_limit(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        value = body.get("power_limit_w") if isinstance(body, dict) else None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ApiError(400, "'power_limit_w' must be a number", param="power_limit_w")
        try:
            self.engine.power_limit_w = float(value)
        except PowerLimitError as exc:
            raise ApiError(400, str(exc), param="power_limit_w") from exc
        return await self.get_power_limit(request)

    async def trace(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("since_s", "-inf")
        try:
            since_s = float(raw)
        except ValueError as exc:
            raise ApiError(400, f"'since_s' is not a number: {raw!r}", param="since_s") from exc
        if math.isnan(since_s):
            raise ApiError(400, "'since_s' is NaN", param="since_s")
        columns: dict[str, list[float]] = {name: [] for name in _TRACE_FIELDS}
        appends = [columns[name].append for name in _TRACE_FIELDS]
        for rec in self.engine.trace_since(since_s):
            for append, name in zip(appends, _TRACE_FIELDS, strict=True):
                append(getattr(rec, name))
        return web.json_response(columns)

    async def state(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.engine.snapshot())


# ---- metrics ---------------------------------------------------------------------------------


class _SimCollector(Collector):
    """Reads the engine at scrape time, so a scrape costs nothing between.

    vLLM's metrics are current at each scrape. dcgm-exporter's are not: it collects its fields
    every `--collect-interval` (NVIDIA/dcgm-exporter; operators set 1 s, the default is 30 s)
    and serves the last collection in between. `dcgm_interval_s` > 0 does the same here: the
    GPU fields are collected on a fixed grid of that period and held, so a reader sees a value
    up to one period old that changes once a period. 0 collects at every scrape.

    `dcgm_lag_s` > 0 serves the newest collection at least that old, as a meter that runs
    behind (a slow scrape chain or a remote exporter) does.
    """

    def __init__(
        self,
        engine: SimEngine,
        model_name: str,
        hostname: str,
        dcgm_interval_s: float = 0.0,
        dcgm_lag_s: float = 0.0,
    ) -> None:
        if dcgm_interval_s < 0 or not math.isfinite(dcgm_interval_s):
            raise ValueError(f"dcgm_interval_s must be >= 0, got {dcgm_interval_s}")
        if dcgm_lag_s < 0 or not math.isfinite(dcgm_lag_s):
            raise ValueError(f"dcgm_lag_s must be >= 0, got {dcgm_lag_s}")
        self.engine = engine
        self.model_name = model_name
        self.hostname = hostname
        self.dcgm_interval_s = dcgm_interval_s
        self.dcgm_lag_s = dcgm_lag_s
        self._collected: tuple[int, list[Metric]] | None = None
        self._past: deque[tuple[float, list[Metric]]] = deque()

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        labels = ["model_name"]
        value = [self.model_name]
        for name, doc, v in (
            ("vllm:num_requests_running", "Requests in the running batch.", e.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", e.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, float(v))
            yield g
        for name, doc, v in (
            ("vllm:prompt_tokens", "Prefill tokens processed.", e.prompt_tokens_total),
            ("vllm:generation_tokens", "Generated tokens.", e.generation_tokens_total),
            ("vllm:num_preemptions", "Cumulative preemptions.", e.preemptions_total),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)  # exposed as <name>_total
            c.add_metric(value, float(v))
            yield c
        # Histograms as sum and count (one +Inf bucket): what the proxy reads of them.
        for name, doc, count, total_s in (
            ("vllm:time_to_first_token_seconds", "Time to first token.",
             e.requests_started_total, e.ttft_total_s),
            ("vllm:inter_token_latency_seconds", "Inter-token latency.",
             e.itl_count, e.itl_total_s),
            ("vllm:request_decode_time_seconds", "Request decode time.",
             e.decode_count, e.decode_total_s),
        ):  # fmt: skip
            h = HistogramMetricFamily(name, doc, labels=labels)
            h.add_metric(value, [("+Inf", float(count))], total_s)
            yield h

        yield from self._gpu_fields()

    def _gpu_fields(self) -> list[Metric]:
        if self.dcgm_lag_s > 0:
            return self._lagged_gpu_fields()
        period = self.dcgm_interval_s
        if period <= 0:
            return self._collect_gpu_fields()
        slot = math.floor(time.monotonic() / period)
        if self._collected is None or self._collected[0] != slot:
            self._collected = (slot, self._collect_gpu_fields())
        return self._collected[1]

    def _lagged_gpu_fields(self) -> list[Metric]:
        """Collect as without a lag, keep the collections, serve the newest one `dcgm_lag_s`
        old (the oldest kept until one is)."""
        now = time.monotonic()
        period = self.dcgm_interval_s
        t = math.floor(now / period) * period if period > 0 else now
        if not self._past or self._past[-1][0] != t:
            self._past.append((t, self._collect_gpu_fields()))
        while len(self._past) > 1 and self._past[1][0] <= now - self.dcgm_lag_s:
            self._past.popleft()
        return self._past[0][1]

    def _collect_gpu_fields(self) -> list[Metric]:
        e = self.engine
        profile = e.profile
        n = profile.num_gpus
        gpu_labels = ["gpu", "UUID", "pci_bus_id", "modelName", "Hostname"]
        per_gpu = [
            [str(i), sim_gpu_uuid(i), sim_gpu_pci_bus_id(i), profile.gpu_model_name, self.hostname]
            for i in range(n)
        ]
        instant = e.instant_power_per_gpu_w()
        even = not profile.gpu_power_shares and profile.noise_tau_s <= 0
        avg_w = [e.average_power_w() / n] * n if even else e.mean_power_per_gpu_w()
        if profile.gpu_power_shares:
            energy_mj = [e.energy_j() * 1000.0 * s for s in profile.shares()]
        else:
            energy_mj = [e.energy_j() * 1000.0 / n] * n
        fields = (
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W), 1-second average.", avg_w),
            ("DCGM_FI_DEV_POWER_USAGE_INSTANT", "Instant power draw (in W).", instant),
            (
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                "Total energy consumption since start (in mJ).",
                energy_mj,
            ),
            (
                "DCGM_FI_DEV_POWER_MGMT_LIMIT",
                "Power management limit (in W).",
                e.gpu_power_limits_w,
            ),
            # The set steps in lockstep: one clock for all.
            ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", [e.sm_clock_mhz()] * n),
        )
        out: list[Metric] = []
        for name, doc, values in fields:
            family = GaugeMetricFamily(name, doc, labels=gpu_labels)
            for lab, value in zip(per_gpu, values, strict=True):
                family.add_metric(lab, value)
            out.append(family)
        return out


# ---- app -------------------------------------------------------------------------------------


def create_sim_app(
    engine: SimEngine,
    *,
    model_name: str = "sim-llama",
    stream_interval_tokens: int = 1,
    max_model_len: int = 8192,
    hostname: str = "powerbatch-sim",
    zeusd_token: str | None = None,
    zeusd_apply_delay_s: float = DEFAULT_APPLY_DELAY_S,
    dcgm_interval_s: float = 0.0,
    dcgm_lag_s: float = 0.0,
) -> web.Application:
    """The app starts the engine on start-up and stops it on clean-up.

    It also serves zeusd's GPU API (powerbatch.sim.zeusd_api), behind `zeusd_token` if given.
    `dcgm_interval_s` > 0 holds the dcgm-exporter fields for that period, as an exporter does;
    `dcgm_lag_s` > 0 serves them that much late.
    """
    if stream_interval_tokens < 1:
        raise ValueError("stream_interval_tokens must be >= 1")
    if max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    h = _Handlers(engine, model_name, stream_interval_tokens, max_model_len)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SimCollector(engine, model_name, hostname, dcgm_interval_s, dcgm_lag_s))

    async def metrics(request: web.Request) -> web.StreamResponse:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def on_startup(app: web.Application) -> None:
        await engine.start()

    async def on_cleanup(app: web.Application) -> None:
        await engine.stop()

    app = web.Application(middlewares=[_error_middleware])
    app[ENGINE_KEY] = engine
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/embeddings", h.embeddings)
    add_api_routes(app, h)  # responses, messages, the chat batch, audio
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/power_limit", h.get_power_limit)
    app.router.add_post("/sim/power_limit", h.set_power_limit)
    app.router.add_get("/sim/trace", h.trace)
    app.router.add_get("/sim/state", h.state)
    add_zeusd_routes(app, engine, token=zeusd_token, apply_delay_s=zeusd_apply_delay_s)
    return app


@dataclass
class SimServer:
    """A simulator listening on a TCP port; `close()` stops the server and the engine."""

    engine: SimEngine
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_sim_server(
    engine: SimEngine, host: str = "127.0.0.1", port: int = 0, **app_kwargs: Any
) -> SimServer:
    """Serve `engine` on host:port (0 picks a free port; read it from the result).

    Handler cancellation is on so a client that hangs up on a non-streaming request frees its slot.
    """
    app = create_sim_app(engine, **app_kwargs)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1]) if runner.addresses else port
    return SimServer(engine=engine, runner=runner, host=host, port=bound)


async def run_sim_server(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str = "sim-llama",
    stream_interval_tokens: int = 1,
    max_model_len: int = 8192,
    zeusd_token: str | None = None,
    dcgm_interval_s: float = 0.0,
    dcgm_lag_s: float = 0.0,
    locked_clocks_mhz: tuple[int, int] | None = None,
    **engine_kwargs: Any,
) -> None:
    """Build an engine from `engine_kwargs` (see SimEngine) and serve until cancelled;
    `locked_clocks_mhz` locks every GPU's SM clock first, as `nvidia-smi -lgc` would."""
    engine = SimEngine(**engine_kwargs)
    if locked_clocks_mhz is not None:
        for gpu in range(engine.profile.num_gpus):
            engine.set_gpu_locked_clocks(gpu, *locked_clocks_mhz)
    server = await start_sim_server(
        engine,
        host,
        port,
        model_name=model_name,
        stream_interval_tokens=stream_interval_tokens,
        max_model_len=max_model_len,
        zeusd_token=zeusd_token,
        dcgm_interval_s=dcgm_interval_s,
        dcgm_lag_s=dcgm_lag_s,
    )
    # The operator's (and a script's) sign that the port is open; with port 0, the port chosen.
    _log.info("powerbatch sim listening on %s (model %s)", server.url, model_name)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


# ---- trace export ----------------------------------------------------------------------------


def trace_rows(engine: SimEngine, since_s: float = -math.inf) -> Iterator[TraceRow]:
    """The step trace as TraceRows stamped at each step's end, when its power and energy are known.

    Rates are tokens over the step's duration; zero-length steps are skipped.
    """
    for rec in engine.trace_since(since_s):
        if rec.step_s <= 0.0:
            continue
        yield TraceRow(
            t_s=rec.t_s + rec.step_s,
            power_w=rec.power_w,
            energy_j=rec.energy_j,
            requests_in_flight=float(rec.running),
            kv_tokens_in_flight=float(rec.kv_tokens),
            prefill_tok_s=rec.prefill_tokens / rec.step_s,
            decode_tok_s=rec.decode_tokens / rec.step_s,
            queued=float(rec.waiting),
        )


def dump_trace_csv(engine: SimEngine, path: str | Path, since_s: float = -math.inf) -> int:
    """Write the step trace with powerbatch.telemetry.trace.write_trace; return the row count."""
    return write_trace(path, trace_rows(engine, since_s))
