"""The GPUs' own power limit as an actuator: backends, crash recovery, rate limit and dead band.

Three backends share one async interface, `PowerLimiter`:

    NvmlLimiter    NVML in this process (root or CAP_SYS_ADMIN); pynvml stays inside nvml.py
    ZeusdLimiter   through the Zeus project's node daemon zeusd (an unprivileged process)
    NoLimiter      no device limit: admission alone holds the ceiling

Safety lives below the controller, so no caller can get it wrong:

  * a total is split evenly over the GPUs and each share clamped to the device's constraints
    (NVML refuses values outside nvmlDeviceGetPowerManagementLimitConstraints; zeusd answers 400);
  * before the first change a state file records that the limit is changed and what to restore;
    `restore()` puts the default back and removes it; a process that dies without restoring
    leaves the file, and the next `start()` restores the default before anything else (the limit
    outlives the process until the driver reloads, per NVML's nvmlDeviceSetPowerManagementLimit);
  * `LimitActuator` applies a requested total only beyond a dead band and, for raises, no sooner
    than a minimum interval after the last change; cuts go through at once. A failed or timed-out
    change makes it `degraded` (with a reason) until a retry, on a backoff, succeeds.

The default restored comes from the device, never from the limit found at start: a process
restarted after a crash (or one whose state file was lost) finds the lowered limit in force, and
taking that for the default would keep the device lowered for good. With NVML it is
nvmlDeviceGetPowerManagementDefaultLimit ("the power management limit that the device boots
with", NVML API reference). zeusd's API has no default-limit read, so for it the highest limit
the device accepts (the max of /gpu/get_power_limit_constraints, NVML's
nvmlDeviceGetPowerManagementLimitConstraints behind it) stands in: on the data-center GPUs this
project targets (A100, H100, H200 SXM) the boot default is that max (nvidia-smi -q -d POWER shows
the same Default and Max Power Limit, the TDP). Where a card's max is above its default, restoring
through zeusd leaves it at the max: still a limit the device accepts, never a lowered one.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol, Unpack, runtime_checkable

from powerbatch.errors import (
    ConfigError,
    LimiterPermissionDenied,
    LimiterTimeout,
    LimiterUnavailable,
    PowerLimitError,
    TelemetryError,
)
from powerbatch.telemetry.actuator import PacedActuator, Pacing
from powerbatch.telemetry.gpu_ids import GpuId
from powerbatch.telemetry.nvml import NvmlPowerLimiter
from powerbatch.telemetry.settings import LimiterSettings
from powerbatch.telemetry.state import DeviceState
from powerbatch.telemetry.zeusd import PciLookup, ZeusdClient, ZeusdRequestError, resolve_gpu_ids

__all__ = [
    "LimitActuator",
    "NoLimiter",
    "NvmlLimiter",
    "PowerLimiter",
    "ZeusdLimiter",
    "clamp_w",
    "split_total_w",
]

_log = logging.getLogger(__name__)


@runtime_checkable
class PowerLimiter(Protocol):
    """Sets the power limit of a GPU set. Call `start()` first, `restore()` then `close()` last.

    Every failure is a `PowerLimitError` subclass. `changes_total` counts device writes
    (restores included) for a metric; `controls_device` is False for `NoLimiter`.
    """

    name: str
    gpu_ids: tuple[GpuId, ...]
    controls_device: bool
    changes_total: int

    async def start(self) -> None: ...

    def constraints_w(self) -> list[tuple[float, float]]: ...

    def default_w(self) -> list[float]: ...

    async def limits_w(self) -> list[float]: ...

    async def set_total_w(self, total_w: float) -> float: ...

    async def restore(self) -> None: ...

    async def close(self) -> None: ...


def clamp_w(limits_w: Sequence[float], constraints_w: Sequence[tuple[float, float]]) -> list[float]:
    """Each GPU's limit clamped to its (min_w, max_w): never outside what the device accepts."""
    return [min(max(w, lo), hi) for w, (lo, hi) in zip(limits_w, constraints_w, strict=True)]


