"""NvmlPowerSource and NvmlPowerLimiter against a fake pynvml module.

The fake reuses the real pynvml's constants, NVMLError classes and c_nvmlFieldValue_t struct
(none of which need a driver) and replaces only the C calls, so the code under test sees the same
types and error codes it would on a GPU machine.
"""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from powerbatch.errors import PowerLimitError, SensorReadError, SensorUnavailable
from powerbatch.telemetry import (
    NvmlPowerLimiter,
    NvmlPowerSource,
    PowerSource,
    default_power_limit_w,
    nvml_available,
)


@dataclass
class FakeGpu:
    instant_mw: int | None = 300_000  # None: field 186 not supported on this GPU
    average_mw: int = 250_000
    energy_mj: int | None = 5_000_000  # None: energy counter not supported
    min_mw: int = 200_000
    max_mw: int = 700_000
    default_mw: int = 700_000
    limit_mw: int = 700_000
    external_cap_mw: int | None = None  # a lower limit set by someone else
    fail: dict[str, int] = field(default_factory=dict)  # call name -> NVML error code
    field_status: int = pynvml.NVML_SUCCESS
    uuid: str = ""  # nvmlDeviceGetHandleByUUID finds it by this
    pci_bus_id: str = ""  # nvmlDeviceGetPciInfo's busId


