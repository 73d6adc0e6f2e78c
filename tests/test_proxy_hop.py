"""The proxy's upstream client (powerbatch.proxy.hop) against a raw socket server that writes
exactly the bytes each case needs: keep-alive, chunks, bodies ended by close, interim answers,
HEAD, broken HTTP, silence, a slow reader, and connections the server or the client gives up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from conftest import run

from powerbatch.proxy import hop
from powerbatch.proxy.hop import HopClient, UpstreamBroken, UpstreamTimeout, UpstreamUnreachable

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


class RawServer:
    """Answers each request with `reply`; counts connections and keeps each request's head."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.heads: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                await self.reply(reader, writer, head)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


@asynccontextmanager
async def raw_server(
    reply: Reply, prefix: str = "", **kw: float
) -> AsyncIterator[tuple[RawServer, HopClient]]:
    srv = RawServer(reply)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HopClient(f"http://127.0.0.1:{port}{prefix}", connect_timeout_s=2.0, **kw)
    try:
        yield srv, client
    finally:
        client.close()
        server.close()


def answer(body: bytes, extra: bytes = b"") -> Reply:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body)
        await w.drain()

    return reply


def test_keep_alive_reuses_one_connection_and_sends_the_prefix_and_host() -> None:
    async def go() -> None:
        async with raw_server(answer(b'{"ok":1}', b"X-Up: a\r\n"), prefix="/base/") as (srv, c):
            for _ in range(3):
                async with await c.request("POST", "/v1/x?q=1", [("X-Key", "k")], b"{}") as a:
                    assert a.status == 200 and a.headers["x-up"] == "a"
                    assert await a.chunk() == b'{"ok":1}' and await a.chunk() is None
            assert srv.connections == 1
            line, *headers = srv.heads[0].decode().split("\r\n")
            assert line == "POST /base/v1/x?q=1 HTTP/1.1"
            assert f"Host: 127.0.0.1:{c.port}" in headers and "X-Key: k" in headers
            assert "Content-Length: 2" in headers

    run(go())


def test_chunks_come_as_they_are_written_and_the_stream_ends_at_the_last() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
            await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")

    async def go() -> None:
        async with raw_server(reply) as (_, c), await c.request("GET", "/s", ()) as a:
            assert not a.complete
            assert await a.chunk() == b"data: 1\n\n"  # before the second is written
            assert await a.chunk() == b"data: 2\n\n"
            assert await a.chunk() is None and a.complete

    run(go())


def test_a_body_without_length_ends_with_the_connection_which_is_not_reused() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await w.drain()
        w.close()

    async def go() -> None:
        async with raw_server(reply) as (srv, c):
            for _ in range(2):
                async with await c.request("GET", "/", ()) as a:
                    assert await a.chunk() == b"all of it" and await a.chunk() is None
            assert srv.connections == 2

    run(go())


def test_a_body_cut_short_is_broken_not_ended() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")
        await w.drain()
        w.close()

    async def go() -> None:
        async with raw_server(reply) as (_, c), await c.request("GET", "/", ()) as a:
            assert await a.chunk() == b"half"
            with pytest.raises(UpstreamBroken, match="connection closed"):
                await a.chunk()

    run(go())


def test_interim_answers_are_skipped_and_head_has_no_body() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        if head.startswith(b"HEAD"):  # the length of the body a GET would get, and no body
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        else:
            w.write(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
            )

    async def go() -> None:
        async with raw_server(reply) as (srv, c):
            async with await c.request("POST", "/", (), b"x") as a:
                assert a.status == 201 and await a.chunk() == b"ok"
            async with await c.request("HEAD", "/", ()) as a:
                assert a.status == 200 and a.complete and await a.chunk() is None
            async with await c.request("POST", "/", (), b"x") as a:
                assert a.status == 201
            assert srv.connections == 2  # not reused after the HEAD

    run(go())


