"""Bad input: each gets a clear OpenAI-style error with the right status, and nothing goes upstream.

Plus properties: request parsing accepts exactly the well-typed requests, and any chunking of an
SSE stream arrives at the client byte for byte.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import aiohttp
import pytest
from conftest import run
from faults import Behaviour, chat_body, running_proxy, upstream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerbatch.proxy.parse import BadRequest, RequestInfo, parse_request

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


# (name, method, path, body, headers, status, code, param)
CASES: list[tuple[str, str, str, bytes, dict[str, str], int, str | None, str | None]] = [
    ("malformed_json", "POST", CHAT, b'{"model": ', {}, 400, "invalid_request", None),
    ("not_utf8", "POST", CHAT, b"\xff\xfe\x00{", {}, 400, "invalid_request", None),
    ("empty_body", "POST", CHAT, b"", {}, 400, "invalid_request", None),
    ("array_body", "POST", CHAT, b"[1, 2]", {}, 400, "invalid_request", None),
    ("missing_messages", "POST", CHAT, j({"model": "m"}), {}, 400, "invalid_request", "messages"),
    ("empty_messages", "POST", CHAT, j({"messages": []}), {}, 400, "invalid_request", "messages"),
    ("messages_string", "POST", CHAT, j({"messages": "hi"}), {}, 400, None, "messages"),
    ("message_not_object", "POST", CHAT, j({"messages": ["hi"]}), {}, 400, None, "messages"),
    ("model_number", "POST", CHAT, j({"model": 5, "messages": MSG}), {}, 400, None, "model"),
    ("stream_string", "POST", CHAT, j({"messages": MSG, "stream": "yes"}), {}, 400, None, "stream"),
    ("max_tokens_string", "POST", CHAT, j({"messages": MSG, "max_tokens": "9"}), {}, 400, None,
     "max_tokens"),
    ("max_tokens_bool", "POST", CHAT, j({"messages": MSG, "max_tokens": True}), {}, 400, None,
     "max_tokens"),
    ("max_tokens_zero", "POST", CHAT, j({"messages": MSG, "max_tokens": 0}), {}, 400, None,
     "max_tokens"),
    ("max_tokens_negative", "POST", CHAT, j({"messages": MSG, "max_tokens": -5}), {}, 400, None,
     "max_tokens"),
    ("max_tokens_absurd", "POST", CHAT, j({"messages": MSG, "max_tokens": 10**12}), {}, 400, None,
     "max_tokens"),
    ("max_completion_tokens_absurd", "POST", CHAT,
     j({"messages": MSG, "max_completion_tokens": 2**63}), {}, 400, None, "max_completion_tokens"),
    ("max_tokens_float_overflow", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}', {}, 400, None,
     "max_tokens"),
    ("max_tokens_5000_digits", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}", {},
     400, "invalid_request", None),
    ("nesting_100k_deep", "POST", CHAT, b"[" * 100_000 + b"]" * 100_000, {}, 400,
     "invalid_request", None),
    ("content_nested_deep", "POST", CHAT,
     b'{"messages": [{"content": ' + b'{"content": ' * 900 + b'"x"' + b"}" * 900 + b"}]}", {}, 400,
     "invalid_request", None),
    ("completions_missing_prompt", "POST", "/v1/completions", j({"model": "m"}), {}, 400, None,
     "prompt"),
    ("completions_prompt_number", "POST", "/v1/completions", j({"prompt": 7}), {}, 400, None,
     "prompt"),
    ("huge_body", "POST", CHAT, j(chat_body("x" * 300_000)), {}, 413, "too_large", None),
    ("bad_priority", "POST", CHAT, j(chat_body()), {"x-priority": "urgent"}, 400,
     "invalid_priority", "x-priority"),
    ("unknown_route", "GET", "/nope", b"", {}, 404, "not_found", None),
    ("unknown_route_post", "POST", "/v2/chat/completions", j(chat_body()), {}, 404, "not_found",
     None),
    ("get_on_chat", "GET", CHAT, b"", {}, 405, "bad_method", None),
    ("put_on_completions", "PUT", "/v1/completions", j({"prompt": "x"}), {}, 405, "bad_method",
     None),
]  # fmt: skip


def assert_openai_error(body: bytes, code: str | None, param: str | None) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return dict(err)


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "code", "param"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_request_gets_a_clear_error(
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    code: str | None,
    param: str | None,
) -> None:
    async def go() -> None:
        async with (
            upstream() as up,
            running_proxy(up.url, max_body_bytes=256 * 1024) as p,
            aiohttp.ClientSession() as s,
        ):
            hdrs = {"Content-Type": "application/json", **headers}
            async with s.request(method, p.url + path, data=body, headers=hdrs) as r:
                assert r.status == status, await r.text()
                assert_openai_error(await r.read(), code, param)
            assert up.seen == [] and p.gov.queue.in_flight == 0
            # ... and the proxy still serves well-formed requests after it.
            async with s.post(p.url + CHAT, json=chat_body()) as r:
                assert r.status == 200

    run(go())


async def _raw(port: int, data: bytes, read_s: float = 3.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(read_s):
            return await reader.read(65536)
    finally:
        writer.close()


def test_invalid_http_headers_are_refused() -> None:
    async def go() -> None:
        async with upstream() as up, running_proxy(up.url) as p:
            port = int(p.url.rsplit(":", 1)[1])
            for junk in (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -4\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: "
                + b"a" * 70_000
                + b"\r\n\r\n",
            ):
                answer = await _raw(port, junk)
                assert answer[:5] == b"HTTP/" and answer[9:10] == b"4", answer[:200]
            assert up.seen == [] and p.gov.queue.in_flight == 0

    run(go())


def test_slow_client_body_gets_408_and_holds_no_slot() -> None:
    async def go() -> None:
        async with upstream() as up, running_proxy(up.url, client_timeout_s=0.4) as p:
            port = int(p.url.rsplit(":", 1)[1])
            t0 = time.monotonic()
            answer = await _raw(
                port,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
            )
            assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 2.0
            assert_openai_error(answer.split(b"\r\n\r\n", 1)[1], "client_timeout", None)
            assert up.seen == [] and p.gov.queue.in_flight == 0

    run(go())


# -- properties ---------------------------------------------------------------------------------

_LIMIT = 1000
_bad_int = st.one_of(
    st.text(max_size=3), st.floats(), st.booleans(), st.integers(max_value=0),
    st.integers(min_value=_LIMIT + 1), st.lists(st.integers(), max_size=2),
)  # fmt: skip
_content = st.one_of(
    st.text(max_size=50),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})),
)


@st.composite
def _chat_request(draw: st.DrawFn) -> tuple[dict[str, Any], str | None]:
    """A chat body that is either valid or wrong in exactly one field; and that field's name."""
    body: dict[str, Any] = {
        "model": draw(st.text(max_size=10)),
        "messages": draw(
            st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                       "content": _content}),
                min_size=1, max_size=4,
            )
        ),
    }  # fmt: skip
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, _LIMIT))
    broken = draw(st.sampled_from([None, None, "model", "messages", "stream", "max_tokens"]))
    bad_values = {
        "model": st.one_of(st.integers(), st.lists(st.text(), max_size=2), st.booleans()),
        "messages": st.one_of(st.just([]), st.text(), st.lists(st.integers(), min_size=1)),
        "stream": st.one_of(st.integers(), st.text(), st.floats()),
        "max_tokens": _bad_int,
    }
    if broken is not None:
        body[broken] = draw(bad_values[broken])
    return body, broken