def fake_nvml(gpus: list[FakeGpu], *, init_error: int | None = None) -> Any:
    """A module object with pynvml's API; `calls` records what was called."""
    module: Any = types.ModuleType("fake_pynvml")
    for name in dir(pynvml):
        if name.startswith(("NVML_", "NVMLError")):
            setattr(module, name, getattr(pynvml, name))
    module.calls = []

    def guarded(name: str, gpu: FakeGpu) -> None:
        module.calls.append(name)
        if name in gpu.fail:
            raise pynvml.NVMLError(gpu.fail[name])

    def init() -> None:
        module.calls.append("nvmlInit")
        if init_error is not None:
            raise pynvml.NVMLError(init_error)

    def get_field_values(gpu: FakeGpu, ids: list[tuple[int, int]]) -> Any:
        guarded("nvmlDeviceGetFieldValues", gpu)
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for i, (field_id, scope) in enumerate(ids):
            values[i].fieldId, values[i].scopeId = field_id, scope
            if field_id != pynvml.NVML_FI_DEV_POWER_INSTANT or gpu.instant_mw is None:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            values[i].nvmlReturn = gpu.field_status
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            values[i].value.uiVal = gpu.instant_mw
        return values

    def power_usage(gpu: FakeGpu) -> int:
        guarded("nvmlDeviceGetPowerUsage", gpu)
        return gpu.average_mw

    def energy(gpu: FakeGpu) -> int:
        guarded("nvmlDeviceGetTotalEnergyConsumption", gpu)
        if gpu.energy_mj is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.energy_mj

    def set_limit(gpu: FakeGpu, mw: int) -> None:
        guarded("nvmlDeviceSetPowerManagementLimit", gpu)
        if not gpu.min_mw <= mw <= gpu.max_mw:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu.limit_mw = mw

    def enforced(gpu: FakeGpu) -> int:
        guarded("nvmlDeviceGetEnforcedPowerLimit", gpu)
        return min(gpu.limit_mw, gpu.external_cap_mw or gpu.limit_mw)

    def handle_by_index(index: int) -> FakeGpu:
        module.calls.append("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpus[index]

    def handle_by_uuid(uuid: str | bytes) -> FakeGpu:
        module.calls.append("nvmlDeviceGetHandleByUUID")
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in gpus:
            if gpu.uuid and gpu.uuid == wanted:
                return gpu
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def pci_info(gpu: FakeGpu) -> Any:
        guarded("nvmlDeviceGetPciInfo", gpu)
        return types.SimpleNamespace(busId=gpu.pci_bus_id.encode())  # pynvml: bytes

    module.nvmlInit = init
    module.nvmlDeviceGetHandleByUUID = handle_by_uuid
    module.nvmlDeviceGetPciInfo = pci_info
    module.nvmlShutdown = lambda: module.calls.append("nvmlShutdown")
    module.nvmlDeviceGetCount = lambda: len(gpus)
    module.nvmlDeviceGetHandleByIndex = handle_by_index
    module.nvmlDeviceGetFieldValues = get_field_values
    module.nvmlDeviceGetPowerUsage = power_usage
    module.nvmlDeviceGetTotalEnergyConsumption = energy
    module.nvmlDeviceGetPowerManagementLimitConstraints = lambda g: [g.min_mw, g.max_mw]
    module.nvmlDeviceGetPowerManagementDefaultLimit = lambda g: g.default_mw
    module.nvmlDeviceGetPowerManagementLimit = lambda g: g.limit_mw
    module.nvmlDeviceSetPowerManagementLimit = set_limit
    module.nvmlDeviceGetEnforcedPowerLimit = enforced
    return module


def read(source: NvmlPowerSource) -> Any:
    return asyncio.run(source.read())


def test_sums_instant_power_and_energy_over_the_set() -> None:
    gpus = [
        FakeGpu(instant_mw=301_000, energy_mj=1_000),
        FakeGpu(instant_mw=299_500, energy_mj=2_500),
    ]
    source = NvmlPowerSource([0, 1], nvml=fake_nvml(gpus))
    assert isinstance(source, PowerSource)
    sample = read(source)
    assert sample.power_w == pytest.approx(600.5)
    assert sample.energy_j == pytest.approx(3.5)
    assert source.instant_power == [True, True]


def test_only_the_selected_gpus_are_summed() -> None:
    gpus = [FakeGpu(instant_mw=100_000), FakeGpu(instant_mw=200_000), FakeGpu(instant_mw=400_000)]
    assert read(NvmlPowerSource([2, 0], nvml=fake_nvml(gpus))).power_w == pytest.approx(500.0)


def test_falls_back_to_averaged_power_per_gpu_and_remembers() -> None:
    gpus = [FakeGpu(instant_mw=None, average_mw=250_000), FakeGpu(instant_mw=320_000)]
    nvml = fake_nvml(gpus)
    source = NvmlPowerSource([0, 1], nvml=nvml)
    assert read(source).power_w == pytest.approx(570.0)
    assert source.instant_power == [False, True]
    nvml.calls.clear()
    read(source)
    # GPU 0 goes straight to the average, GPU 1 keeps using the field.
    assert nvml.calls.count("nvmlDeviceGetFieldValues") == 1
    assert nvml.calls.count("nvmlDeviceGetPowerUsage") == 1


def test_prefer_instant_false_uses_averaged_power() -> None:
    source = NvmlPowerSource(nvml=fake_nvml([FakeGpu()]), prefer_instant=False)
    assert read(source).power_w == pytest.approx(250.0)


def test_energy_is_none_if_any_gpu_lacks_the_counter() -> None:
    gpus = [FakeGpu(energy_mj=1_000), FakeGpu(energy_mj=None)]
    sample = read(NvmlPowerSource([0, 1], nvml=fake_nvml(gpus)))
    assert sample.energy_j is None
    assert sample.power_w == pytest.approx(600.0)


def test_lost_gpu_is_unavailable_and_names_the_index() -> None:
    gpus = [FakeGpu(), FakeGpu(fail={"nvmlDeviceGetFieldValues": pynvml.NVML_ERROR_GPU_IS_LOST})]
    with pytest.raises(SensorUnavailable, match="GPU 1"):
        read(NvmlPowerSource([0, 1], nvml=fake_nvml(gpus)))


def test_field_value_error_status_is_mapped() -> None:
    gpu = FakeGpu(field_status=pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(SensorReadError, match="GPU 0"):
        read(NvmlPowerSource(nvml=fake_nvml([gpu])))


def test_other_errors_are_read_errors() -> None:
    gpu = FakeGpu(instant_mw=None, fail={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_TIMEOUT})
    with pytest.raises(SensorReadError, match="GPU 0") as info:
        read(NvmlPowerSource(nvml=fake_nvml([gpu])))
    assert not isinstance(info.value, SensorUnavailable)


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND]
)
def test_init_failure_is_unavailable(code: int) -> None:
    with pytest.raises(SensorUnavailable):
        NvmlPowerSource(nvml=fake_nvml([FakeGpu()], init_error=code))


def test_missing_index_is_unavailable_and_shuts_down() -> None:
    nvml = fake_nvml([FakeGpu()])
    with pytest.raises(SensorUnavailable, match=r"\[3\]"):
        NvmlPowerSource([0, 3], nvml=nvml)
    assert nvml.calls[-1] == "nvmlShutdown"


def test_close_shuts_down_once() -> None:
    nvml = fake_nvml([FakeGpu()])
    source = NvmlPowerSource(nvml=nvml)

    async def close_twice() -> None:
        await source.close()
        await source.close()

    asyncio.run(close_twice())
    assert nvml.calls.count("nvmlInit") == 1
    assert nvml.calls.count("nvmlShutdown") == 1


