"""GPU power through NVML: the only module in powerbatch that touches pynvml.

pynvml is imported inside functions, never at module level, so powerbatch imports (and its
simulator and tests run) on machines without an NVIDIA driver. Every constructor takes an optional
`nvml` module so tests can hand in a fake that imitates pynvml's API.

NVML calls run inline on the event loop rather than through asyncio.to_thread: they are local
ioctl calls that return in well under a millisecond, a thread hop costs about as much, and the
default executor may be busy with other work exactly when the controller needs a reading. A hung
driver is caught one level up: the monitor bounds every read with a timeout and reports staleness.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

from powerbatch.errors import (
    ClockError,
    LimiterPermissionDenied,
    LimiterUnavailable,
    PowerLimitError,
    SensorReadError,
    SensorUnavailable,
)
from powerbatch.telemetry.base import PowerSample
from powerbatch.telemetry.gpu_ids import GpuId

_T = TypeVar("_T")

# NVML return codes (pynvml names) meaning the device or library is gone, not that one call failed.
_UNAVAILABLE_CODES = (
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    "NVML_ERROR_GPU_NOT_FOUND",
)
# A feature this GPU or driver lacks: fall back to another call instead of failing.
_UNSUPPORTED_CODES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")


def _load(nvml: ModuleType | None) -> ModuleType:
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a hard dependency
        raise SensorUnavailable(f"pynvml (nvidia-ml-py) is not installed: {exc}") from exc
    module: ModuleType = pynvml
    return module


def _codes(nvml: ModuleType, names: Sequence[str]) -> frozenset[int]:
    return frozenset(int(getattr(nvml, name)) for name in names if hasattr(nvml, name))


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _field_value(nvml: ModuleType, field: Any) -> float:
    """Read a c_nvmlFieldValue_t's value through the union member its valueType names."""
    members = {
        getattr(nvml, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }
    member = members.get(int(field.valueType), "uiVal")
    return float(getattr(field.value, member))


class _NvmlHandles:
    """nvmlInit once and one handle per GPU, by index or by UUID (nvmlDeviceGetHandleByUUID:
    in a container, NVML numbers only the GPUs it was given, so an index is this process's, a
    UUID the node's); shared by the source and the limiter."""

    def __init__(self, nvml: ModuleType, gpu_indices: Sequence[GpuId]) -> None:
        if not gpu_indices:
            raise ValueError("gpu_indices must name at least one GPU")
        if len(set(gpu_indices)) != len(gpu_indices):
            raise ValueError(f"gpu_indices has duplicates: {list(gpu_indices)}")
        self.nvml = nvml
        self.indices = tuple(gpu_indices)
        self._closed = False
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise SensorUnavailable(f"NVML init failed: {exc}") from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
            missing = [i for i in self.indices if isinstance(i, int) and not 0 <= i < count]
            if missing:
                raise SensorUnavailable(f"no GPU at index {missing} (NVML sees {count} GPUs)")
            self.handles: list[Any] = []
            for gpu in self.indices:
                try:
                    if isinstance(gpu, str):
                        self.handles.append(nvml.nvmlDeviceGetHandleByUUID(gpu))
                    else:
                        self.handles.append(nvml.nvmlDeviceGetHandleByIndex(gpu))
                except nvml.NVMLError as exc:
                    seen = f"NVML sees {count} GPUs here; check NVIDIA_VISIBLE_DEVICES"
                    raise SensorUnavailable(f"GPU {gpu}: no NVML handle: {exc} ({seen})") from exc
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shutting down a library that is already gone is not worth failing over.
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


class NvmlPowerSource:
    """Total power (and energy) over a set of GPUs, read from NVML.

    Per GPU it prefers NVML_FI_DEV_POWER_INSTANT (field 186): nvmlDeviceGetPowerUsage is a
    1-second average on Ampere and newer, which lags a 100 ms control loop by most of a second.
    Where the field is unsupported it falls back to the average, and remembers that per GPU so an
    unsupported call is not retried on every read.
    """

    def __init__(
        self,
        gpu_indices: Sequence[GpuId] = (0,),
        *,
        prefer_instant: bool = True,
        nvml: ModuleType | None = None,
    ) -> None:
        self._nvml = _load(nvml)
        self._unavailable = _codes(self._nvml, _UNAVAILABLE_CODES)
        self._unsupported = _codes(self._nvml, _UNSUPPORTED_CODES)
        self._devices = _NvmlHandles(self._nvml, gpu_indices)
        self.gpu_indices = self._devices.indices
        self.name = f"nvml:{','.join(str(i) for i in self.gpu_indices)}"
        # Per GPU: True = instant field works, False = use the averaged call, None = not tried yet.
        self._instant: list[bool | None] = [None if prefer_instant else False] * len(
            self.gpu_indices
        )
        self._energy: list[bool | None] = [None] * len(self.gpu_indices)

    @property
    def instant_power(self) -> list[bool | None]:
        """Per GPU: whether the instant power field is in use (None until the first read)."""
        return list(self._instant)

    def _map(self, exc: Exception, index: GpuId, what: str) -> SensorUnavailable | SensorReadError:
        message = f"GPU {index}: {what} failed: {exc}"
        if _error_code(exc) in self._unavailable:
            return SensorUnavailable(message)
        return SensorReadError(message)

    def _power_mw(self, slot: int) -> float:
        nvml, handle, index = self._nvml, self._devices.handles[slot], self.gpu_indices[slot]
        if self._instant[slot] is not False:
            try:
                fields = nvml.nvmlDeviceGetFieldValues(
                    handle, [(nvml.NVML_FI_DEV_POWER_INSTANT, 0)]
                )
                status = int(fields[0].nvmlReturn)
                if status == nvml.NVML_SUCCESS:
                    self._instant[slot] = True
                    return _field_value(nvml, fields[0])
                if status not in self._unsupported:
                    raise nvml.NVMLError(status)
            except nvml.NVMLError as exc:
                if _error_code(exc) not in self._unsupported:
                    raise self._map(exc, index, "instant power field") from exc
            self._instant[slot] = False
        try:
            return float(nvml.nvmlDeviceGetPowerUsage(handle))
        except nvml.NVMLError as exc:
            raise self._map(exc, index, "nvmlDeviceGetPowerUsage") from exc

    def _energy_mj(self, slot: int) -> float | None:
        if self._energy[slot] is False:
            return None
        nvml, handle = self._nvml, self._devices.handles[slot]
        try:
            value = float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        except nvml.NVMLError as exc:
            if _error_code(exc) in self._unsupported:
                self._energy[slot] = False
                return None
            raise self._map(exc, self.gpu_indices[slot], "energy counter") from exc
        self._energy[slot] = True
        return value

    async def read(self) -> PowerSample:
        power_mw = 0.0
        energy_mj: float | None = 0.0
        for slot in range(len(self.gpu_indices)):
            power_mw += self._power_mw(slot)
            gpu_energy_mj = self._energy_mj(slot)
            # A sum that leaves out one GPU's joules would be silently wrong: report none instead.
            energy_mj = (
                None if energy_mj is None or gpu_energy_mj is None else (energy_mj + gpu_energy_mj)
            )
        t_s = time.monotonic()
        return PowerSample(
            t_s=t_s,
            power_w=power_mw / 1000.0,
            energy_j=None if energy_mj is None else energy_mj / 1000.0,
        )

    async def close(self) -> None:
        self._devices.shutdown()


class _NvmlDevices:
    """The GPUs a setter drives (power limits, SM clocks): NVML and a handle each, every call
    made per GPU, and an NVML failure told in the setter's own error (`_error`)."""

    def __init__(
        self,
        gpu_indices: Sequence[GpuId],
        nvml: ModuleType | None,
        failed: Callable[[str], Exception],
        purpose: str,
    ) -> None:
        try:
            self._nvml = _load(nvml)
            self._devices = _NvmlHandles(self._nvml, gpu_indices)
        except (SensorUnavailable, SensorReadError) as exc:
            raise failed(f"cannot open GPUs for {purpose}: {exc}") from exc
        self.gpu_indices = self._devices.indices
        self._no_permission = _codes(self._nvml, ("NVML_ERROR_NO_PERMISSION",))

    def _error(self, exc: Exception, index: GpuId, what: str) -> Exception:
        raise NotImplementedError

    def _per_gpu(self, what: str, call: Callable[[Any], _T]) -> list[_T]:
        results: list[_T] = []
        for index, handle in zip(self.gpu_indices, self._devices.handles, strict=True):
            try:
                results.append(call(handle))
            except self._nvml.NVMLError as exc:
                raise self._error(exc, index, what) from exc
        return results

    def close(self) -> None:
        """Release NVML; the limits or clocks stay as they are."""
        self._devices.shutdown()


class NvmlPowerLimiter(_NvmlDevices):
    """Read and set the hardware power limit of a set of GPUs, one value per GPU (synchronous).

    The device calls only: splitting a total, clamping, what to restore and the crash-recovery
    record are `powerbatch.telemetry.limiter.NvmlLimiter`'s, which every caller goes through.
    """

    def __init__(
        self, gpu_indices: Sequence[GpuId] = (0,), *, nvml: ModuleType | None = None
    ) -> None:
        super().__init__(gpu_indices, nvml, LimiterUnavailable, "power limiting")
        self._unavailable = _codes(self._nvml, _UNAVAILABLE_CODES)
        self._constraints_w = self._per_gpu(
            "nvmlDeviceGetPowerManagementLimitConstraints", self._read_constraints_w
        )

    def _read_constraints_w(self, handle: Any) -> tuple[float, float]:
        min_mw, max_mw = self._nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        return float(min_mw) / 1000.0, float(max_mw) / 1000.0

    def _error(self, exc: Exception, index: GpuId, what: str) -> PowerLimitError:
        if _error_code(exc) in self._no_permission:
            return LimiterPermissionDenied(
                f"GPU {index}: {what}: no permission; setting power limits needs root or "
                "CAP_SYS_ADMIN (in a container: --cap-add SYS_ADMIN)"
            )
        if _error_code(exc) in self._unavailable:
            return LimiterUnavailable(f"GPU {index}: {what} failed: {exc}")
        return PowerLimitError(f"GPU {index}: {what} failed: {exc}")

    def constraints_w(self) -> list[tuple[float, float]]:
        """Per GPU (min_w, max_w) the driver accepts."""
        return list(self._constraints_w)

    def _limit_w(self, call: str) -> list[float]:
        """Per GPU, NVML's `call` (milliwatts) in watts."""
        return self._per_gpu(call, lambda h: float(getattr(self._nvml, call)(h)) / 1000.0)

    def default_limits_w(self) -> list[float]:
        """Per GPU factory default limit."""
        return self._limit_w("nvmlDeviceGetPowerManagementDefaultLimit")

    def limits_w(self) -> list[float]:
        """Per GPU limit set now (by whoever set it last), not necessarily the one enforced."""
        return self._limit_w("nvmlDeviceGetPowerManagementLimit")

    def enforced_limits_w(self) -> list[float]:
        """Per GPU limit actually in force (the lowest of all limits set by anyone)."""
        return self._limit_w("nvmlDeviceGetEnforcedPowerLimit")

    def set_limits_w(self, limits_w: Sequence[float]) -> None:
        """Set one limit per GPU as given (the caller clamps)."""
        if len(limits_w) != len(self.gpu_indices):
            raise PowerLimitError(f"{len(limits_w)} limits for {len(self.gpu_indices)} GPUs")
        for index, handle, limit_w in zip(
            self.gpu_indices, self._devices.handles, limits_w, strict=True
        ):
            try:
                self._nvml.nvmlDeviceSetPowerManagementLimit(handle, round(limit_w * 1000.0))
            except self._nvml.NVMLError as exc:
                raise self._error(exc, index, f"set power limit to {limit_w:.1f} W") from exc


class NvmlClockLocker(_NvmlDevices):
    """Read and lock the SM (graphics) clock of a set of GPUs (synchronous device calls only;
    the state file, snapping and safety rules are powerbatch.telemetry.clock's).

    nvmlDeviceGetSupportedGraphicsClocks lists the clocks valid at a memory clock: the one in
    force now (nvmlDeviceGetClockInfo, NVML_CLOCK_MEM). Locking needs root or CAP_SYS_ADMIN
    (nvmlDeviceSetGpuLockedClocks); reading does not.
    """

    def __init__(
        self, gpu_indices: Sequence[GpuId] = (0,), *, nvml: ModuleType | None = None
    ) -> None:
        super().__init__(gpu_indices, nvml, ClockError, "clock control")

    def _error(self, exc: Exception, index: GpuId, what: str) -> ClockError:
        hint = ""
        if _error_code(exc) in self._no_permission:
            hint = " (locking clocks needs root or CAP_SYS_ADMIN, or use zeusd)"
        return ClockError(f"GPU {index}: {what} failed: {exc}{hint}")

    def supported_mhz(self) -> list[list[int]]:
        """Per GPU, the SM clocks it accepts at its memory clock now, ascending."""
        nvml = self._nvml

        def one(handle: Any) -> list[int]:
            mem = int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM))
            return sorted(int(c) for c in nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, mem))

        return self._per_gpu("nvmlDeviceGetSupportedGraphicsClocks", one)

    def clocks_mhz(self) -> list[float]:
        """Per GPU SM clock now."""
        nvml = self._nvml
        return self._per_gpu(
            "nvmlDeviceGetClockInfo",
            lambda h: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
        )

    def lock(self, min_mhz: int, max_mhz: int) -> None:
        self._per_gpu(
            f"lock SM clocks to {min_mhz}-{max_mhz} MHz",
            lambda h: self._nvml.nvmlDeviceSetGpuLockedClocks(h, int(min_mhz), int(max_mhz)),
        )

    def reset(self) -> None:
        """Back to the driver's default clock policy on every GPU (each is tried)."""
        errors: list[ClockError] = []
        for index, handle in zip(self.gpu_indices, self._devices.handles, strict=True):
            try:
                self._nvml.nvmlDeviceResetGpuLockedClocks(handle)
            except self._nvml.NVMLError as exc:
                errors.append(ClockError(f"GPU {index}: nvmlDeviceResetGpuLockedClocks: {exc}"))
        if errors:
            raise errors[0]


