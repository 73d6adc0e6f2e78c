"""--hardware-backstop: the NVML power limit is set to the ceiling, read back, and restored.

pynvml is replaced in sys.modules by the fake from test_telemetry_nvml, so `powerbatch serve`
runs its real code path (power source and limiter both through NVML) without a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import aiohttp
import pynvml
import pytest
from conftest import run
from faults import upstream
from helpers import async_wait_until
from test_telemetry_nvml import FakeGpu, fake_nvml

from powerbatch.cli.serve import serve
from powerbatch.cli.settings import SERVE, ServeSettings
from powerbatch.cli.stack import free_port
from powerbatch.errors import ConfigError, PowerLimitError
from powerbatch.settings import load


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
