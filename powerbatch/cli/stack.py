"""Start the simulator and the proxy as child processes on loopback, as a user would run them.

Separate processes keep the simulator's step timing honest: in one event loop with the proxy
and the load, every relay would delay the GPU's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from types import TracebackType

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A `python -m powerbatch ...` child with its output in a log file; stopped with SIGTERM."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, ready_url: str, timeout_s: float = 30.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115, ASYNC230 - a local file, handed to the child
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "powerbatch",
            *self.args,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        log.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession() as session:
            while loop.time() < deadline:
                if self.proc.returncode is not None:
                    break
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with asyncio.timeout(1.0), session.get(ready_url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        await self.stop()
        raise RuntimeError(f"{self.name} did not become ready at {ready_url}:\n{tail}")

    async def stop(self, timeout_s: float = 15.0) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


class Stack:
    """The simulator, and optionally the proxy in front of it. Use as an async context manager."""

    def __init__(
        self,
        log_dir: Path,
        *,
        sim_args: list[str] | None = None,
        proxy_args: list[str] | None = None,
        with_proxy: bool = True,
    ) -> None:
        self.sim_port = free_port()
        self.proxy_port = free_port()
        self.sim_url = f"http://127.0.0.1:{self.sim_port}"
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        self.sim = Child("sim", ["sim", "--port", str(self.sim_port), *(sim_args or [])], log_dir)
        self.proxy: Child | None = None
        if with_proxy:
            args = [
                "serve",
                "--upstream",
                self.sim_url,
                "--port",
                str(self.proxy_port),
                "--power-source",
                "dcgm",
                "--dcgm-url",
                self.sim_url + "/metrics",
                "--dcgm-metric",
                "DCGM_FI_DEV_POWER_USAGE_INSTANT",
                *(proxy_args or []),
            ]
            self.proxy = Child("proxy", args, log_dir)

    @property
    def entry_url(self) -> str:
        """Where the load goes: the proxy when there is one, else the simulator itself."""
        return self.proxy_url if self.proxy else self.sim_url

    async def __aenter__(self) -> Stack:
        await self.sim.start(self.sim_url + "/health")
        if self.proxy:
            try:
                await self.proxy.start(self.proxy_url + "/ready")
            except BaseException:
                await self.sim.stop()
                raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proxy:
            await self.proxy.stop()
        await self.sim.stop()
