"""The process: SIGTERM drains `powerbatch serve` (a real child in front of `powerbatch sim`).

Draining means: admission closes at once (queued and new requests get 503 `draining`), requests
already upstream run to completion within the grace period, then the process exits 0; a new
process on the same port starts cleanly.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
from conftest import run
from helpers import async_wait_until

from powerbatch.cli.process import Child
from powerbatch.cli.stack import Stack

CHAT = "/v1/chat/completions"
GRACE_S = 15.0


def body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "sim-llama",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


async def call(s: aiohttp.ClientSession, url: str, max_tokens: int, stream: bool) -> Any:
    async with s.post(url + CHAT, json=body(max_tokens, stream)) as r:
        return r.status, await r.read()


async def status(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/status") as r:
        data: dict[str, Any] = await r.json()
        return data


def test_sigterm_drains_in_flight_rejects_queued_and_restarts_cleanly(tmp_path: Path) -> None:
    proxy_args = [
        "--ceiling-w", "1000", "--min-batch", "1", "--initial-batch", "2", "--max-batch", "2",
        "--warmup-s", "1000", "--drain-grace-s", str(GRACE_S), "--upstream-metrics",
    ]  # fmt: skip

    async def go() -> None:
        async with Stack(tmp_path, proxy_args=proxy_args) as stack, aiohttp.ClientSession() as s:
            assert stack.proxy is not None and stack.proxy.running()
            url = stack.proxy_url
            inflight = [asyncio.create_task(call(s, url, 300, stream)) for stream in (True, False)]

            async def in_flight() -> bool:
                return bool((await status(s, url))["queue"]["in_flight"] == 2)

            await async_wait_until(in_flight, 5.0, "both long requests in flight")
            queued = [asyncio.create_task(call(s, url, 10, i % 2 == 0)) for i in range(3)]

            async def queued_3() -> bool:
                return sum((await status(s, url))["queue"]["queued"].values()) == 3

            await async_wait_until(queued_3, 5.0, "three requests queued")
            t_term = time.monotonic()
            stack.proxy.send_signal(signal.SIGTERM)
            for task in queued:  # answered at once, not after the in-flight work
                st, raw = await task
                assert st == 503 and json.loads(raw)["error"]["code"] == "draining"
            assert time.monotonic() - t_term < 1.0
            st, raw = await call(s, url, 10, False)  # new work is refused while draining
            assert st == 503 and json.loads(raw)["error"]["code"] == "draining"
            async with s.get(url + "/ready") as r:
                assert r.status == 503 and "draining" in (await r.json())["problems"]
            # The in-flight requests finish whole.
            (st1, streamed), (st2, whole) = [await t for t in inflight]
            assert st1 == 200 and streamed.rstrip().endswith(b"data: [DONE]")
            assert b'"completion_tokens":300' in streamed.replace(b" ", b"")
            assert st2 == 200 and json.loads(whole)["usage"]["completion_tokens"] == 300
            code = await stack.proxy.wait(GRACE_S)
            assert code == 0
            assert time.monotonic() - t_term < GRACE_S
            try:
                await call(s, url, 5, False)
                raise AssertionError("the old process still listens")
            except aiohttp.ClientConnectionError:
                pass
            log = stack.proxy.log_path.read_text()
            assert "draining: 2 in flight, 3 queued" in log and "Traceback" not in log
            assert "Unclosed" not in log  # every HTTP session it opened (the scraper's too) closed
            # A restart on the same port starts cleanly and serves.
            again = Child("proxy-restarted", stack.proxy.args, tmp_path)
            await again.start(url + "/ready")
            try:
                st, _ = await call(s, url, 5, True)
                assert st == 200
                fresh = await status(s, url)
                assert sum(fresh["queue"]["admitted_total"].values()) == 1
                assert fresh["queue"]["in_flight"] == 0 and not fresh["queue"]["draining"]
            finally:
                await again.stop()
            assert again.returncode == 0

    run(go())
