"""Upstream faults: refused, hung, dying mid-stream or mid-body, 5xx, slow, restarted.

Every case checks the three promises: the client gets a clear answer (an OpenAI error, or an SSE
error event that parses), the slot is freed, and nothing waits past the configured timeouts.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
from conftest import run
from faults import Behaviour, Proxy, chat_body, running_proxy, sse_events, upstream
from helpers import async_wait_until

CHAT = "/v1/chat/completions"


def events(body: bytes) -> list[Any]:
    """Every SSE data payload, parsed; raises if any is not whole JSON (or [DONE])."""
    out: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        payload = block[6:]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def post(
    s: aiohttp.ClientSession, p: Proxy, body: Any, **kw: Any
) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    async with s.post(p.url + CHAT, json=body, **kw) as r:
        data = await r.read()
        return r.status, data, time.monotonic() - t0


async def settled(p: Proxy, limit_s: float = 2.0) -> None:
    """The slot accounting is back to zero (allowing a moment for handlers to unwind)."""
    await async_wait_until(
        lambda: p.gov.queue.in_flight == 0 and p.gov.queue.queued == 0,
        limit_s,
        lambda: f"slots freed: {p.gov.status()['queue']}",
        interval_s=0.02,
    )


def outcome(p: Proxy, name: str, priority: str = "normal") -> float:
    return float(p.gov.metrics.requests.labels(priority, name)._value.get())


def test_refused_then_restarted_upstream() -> None:
    async def go() -> None:
        async with upstream() as up, running_proxy(up.url) as p, aiohttp.ClientSession() as s:
            assert (await post(s, p, chat_body()))[0] == 200
            await up.stop()  # now nothing listens on its port
            for stream in (False, True):
                status, body, dt = await post(s, p, chat_body(stream=stream))
                assert status == 503 and dt < 2.0
                assert json.loads(body)["error"]["code"] == "upstream_unavailable"
            async with s.get(p.url + "/ready") as r:
                assert r.status == 503
                assert any("upstream" in x for x in (await r.json())["problems"])
            await settled(p)
            await up.start()  # same port: a restart
            for stream in (False, True):
                status, body, _ = await post(s, p, chat_body(stream=stream))
                assert status == 200, body
            async with s.get(p.url + "/ready") as r:
                assert r.status == 200
            assert outcome(p, "upstream_error") == 2
            await settled(p)

    run(go())


def test_hang_before_headers_times_out_and_frees_the_slot() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(delay_s=30)) as up,
            running_proxy(up.url, headers_timeout_s=0.4) as p,
            aiohttp.ClientSession() as s,
        ):
            results = await asyncio.gather(
                *(post(s, p, chat_body(stream=i % 2 == 0)) for i in range(6))
            )
            for status, body, dt in results:
                assert status == 504 and dt < 3.0
                assert json.loads(body)["error"]["code"] == "upstream_timeout"
            await settled(p)
            await asyncio.sleep(0.1)
            assert up.active == 0 and up.aborted == 6  # the proxy hung up on the upstream too
            up.behaviour = Behaviour()
            assert (await post(s, p, chat_body()))[0] == 200

    run(go())


def test_long_non_streamed_answer_is_not_cut_by_the_read_timeout() -> None:
    """The read timeout is for silence inside an answer; the headers timeout bounds the wait."""

    async def go() -> None:
        async with (
            upstream(Behaviour(delay_s=0.8)) as up,
            running_proxy(up.url, read_timeout_s=0.3, headers_timeout_s=5) as p,
            aiohttp.ClientSession() as s,
        ):
            status, body, _ = await post(s, p, chat_body())
            assert status == 200, body

    run(go())


def test_upstream_dies_mid_stream_ends_with_a_clean_error_event() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(tokens=6, die_after_events=3)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
        ):
            status, body, dt = await post(s, p, chat_body(stream=True))
            assert status == 200 and dt < 3.0
            evs = events(body)  # every event is whole: the half event was held back
            assert evs[-1] == "[DONE]"
            err = evs[-2]["error"]
            assert err["code"] == "upstream_error" and "mid-stream" in err["message"]
            assert [e["choices"][0]["delta"].get("content") for e in evs[:-2]] == ["", "t0 ", "t1 "]
            assert outcome(p, "upstream_error") == 1
            await settled(p)
            up.behaviour = Behaviour()
            assert (await post(s, p, chat_body(stream=True)))[0] == 200

    run(go())


def test_upstream_dies_mid_body() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(die_mid_body=True)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
        ):
            status, body, _ = await post(s, p, chat_body())
            assert status == 502
            assert json.loads(body)["error"]["code"] == "upstream_error"
            await settled(p)

    run(go())


def test_upstream_5xx_json_is_relayed_and_non_json_is_explained() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(status=500)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
        ):
            status, body, _ = await post(s, p, chat_body(stream=True))
            assert status == 500 and json.loads(body)["error"]["message"] == "stub failure"
            up.behaviour = Behaviour(
                status=503, body=b"<html>Bad Gateway</html>", content_type="text/html"
            )
            status, body, _ = await post(s, p, chat_body())
            err = json.loads(body)["error"]
            assert status == 502 and err["code"] == "upstream_error"
            assert "503" in err["message"] and "Bad Gateway" in err["message"]
            assert outcome(p, "upstream_error") == 2
            await settled(p)

    run(go())


def test_slow_upstream_within_timeouts_succeeds_silence_beyond_them_fails() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(tokens=5, token_interval_s=0.1)) as up,
            running_proxy(up.url, read_timeout_s=0.5) as p,
            aiohttp.ClientSession() as s,
        ):
            status, body, _ = await post(s, p, chat_body(stream=True))
            assert status == 200 and events(body)[-1] == "[DONE]" and len(events(body)) == 8
            assert (await post(s, p, chat_body()))[0] == 200
            up.behaviour = Behaviour(tokens=5, token_interval_s=5.0)
            status, body, dt = await post(s, p, chat_body(stream=True))
            assert status == 200 and dt < 2.5
            assert "no data for 0.5 s" in events(body)[-2]["error"]["message"]
            await settled(p)

    run(go())


def test_upstream_restart_during_streams() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(tokens=50, token_interval_s=0.05)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
        ):
            tasks = [asyncio.create_task(post(s, p, chat_body(stream=True))) for _ in range(3)]
            await asyncio.sleep(0.4)
            await up.stop()
            for status, body, dt in await asyncio.gather(*tasks):
                assert status == 200 and dt < 3.0
                assert "error" in events(body)[-2]
            await settled(p)
            up.behaviour = Behaviour()
            await up.start()
            assert (await post(s, p, chat_body(stream=True)))[0] == 200

    run(go())


def test_client_that_leaves_frees_its_slot_and_the_upstream_request() -> None:
    async def go() -> None:
        async with (
            upstream(Behaviour(tokens=100, token_interval_s=0.05)) as up,
            running_proxy(up.url, batch=1) as p,
            aiohttp.ClientSession() as s,
        ):
            inflight = asyncio.create_task(post(s, p, chat_body(stream=True)))
            queued = asyncio.create_task(post(s, p, chat_body()))
            await asyncio.sleep(0.3)
            assert p.gov.queue.in_flight == 1 and p.gov.queue.queued == 1
            queued.cancel()
            inflight.cancel()
            await asyncio.gather(inflight, queued, return_exceptions=True)
            await settled(p)
            await asyncio.sleep(0.1)
            assert up.active == 0 and up.aborted == 1
            assert outcome(p, "cancelled") >= 1

    run(go())


def test_client_that_stops_reading_a_stream_is_dropped() -> None:
    """A stalled reader must not hold its slot: after client_timeout_s the proxy hangs up."""
    big = [b"data: " + b"x" * 65_536 + b"\n\n"] * 400  # ~26 MB: more than socket buffers hold

    async def go() -> None:
        async with (
            upstream(Behaviour(chunks=big)) as up,
            running_proxy(up.url, client_timeout_s=0.5) as p,
        ):
            port = int(p.url.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            body = json.dumps(chat_body(stream=True)).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await asyncio.sleep(0.3)
            assert p.gov.queue.in_flight == 1
            await settled(p, limit_s=10)
            assert outcome(p, "cancelled") == 1
            writer.close()

    run(go())


def test_first_events_are_relayed_before_the_stream_ends() -> None:
    """Streaming stays streaming: holding back partial events must not hold back whole ones."""

    async def go() -> None:
        async with (
            upstream(Behaviour(tokens=1, token_interval_s=0.4)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
        ):
            t0 = time.monotonic()
            async with s.post(p.url + CHAT, json=chat_body(stream=True)) as r:
                first = await r.content.readuntil(b"\n\n")
                assert time.monotonic() - t0 < 0.35
                assert first == sse_events(1)[0]

    run(go())


def test_a_silent_upstream_gets_the_same_504_on_every_route() -> None:
    """Admitted and pass-through routes share one mapping of upstream failures to answers."""

    async def go() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)  # accepts, reads nothing, never answers

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with (
                running_proxy(url, headers_timeout_s=0.3) as p,
                aiohttp.ClientSession() as s,
            ):
                errors = []
                for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("POST", "/tokenize")):
                    async with s.request(method, p.url + path, json=chat_body()) as r:
                        errors.append((r.status, (await r.json())["error"]))
                assert errors[0] == errors[1] == errors[2]
                assert errors[0] == (
                    504,
                    {
                        "message": "upstream did not answer within 0.3 s",
                        "type": "upstream_timeout",
                        "param": None,
                        "code": "upstream_timeout",
                    },
                )
                assert outcome(p, "upstream_error") == 1  # only the admitted one is counted
                await settled(p)
        finally:
            server.close()

    run(go())