def default_power_limit_w(
    gpu_indices: Sequence[GpuId] = (0,), *, nvml: ModuleType | None = None
) -> float | None:
    """The GPU set's factory power limit (its TDP), summed; None where NVML cannot say.

    The power model's prior is scaled by this figure; read from the device, the prior starts
    from the plant it runs on rather than from a guess made from the ceiling. Read only.
    """
    try:
        limiter = NvmlPowerLimiter(gpu_indices, nvml=nvml)
    except (PowerLimitError, ValueError):
        return None
    try:
        return sum(limiter.default_limits_w())
    except PowerLimitError:
        return None
    finally:
        limiter.close()


def _probe(nvml: ModuleType | None, ask: Callable[[ModuleType], _T], failed: _T) -> _T:
    """`ask(nvml)` between nvmlInit and nvmlShutdown; `failed` where anything fails."""
    try:
        module = _load(nvml)
        module.nvmlInit()
    except Exception:
        return failed
    try:
        return ask(module)
    except Exception:
        return failed
    finally:
        with contextlib.suppress(Exception):
            module.nvmlShutdown()


def nvml_pci_bus_ids(uuids: Sequence[str], *, nvml: ModuleType | None = None) -> dict[str, str]:
    """The PCI bus ID (nvmlDeviceGetPciInfo's busId) of each GPU UUID this process's NVML sees;
    the others are left out, and an NVML that cannot start gives {}. Never raises."""

    def ask(module: ModuleType) -> dict[str, str]:
        found: dict[str, str] = {}
        for uuid in uuids:
            try:
                bus_id = module.nvmlDeviceGetPciInfo(module.nvmlDeviceGetHandleByUUID(uuid)).busId
            except module.NVMLError:
                continue
            found[uuid] = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
        return found

    return _probe(nvml, ask, {})


def nvml_available(nvml: ModuleType | None = None) -> bool:
    """True when NVML loads and sees at least one GPU; never raises."""
    return _probe(nvml, lambda module: int(module.nvmlDeviceGetCount()) > 0, False)


CAP_SYS_ADMIN = 21  # linux/capability.h


def holds_cap_sys_admin(status_path: str = "/proc/self/status") -> bool:
    """True when this process's effective capabilities include CAP_SYS_ADMIN (`CapEff` in
    proc(5)); where there is no /proc, root stands for it. Root in a container without
    SYS_ADMIN has no such bit, and NVML refuses it a limit."""
    try:
        with open(status_path, encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return hasattr(os, "geteuid") and os.geteuid() == 0


def may_set_power_limit(
    nvml: ModuleType | None = None, status_path: str = "/proc/self/status"
) -> bool:
    """True when NVML sees a GPU and this process may set its power limit: the NVML API
    reference says nvmlDeviceSetPowerManagementLimit "requires root/admin permissions", which on
    Linux is CAP_SYS_ADMIN. Never raises."""
    return holds_cap_sys_admin(status_path) and nvml_available(nvml)
