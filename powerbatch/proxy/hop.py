"""The proxy's HTTP/1.1 client for its one upstream: pooled keep-alive connections, nothing else.

Why not aiohttp's `ClientSession`: on the request path its client side is most of what a second
hop costs. With a zero-cost upstream and 64 wrk connections, a bare aiohttp pass-through made
4,300-4,700 requests/s on a 2-core VM and the same pass-through on this client 8,100
(docs/benchmarks.md). The proxy needs none of what that cost buys (cookies, redirects, proxies,
decompression, tracing, many hosts): it writes each request in one piece and parses the answer
with httptools, the llhttp binding uvicorn (and so vLLM's own API server) parses with.

Connections are reused only after an answer that ended cleanly with keep-alive, most recent
first, and only while idle under `IDLE_S`, below uvicorn's 5-s keep-alive, so a request is not
sent down a connection the server is closing. A request is never retried: a POST that reached
a server may have started generating. Reading is paused while more than `HIGH_WATER_BYTES` of
answer wait unread, so a client that reads slowly holds the upstream back, not memory.

Timeouts (the wait for an answer's headers, and for each piece of its body) are kept by one
watchdog that looks at the connections in use every tenth of the shortest timeout (1 s at
most), not by a timer armed and cancelled per wait (`asyncio.timeout` costs about 6 µs a wait,
a few percent of a request at this client's rates): a wait ends with UpstreamTimeout between
its timeout and a tenth of it (1 s at most) later.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections import deque
from collections.abc import Iterable
from types import TracebackType
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from powerbatch.errors import PowerbatchError

# uvicorn closes a connection idle for timeout_keep_alive, 5 s by default
# (https://www.uvicorn.org/settings/#timeouts): reuse only below that.
IDLE_S = 4.0
HIGH_WATER_BYTES = 256 * 1024
# Header bytes as aiohttp's server decodes them, so what is relayed goes out as it came in.
_CODEC = ("utf-8", "surrogateescape")


class UpstreamUnreachable(PowerbatchError):
    """No connection to the upstream could be made (refused, unresolvable, too slow)."""


class UpstreamBroken(PowerbatchError):
    """The upstream broke off, went silent or spoke broken HTTP while answering."""


class UpstreamTimeout(UpstreamBroken):
    """The upstream was silent for longer than allowed (headers, or a piece of the body)."""


class Answer:
    """The upstream's response: status and headers at once, the body as it comes."""

    __slots__ = (
        "_buffered",
        "_conn",
        "_error",
        "_parts",
        "_waiter",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self._parts: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self.complete = False  # the whole body is in (what is unread is buffered here)
        self.status = status
        self.headers = headers

    def body(self) -> bytes:
        """What is buffered, all at once (the whole body once `complete`)."""
        out = b"".join(self._parts)
        self._parts.clear()
        self._buffered = 0
        self._conn.drained()
        return out

    async def chunk(self) -> bytes | None:
        """Everything that has come since the last call, waiting for some; None at the end."""
        while not self._parts:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            conn = self._conn
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            conn.due = loop.time() + conn.pool.read_timeout_s
            try:
                await self._waiter
            finally:
                self._waiter = None
                conn.due = math.inf
        return self.body()

    def _feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._buffered += len(data)
        self._wake()

    def _end(self, error: Exception | None = None) -> None:
        """The body ended, cleanly or with `error`; the first end is the one that counts."""
        if not self.complete and self._error is None:
            self._error = error
            self.complete = error is None
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Give the connection back when the answer ended cleanly, else close it (an unread
        answer closed tells the upstream its client left, so it stops generating)."""
        self._conn.finish(self)

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Connection(asyncio.Protocol):
    """One connection, one request at a time, its answer parsed by httptools' callbacks."""

    def __init__(self, pool: HopClient) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.head: asyncio.Future[Answer] | None = None
        self.answer: Answer | None = None
        self.reusable = False
        self.lost = False
        self.paused = False
        self.head_only = False
        self.idle_since = 0.0
        self.due = math.inf  # when the wait for the answer's headers or next piece times out

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"bad HTTP from the upstream: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.busy.discard(self)
        a = self.answer
        if a is not None and not a.complete and self._ends_at_close():
            a._end()  # a body without a length or chunks ends where the connection does
        else:
            self._fail(UpstreamBroken(f"connection closed: {exc or 'by the upstream'}"))

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.headers = CIMultiDict()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode(*_CODEC), value.decode(*_CODEC))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 or self.head is None or self.head.done():
            return  # an interim answer (100 Continue): the final one follows
        self.due = math.inf
        self.answer = Answer(self, status, self.headers)
        self.head.set_result(self.answer)
        if self.head_only:  # a HEAD answer has no body, whatever its headers say
            self.answer._end()

    def on_body(self, body: bytes) -> None:
        a = self.answer
        if a is not None and not a.complete:
            a._feed(body)
            if a._buffered > HIGH_WATER_BYTES and not self.paused and self.transport:
                self.paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200 or self.answer is None:
            return
        self.reusable = self.parser.should_keep_alive() and not self.head_only
        self.answer._end()

    # -- the pool's side
    def send(self, request: bytes, head_only: bool) -> asyncio.Future[Answer]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.head = loop.create_future()
        self.answer, self.reusable, self.head_only = None, False, head_only
        self.due = loop.time() + self.pool.headers_timeout_s
        self.pool.watch(self)
        self.transport.write(request)
        return self.head

    def expire(self) -> None:
        """The wait in progress has run past its timeout: end it, and the request with it."""
        if self.head is not None and not self.head.done():
            msg = f"no answer within {self.pool.headers_timeout_s:g} s"
        else:
            msg = f"no data for {self.pool.read_timeout_s:g} s"
        self._fail(UpstreamTimeout(msg))
        self.close()

    def drained(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def finish(self, answer: Answer) -> None:
        if answer is not self.answer:
            return  # closed twice
        self.answer = None
        self.pool.busy.discard(self)
        if answer.complete and self.reusable and not self.lost:
            self.drained()
            self.idle_since = time.monotonic()
            self.pool.idle.append(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _ends_at_close(self) -> bool:
        h = self.headers
        return "Content-Length" not in h and "chunked" not in h.get("Transfer-Encoding", "")

    def _fail(self, error: UpstreamBroken) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        if self.answer is not None:
            self.answer._end(error)


class HopClient:
    """Requests to one base URL (http or https, with an optional path prefix)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        headers_timeout_s: float = math.inf,
        read_timeout_s: float = math.inf,
    ) -> None:
        url = urlsplit(base_url)
        self.https = url.scheme == "https"
        self.host = url.hostname or ""
        self.port = url.port or (443 if self.https else 80)
        self.prefix = url.path.rstrip("/")
        default = (443 if self.https else 80) == self.port
        self.host_header = self.host if default else f"{self.host}:{self.port}"
        if ":" in self.host:  # an IPv6 literal keeps its brackets in Host
            self.host_header = f"[{self.host}]" + ("" if default else f":{self.port}")
        self.connect_timeout_s = connect_timeout_s
        self.headers_timeout_s = headers_timeout_s
        self.read_timeout_s = read_timeout_s
        self.watch_s = min(1.0, headers_timeout_s / 10, read_timeout_s / 10)
        self.ssl = ssl.create_default_context() if self.https else None
        self.idle: deque[_Connection] = deque()
        self.busy: set[_Connection] = set()  # with a request in progress
        self._watchdog: asyncio.Task[None] | None = None

    async def request(
        self, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> Answer:
        """Send a request (`target`: path and query below the base) and wait for the answer's
        headers. Raises UpstreamUnreachable, UpstreamTimeout or UpstreamBroken; close the answer
        when done."""
        lines = [f"{method} {self.prefix}{target} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        conn = await self._connection()
        head = conn.send("".join(lines).encode(*_CODEC) + body, method == "HEAD")
        try:
            return await head
        except BaseException:
            conn.close()  # cancelled or broken before the headers: the connection is spent
            raise

    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            msg = f"could not connect within {self.connect_timeout_s:g} s"
            raise UpstreamUnreachable(msg) from None
        except OSError as exc:
            raise UpstreamUnreachable(str(exc) or type(exc).__name__) from exc
        return conn

    def watch(self, conn: _Connection) -> None:
        self.busy.add(conn)
        if self._watchdog is None and math.isfinite(self.watch_s):
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """While connections are in use, expire the waits past their time."""
        loop = asyncio.get_running_loop()
        try:
            while self.busy:
                await asyncio.sleep(self.watch_s)
                now = loop.time()
                for conn in [c for c in self.busy if c.due <= now]:
                    conn.expire()
        finally:
            self._watchdog = None

    def close(self) -> None:
        """Close the idle connections (those in use close with their answers)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        while self.idle:
            self.idle.pop().close()