def test_real_pynvml_without_driver_is_unavailable() -> None:
    if nvml_available():
        pytest.skip("this machine has a working NVML")
    with pytest.raises(SensorUnavailable):
        NvmlPowerSource()
    with pytest.raises(PowerLimitError):
        NvmlPowerLimiter()


def test_package_import_does_not_import_pynvml() -> None:
    code = "import sys, powerbatch.telemetry; assert 'pynvml' not in sys.modules"
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_nvml_available_with_fakes() -> None:
    assert nvml_available(fake_nvml([FakeGpu()]))
    assert not nvml_available(fake_nvml([]))
    assert not nvml_available(
        fake_nvml([FakeGpu()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    )


# --- limiter -----------------------------------------------------------------------------------


def test_limiter_sets_per_gpu_and_reads_set_and_enforced() -> None:
    gpus = [FakeGpu(), FakeGpu(external_cap_mw=300_000)]  # GPU 1 capped lower by someone else
    nvml = fake_nvml(gpus)
    limiter = NvmlPowerLimiter([0, 1], nvml=nvml)
    assert limiter.constraints_w() == [(200.0, 700.0), (200.0, 700.0)]
    assert "nvmlDeviceSetPowerManagementLimit" not in nvml.calls  # opening changes nothing
    limiter.set_limits_w([500.0, 400.0])
    assert [g.limit_mw for g in gpus] == [500_000, 400_000]
    assert limiter.limits_w() == [500.0, 400.0]
    assert limiter.enforced_limits_w() == [500.0, 300.0]  # what is in force, not what was set
    with pytest.raises(PowerLimitError, match="1 limits for 2 GPUs"):
        limiter.set_limits_w([500.0])
    limiter.close()
    assert nvml.calls[-1] == "nvmlShutdown"


def test_limiter_without_permission_says_what_is_needed() -> None:
    gpu = FakeGpu(fail={"nvmlDeviceSetPowerManagementLimit": pynvml.NVML_ERROR_NO_PERMISSION})
    limiter = NvmlPowerLimiter(nvml=fake_nvml([gpu]))
    with pytest.raises(PowerLimitError, match="needs root or CAP_SYS_ADMIN"):
        limiter.set_limits_w([500.0])


def test_limiter_errors_are_power_limit_errors() -> None:
    with pytest.raises(PowerLimitError):
        NvmlPowerLimiter(
            nvml=fake_nvml([FakeGpu()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        )
    gpu = FakeGpu(fail={"nvmlDeviceGetEnforcedPowerLimit": pynvml.NVML_ERROR_UNKNOWN})
    limiter = NvmlPowerLimiter(nvml=fake_nvml([gpu]))
    with pytest.raises(PowerLimitError, match="GPU 0"):
        limiter.enforced_limits_w()


# --- the power model's prior from the device ---------------------------------------------------


def test_default_power_limit_is_the_sets_tdp_read_only() -> None:
    nvml = fake_nvml([FakeGpu(default_mw=700_000), FakeGpu(default_mw=400_000, limit_mw=300_000)])
    assert default_power_limit_w([0, 1], nvml=nvml) == pytest.approx(1100.0)
    assert "nvmlDeviceSetPowerManagementLimit" not in nvml.calls
    assert nvml.calls.count("nvmlInit") == nvml.calls.count("nvmlShutdown")


def test_default_power_limit_is_none_when_nvml_cannot_say() -> None:
    assert (
        default_power_limit_w(nvml=fake_nvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
        is None
    )
    assert default_power_limit_w([3], nvml=fake_nvml([FakeGpu()])) is None  # no such GPU


def test_serve_takes_the_prior_from_nvml_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from powerbatch.cli import serve
    from powerbatch.control import prior_max_w
    from powerbatch.telemetry import factory

    nvml = fake_nvml([FakeGpu(default_mw=700_000)])
    monkeypatch.setattr(
        factory, "default_power_limit_w", lambda g: default_power_limit_w(g, nvml=nvml)
    )
    from powerbatch.cli.settings import SERVE
    from powerbatch.settings import load

    def chosen(**kw: object) -> float | None:
        flat = {"upstream": "http://127.0.0.1:9", "ceiling_w": 600.0, "power_source": "nvml"}
        s = load(SERVE, overrides=flat | kw)
        device_w = serve.device_max_w(s, s.power.power_source)
        return prior_max_w(s.control.max_w, device_w, s.control.ceiling_w)

    assert chosen() == pytest.approx(700.0)
    assert chosen(max_w=800.0) == 800.0  # the operator's figure wins
    assert chosen(ceiling_w=900.0) is None  # ceiling above the TDP
    assert chosen(power_source="dcgm") is None  # no device to ask