def split_total_w(total_w: float, constraints_w: Sequence[tuple[float, float]]) -> list[float]:
    """An even share per GPU, each clamped to its constraints."""
    if not (math.isfinite(total_w) and total_w > 0):
        raise PowerLimitError(f"total power limit must be positive and finite, got {total_w}")
    return clamp_w([total_w / len(constraints_w)] * len(constraints_w), constraints_w)


class _DeviceLimiter:
    """Split, clamp, read back, count, and the state file; backends supply four device calls."""

    controls_device = True
    backend = "device"

    def __init__(
        self, gpu_ids: Sequence[GpuId], *, tag: str, state_dir: str | Path | None = None
    ) -> None:
        state = DeviceState(
            gpu_ids,
            kind="limits",
            tag=tag,
            state_dir=state_dir,
            error=PowerLimitError,
            corrupt_hint="; check the GPUs' power limits (nvidia-smi -q -d POWER), restore them, "
            "then delete the file",
        )
        self.gpu_ids, self.name, self.state_file = state.gpu_ids, state.name, state.file
        self.changes_total = 0
        self.recovered = False
        """True when `start()` found a record left by a process that died and restored."""
        self._constraints_w: list[tuple[float, float]] | None = None
        self._default_w: list[float] | None = None

    # -- backend calls ---------------------------------------------------------------------

    async def _open(self) -> tuple[list[tuple[float, float]], list[float]]:
        """Reach the devices; (constraints, default) per GPU."""
        raise NotImplementedError

    async def _read_w(self) -> list[float]:
        raise NotImplementedError

    async def _write_w(self, limits_w: Sequence[float]) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def _recovery_w(self, record: dict[str, Any], default_w: list[float]) -> list[float]:
        """What to restore after a crash: the device default."""
        return default_w

    def _recorded_w(self, record: dict[str, Any]) -> list[float]:
        """The limits in force before the crashed run's first change, from its record."""
        saved = record.get("restore_w")
        if (
            isinstance(saved, list)
            and len(saved) == len(self.gpu_ids)
            and all(isinstance(w, int | float) and w > 0 for w in saved)
        ):
            return [float(w) for w in saved]
        raise PowerLimitError(
            f"the limit state file {self.state_file.path} has no usable restore_w; restore the "
            "GPUs' limits by hand, then delete the file"
        )

    # -- the interface ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open the devices; if a previous process left a changed limit, restore it first."""
        constraints_w, default_w = await self._open()
        record = self.state_file.read()
        if record is not None:
            restore_w = clamp_w(self._recovery_w(record, default_w), constraints_w)
            _log.warning(
                "%s: a previous run (pid %s) changed the power limit and did not restore it; "
                "restoring %s W",
                self.name,
                record.get("pid", "?"),
                _fmt(restore_w),
            )
            await self._write_w(restore_w)
            self.changes_total += 1
            self.state_file.remove()
            self.recovered = True
            default_w = restore_w
        self._constraints_w, self._default_w = constraints_w, default_w

    def _started(self) -> tuple[list[tuple[float, float]], list[float]]:
        if self._constraints_w is None or self._default_w is None:
            raise LimiterUnavailable(f"{self.name}: start() has not run")
        return self._constraints_w, self._default_w

    def constraints_w(self) -> list[tuple[float, float]]:
        """Per GPU (min_w, max_w) the device accepts."""
        return list(self._started()[0])

    def default_w(self) -> list[float]:
        """Per GPU limit that `restore()` puts back."""
        return list(self._started()[1])

    async def limits_w(self) -> list[float]:
        """Per GPU limit in force, read from the device."""
        self._started()
        return await self._read_w()

    async def set_total_w(self, total_w: float) -> float:
        """Split `total_w` evenly, clamp, set, and return the total read back (what is in force,
        which reflects clamping and any lower limit set by someone else)."""
        constraints_w, default_w = self._started()
        limits_w = split_total_w(total_w, constraints_w)
        self.state_file.mark(
            backend=self.backend, limiter=self.name, gpu_ids=list(self.gpu_ids), restore_w=default_w
        )
        await self._write_w(limits_w)
        self.changes_total += 1
        in_force_w = sum(await self._read_w())
        _log.info(
            "%s: power limit set to %s W (asked %.0f W total; %.0f W in force)",
            self.name,
            _fmt(limits_w),
            total_w,
            in_force_w,
        )
        return in_force_w

    async def restore(self) -> None:
        """Put the default back and drop the state file; a no-op if nothing was changed."""
        if not self.state_file.exists():
            return
        _, default_w = self._started()
        await self._write_w(default_w)
        self.changes_total += 1
        self.state_file.remove()
        _log.info("%s: power limit restored to %s W", self.name, _fmt(default_w))

    async def close(self) -> None:
        """Release the backend; does not restore (call restore() first)."""
        await self._close()


