"""Shared helpers: run coroutines, serve aiohttp apps on loopback, scripted power sources."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from powerbatch.errors import SensorReadError
from powerbatch.telemetry import PowerSample


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start an app on 127.0.0.1 with a free port; the caller cleans up the runner."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, f"http://127.0.0.1:{port}"


class FuncPowerSource:
    """A power source whose watts come from a function of time: the plant in controller tests.

    Returning None from the function makes the read fail, as a broken sensor would.
    """

    name = "func"

    def __init__(self, fn: Callable[[], float | None]) -> None:
        self.fn = fn

    async def read(self) -> PowerSample:
        value = self.fn()
        if value is None:
            raise SensorReadError("scripted failure")
        return PowerSample(time.monotonic(), value, None)

    async def close(self) -> None:
        return None
