"""A fake OpenAI-compatible upstream that answers at once: the baseline for proxy_overhead.py.

Chat and completion requests get `max_tokens` SSE events (or one JSON body) with no model work,
so the time a request takes through the proxy minus straight to this server is the proxy's own.
Also serves /health, /v1/models and /metrics with a constant dcgm-exporter power reading
(`DCGM_FI_DEV_POWER_USAGE{gpu="0"} 100`) for the proxy's power source.

Test hooks, as request headers: `x-fake-delay-s` holds the answer that long (to keep a proxy's
queue full), `x-fake-interval-ms` spaces the SSE events (so each arrives as its own chunk, as
tokens from a real server do).

    python benchmarks/fake_upstream.py --port 8101
"""

from __future__ import annotations

import argparse
import asyncio
import json
from functools import cache, partial

from aiohttp import web

MODEL = "fake"
METRICS = (
    b"# TYPE DCGM_FI_DEV_POWER_USAGE gauge\n"
    b'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-fake",modelName="fake"} 100\n'
)


@cache
def _json_body(tokens: int, chat: bool) -> bytes:
    choice: dict[str, object] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": "tok " * tokens}
    else:
        choice["text"] = "tok " * tokens
    body = {
        "id": "cmpl-fake",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8},
    }
    return json.dumps(body).encode()


@cache
def _events(chat: bool, tokens: int) -> tuple[bytes, bytes]:
    """(one token event, the usage event); every token event is the same bytes."""
    if chat:
        choice = {"index": 0, "delta": {"content": "tok "}, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": "tok ", "finish_reason": None}
        obj = "text_completion"
    head = {"id": "cmpl-fake", "object": obj, "created": 0, "model": MODEL}
    token = b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}
    return token, b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n"


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    body = json.loads(await request.read())
    tokens = int(body.get("max_tokens") or 16)
    if delay := float(request.headers.get("x-fake-delay-s", "0")):
        await asyncio.sleep(delay)
    if not body.get("stream"):
        return web.Response(body=_json_body(tokens, chat), content_type="application/json")
    interval = float(request.headers.get("x-fake-interval-ms", "0")) / 1000
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    token, usage = _events(chat, tokens)
    for _ in range(tokens):
        await resp.write(token)
        if interval:
            await asyncio.sleep(interval)
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(usage)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=METRICS, content_type="text/plain")


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", partial(_complete, chat=True))
    app.router.add_post("/v1/completions", partial(_complete, chat=False))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    a = p.parse_args()
    web.run_app(
        create_app(),
        host=a.host,
        port=a.port,
        access_log=None,
        backlog=4096,
        handler_cancellation=True,
        print=None,
    )


if __name__ == "__main__":
    main()
