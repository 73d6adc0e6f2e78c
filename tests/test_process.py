"""powerbatch.cli.process.Child: the one launch-wait-stop helper, sync and async."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run

from powerbatch.cli.process import Child, ChildFailed, _ephemeral_low, free_port
from powerbatch.errors import PowerbatchError

PY = (sys.executable,)
SERVE = ["-m", "http.server", "--bind", "127.0.0.1"]


def test_a_child_that_exits_fails_with_its_log(tmp_path: Path) -> None:
    child = Child("oops", ["-c", "print('boom'); raise SystemExit(3)"], tmp_path, command=PY)
    child.launch()
    with pytest.raises(ChildFailed, match=r"(?s)oops exited \(3\).*boom"):
        child.wait_ready(f"http://127.0.0.1:{free_port()}/", timeout_s=10)
    assert isinstance(ChildFailed("x"), PowerbatchError)


def test_sync_launch_ready_terminate(tmp_path: Path) -> None:
    port = free_port()
    child = Child("http", [*SERVE, str(port)], tmp_path, command=PY, new_session=True)
    child.launch()
    child.wait_ready(f"http://127.0.0.1:{port}/", timeout_s=20)
    assert child.running()
    assert child.terminate(timeout_s=10) == -signal.SIGTERM
    assert not child.running() and child.returncode == -signal.SIGTERM


def test_async_start_wait_stop(tmp_path: Path) -> None:
    port = free_port()

    async def go() -> None:
        child = Child("http", [*SERVE, str(port)], tmp_path, command=PY)
        await child.start(f"http://127.0.0.1:{port}/", timeout_s=20)
        with pytest.raises(TimeoutError):
            await child.wait(0.1)
        assert await child.stop() == -signal.SIGTERM
        assert await child.stop() == -signal.SIGTERM  # idempotent

    run(go())


def test_free_ports_are_drawn_below_the_ephemeral_range() -> None:
    """An outgoing connection may take any ephemeral port before the child given it binds."""
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), sorted(ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free, as promised


def test_sigterm_stops_a_harness_through_its_finally_blocks(tmp_path: Path) -> None:
    """A bench stopped with `kill` must stop the children it started: its coroutine is
    cancelled, its `finally` blocks run, and it exits 143, as after Ctrl-C."""
    mark = tmp_path / "stopped"
    code = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from powerbatch.cli.process import run_stopping_children

        async def harness():
            try:
                print("running", flush=True)
                await asyncio.sleep(60)
            finally:
                Path({str(mark)!r}).write_text("children stopped")

        run_stopping_children(harness())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert mark.read_text() == "children stopped"
