"""GPU identity by UUID across NVML, DCGM and zeusd (issue 26): a pod finds the GPUs it was given.

NVML is the fake pynvml of test_telemetry_nvml.py (handles by UUID, PCI bus IDs); DCGM and zeusd
are the simulator's dcgm-exporter endpoint (`UUID` and `pci_bus_id` labels) and its zeusd API
(which, like zeusd, lists PCI addresses and no UUIDs), over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import run
from test_telemetry_nvml import FakeGpu, fake_nvml

from powerbatch.errors import ConfigError, LimiterUnavailable, SensorUnavailable
from powerbatch.sim import SimEngine
from powerbatch.sim.server import SimServer, start_sim_server
from powerbatch.sim.zeusd_api import sim_gpu_pci_bus_id, sim_gpu_uuid
from powerbatch.telemetry.factory import make_limiter, make_power_source, pci_lookup
from powerbatch.telemetry.gpu_ids import pci_key, visible_uuids
from powerbatch.telemetry.limiter import LimitActuator, NvmlLimiter, ZeusdLimiter
from powerbatch.telemetry.nvml import NvmlPowerSource
from powerbatch.telemetry.settings import LimiterSettings, PowerSettings
from powerbatch.telemetry.zeusd import ZeusdPowerSource

UUID_A = "GPU-1d3f0a8e-77b2-4c1a-9a55-0f2c3b9d8e11"
UUID_B = "GPU-8a2b9c4d-1e5f-4a6b-8c7d-2e9f0a1b3c44"


# ---- settings -------------------------------------------------------------------------------


def test_gpus_take_uuids_and_default_to_the_device_plugins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = PowerSettings(gpus=(UUID_B, UUID_A))
    assert s.gpu_indices() == [UUID_B, UUID_A]
    assert s.dcgm_labels() == {"UUID": (UUID_B, UUID_A)}
    assert PowerSettings(gpus=("2", "3")).dcgm_labels() == {"gpu": ("2", "3")}
    assert PowerSettings(gpus=("2", "3")).gpu_indices() == [2, 3]

    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", f"{UUID_A},{UUID_B}")
    assert PowerSettings().gpus == (UUID_A, UUID_B)  # unset: the device plugin's GPUs
    assert PowerSettings(gpus=("1",)).gpus == ("1",)  # set: as set
    for other in ("all", "none", "void", "0,1", ""):  # no UUIDs: today's meaning, GPU 0
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", other)
        assert PowerSettings().gpus == ("0",), other
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES")
    assert PowerSettings().gpus == ("0",)


@pytest.mark.parametrize(
    ("gpus", "match"),
    [
        (("0", UUID_A), "mixes indices and UUIDs"),
        (("MIG-1d3f0a8e-77b2-4c1a-9a55-0f2c3b9d8e11",), "MIG instance"),
        (("nvidia0",), "indices or UUIDs"),
        ((UUID_A, UUID_A), "twice"),
    ],
)
def test_gpus_that_name_no_gpu_are_refused(gpus: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PowerSettings(gpus=gpus)


def test_visible_uuids_and_pci_spellings() -> None:
    assert visible_uuids({"NVIDIA_VISIBLE_DEVICES": f" {UUID_A} "}) == (UUID_A,)
    assert visible_uuids({"NVIDIA_VISIBLE_DEVICES": f"{UUID_A},0"}) is None
    assert pci_key("00000000:1A:00.0") == pci_key("0000:1a:00.0") == (0, 0x1A, 0)
    assert pci_key("0000:1b:00.0") != pci_key("0000:1a:00.0")
    assert pci_key("not-a-bus") is None


# ---- NVML -----------------------------------------------------------------------------------


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(uuid=UUID_A, instant_mw=100_000, pci_bus_id="00000000:18:00.0"),
        FakeGpu(uuid=UUID_B, instant_mw=400_000, pci_bus_id="00000000:1B:00.0"),
    ]


def test_nvml_finds_a_gpu_by_uuid(tmp_path: Path) -> None:
    gpus = two_gpus()

    async def body() -> None:
        source = NvmlPowerSource([UUID_B], nvml=fake_nvml(gpus))
        assert (await source.read()).power_w == pytest.approx(400.0)  # GPU B's, not GPU 0's
        await source.close()
        limiter = NvmlLimiter([UUID_B], state_dir=tmp_path, nvml=fake_nvml(gpus))
        await limiter.start()
        await limiter.set_total_w(300.0)
        assert [g.limit_mw for g in gpus] == [700_000, 300_000]
        assert UUID_B in limiter.state_file.path.name  # stable across restarts, unlike an index
        await limiter.restore()
        await limiter.close()

    run(body())
    assert gpus[1].limit_mw == 700_000


def test_nvml_refuses_a_uuid_it_does_not_see(tmp_path: Path) -> None:
    with pytest.raises(SensorUnavailable, match="NVIDIA_VISIBLE_DEVICES"):
        NvmlPowerSource([UUID_B], nvml=fake_nvml(two_gpus()[:1]))
    limiter = NvmlLimiter([UUID_B], state_dir=tmp_path, nvml=fake_nvml(two_gpus()[:1]))
    with pytest.raises(LimiterUnavailable, match=UUID_B):
        run(limiter.start())


# ---- DCGM and zeusd, against the simulator ---------------------------------------------------

TOKEN = "sim-token-0123"


def with_sim(body: Callable[[SimServer], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        server = await start_sim_server(SimEngine("h100x4-llama70b", seed=3), zeusd_token=TOKEN)
        try:
            return await body(server)
        finally:
            await server.close()

    return run(main())


def limit_source(server: SimServer, gpus: tuple[str, ...]) -> Any:
    """dcgm-exporter's power limit of `gpus`, read as a power source would read power."""
    power = PowerSettings(
        power_source="dcgm", gpus=gpus, dcgm_metric="DCGM_FI_DEV_POWER_MGMT_LIMIT"
    )
    return make_power_source(
        power, "dcgm", dcgm_url=server.url + "/metrics", limiter=LimiterSettings()
    )


