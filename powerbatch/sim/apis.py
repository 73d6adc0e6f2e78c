"""The simulator's other generating APIs, shaped as vLLM 0.33 serves them (vllm/entrypoints/):

* `/v1/responses`: OpenAI's Responses API (openai/responses/), whole or as named SSE events
  from `response.created` to `response.completed` / `response.incomplete`;
* `/v1/messages`: Anthropic's Messages API (anthropic/), its error shape and stream events
  (`message_start` ... `message_stop`);
* `/v1/chat/completions/batch`: N conversations in one request, one choice each
  (openai/chat_completion/batch_serving.py);
* `/v1/audio/transcriptions`, `/v1/audio/translations`: a multipart upload, cut into 30-s
  windows run as one engine request each (speech_to_text/), each a 1,500-token prefill
  (Whisper's encoder, arXiv 2212.04356) and a short decode.

Each runs its work on the same SimEngine as chat, so power and the batch see it.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from powerbatch.sim.engine import EngineStopped, SimRequest

if TYPE_CHECKING:
    from powerbatch.sim.server import _Handlers


def next_event_at(sent: int, interval: int) -> int:
    """Output tokens the next streamed event waits for: the first token at once, then one event
    per `interval` tokens, as vLLM's `--stream-interval` (vllm/v1/engine/output_processor.py:
    "It is the first token, or it has reached the stream interval number of tokens")."""
    return sent + interval if sent else 1


AUDIO_WINDOW_S = 30.0
AUDIO_ENCODER_TOKENS = 1500  # per 30-s window, padded (Whisper)
AUDIO_MAX_DECODE = 448  # Whisper's decoder context
SPEECH_TOKENS_PER_S = 3.0  # about 150 words a minute
COMPRESSED_BYTES_PER_S = 16_000.0  # a 128 kbit/s MP3, for uploads that are not WAV

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _named(event: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with an `event:` line, as vLLM writes the Responses and Messages streams."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for k, v in value.items() if k in ("content", "text", "output"))
    return 0


class SimApis:
    """The handlers; errors raised as the server's ApiError (OpenAI shape) unless a route
    answers in its own (Anthropic's)."""

    def __init__(self, h: _Handlers) -> None:
        from powerbatch.sim import server  # the server module imports this one

        self.h = h
        self.server = server

    # ---- shared ------------------------------------------------------------------------

    def _error(self, status: int, message: str, *, param: str | None = None) -> Exception:
        return self.server.ApiError(status, message, param=param)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await self.server._json_body(request)
        self.server._check_model(body, self.h.model_name)
        return body

    def _max_tokens(self, body: dict[str, Any], key: str, *, required: bool = False) -> int:
        value = body.get(key)
        if value is None and not required:
            return int(self.server.DEFAULT_MAX_TOKENS)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self._error(400, f"'{key}' must be a positive integer", param=key)
        return value

    def _stream_flag(self, body: dict[str, Any]) -> bool:
        stream = body.get("stream", False)
        if stream is None:
            return False
        if not isinstance(stream, bool):
            raise self._error(400, "'stream' must be a boolean", param="stream")
        return stream

    def _submit(self, prompt_tokens: int, max_tokens: int) -> SimRequest:
        limit = self.h.max_model_len
        if prompt_tokens >= limit:
            raise self._error(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, your prompt has {prompt_tokens} tokens.",
            )
        return self.h._submit(prompt_tokens, min(max_tokens, limit - prompt_tokens))

    async def _finish(self, req: SimRequest) -> None:
        await self.h._finish(req, req.max_tokens, "length")

    async def _deltas(self, req: SimRequest, write: Callable[[str], Awaitable[None]]) -> None:
        """Write the output as it is made: the first token, then one delta per
        `stream_interval_tokens`."""
        sent = 0
        while True:
            n = await req.wait_tokens(next_event_at(sent, self.h.interval))
            if req.finish_reason not in (None, "length"):
                raise EngineStopped(f"request ended early: {req.finish_reason}")
            if n > sent:
                await write(self.server._filler(sent, n))
            sent = n
            if req.finished:
                return

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        return await self.server._event_stream(request)

    def _guard(self, reqs: list[SimRequest]) -> contextlib.AbstractContextManager[None]:
        engine = self.h.engine

        @contextlib.contextmanager
        def run() -> Any:
            try:
                yield
            finally:
                for req in reqs:
                    if not req.finished:  # the client went away
                        engine.abort(req)

        return run()

    # ---- /v1/responses -------------------------------------------------------------------

    def _response(
        self, rid: str, created: int, status: str, text: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        if text is not None:
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{rid[5:]}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            )
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "model": self.h.model_name,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "usage": usage,
        }

    @staticmethod
    def _response_usage(req: SimRequest) -> dict[str, Any]:
        return {
            "input_tokens": req.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": req.num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": req.prompt_tokens + req.num_output,
        }

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        value = body.get("input")
        if not isinstance(value, (str, list)) or not value:
            raise self._error(400, "'input' must be a string or a non-empty list", param="input")
        chars = _text_chars(value) + _text_chars(body.get("instructions") or "")
        max_tokens = self._max_tokens(body, "max_output_tokens")
        # vLLM ends a response cut at max_output_tokens as `incomplete`; the simulator always
        # runs to its length, which is the client's limit only where it set one.
        status = "completed" if body.get("max_output_tokens") is None else "incomplete"
        stream = self._stream_flag(body)
        req = self._submit(max(1, chars // 4), max_tokens)
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        with self._guard([req]):
            if not stream:
                await self._finish(req)
                text = self.server._filler(0, req.num_output)
                return web.json_response(
                    self._response(rid, created, status, text, self._response_usage(req))
                )
            return await self._responses_stream(request, req, rid, created, status)

    async def _responses_stream(
        self, request: web.Request, req: SimRequest, rid: str, created: int, status: str
    ) -> web.StreamResponse:
        resp = await self._sse(request)
        seq = 0
        item_id = f"msg_{rid[5:]}"
        parts: list[str] = []

        async def send(event: str, payload: dict[str, Any]) -> None:
            nonlocal seq
            await resp.write(_named(event, {"type": event, "sequence_number": seq, **payload}))
            seq += 1

        async def delta(text: str) -> None:
            parts.append(text)
            ids = {"item_id": item_id, "output_index": 0, "content_index": 0}
            await send("response.output_text.delta", {**ids, "delta": text, "logprobs": []})

        with contextlib.suppress(ConnectionResetError):
            initial = self._response(rid, created, "in_progress", None, None)
            await send("response.created", {"response": initial})
            await send("response.in_progress", {"response": initial})
            item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant"}
            await send(
                "response.output_item.added", {"output_index": 0, "item": {**item, "content": []}}
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            ids = {"item_id": item_id, "output_index": 0, "content_index": 0}
            await send("response.content_part.added", {**ids, "part": empty})
            try:
                await self._deltas(req, delta)
            except EngineStopped as exc:
                await send("error", {"code": "server_error", "message": str(exc), "param": None})
            else:
                text = "".join(parts)
                part = {**empty, "text": text}
                await send("response.output_text.done", {**ids, "text": text, "logprobs": []})
                await send("response.content_part.done", {**ids, "part": part})
                done = {**item, "status": "completed", "content": [part]}
                await send("response.output_item.done", {"output_index": 0, "item": done})
                final = self._response(rid, created, status, text, self._response_usage(req))
                await send(f"response.{status}", {"response": final})
            await resp.write_eof()
        return resp

    # ---- /v1/messages (Anthropic) --------------------------------------------------------

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Errors in Anthropic's shape, with vLLM's status-to-type map
        (anthropic/protocol.py, translate_error_type)."""
        try:
            return await self._messages(request)
        except self.server.ApiError as exc:
            kinds = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}
            kind = kinds.get(
                exc.status, "api_error" if exc.status >= 500 else "invalid_request_error"
            )
            body = {"type": "error", "error": {"type": kind, "message": exc.message}}
            return web.json_response(body, status=exc.status)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise self._error(400, "'messages' must be a non-empty list", param="messages")
        chars = _text_chars(messages) + _text_chars(body.get("system") or "")
        max_tokens = self._max_tokens(body, "max_tokens", required=True)
        stream = self._stream_flag(body)
        req = self._submit(max(1, chars // 4), max_tokens)
        mid = f"msg_{uuid.uuid4().hex}"
        head = {"id": mid, "type": "message", "role": "assistant", "model": self.h.model_name}
        with self._guard([req]):
            if not stream:
                await self._finish(req)
                text = self.server._filler(0, req.num_output)
                usage = {"input_tokens": req.prompt_tokens, "output_tokens": req.num_output}
                return web.json_response(
                    {
                        **head,
                        "content": [{"type": "text", "text": text}],
                        "stop_reason": "max_tokens",
                        "stop_sequence": None,
                        "usage": usage,
                    }
                )
            return await self._messages_stream(request, req, head)

    async def _messages_stream(
        self, request: web.Request, req: SimRequest, head: dict[str, Any]
    ) -> web.StreamResponse:
        resp = await self._sse(request)

        async def send(event: str, payload: dict[str, Any]) -> None:
            await resp.write(_named(event, {"type": event, **payload}))

        async def delta(text: str) -> None:
            await send(
                "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}
            )

        with contextlib.suppress(ConnectionResetError):
            usage0 = {"input_tokens": req.prompt_tokens, "output_tokens": 0}
            message = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
            await send("message_start", {"message": {**message, "usage": usage0}})
            await send(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            )
            try:
                await self._deltas(req, delta)
            except EngineStopped as exc:
                await send("error", {"error": {"type": "api_error", "message": str(exc)}})
            else:
                await send("content_block_stop", {"index": 0})
                usage = {"input_tokens": req.prompt_tokens, "output_tokens": req.num_output}
                stop = {"stop_reason": "max_tokens", "stop_sequence": None}
                await send("message_delta", {"delta": stop, "usage": usage})
                await send("message_stop", {})
            await resp.write_eof()
        return resp

    # ---- /v1/chat/completions/batch ------------------------------------------------------

    async def chat_batch(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if self._stream_flag(body):
            raise self._error(400, "Streaming is not supported for batch requests", param="stream")
        convs = body.get("messages")
        if (
            not isinstance(convs, list)
            or not convs
            or not all(isinstance(c, list) and c for c in convs)
        ):
            raise self._error(
                400, "'messages' must be a non-empty list of conversations", param="messages"
            )
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = self._max_tokens(body, key)
        reqs: list[SimRequest] = []
        with self._guard(reqs):
            for conv in convs:
                reqs.append(self._submit(max(1, _text_chars(conv) // 4), max_tokens))
            for req in reqs:
                await self._finish(req)
        return web.json_response(self.server._completion(self.h.model_name, reqs, chat=True))

    # ---- /v1/audio/* ---------------------------------------------------------------------

    def audio(self, task: str) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._audio(request, task)

        return handle

    async def _audio(self, request: web.Request, task: str) -> web.StreamResponse:
        if not request.content_type.startswith("multipart/form-data"):
            raise self._error(400, "the body must be multipart/form-data", param="file")
        form = await request.post()
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            raise self._error(400, "'file' is required", param="file")
        data = upload.file.read()
        model = form.get("model")
        if isinstance(model, str) and model and model != self.h.model_name:
            raise self.server.ApiError(
                404, f"The model `{model}` does not exist.", param="model", err_type="NotFoundError"
            )
        seconds = _audio_seconds(data)
        windows = max(1, math.ceil(seconds / AUDIO_WINDOW_S))
        cap = AUDIO_MAX_DECODE
        if isinstance(form.get("max_completion_tokens"), str):
            try:
                cap = min(cap, max(1, int(str(form["max_completion_tokens"]))))
            except ValueError:
                raise self._error(
                    400, "'max_completion_tokens' must be an integer", param="max_completion_tokens"
                ) from None
        stream = str(form.get("stream", "false")).lower() in ("true", "1", "yes", "on")
        usage_too = str(form.get("stream_include_usage", "false")).lower() in ("true", "1")
        reqs: list[SimRequest] = []
        with self._guard(reqs):
            for w in range(windows):
                span = min(AUDIO_WINDOW_S, seconds - w * AUDIO_WINDOW_S)
                decode = min(cap, max(1, math.ceil(span * SPEECH_TOKENS_PER_S)))
                reqs.append(self._submit(AUDIO_ENCODER_TOKENS, decode))
            if stream:
                return await self._audio_stream(request, reqs, task, usage_too)
            for req in reqs:
                await self._finish(req)
        text = "".join(self.server._filler(0, r.num_output) for r in reqs)
        if form.get("response_format") == "text":
            return web.Response(text=text, content_type="text/plain")
        return web.json_response(
            {"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}}
        )

    async def _audio_stream(
        self, request: web.Request, reqs: list[SimRequest], task: str, usage_too: bool
    ) -> web.StreamResponse:
        resp = await self._sse(request)
        head = {
            "id": f"trsc-{uuid.uuid4().hex}",
            "object": f"{task}.chunk",
            "created": int(time.time()),
            "model": self.h.model_name,
        }

        async def delta(text: str) -> None:
            choice = {"delta": {"content": text}, "finish_reason": None}
            await resp.write(self.server._sse({**head, "choices": [choice]}))

        with contextlib.suppress(ConnectionResetError):
            try:
                for req in reqs:  # vLLM streams the windows in order
                    await self._deltas(req, delta)
            except EngineStopped as exc:
                error = self.server.ApiError(500, str(exc), err_type="InternalError").body()
                await resp.write(self.server._sse(error))
            else:
                end = {"delta": {"content": ""}, "finish_reason": "length"}
                await resp.write(self.server._sse({**head, "choices": [end]}))
                if usage_too:
                    usage = self.server._usage(*reqs)
                    await resp.write(self.server._sse({**head, "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp


def _audio_seconds(data: bytes) -> float:
    """A WAV's duration from its header; other formats at COMPRESSED_BYTES_PER_S."""
    if len(data) >= 44 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        byte_rate = int.from_bytes(data[28:32], "little")
        if byte_rate > 0:
            return (len(data) - 44) / byte_rate
    return len(data) / COMPRESSED_BYTES_PER_S


def add_api_routes(app: web.Application, h: _Handlers) -> None:
    apis = SimApis(h)
    app.router.add_post("/v1/responses", apis.responses)
    app.router.add_post("/v1/messages", apis.messages)
    app.router.add_post("/v1/chat/completions/batch", apis.chat_batch)
    app.router.add_post("/v1/audio/transcriptions", apis.audio("transcription"))
    app.router.add_post("/v1/audio/translations", apis.audio("translation"))
