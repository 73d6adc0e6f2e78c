"""Polling with a deadline that fails loudly: a condition that never comes true is a failure.

A bare `while time.monotonic() < deadline:` (or `for _ in range(n): ... sleep`) loop falls
through silently when its condition never holds, and the test then fails later, somewhere less
clear, or not at all. These raise AssertionError naming what was awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

What = str | Callable[[], str]


def _message(what: What, timeout_s: float, last: object) -> str:
    text = what() if callable(what) else what
    return f"timed out after {timeout_s:g} s waiting for {text} (last: {last!r})"


def wait_until(cond: Callable[[], T], timeout_s: float, what: What, interval_s: float = 0.05) -> T:
    """Call `cond` until it returns something truthy, and return that; AssertionError naming
    `what` (a string, or a function called at failure time, e.g. to add a log's tail) after
    `timeout_s`. `cond` is always called at least once."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = cond()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(_message(what, timeout_s, last))
        time.sleep(interval_s)


async def async_wait_until(
    cond: Callable[[], Awaitable[T]], timeout_s: float, what: What, interval_s: float = 0.05
) -> T:
    """`wait_until` for a coroutine condition, sleeping without blocking the event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        last = await cond()
        if last:
            return last
        if loop.time() >= deadline:
            raise AssertionError(_message(what, timeout_s, last))
        await asyncio.sleep(interval_s)