def test_a_uuid_meters_and_limits_the_same_gpu_in_dcgm_and_zeusd(tmp_path: Path) -> None:
    # zeusd lists no UUIDs: the limiter finds GPU 2 through DCGM's UUID and pci_bus_id labels.
    uuid = sim_gpu_uuid(2)

    async def body(server: SimServer) -> None:
        settings = LimiterSettings(
            power_limiter="zeusd",
            zeusd_url=server.url,
            zeusd_token=TOKEN,
            limit_state_dir=str(tmp_path),
        )
        limiter = make_limiter(settings, [uuid], dcgm_url=server.url + "/metrics")
        await limiter.start()
        assert await limiter.set_total_w(450.0) == pytest.approx(450.0)
        assert server.engine.gpu_power_limits_w == [700.0, 700.0, 450.0, 700.0]
        dcgm = limit_source(server, (uuid,))
        assert (await dcgm.read()).power_w == pytest.approx(450.0)  # DCGM's series of GPU 2
        assert (await limit_source(server, ("2",)).read()).power_w == pytest.approx(450.0)
        await dcgm.close()

        source = ZeusdPowerSource(
            server.url, [uuid], token=TOKEN, pci_lookup=pci_lookup(server.url + "/metrics")
        )
        await source.read()
        assert source._ids == [2]
        await source.close()
        await limiter.restore()
        assert server.engine.gpu_power_limits_w == [700.0] * 4
        await limiter.close()

    with_sim(body)


