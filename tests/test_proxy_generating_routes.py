"""vLLM's other generating routes through the proxy: the Responses API, Anthropic's Messages
API, the chat batch and speech to text. Each is admitted and counted, relayed byte for byte,
and refused in its own API's shape; a POST route the proxy does not know is refused unless
named in `pass_routes`."""

from __future__ import annotations

import asyncio
import io
import json
import wave
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import run, serve
from faults import Proxy, running_proxy
from helpers import async_wait_until

from powerbatch.proxy.parse import (
    AUDIO_TOKENS_PER_WINDOW,
    BadRequest,
    parse_audio_request,
    parse_chat_batch_request,
    parse_messages_request,
    parse_responses_request,
)
from powerbatch.sim import SimEngine
from powerbatch.sim.server import start_sim_server

MODEL = "sim-llama"


def _ok(gov: Any) -> float:
    value = gov.metrics.registry.get_sample_value(
        "powerbatch_requests_total", {"priority": "normal", "outcome": "ok"}
    )
    return float(value or 0.0)


def _output_tokens(gov: Any) -> float:
    value = gov.metrics.registry.get_sample_value(
        "powerbatch_output_tokens_total", {"priority": "normal"}
    )
    return float(value or 0.0)


@asynccontextmanager
async def _sim_and_proxy(**settings: Any) -> AsyncIterator[Proxy]:
    sim = await start_sim_server(SimEngine(seed=3), stream_interval_tokens=2)
    try:
        async with running_proxy(sim.url, **settings) as p:
            yield p
    finally:
        await sim.close()


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()