def _fmt(values_w: Sequence[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values_w)


class NvmlLimiter(_DeviceLimiter):
    """NVML in this process: needs root or CAP_SYS_ADMIN. NVML calls are local and sub-millisecond,
    so they run inline (see powerbatch.telemetry.nvml).

    `restore_to="previous"` (serve's hardware backstop) puts back the limits in force at start
    rather than the device default, after a crash too (from the state file), as zeusd does.
    """

    backend = "nvml"

    def __init__(
        self,
        gpu_ids: Sequence[GpuId] = (0,),
        *,
        state_dir: str | Path | None = None,
        nvml: ModuleType | None = None,
        restore_to: Literal["default", "previous"] = "default",
    ) -> None:
        super().__init__(gpu_ids, tag="nvml", state_dir=state_dir)
        self._nvml = nvml
        self._restore_to = restore_to
        self._device: NvmlPowerLimiter | None = None

    def _dev(self) -> NvmlPowerLimiter:
        if self._device is None:
            raise LimiterUnavailable(f"{self.name}: start() has not run")
        return self._device

    async def _open(self) -> tuple[list[tuple[float, float]], list[float]]:
        if self._device is None:
            self._device = NvmlPowerLimiter(self.gpu_ids, nvml=self._nvml)
        dev = self._device
        if self._restore_to == "previous":
            return dev.constraints_w(), dev.limits_w()
        return dev.constraints_w(), dev.default_limits_w()

    def _recovery_w(self, record: dict[str, Any], default_w: list[float]) -> list[float]:
        if self._restore_to == "previous":
            return self._recorded_w(record)
        return default_w

    async def _read_w(self) -> list[float]:
        return self._dev().enforced_limits_w()

    async def _write_w(self, limits_w: Sequence[float]) -> None:
        self._dev().set_limits_w(limits_w)

    async def _close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None


@contextlib.contextmanager
def _limit_errors() -> Iterator[None]:
    """zeusd's answers as PowerLimitError subclasses."""
    try:
        yield
    except ZeusdRequestError as exc:
        if exc.kind == "unreachable":
            raise LimiterUnavailable(str(exc)) from exc
        if exc.kind == "unauthorized":
            raise LimiterPermissionDenied(
                f"{exc} (zeusd wants a bearer token: set zeusd_token)"
            ) from exc
        if exc.kind == "forbidden":
            raise LimiterPermissionDenied(
                f"{exc} (the token needs the gpu-control scope, and zeusd needs CAP_SYS_ADMIN)"
            ) from exc
        if exc.kind == "timeout":
            raise LimiterTimeout(str(exc)) from exc
        raise PowerLimitError(str(exc)) from exc


class ZeusdLimiter(_DeviceLimiter):
    """Through zeusd's `/gpu/set_power_limit` (block=true: the answer comes once it is applied).

    The default it restores, after a crash too, is each GPU's highest allowed limit: zeusd
    reports no default (see the module docstring).
    """

    backend = "zeusd"

    def __init__(
        self,
        url: str,
        gpu_ids: Sequence[GpuId] = (0,),
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        state_dir: str | Path | None = None,
        client: ZeusdClient | None = None,
        pci_lookup: PciLookup | None = None,
    ) -> None:
        self._client = client or ZeusdClient(url, token=token, timeout_s=timeout_s)
        self._token = token
        self._pci_lookup = pci_lookup
        self._ids: list[int] = []  # zeusd's index of each GPU, found at start
        super().__init__(gpu_ids, tag=f"zeusd:{self._client.endpoint}", state_dir=state_dir)

    async def _open(self) -> tuple[list[tuple[float, float]], list[float]]:
        with _limit_errors():
            gpus, groups, auth_required = await self._client.discover()
            try:
                self._ids = await resolve_gpu_ids(self.gpu_ids, gpus, self._pci_lookup)
            except (ConfigError, TelemetryError) as exc:
                raise LimiterUnavailable(str(exc)) from exc
            missing = sorted(set(self._ids) - {g.id for g in gpus})
            if missing:
                raise LimiterUnavailable(
                    f"zeusd at {self._client.endpoint} has no GPU {missing} "
                    f"(it has {sorted(g.id for g in gpus)})"
                )
            if "gpu-control" not in groups:
                raise LimiterUnavailable(
                    f"zeusd at {self._client.endpoint} has the gpu-control API group disabled "
                    "(start it with --enable gpu-read,gpu-control)"
                )
            if auth_required and not self._token:
                raise LimiterPermissionDenied(
                    f"zeusd at {self._client.endpoint} requires a token: set zeusd_token to one "
                    "scoped to gpu-read,gpu-control"
                )
            constraints = await self._client.get_power_limit_constraints_mw(self._ids)
        constraints_w = [
            (constraints[i][0] / 1000.0, constraints[i][1] / 1000.0) for i in self._ids
        ]
        # zeusd reads no default limit: the device's max stands in (see the module docstring).
        return constraints_w, [hi for _, hi in constraints_w]

    async def _read_w(self) -> list[float]:
        with _limit_errors():
            current = await self._client.get_power_limit_mw(self._ids)
        return [current[i] / 1000.0 for i in self._ids]

    async def _write_w(self, limits_w: Sequence[float]) -> None:
        constraints_w = self._constraints_w
        groups: dict[int, list[int]] = {}
        for slot, (gpu, limit_w) in enumerate(zip(self._ids, limits_w, strict=True)):
            mw = round(limit_w * 1000.0)
            if constraints_w is not None:  # clamp again in mW: rounding must not step outside
                lo, hi = constraints_w[slot]
                mw = min(max(mw, math.ceil(lo * 1000.0)), math.floor(hi * 1000.0))
            groups.setdefault(mw, []).append(gpu)
        with _limit_errors():
            for mw, ids in groups.items():
                await self._client.set_power_limit_mw(ids, mw, block=True)

    async def _close(self) -> None:
        await self._client.close()


class NoLimiter:
    """No device limit: admission alone holds the ceiling. Every call succeeds and changes nothing;
    `set_total_w` answers inf (no limit in force)."""

    name = "none"
    gpu_ids: tuple[GpuId, ...] = ()
    controls_device = False
    changes_total = 0

    async def start(self) -> None:
        return None

    def constraints_w(self) -> list[tuple[float, float]]:
        return []

    def default_w(self) -> list[float]:
        return []

    async def limits_w(self) -> list[float]:
        return []

    async def set_total_w(self, total_w: float) -> float:
        return math.inf

    async def restore(self) -> None:
        return None

    async def close(self) -> None:
        return None


SAME_W = 0.5  # a request this close to the total in force is that total


class LimitActuator(PacedActuator[PowerLimiter]):
    """Applies the controller's requested total limit at a safe pace; never raises on failure.

    A cut goes through at once, however small (safety first: a limit left a few watts over a
    fleet share that fell is no limit under that share, and the loop's admission law then
    cut the batch; docs/fleet.md, stop 44). A raise is applied when it is more than
    `dead_band_w` over the total in force, `min_interval_s` after the last change; one the
    caller marks unpaced (a fleet share that rose: the watts are granted) goes at once, however
    small.
    A failure or timeout (of `start()` too) sets `degraded` with a reason, forgets the total in
    force (a half-applied change is unknown), and retries after a backoff that doubles from
    `backoff_initial_s` to `backoff_max_s`; the first success clears it. While degraded the
    caller should hold the ceiling by admission alone, with its software margin. The pacing,
    timeout and backoff are `PacedActuator`'s (powerbatch.telemetry.actuator).
    """

    error = PowerLimitError
    timeout_error = LimiterTimeout
    control = "power limit control"

    def __init__(
        self, limiter: PowerLimiter, *, dead_band_w: float = 10.0, **pacing: Unpack[Pacing]
    ) -> None:
        if dead_band_w < 0:
            raise ValueError("dead_band_w must be >= 0")
        super().__init__(limiter, **pacing)
        self.dead_band_w = dead_band_w
        self.in_force_w: float | None = None
        self.requested_w: float | None = None

    @property
    def limiter(self) -> PowerLimiter:
        return self.device

    @classmethod
    def from_settings(cls, limiter: PowerLimiter, settings: LimiterSettings) -> LimitActuator:
        return cls(
            limiter,
            dead_band_w=settings.limit_dead_band_w,
            min_interval_s=settings.limit_min_interval_s,
            timeout_s=settings.limit_timeout_s,
        )

    def bounds_w(self) -> tuple[float, float] | None:
        """(lowest, highest) total the GPU set accepts; None before the limiter has started."""
        if not self._started:
            return None
        constraints = self.limiter.constraints_w()
        return sum(lo for lo, _ in constraints), sum(hi for _, hi in constraints)

    def decide(self, requested_w: float, now_s: float, paced: bool = True) -> str:
        """What `apply` would do now: apply, dead_band, too_soon, backoff or inactive. Pure."""
        gate = self._gate(now_s)
        if gate is not None:
            return gate
        if self.in_force_w is None:
            return "apply"
        delta_w = self._target_w(requested_w) - self.in_force_w
        if abs(delta_w) <= SAME_W:
            return "dead_band"
        if delta_w < 0 or not paced:  # a ceiling that fell, or watts granted: however small
            return "apply"
        if delta_w <= self.dead_band_w:
            return "dead_band"
        return self._paced(now_s)

    def _target_w(self, requested_w: float) -> float:
        bounds = self.bounds_w()
        if bounds is None:
            return requested_w
        return min(max(requested_w, bounds[0]), bounds[1])

    async def apply(self, requested_w: float, paced: bool = True) -> float | None:
        """Apply `requested_w` if the rules allow (`paced`: a raise waits `min_interval_s`);
        the total in force after (None if unknown)."""
        if not (math.isfinite(requested_w) and requested_w > 0):
            raise ValueError(f"requested_w must be positive and finite, got {requested_w}")
        self.requested_w = requested_w
        now_s = self._clock()
        if self.decide(requested_w, now_s, paced) != "apply":
            return self.in_force_w
        if not self._started and not await self.start():
            return None
        target_w = self._target_w(requested_w)
        what = f"set {target_w:.0f} W"
        try:
            in_force_w = await self._timed(self.limiter.set_total_w(target_w), what)
        except PowerLimitError as exc:
            self.in_force_w = None  # a half-applied change: what is in force is unknown
            self._fail(exc, now_s, what)
            return None
        self._succeeded(now_s)
        self.in_force_w = in_force_w
        return in_force_w

    def _restored(self) -> None:
        self.in_force_w = None

    def status(self) -> dict[str, Any]:
        """For /status and metrics."""
        return {
            "limiter": self.limiter.name,
            "requested_w": self.requested_w,
            "in_force_w": self.in_force_w,
            **self._status(),
        }
