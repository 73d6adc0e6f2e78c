"""--hardware-backstop: the NVML power limit is set to the ceiling, read back, and restored,
after a crash too.

pynvml is replaced in sys.modules by the fake from test_telemetry_nvml, so `powerbatch serve`
runs its real code path (power source and limiter both through NVML) without a GPU; for the
crash, a child process whose fake GPUs keep their limits in a file, as the driver does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pynvml
import pytest
from conftest import run
from faults import upstream
from helpers import async_wait_until, wait_until
from test_telemetry_nvml import FakeGpu, fake_nvml

from powerbatch.cli.serve import serve
from powerbatch.cli.settings import SERVE, ServeSettings
from powerbatch.cli.stack import free_port
from powerbatch.errors import ConfigError, PowerLimitError
from powerbatch.settings import load


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The limiter's crash-recovery file goes under the test's own directory."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


def options(upstream_url: str, **over: Any) -> ServeSettings:
    base: dict[str, Any] = {
        "upstream": upstream_url,
        "port": free_port(),
        "ceiling_w": 800.0,
        "power_source": "nvml",
        "gpus": "0,1",
        "hardware_backstop": True,
        "upstream_metrics": False,
        "drain_grace_s": 1.0,
    }
    settings: ServeSettings = load(SERVE, overrides=base | over)
    return settings


async def serve_until_up(o: ServeSettings, check: Any) -> None:
    """Run `serve` in-process, call `check()` once it answers, then stop it like SIGTERM does."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(o, stop=stop))
    url = f"http://127.0.0.1:{o.proxy.port}/health"
    async with aiohttp.ClientSession() as s:

        async def up() -> bool:
            if task.done():
                await task  # raises what start-up raised
            try:
                async with s.get(url) as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await async_wait_until(up, 4.0, f"serve to answer {url}", interval_s=0.02)
    check()
    stop.set()
    async with asyncio.timeout(10):
        await task


def test_backstop_sets_clamps_reads_back_and_restores(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [FakeGpu(limit_mw=700_000), FakeGpu(limit_mw=650_000)]
    nvml = fake_nvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    def while_serving() -> None:
        assert [g.limit_mw for g in gpus] == [400_000, 400_000]  # 800 W over two GPUs
        assert "nvmlDeviceGetEnforcedPowerLimit" in nvml.calls  # read back, not assumed

    async def go() -> None:
        async with upstream() as up:
            await serve_until_up(options(up.url), while_serving)

    with caplog.at_level(logging.INFO, logger="powerbatch"):
        run(go())
    assert [g.limit_mw for g in gpus] == [700_000, 650_000]  # restored on shutdown
    assert "NVML power limit 800 W in force" in caplog.text
    assert nvml.calls.count("nvmlShutdown") >= 2  # the source's and the limiter's handles


def test_backstop_below_the_device_minimum_is_clamped_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [FakeGpu(min_mw=200_000, limit_mw=700_000)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus))

    def while_serving() -> None:
        assert gpus[0].limit_mw == 200_000  # the lowest the driver accepts

    async def go() -> None:
        async with upstream() as up:
            await serve_until_up(options(up.url, gpus="0", ceiling_w=150.0), while_serving)

    with caplog.at_level(logging.WARNING, logger="powerbatch"):
        run(go())
    assert gpus[0].limit_mw == 700_000
    assert "lowest allowed power limit (200 W) is above the ceiling" in caplog.text


def test_backstop_without_permission_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(fail={"nvmlDeviceSetPowerManagementLimit": pynvml.NVML_ERROR_NO_PERMISSION})]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus))

    async def go() -> None:
        async with upstream() as up:
            o = options(up.url, gpus="0")
            with pytest.raises(PowerLimitError, match="no permission"):
                await serve(o, stop=asyncio.Event())
            async with aiohttp.ClientSession() as s:  # nothing was left listening
                with pytest.raises(aiohttp.ClientConnectionError):
                    await s.get(f"http://127.0.0.1:{o.proxy.port}/health")

    run(go())
    assert gpus[0].limit_mw == 700_000


def test_backstop_needs_the_nvml_power_source() -> None:
    with pytest.raises(ConfigError, match="needs nvml"):
        options("http://127.0.0.1:9", power_source="dcgm")


def test_backstop_is_off_by_default() -> None:
    o = load(SERVE, overrides={"upstream": "http://127.0.0.1:9", "ceiling_w": 500})
    assert o.hardware_backstop is False


# A child `powerbatch serve` on fake GPUs whose limits live in a file: they outlive the process.
CHILD = """
import dataclasses, json, os, sys
sys.path.insert(0, {tests!r})
from test_telemetry_nvml import FakeGpu, fake_nvml
gpus = [FakeGpu(**g) for g in json.load(open({state!r}))]
nvml = fake_nvml(gpus)
set_limit = nvml.nvmlDeviceSetPowerManagementLimit
def persisted(handle, mw):
    set_limit(handle, mw)
    with open({state!r} + ".tmp", "w") as f:
        json.dump([dataclasses.asdict(g) for g in gpus], f)
    os.replace({state!r} + ".tmp", {state!r})
nvml.nvmlDeviceSetPowerManagementLimit = persisted
sys.modules["pynvml"] = nvml
from powerbatch.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_limit_left_by_kill_9_is_restored_by_the_next_start(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    state.write_text(
        json.dumps([dataclasses.asdict(FakeGpu(limit_mw=mw)) for mw in (700_000, 650_000)])
    )
    code = CHILD.format(tests=str(Path(__file__).parent), state=str(state))
    argv = [
        sys.executable, "-c", code, "serve", "--upstream", "http://127.0.0.1:9",
        "--port", str(free_port()), "--ceiling-w", "800", "--power-source", "nvml", "--gpus", "0,1",
        "--hardware-backstop", "--limit-state-dir", str(tmp_path / "state"),
    ]  # fmt: skip

    def limits_mw() -> list[int]:
        return [g["limit_mw"] for g in json.loads(state.read_text())]

    def start(log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ)

    first = start(tmp_path / "first.log")
    try:
        wait_until(lambda: limits_mw() == [400_000, 400_000], 20.0, "the backstop to set 800 W")
    finally:
        first.kill()  # SIGKILL: no restore, no cleanup
        first.wait(10)
    assert limits_mw() == [400_000, 400_000]  # the limit outlived the process

    log = tmp_path / "second.log"
    second = start(log)
    try:
        wait_until(lambda: "powerbatch listening" in log.read_text(), 20.0, log.read_text)
        second.send_signal(signal.SIGTERM)
        assert second.wait(20) == 0, log.read_text()
    finally:
        if second.poll() is None:
            second.kill()
    assert limits_mw() == [700_000, 650_000]  # what was set before the first run
    assert "did not restore it; restoring 700/650 W" in log.read_text()
