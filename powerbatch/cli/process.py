"""Launch a child process, wait until it answers, stop it: the one helper for servers we start.

`Child` runs a command with its output in a log file, is ready when a URL answers 200, and is
stopped with SIGTERM (SIGKILL after a grace period). Both sync callers (tests, harnesses) and
async ones (the demo's and the bench's stack) use it: `launch`/`wait_ready`/`terminate` block,
`start`/`stop`/`wait` are their async twins. `run_stopping_children` runs a harness so that
SIGTERM stops the children it started, as Ctrl-C does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from powerbatch.errors import PowerbatchError

POWERBATCH = (sys.executable, "-m", "powerbatch")
"""The default command prefix: `python -m powerbatch` of this interpreter."""

T = TypeVar("T")


def run_stopping_children(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`, where SIGTERM cancels it as Ctrl-C does, so that its `finally`
    blocks stop the children it started, and the process exits 143 (128 + SIGTERM). Without
    it a bench stopped with `kill` left its simulators, proxies and Redis running."""

    async def main() -> T:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await coro
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        raise SystemExit(128 + signal.SIGTERM) from None


def _ephemeral_low() -> int:
    """The first port of the OS's ephemeral range (Linux's ip_local_port_range; 32768 else)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` now, free until someone binds it. Drawn below the
    ephemeral range: a port the OS picks for bind(0) is one it may hand to any outgoing
    connection before the child that was given it binds (a bench starting many children at
    once lost that race)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket() as s:  # a crowded range below: the OS's pick, as before
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ChildFailed(PowerbatchError, RuntimeError):
    """A child exited or did not become ready; the message ends with its log's tail."""


class Child:
    """`command + args` as a child process with stdout and stderr in `log_dir/<name>.log`.

    `command` defaults to `python -m powerbatch`; pass `command=()` to give the full argv in
    `args`. `env` replaces the environment (default: this process's), with PYTHONUNBUFFERED=1
    added. `new_session` puts the child in a process group of its own, and every signal then
    goes to the whole group (servers that fork workers, such as `vllm serve`).
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_dir: Path,
        *,
        command: Sequence[str] = POWERBATCH,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.argv = [*command, *self.args]
        self.log_path = log_dir / f"{name}.log"
        self.env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None

    # ---- state ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never launched"
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (checked now), else None."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def send_signal(self, sig: int) -> None:
        """Signal the child (its whole group with `new_session`); a no-op once it has exited."""
        if not self.running():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def _failed(self, what: str) -> ChildFailed:
        return ChildFailed(f"{self.name} {what}:\n{self.log_tail()}")

    # ---- sync ----------------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the process and return at once (not yet ready)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=self.new_session,
            )

    def wait_ready(self, url: str, timeout_s: float = 30.0, interval_s: float = 0.1) -> None:
        """Block until GET `url` answers 200. On exit or timeout: stop it, raise ChildFailed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise self._failed(f"exited ({self.returncode}) before {url} answered")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(url, timeout=2.0) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(interval_s)
        self.terminate()
        raise self._failed(f"did not become ready at {url} in {timeout_s:g} s")

    def terminate(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status (None: never ran)."""
        if self.proc is None:
            return None
        self.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGKILL)
            return self.proc.wait(10.0)

    # ---- async ---------------------------------------------------------------------------------

    async def start(self, ready_url: str, timeout_s: float = 30.0) -> None:
        """Launch, then wait (without blocking the loop) until GET `ready_url` answers 200."""
        self.launch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession() as session:
            while loop.time() < deadline and self.running():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with asyncio.timeout(1.0), session.get(ready_url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)
        await self.stop()
        raise self._failed(f"did not become ready at {ready_url}")

    async def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the exit without blocking the loop; TimeoutError after `timeout_s`."""
        assert self.proc is not None, f"{self.name} was never launched"
        async with asyncio.timeout(timeout_s):
            while (code := self.proc.poll()) is None:  # noqa: ASYNC110 - no event: a Popen
                await asyncio.sleep(0.02)
        return code

    async def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status (None: never ran)."""
        if self.proc is None:
            return None
        self.send_signal(signal.SIGTERM)
        try:
            return await self.wait(timeout_s)
        except TimeoutError:
            self.send_signal(signal.SIGKILL)
            return await self.wait(10.0)