@settings(max_examples=150, deadline=None)
@given(_chat_request())
def test_parse_accepts_exactly_the_well_typed_requests(
    case: tuple[dict[str, Any], str | None],
) -> None:
    body, broken = case
    raw = json.dumps(body).encode()
    if broken is None:
        info = parse_request(raw, chat=True, default_max_tokens=77, max_tokens_limit=_LIMIT)
        assert isinstance(info, RequestInfo)
        assert info.stream == body.get("stream", False)
        assert info.max_tokens == body.get("max_tokens", 77)
        assert info.prompt_tokens >= 1 and info.kv_tokens == info.prompt_tokens + info.max_tokens
    else:
        with pytest.raises(BadRequest) as exc:
            parse_request(raw, chat=True, default_max_tokens=77, max_tokens_limit=_LIMIT)
        assert exc.value.param == broken or (broken == "messages" and exc.value.param is None)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "content", "text", "stream",
                         "max_tokens", "role", "x"]), inner, max_size=5),
    max_leaves=25,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json.map(lambda v: json.dumps(v).encode()), st.binary(max_size=200)),
       st.booleans())  # fmt: skip
def test_parse_never_fails_other_than_bad_request(raw: bytes, chat: bool) -> None:
    try:
        info = parse_request(raw, chat=chat, default_max_tokens=16, max_tokens_limit=_LIMIT)
    except BadRequest:
        return
    assert info.prompt_tokens >= 1 and 1 <= info.max_tokens <= _LIMIT


# SSE: events whose data has no line breaks; any separator style; any split of the bytes.
_event = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=40
).map(lambda t: "data: " + json.dumps({"t": t}, ensure_ascii=False))


@st.composite
def _sse_chunks(draw: st.DrawFn) -> list[bytes]:
    sep = draw(st.sampled_from(["\n\n", "\r\n\r\n"]))
    events = draw(st.lists(_event, min_size=1, max_size=12))
    stream = "".join(e + sep for e in events) + "data: [DONE]" + sep
    data = stream.encode()
    cuts = sorted(set(draw(st.lists(st.integers(1, len(data) - 1), max_size=15))))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sse_chunks())
def test_sse_relay_is_byte_identical_under_any_chunking(chunks: list[bytes]) -> None:
    async def go() -> bytes:
        async with (
            upstream(Behaviour(chunks=chunks)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
            s.post(p.url + CHAT, json=chat_body(stream=True)) as r,
        ):
            assert r.status == 200
            return await r.read()

    assert run(go()) == b"".join(chunks)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_json.map(lambda v: json.dumps(v).encode()), st.binary(max_size=100)))
def test_proxy_never_answers_500_to_any_body(raw: bytes) -> None:
    async def go() -> None:
        async with upstream() as up, running_proxy(up.url) as p, aiohttp.ClientSession() as s:
            async with s.post(p.url + CHAT, data=raw) as r:
                assert r.status in (200, 400), await r.text()
                if r.status == 400:
                    assert_openai_error(await r.read(), None, None)
            assert p.gov.queue.in_flight == 0

    run(go())