def _form(audio: bytes, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    for k, v in fields.items():
        form.add_field(k, v)
    return form


async def _sse_types(resp: aiohttp.ClientResponse) -> list[str]:
    """The `event:` names of a named-event stream, in order."""
    raw = (await resp.read()).decode()
    return [line[7:] for line in raw.splitlines() if line.startswith("event: ")]


# ---- through the simulator --------------------------------------------------------------


def test_every_generating_route_is_admitted_counted_and_answered_through_the_simulator() -> None:
    """Each route's answer comes back in its API's shape, and each request is admitted
    (admitted_total) and counted as ok with its output tokens."""

    async def main() -> None:
        async with _sim_and_proxy() as p, aiohttp.ClientSession() as s:
            q = p.gov.queue
            base = q.stats.admitted_total["normal"]

            body = {"model": MODEL, "input": "hello there", "max_output_tokens": 6}
            async with s.post(p.url + "/v1/responses", json=body) as r:
                assert r.status == 200, await r.text()
                doc = await r.json()
            assert doc["object"] == "response" and doc["usage"]["output_tokens"] == 6
            assert doc["output"][0]["content"][0]["type"] == "output_text"

            async with s.post(p.url + "/v1/responses", json={**body, "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                types = await _sse_types(r)
            assert types[:2] == ["response.created", "response.in_progress"]
            # 6 tokens: the first at once, then 2 a delta (1, 2, 2, 1), as vLLM streams.
            assert types.count("response.output_text.delta") == 4
            assert types[-1] == "response.incomplete"  # cut at max_output_tokens, as vLLM says

            msg = {
                "model": MODEL,
                "max_tokens": 5,
                "system": "be brief",
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with s.post(p.url + "/v1/messages", json=msg) as r:
                doc = await r.json()
            assert doc["type"] == "message" and doc["usage"]["output_tokens"] == 5
            async with s.post(p.url + "/v1/messages", json={**msg, "stream": True}) as r:
                types = await _sse_types(r)
            assert types[0] == "message_start" and types[-1] == "message_stop"
            assert "content_block_delta" in types and "message_delta" in types

            convs = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
            batch = {"model": MODEL, "messages": convs, "max_tokens": 4}
            async with s.post(p.url + "/v1/chat/completions/batch", json=batch) as r:
                doc = await r.json()
            assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
            assert doc["usage"]["completion_tokens"] == 12

            for task in ("transcriptions", "translations"):
                form = _form(_wav(4.0), model=MODEL)
                async with s.post(p.url + f"/v1/audio/{task}", data=form) as r:
                    assert r.status == 200, await r.text()
                    doc = await r.json()
                assert doc["text"] and doc["usage"] == {"type": "duration", "seconds": 4}
            form = _form(_wav(2.0), stream="true", stream_include_usage="true")
            async with s.post(p.url + "/v1/audio/transcriptions", data=form) as r:
                raw = await r.read()
            assert raw.endswith(b"data: [DONE]\n\n") and b"transcription.chunk" in raw

            assert q.stats.admitted_total["normal"] - base == 8
            await async_wait_until(lambda: q.in_flight == 0, 2.0, "every slot released")
            assert _ok(p.gov) == 8
            # 6 + 6 + 5 + 5 + 12, plus the audio's decode (whatever the sim made of it)
            assert _output_tokens(p.gov) >= 34

    run(main())


def test_the_openai_sdk_responses_api_through_the_proxy() -> None:
    """The openai SDK's own client, whole and streamed, against powerbatch and the simulator."""
    import openai  # a test dependency (pyproject: test extras)

    async def main() -> None:
        async with _sim_and_proxy() as p:
            client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="none", max_retries=0)
            try:
                resp = await client.responses.create(
                    model=MODEL, input="Say something.", max_output_tokens=8
                )
                assert resp.usage is not None and resp.usage.output_tokens == 8
                assert resp.output_text.strip()
                seen: list[str] = []
                stream = await client.responses.create(
                    model=MODEL, input=[{"role": "user", "content": "hi"}], stream=True
                )
                async for event in stream:
                    seen.append(event.type)
                assert seen[0] == "response.created" and seen[-1] == "response.completed"
                with pytest.raises(openai.BadRequestError) as err:
                    await client.responses.create(model=MODEL, input="x", background=True)
                assert err.value.body["param"] == "background"  # type: ignore[index]
            finally:
                await client.close()
            assert _ok(p.gov) == 2

    run(main())


# ---- counted as the upstream runs them ----------------------------------------------------


class _Recorded:
    """An upstream that answers any POST with fixed bytes after a pause, and records how many
    it held at once: what the proxy relays can be compared byte for byte."""

    def __init__(self, chunks: list[bytes], content_type: str, delay_s: float = 0.0) -> None:
        self.chunks, self.content_type, self.delay_s = chunks, content_type, delay_s
        self.active = self.max_active = 0
        self.paths: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        await request.read()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)
            resp = web.StreamResponse(headers={"Content-Type": self.content_type})
            await resp.prepare(request)
            for c in self.chunks:
                await resp.write(c)
                await asyncio.sleep(0)
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


def _named(event: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n".encode()


def _responses_stream(deltas: int) -> list[bytes]:
    """A Responses stream as vLLM 0.33 writes it (openai/responses/api_router.py)."""
    seq = iter(range(1000))
    out = [
        _named(t, {"type": t, "sequence_number": next(seq), "response": {"id": "resp_1"}})
        for t in ("response.created", "response.in_progress")
    ]
    out += [
        _named(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "sequence_number": next(seq), "delta": "ab"},
        )
        for _ in range(deltas)
    ]
    usage = {"input_tokens": 11, "output_tokens": 2 * deltas, "total_tokens": 11 + 2 * deltas}
    done = {"type": "response.completed", "sequence_number": next(seq)}
    out.append(_named("response.completed", {**done, "response": {"usage": usage}}))
    return out


def _messages_stream(deltas: int) -> list[bytes]:
    """An Anthropic Messages stream as vLLM 0.33 writes it (anthropic/serving.py)."""
    usage0 = {"input_tokens": 9, "output_tokens": 0}
    out = [
        _named("message_start", {"type": "message_start", "message": {"usage": usage0}}),
        _named("content_block_start", {"type": "content_block_start", "index": 0}),
    ]
    delta = {"type": "content_block_delta", "index": 0, "delta": {"text": "x"}}
    out += [_named("content_block_delta", delta) for _ in range(deltas)]
    out.append(_named("content_block_stop", {"type": "content_block_stop", "index": 0}))
    usage = {"input_tokens": 9, "output_tokens": deltas}
    out.append(_named("message_delta", {"type": "message_delta", "usage": usage}))
    out.append(_named("message_stop", {"type": "message_stop"}))
    return out


@pytest.mark.parametrize(
    ("path", "chunks", "body", "tokens"),
    [
        ("/v1/responses", _responses_stream(5), {"input": "x" * 40, "stream": True}, 10),
        (
            "/v1/messages",
            _messages_stream(7),
            {"messages": [{"role": "user", "content": "y"}], "max_tokens": 9, "stream": True},
            7,
        ),
    ],
)
def test_a_named_event_stream_is_relayed_byte_for_byte_and_its_tokens_counted(
    path: str, chunks: list[bytes], body: dict[str, Any], tokens: int
) -> None:
    async def main() -> None:
        stub = _Recorded(chunks, "text/event-stream")
        runner, url = await serve(stub.app())
        try:
            async with running_proxy(url) as p, aiohttp.ClientSession() as s:
                async with s.post(p.url + path, json={"model": "m", **body}) as r:
                    got = await r.read()
                assert got == b"".join(chunks)
                assert _output_tokens(p.gov) == tokens  # from the final usage
        finally:
            await runner.cleanup()

    run(main())


def test_a_whole_answer_of_a_new_route_is_relayed_untouched() -> None:
    """No usage rewriting for the Responses and Messages answers: the bytes are vLLM's."""

    async def main() -> None:
        answer = (
            b'{"id":"resp_1", "object":"response","usage":{"input_tokens":3,"output_tokens":4}}'
        )
        stub = _Recorded([answer], "application/json")
        runner, url = await serve(stub.app())
        try:
            async with running_proxy(url) as p, aiohttp.ClientSession() as s:
                async with s.post(p.url + "/v1/responses", json={"input": "q"}) as r:
                    assert await r.read() == answer
                msg = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
                async with s.post(p.url + "/v1/messages", json=msg) as r:
                    assert await r.read() == answer
                assert _output_tokens(p.gov) == 8
        finally:
            await runner.cleanup()

    run(main())


def test_a_batch_and_a_long_upload_hold_one_place_per_engine_request() -> None:
    """Three conversations hold three places of the batch; a 65-s WAV three 30-s windows.
    With a batch of 4, a second such request waits until the first is done."""

    async def main() -> None:
        ok = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
        stub = _Recorded([ok], "application/json", delay_s=0.3)
        runner, url = await serve(stub.app())
        try:
            async with running_proxy(url, batch=4) as p, aiohttp.ClientSession() as s:
                q = p.gov.queue
                convs = [[{"role": "user", "content": "q"}]] * 3

                async def batch() -> int:
                    body = {"messages": convs, "max_tokens": 8}
                    async with s.post(p.url + "/v1/chat/completions/batch", json=body) as r:
                        return r.status

                async def audio() -> int:
                    form = _form(_wav(65.0, rate=8000))
                    async with s.post(p.url + "/v1/audio/transcriptions", data=form) as r:
                        return r.status

                for make in (batch, audio):
                    first = asyncio.create_task(make())
                    await async_wait_until(lambda: q.in_flight == 3, 2.0, "three places held")
                    second = asyncio.create_task(make())
                    await asyncio.sleep(0.1)
                    assert q.in_flight == 3 and q.queued == 1  # 3 + 3 > 4: it waits
                    assert await first == 200 and await second == 200
                    assert stub.max_active == 1
                    stub.max_active = 0
                assert q.in_flight == 0
        finally:
            await runner.cleanup()

    run(
        main(),
    )


# ---- refusals in the route's own shape ----------------------------------------------------


def test_refusals_come_in_each_routes_own_error_shape() -> None:
    """400 (bad body), 429 (queue full) and 503 (draining): Anthropic's shape on /v1/messages,
    OpenAI's on the others."""

    async def main() -> None:
        stub = _Recorded([b"{}"], "application/json", delay_s=0.5)
        runner, url = await serve(stub.app())
        try:
            async with (
                running_proxy(url, batch=1, max_queue_len=0) as p,
                aiohttp.ClientSession() as s,
            ):
                msg = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
                cases = {
                    "/v1/messages": (msg, {"messages": []}),
                    "/v1/responses": ({"input": "q"}, {"input": 3}),
                    "/v1/chat/completions/batch": (
                        {"messages": [[{"role": "user", "content": "q"}]]},
                        {"messages": [{"role": "user", "content": "q"}]},
                    ),
                }
                for path, (good, bad) in cases.items():
                    async with s.post(p.url + path, json=bad) as r:
                        assert r.status == 400
                        _check_shape(path, await r.json(), "invalid_request_error")
                    hold = asyncio.create_task(s.post(p.url + path, json=good))
                    await async_wait_until(lambda: p.gov.queue.in_flight == 1, 2.0, "held")
                    async with s.post(p.url + path, json=good) as r:
                        assert r.status == 429 and "Retry-After" in r.headers
                        kind = "rate_limit_error" if path == "/v1/messages" else None
                        _check_shape(path, await r.json(), kind or "rate_limit_exceeded")
                    (await hold).release()
                    await async_wait_until(lambda: p.gov.queue.in_flight == 0, 2.0, "freed")
                async with s.post(p.url + "/v1/audio/transcriptions", data=b"x") as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == "file"
                p.gov.queue.drain()
                async with s.post(p.url + "/v1/messages", json=msg) as r:
                    assert r.status == 503
                    _check_shape("/v1/messages", await r.json(), "overloaded_error")
                async with s.post(p.url + "/v1/responses", json={"input": "q"}) as r:
                    assert r.status == 503
                    _check_shape("/v1/responses", await r.json(), "service_unavailable")
        finally:
            await runner.cleanup()

    run(main())


def _check_shape(path: str, doc: dict[str, Any], kind: str) -> None:
    if path == "/v1/messages":  # https://docs.anthropic.com/en/api/errors
        assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}, doc
    else:
        assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["type"] == kind, doc


@pytest.mark.parametrize(
    ("path", "body", "marker"),
    [
        ("/v1/responses", {"input": "q", "stream": True}, b'"type": "error"'),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True},
            b'"type": "api_error"',
        ),
    ],
)
def test_an_upstream_that_dies_mid_stream_ends_it_with_the_apis_error_event(
    path: str, body: dict[str, Any], marker: bytes
) -> None:
    async def main() -> None:
        async def die(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(_named("x.delta", {"n": 1}) + b"event: x.delta\ndata: {")
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp

        app = web.Application()
        app.router.add_post(path, die)
        runner, url = await serve(app)
        try:
            async with running_proxy(url) as p, aiohttp.ClientSession() as s:
                async with s.post(p.url + path, json=body) as r:
                    raw = await r.read()
                assert raw.startswith(b"event: x.delta\n")
                tail = raw.split(b"\n\n")[-2]
                assert tail.startswith(b"event: error\ndata: ") and marker in tail
                assert b"[DONE]" not in raw  # neither API ends a stream so
        finally:
            await runner.cleanup()

    run(main())


# ---- routes the proxy does not know ------------------------------------------------------


def test_an_unknown_post_route_is_refused_unless_named_and_known_safe_ones_pass() -> None:
    async def main() -> None:
        stub = _Recorded([b'{"ok": true}'], "application/json")
        runner, url = await serve(stub.app())
        try:
            async with running_proxy(url) as p, aiohttp.ClientSession() as s:
                async with s.post(p.url + "/v1/decisions", json={}) as r:
                    assert r.status == 403
                    doc = await r.json()
                assert doc["error"]["code"] == "route_not_admitted"
                assert "pass_routes" in doc["error"]["message"]
                for safe in ("/v1/messages/count_tokens", "/v1/responses/resp_1/cancel"):
                    async with s.post(p.url + safe, json={}) as r:
                        assert r.status == 200
                async with s.get(p.url + "/v1/decisions") as r:  # only POST may generate
                    assert r.status == 200
            assert stub.paths == [
                "/v1/messages/count_tokens",
                "/v1/responses/resp_1/cancel",
                "/v1/decisions",
            ]
            async with (
                running_proxy(url, pass_routes=("/v1/decisions", "/v1/x/*")) as p,
                aiohttp.ClientSession() as s,
            ):
                for path in ("/v1/decisions", "/v1/x/y"):
                    async with s.post(p.url + path, json={}) as r:
                        assert r.status == 200
                for path in ("/v1/systemone", "/v1/x/y/z", "/v1/responses/a/b/cancel"):
                    async with s.post(p.url + path, json={}) as r:
                        assert r.status == 403, path  # a * never spans a /
            # observe mode enforces nothing: the route passes, as every other request does
            async with (
                running_proxy(url, mode="observe") as p,
                aiohttp.ClientSession() as s,
                s.post(p.url + "/v1/systemone", json={}) as r,
            ):
                assert r.status == 200
            assert stub.paths[-1] == "/v1/systemone"
        finally:
            await runner.cleanup()

    run(main())


# ---- the estimates -------------------------------------------------------------------------


def test_the_estimates_of_each_route() -> None:
    sizes = {"default_max_tokens": 100, "max_tokens_limit": 1000}
    info = parse_responses_request(
        json.dumps({"input": "x" * 400, "instructions": "y" * 40, "max_output_tokens": 7}).encode(),
        **sizes,
    )
    assert (info.prompt_tokens, info.max_tokens, info.stream) == (110, 7, False)
    with pytest.raises(BadRequest) as err:
        parse_responses_request(b'{"input": "q", "background": true}', **sizes)
    assert err.value.param == "background"
    info = parse_messages_request(
        json.dumps(
            {
                "system": [{"type": "text", "text": "s" * 80}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "u" * 40}]}],
                "max_tokens": 50,
                "stream": True,
            }
        ).encode(),
        max_tokens_limit=1000,
    )
    assert (info.prompt_tokens, info.max_tokens, info.stream) == (30, 50, True)
    with pytest.raises(BadRequest, match="max_tokens is required"):
        parse_messages_request(
            b'{"messages": [{"role": "user", "content": "q"}]}', max_tokens_limit=9
        )
    convs = [[{"role": "user", "content": "z" * 80}]] * 4
    info = parse_chat_batch_request(
        json.dumps({"messages": convs, "max_tokens": 10}).encode(), **sizes
    )
    assert (info.requests, info.prompt_tokens, info.kv_tokens) == (4, 80, 120)

    def audio(payload: bytes, **fields: str) -> Any:
        form = _form(payload, **fields)
        body = form()
        ctype = body.content_type
        raw = asyncio.run(_payload_bytes(body))
        return parse_audio_request(raw, ctype, **sizes)

    info = audio(_wav(61.0, rate=8000), stream="true", max_completion_tokens="20")
    assert (info.requests, info.prompt_tokens, info.max_tokens, info.stream) == (
        3,
        3 * AUDIO_TOKENS_PER_WINDOW,
        20,
        True,
    )
    assert audio(b"\xff\xfb" + b"\0" * 200_000).requests == 2  # 50 s at the assumed rate
    assert audio(_wav(1.0)).requests == 1