def test_bad_http_and_a_closed_port_are_errors_of_their_own() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        w.write(b"SMTP ready\r\n\r\n")

    async def go() -> None:
        async with raw_server(reply) as (_, c):
            with pytest.raises(UpstreamBroken, match="bad HTTP"):
                await c.request("GET", "/", ())
        with pytest.raises(UpstreamUnreachable):
            await c.request("GET", "/", ())  # the server is gone: nothing listens there

    run(go())


def test_silence_times_out_before_the_headers_and_inside_the_body() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        if b"/body" in head:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await r.read(1)  # silent until the client goes

    async def go() -> None:
        async with raw_server(reply, headers_timeout_s=0.3, read_timeout_s=0.4) as (srv, c):
            t0 = time.monotonic()
            with pytest.raises(UpstreamTimeout, match=r"no answer within 0\.3 s"):
                await c.request("GET", "/head", ())
            assert 0.3 <= time.monotonic() - t0 < 0.5
            async with await c.request("GET", "/body", ()) as a:
                assert await a.chunk() == b"abc"
                t0 = time.monotonic()
                with pytest.raises(UpstreamTimeout, match=r"no data for 0\.4 s"):
                    await a.chunk()
                assert 0.4 <= time.monotonic() - t0 < 0.6
            # the timed-out requests' connections were closed, so the server stops too
            await asyncio.wait_for(srv.closed_by_client.wait(), 1.0)
            assert not c.busy

    run(go())


def test_a_slow_reader_pauses_the_upstream_instead_of_buffering_it_all() -> None:
    size = 128 * hop.HIGH_WATER_BYTES  # well past what the kernel's socket buffers hold
    sent = 0

    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            w.write(b"x" * 65536)
            await w.drain()
            sent += 65536

    async def go() -> None:
        async with raw_server(reply) as (_, c), await c.request("GET", "/", ()) as a:
            await asyncio.sleep(0.5)  # nobody reads: the server is held back by the pause
            assert a._buffered <= hop.HIGH_WATER_BYTES + 256 * 1024
            assert sent < size
            got = 0
            while (part := await a.chunk()) is not None:
                got += len(part)
            assert got == size and sent == size

    run(go())


def test_an_answer_left_unread_closes_its_connection_and_idle_ones_expire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        if b"/part" in head:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
            await r.read(1)  # the rest never comes: the client must hang up
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def go() -> None:
        async with raw_server(reply) as (srv, c):
            a = await c.request("GET", "/part", ())
            a.close()  # before its body ended: not given back to the pool
            await asyncio.wait_for(srv.closed_by_client.wait(), 1.0)  # the upstream sees it
            for _ in range(2):
                async with await c.request("GET", "/", ()) as a:
                    assert await a.chunk() == b"ok"
            assert srv.connections == 2
            monkeypatch.setattr(hop, "IDLE_S", 0.0)  # idle too long: not reused
            async with await c.request("GET", "/", ()) as a:
                pass
            assert srv.connections == 3

    run(go())


def test_a_cancelled_request_closes_its_connection() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        await r.read(1)  # silent until the client goes

    async def go() -> None:
        async with raw_server(reply) as (srv, c):
            task = asyncio.create_task(c.request("POST", "/", (), b"{}"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(srv.closed_by_client.wait(), 1.0)  # the upstream sees it

    run(go())


def test_a_body_ended_by_close_after_a_timeout_stays_timed_out() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nsome")
        await r.read(1)

    async def go() -> None:
        async with (
            raw_server(reply, read_timeout_s=0.2) as (_, c),
            await c.request("GET", "/", ()) as a,
        ):
            assert await a.chunk() == b"some"
            with pytest.raises(UpstreamTimeout):
                await a.chunk()
            await asyncio.sleep(0.1)  # the closed connection does not end it cleanly
            assert not a.complete
            with pytest.raises(UpstreamTimeout):
                await a.chunk()

    run(go())
