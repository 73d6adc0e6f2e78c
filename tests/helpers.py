"""Waiting in tests: polling that fails loudly, and an event loop with a virtual clock.

A bare `while time.monotonic() < deadline:` (or `for _ in range(n): ... sleep`) loop falls
through silently when its condition never holds, and the test then fails later, somewhere less
clear, or not at all. `wait_until` raises AssertionError naming what was awaited.

Code whose timing is the point (pacing, timeouts) runs on `run_virtual`'s loop instead of
being timed against the wall clock: its time jumps to the next timer whenever nothing is ready,
so a paced second takes no real time and the result does not depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import inspect
import selectors
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

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
    cond: Callable[[], T | Awaitable[T]], timeout_s: float, what: What, interval_s: float = 0.05
) -> T:
    """`wait_until` inside an event loop: sleeps without blocking it; `cond` may be a plain
    function or a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = cond()
        last: T = await got if inspect.isawaitable(got) else got
        if last:
            return last
        if loop.time() >= deadline:
            raise AssertionError(_message(what, timeout_s, last))
        await asyncio.sleep(interval_s)


class _JumpSelector(selectors.DefaultSelector):
    """Never sleeps: polls, and when nothing is ready moves the loop's clock by the timeout."""

    loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if not ready and timeout and self.loop is not None:
            self.loop.now_s += timeout  # asyncio's timeout is the wait for the next timer
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` only moves when every task waits on a timer.

    For in-memory code (no sockets that need real time to answer). Pass `loop.time` as the
    clock of code under test, so its own arithmetic and the loop's timers share one clock.
    """

    def __init__(self) -> None:
        selector = _JumpSelector()
        super().__init__(selector)
        selector.loop = self
        self.now_s = 1000.0

    def time(self) -> float:
        return self.now_s


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
