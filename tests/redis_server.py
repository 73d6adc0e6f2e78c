"""A real `redis-server` on 127.0.0.1 for the fleet tests, started and stopped per test.

No Redis on PATH: the tests skip here, but fail where CI is set, so CI cannot skip silently
(`.ci/run` installs it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from powerbatch.cli.process import free_port


class RedisServer:
    """One redis-server without persistence; `kill` and `start` again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                exe,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: Redis dies as a crash would, with no goodbye to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def redis_or_skip() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not on PATH and CI is set: the fleet tests must run")
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    redis_or_skip()
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