async def _payload_bytes(payload: Any) -> bytes:
    class Sink:
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        async def write(self, data: bytes) -> None:
            self.parts.append(bytes(data))

    sink = Sink()
    await payload.write(sink)
    return b"".join(sink.parts)


def test_the_simulator_answers_each_api_in_its_own_error_shape() -> None:
    """Straight to the simulator, as a client of vLLM would meet it: Anthropic's shape on
    /v1/messages, OpenAI's on the others."""

    async def main() -> None:
        sim = await start_sim_server(SimEngine(seed=2))
        try:
            async with aiohttp.ClientSession() as s:
                no_max = {"messages": [{"role": "user", "content": "q"}]}
                async with s.post(sim.url + "/v1/messages", json=no_max) as r:
                    assert r.status == 400
                    doc = await r.json()
                assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
                async with s.post(sim.url + "/v1/messages", json={**no_max, "model": "x"}) as r:
                    assert r.status == 404
                    assert (await r.json())["error"]["type"] == "not_found_error"
                async with s.post(sim.url + "/v1/responses", json={"input": []}) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == "input"
                batch = {"messages": [[{"role": "user", "content": "q"}]], "stream": True}
                async with s.post(sim.url + "/v1/chat/completions/batch", json=batch) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == "stream"
                async with s.post(sim.url + "/v1/audio/translations", data=b"x") as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == "file"
        finally:
            await sim.close()

    run(main())