def test_zeusd_finds_a_uuid_through_nvml_where_the_process_sees_the_gpu(tmp_path: Path) -> None:
    # The simulated node's GPU 3 is at PCI 00000000:1B:00.0, which the fake NVML gives UUID_B.
    assert sim_gpu_pci_bus_id(3) == "00000000:1B:00.0"
    nvml = fake_nvml(two_gpus())

    async def body(server: SimServer) -> None:
        limiter = ZeusdLimiter(
            server.url,
            [UUID_B],
            token=TOKEN,
            state_dir=tmp_path,
            pci_lookup=pci_lookup(None, nvml=nvml),
        )
        await limiter.start()
        await limiter.set_total_w(500.0)
        assert server.engine.gpu_power_limits_w == [700.0, 700.0, 700.0, 500.0]
        await limiter.restore()
        await limiter.close()

    with_sim(body)


def test_a_uuid_nothing_can_place_is_refused_with_the_fix(tmp_path: Path) -> None:
    nvml = fake_nvml([])  # NVML here sees no GPU, and no dcgm_url is set

    async def body(server: SimServer) -> None:
        lookup = pci_lookup(None, nvml=nvml)
        limiter = ZeusdLimiter(
            server.url, [UUID_A], token=TOKEN, state_dir=tmp_path, pci_lookup=lookup
        )
        actuator = LimitActuator(limiter)
        assert not await actuator.start()
        assert actuator.degraded and "Set dcgm_url" in (actuator.degraded_reason or "")
        await limiter.close()
        source = ZeusdPowerSource(server.url, [UUID_A], token=TOKEN, pci_lookup=lookup)
        with pytest.raises(SensorUnavailable, match="Set dcgm_url"):
            await source.read()
        await source.close()
        # A dcgm-exporter that does not list the UUID does not place it either.
        lookup_dcgm = pci_lookup(server.url + "/metrics", nvml=nvml)
        other = ZeusdPowerSource(server.url, [UUID_A], token=TOKEN, pci_lookup=lookup_dcgm)
        with pytest.raises(SensorUnavailable, match="Set dcgm_url"):
            await other.read()
        await other.close()
        # A GPU at a PCI address zeusd does not list (another node's zeusd).
        elsewhere = fake_nvml([FakeGpu(uuid=UUID_A, pci_bus_id="00000000:99:00.0")])
        lookup_nvml = pci_lookup(None, nvml=elsewhere)
        stray = ZeusdPowerSource(server.url, [UUID_A], token=TOKEN, pci_lookup=lookup_nvml)
        with pytest.raises(SensorUnavailable, match="zeusd does not list"):
            await stray.read()
        await stray.close()
        assert server.engine.gpu_power_limits_w == [700.0] * 4

    with_sim(body)


def test_serve_given_two_uuids_limits_those_gpus_and_restores_them(tmp_path: Path) -> None:
    # The Kubernetes pod's setup: power and limit through zeusd, GPUs by UUID, placed through
    # the node's dcgm-exporter; here against the simulated 4-GPU node.
    from powerbatch.cli.serve import build
    from powerbatch.cli.settings import SERVE
    from powerbatch.settings import load

    async def body(server: SimServer) -> None:
        engine = server.engine
        flat = {
            "upstream": server.url,
            "ceiling_w": 1200.0,
            "power_source": "zeusd",
            "gpus": f"{sim_gpu_uuid(3)},{sim_gpu_uuid(1)}",
            "dcgm_url": server.url + "/metrics",
            "power_limiter": "zeusd",
            "zeusd_url": server.url,
            "zeusd_token": TOKEN,
            "limit_state_dir": str(tmp_path),
            "limit_min_interval_s": 0.0,
            "warmup_s": 0.2,
            "upstream_metrics": False,
        }
        _, gov = build(load(SERVE, overrides=flat))
        await gov.start()
        try:
            for _ in range(100):  # the limit lands ~100 ms after the request
                if engine.gpu_power_limits_w != [700.0] * 4:
                    break
                await asyncio.sleep(0.05)
            # The ceiling less 1 %, split over GPUs 1 and 3 alone.
            assert engine.gpu_power_limits_w == [700.0, 594.0, 700.0, 594.0]
            assert gov.loop.status()["power_limit"]["degraded"] is False
        finally:
            await gov.stop()
        assert engine.gpu_power_limits_w == [700.0] * 4

    with_sim(body)
