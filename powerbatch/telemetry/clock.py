"""The GPUs' SM clock as an actuator: backends, crash recovery, snapping, rate limit, fallback.

A power cap does nothing while power is under it, and decode usually is ("Illusion of Power
Capping in LLM Decode", arXiv 2605.11999: 137-300 W of 700 W on H200); a lower locked SM clock
saves energy there (VoltanaLLM, arXiv 2509.04827; throttLL'eM, arXiv 2408.05235; DynamoLLM,
arXiv 2408.00741). Three backends share one async interface, `ClockBackend`, as the limiter's do:

    NvmlClock   nvmlDeviceSetGpuLockedClocks in this process (root or CAP_SYS_ADMIN); pynvml
                stays inside nvml.py
    ZeusdClock  zeusd's /gpu/set_gpu_locked_clocks and /gpu/reset_gpu_locked_clocks, through the
                limiter's own zeusd client (zeusd/src/routes/gpu.rs)
    NoClock     no clock control (the default: the driver's own clock policy)

Safety lives here, below the controller, as the limit's does (powerbatch.telemetry.limiter):

  * a lock is snapped to the clocks the device supports (nvmlDeviceGetSupportedGraphicsClocks;
    zeusd has no clock read, so NVML's read-only list where this process sees the GPUs, else the
    configured range on the configured grid) and never leaves them;
  * before the first lock a state file records that the clocks are locked; `restore()` resets
    them (the driver's default policy) and removes it; a process that dies leaves the file and
    the next `start()` resets the clocks before anything else (a lock outlives the process until
    reset or a driver reload, as a power limit does);
  * `ClockActuator` applies a request only beyond a dead band; lowering the clock waits a
    minimum interval after the last change, raising it (or unlocking) goes at once, since that
    is what latency needs; a failed, refused or timed-out lock falls back to unlocked clocks and
    reports `degraded` until a retry, on a backoff, succeeds.

Reset, not "the previous lock": NVML has no read of the locked range, so an operator's own lock
from before powerbatch started is not known; powerbatch owns the clock while it runs.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, Unpack, runtime_checkable

from powerbatch.errors import ClockError, ConfigError, TelemetryError
from powerbatch.telemetry.actuator import PacedActuator, Pacing
from powerbatch.telemetry.gpu_ids import GpuId
from powerbatch.telemetry.nvml import NvmlClockLocker
from powerbatch.telemetry.state import DeviceState
from powerbatch.telemetry.zeusd import PciLookup, ZeusdClient, ZeusdRequestError, resolve_gpu_ids

__all__ = [
    "ClockActuator",
    "ClockBackend",
    "Lock",
    "NoClock",
    "NvmlClock",
    "ZeusdClock",
    "grid_mhz",
    "snap_lock",
]

_log = logging.getLogger(__name__)

Lock = tuple[int, int]
"""(min, max) locked SM clock, MHz."""


class ClockReader(Protocol):
    """The SM clock now, MHz (None where unknown); dcgm-exporter's, for zeusd."""

    async def read_mhz(self) -> float | None: ...

    async def close(self) -> None: ...


SupportedClocks = Callable[[], Awaitable[list[int]]]
"""The SM clocks every GPU of the set accepts, ascending."""


@runtime_checkable
class ClockBackend(Protocol):
    """Locks the SM clock of a GPU set. `start()` first, `restore()` then `close()` last."""

    name: str
    controls_device: bool
    recovered: bool

    async def start(self) -> None: ...

    def supported_mhz(self) -> list[int]: ...

    async def lock(self, min_mhz: int, max_mhz: int) -> None: ...

    async def restore(self) -> None: ...

    async def read_mhz(self) -> float | None: ...

    async def close(self) -> None: ...


def grid_mhz(lo_mhz: int, hi_mhz: int, step_mhz: int) -> list[int]:
    """Clocks from the top down on a grid (15 MHz on H100), ascending."""
    if not 0 < lo_mhz <= hi_mhz or step_mhz < 1:
        raise ConfigError(f"need 0 < lowest <= highest clock and step >= 1, got {lo_mhz}..{hi_mhz}")
    return sorted(range(hi_mhz, lo_mhz - 1, -step_mhz))


def snap_lock(min_mhz: float, max_mhz: float, supported: Sequence[int]) -> Lock:
    """The supported lock nearest to a request, inside it where possible: min rounds up and
    max down to supported clocks, both clamped to the supported range, and min <= max."""
    if not supported:
        raise ClockError("no supported clocks known")
    lo_c, hi_c = supported[0], supported[-1]
    want_hi = min(max(max_mhz, lo_c), hi_c)
    want_lo = min(max(min_mhz, lo_c), want_hi)
    hi = supported[max(bisect.bisect_right(supported, want_hi) - 1, 0)]
    i = bisect.bisect_left(supported, want_lo)
    lo = supported[min(i, len(supported) - 1)]
    return min(lo, hi), hi


class _DeviceClock:
    """The state file, the supported list and the checks; backends supply four device calls."""

    controls_device = True
    backend = "device"

    def __init__(
        self, gpu_ids: Sequence[GpuId], *, tag: str, state_dir: str | Path | None = None
    ) -> None:
        state = DeviceState(gpu_ids, kind="clocks", tag=tag, state_dir=state_dir, error=ClockError)
        self.gpu_ids, self.name, self.state_file = state.gpu_ids, state.name, state.file
        self.recovered = False
        self.changes_total = 0
        self._supported: list[int] | None = None

    async def _open(self) -> list[int]:
        raise NotImplementedError

    async def _lock(self, min_mhz: int, max_mhz: int) -> None:
        raise NotImplementedError

    async def _reset(self) -> None:
        raise NotImplementedError

    async def read_mhz(self) -> float | None:
        return None

    async def _close(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Reach the devices; if a previous process left the clocks locked, reset them first."""
        try:
            record = self.state_file.read()
        except ClockError as exc:  # corrupt: reset anyway, it is what the record would ask
            _log.warning("%s: %s; resetting the clocks", self.name, exc)
            record = {"pid": "?"}
        supported = await self._open()
        if record is not None:
            _log.warning(
                "%s: a previous run (pid %s) locked the SM clocks and did not reset them; "
                "resetting",
                self.name,
                record.get("pid", "?"),
            )
            await self._reset()
            self.changes_total += 1
            self.state_file.remove()
            self.recovered = True
        self._supported = supported

    def supported_mhz(self) -> list[int]:
        if self._supported is None:
            raise ClockError(f"{self.name}: start() has not run")
        return list(self._supported)

    async def lock(self, min_mhz: int, max_mhz: int) -> None:
        """Lock to a supported [min, max] (ClockError for anything else: the actuator snaps)."""
        supported = set(self.supported_mhz())
        if min_mhz not in supported or max_mhz not in supported or min_mhz > max_mhz:
            raise ClockError(f"{self.name}: {min_mhz}-{max_mhz} MHz is not a supported lock")
        self.state_file.mark(backend=self.backend, clock=self.name, gpu_ids=list(self.gpu_ids))
        self.changes_total += 1
        await self._lock(min_mhz, max_mhz)

    async def restore(self) -> None:
        """Reset to the driver's default policy and drop the state file; a no-op if nothing
        was locked (no state file)."""
        if not self.state_file.exists():
            return
        await self._reset()
        self.changes_total += 1
        self.state_file.remove()

    async def close(self) -> None:
        await self._close()


class NvmlClock(_DeviceClock):
    """NVML in this process: needs root or CAP_SYS_ADMIN to lock; local calls, run inline."""

    backend = "nvml"

    def __init__(
        self,
        gpu_ids: Sequence[GpuId] = (0,),
        *,
        state_dir: str | Path | None = None,
        nvml: ModuleType | None = None,
    ) -> None:
        super().__init__(gpu_ids, tag="nvml", state_dir=state_dir)
        self._nvml = nvml
        self._device: NvmlClockLocker | None = None

    def _dev(self) -> NvmlClockLocker:
        if self._device is None:
            self._device = NvmlClockLocker(self.gpu_ids, nvml=self._nvml)
        return self._device

    async def _open(self) -> list[int]:
        per_gpu = self._dev().supported_mhz()
        common = set(per_gpu[0]).intersection(*per_gpu[1:])
        if not common:
            raise ClockError(f"{self.name}: the GPUs share no supported SM clock")
        return sorted(common)

    async def _lock(self, min_mhz: int, max_mhz: int) -> None:
        self._dev().lock(min_mhz, max_mhz)

    async def _reset(self) -> None:
        self._dev().reset()

    async def read_mhz(self) -> float | None:
        clocks = self._dev().clocks_mhz()
        return sum(clocks) / len(clocks)

    async def _close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None


@contextlib.contextmanager
def _clock_errors() -> Iterator[None]:
    try:
        yield
    except ZeusdRequestError as exc:
        hint = {
            "unauthorized": " (zeusd wants a bearer token: set zeusd_token)",
            "forbidden": " (the token needs the gpu-control scope)",
        }.get(exc.kind, "")
        raise ClockError(f"{exc}{hint}") from exc


class ZeusdClock(_DeviceClock):
    """Through zeusd, sharing the limiter's client. zeusd reads no clocks: `supported` gives the
    supported list (NVML's read, or the configured range) and `reader` the clock now."""

    backend = "zeusd"

    def __init__(
        self,
        client: ZeusdClient,
        gpu_ids: Sequence[GpuId] = (0,),
        *,
        supported: SupportedClocks,
        reader: ClockReader | None = None,
        token: str | None = None,
        state_dir: str | Path | None = None,
        pci_lookup: PciLookup | None = None,
    ) -> None:
        self._client = client
        self._supported_fn = supported
        self._reader = reader
        self._token = token
        self._pci_lookup = pci_lookup
        self._ids: list[int] = []
        super().__init__(gpu_ids, tag=f"zeusd:{client.endpoint}", state_dir=state_dir)

    async def _open(self) -> list[int]:
        with _clock_errors():
            gpus, groups, auth_required = await self._client.discover()
            try:
                self._ids = await resolve_gpu_ids(self.gpu_ids, gpus, self._pci_lookup)
            except (ConfigError, TelemetryError) as exc:
                raise ClockError(str(exc)) from exc
        if "gpu-control" not in groups:
            raise ClockError(
                f"zeusd at {self._client.endpoint} has the gpu-control API group disabled"
            )
        if auth_required and not self._token:
            raise ClockError(f"zeusd at {self._client.endpoint} requires a token (zeusd_token)")
        return await self._supported_fn()

    async def _lock(self, min_mhz: int, max_mhz: int) -> None:
        with _clock_errors():
            await self._client.set_gpu_locked_clocks(self._ids, min_mhz, max_mhz, block=True)

    async def _reset(self) -> None:
        with _clock_errors():
            await self._client.reset_gpu_locked_clocks(self._ids, block=True)

    async def read_mhz(self) -> float | None:
        return await self._reader.read_mhz() if self._reader is not None else None

    async def _close(self) -> None:
        await self._client.close()
        if self._reader is not None:
            await self._reader.close()


class NoClock:
    """No clock control: the driver's own policy. Every call succeeds and changes nothing."""

    name = "none"
    controls_device = False
    recovered = False

    async def start(self) -> None:
        return None

    def supported_mhz(self) -> list[int]:
        return []

    async def lock(self, min_mhz: int, max_mhz: int) -> None:
        return None

    async def restore(self) -> None:
        return None

    async def read_mhz(self) -> float | None:
        return None

    async def close(self) -> None:
        return None


class ClockActuator(PacedActuator[ClockBackend]):
    """Applies the controller's requested lock at a safe pace; never raises on failure.

    A request is a (min, max) in MHz, or None for the driver's default policy (unlocked). It is
    snapped to the supported clocks; a lock spanning them all is the same as unlocked. It is
    applied when either end moves more than `dead_band_mhz`; a lower top waits `min_interval_s`
    after the last change, a higher one (or unlocking) goes at once. A failure or timeout resets
    the clocks (unlocked is the fallback: the driver's own policy, fastest), sets `degraded`
    with a reason and retries after a backoff doubling from `backoff_initial_s` to
    `backoff_max_s`; the first success clears it. The pacing, timeout and backoff are
    `PacedActuator`'s (powerbatch.telemetry.actuator).
    """

    error = ClockError
    timeout_error = ClockError
    control = "clock control"

    def __init__(
        self, backend: ClockBackend, *, dead_band_mhz: float = 45.0, **pacing: Unpack[Pacing]
    ) -> None:
        if dead_band_mhz < 0:
            raise ValueError("dead_band_mhz must be >= 0")
        super().__init__(backend, **pacing)
        self.dead_band_mhz = dead_band_mhz
        self.in_force: Lock | None = None  # None: unlocked (the driver's policy)
        self.known = True  # False after a failed reset: what is in force is unknown
        self.requested: Lock | None = None
        self.measured_mhz: float | None = None
        self.fallbacks_total = 0

    @property
    def backend(self) -> ClockBackend:
        return self.device

    def supported_mhz(self) -> list[int]:
        """The supported clocks, ascending; [] before the backend has started."""
        return self.backend.supported_mhz() if self._started else []

    def normalise(self, requested: tuple[float, float] | None) -> Lock | None:
        """The request snapped to the supported clocks; None (unlocked) for a lock that spans
        them all, or when nothing is known of them."""
        supported = self.supported_mhz()
        if requested is None or not supported:
            return None
        lock = snap_lock(requested[0], requested[1], supported)
        if lock == (supported[0], supported[-1]):
            return None
        return lock

    def decide(self, target: Lock | None, now_s: float, paced: bool = True) -> str:
        """What `apply` would do now: apply, same, dead_band, too_soon, backoff or inactive."""
        gate = self._gate(now_s)
        if gate is not None:
            return gate
        if target == self.in_force and self.known:
            return "same"
        if target is None or self.in_force is None or not self.known:
            higher = target is None
        else:
            lo0, hi0 = self.in_force
            if abs(target[0] - lo0) <= self.dead_band_mhz and abs(target[1] - hi0) <= (
                self.dead_band_mhz
            ):
                return "dead_band"
            higher = target[1] > hi0
        return "apply" if higher or not paced else self._paced(now_s)

    async def apply(
        self, requested: tuple[float, float] | None, *, paced: bool = True
    ) -> Lock | None:
        """Apply a request if the rules allow; the lock in force after (None: unlocked).

        `paced=False` lowers without waiting `min_interval_s` and logs at debug: the return
        from a prefill's boost to the lock in force before it (`DeviceClock`), bounded by the
        request rate, not by the pacing that keeps the law from flapping."""
        if requested is not None and not all(math.isfinite(x) and x > 0 for x in requested):
            raise ValueError(f"requested clocks must be positive and finite, got {requested}")
        now_s = self._clock()
        if not self._started and (self.decide(None, now_s) != "apply" or not await self.start()):
            return self.in_force
        target = self.normalise(requested)
        self.requested = target
        verdict = self.decide(target, now_s, paced)
        if verdict != "apply":
            return self.in_force
        what = "unlock" if target is None else f"lock {target[0]}-{target[1]} MHz"
        try:
            if target is None:
                await self._timed(self.backend.restore(), what)
            else:
                await self._timed(self.backend.lock(*target), what)
        except ClockError as exc:
            await self._fallback(exc, now_s, what)
            return self.in_force
        self._succeeded(now_s)
        before, self.in_force, self.known = self.in_force, target, True
        level = logging.INFO if paced else logging.DEBUG
        _log.log(
            level, "%s: SM clocks %s (were %s)", self.name, _fmt_lock(target), _fmt_lock(before)
        )
        return target

    async def _fallback(self, exc: BaseException, now_s: float, what: str) -> None:
        """A failed change: back to unlocked clocks, degraded until a retry succeeds."""
        self._fail(exc, now_s, what, note=", falling back to unlocked clocks")
        try:
            await asyncio.wait_for(self.backend.restore(), self.timeout_s)
            self.in_force, self.known = None, True
        except (ClockError, TimeoutError) as reset_exc:
            self.known = False  # the state file stays: the next start resets
            _log.error("%s: falling back to unlocked clocks failed too: %s", self.name, reset_exc)
        self.fallbacks_total += 1

    async def sample(self) -> float | None:
        """Read the SM clock now (for the metric); None where it cannot be read."""
        if not self._started:
            return None
        try:
            self.measured_mhz = await asyncio.wait_for(self.backend.read_mhz(), self.timeout_s)
        except (ClockError, TelemetryError, TimeoutError) as exc:
            _log.debug("%s: SM clock read failed: %s", self.name, exc)
            self.measured_mhz = None
        return self.measured_mhz

    def _restored(self) -> None:
        self.in_force, self.known = None, True

    def status(self) -> dict[str, Any]:
        """For /status and metrics."""
        supported = self.supported_mhz()
        return {
            "clock": self.name,
            "requested_mhz": list(self.requested) if self.requested else None,
            "locked_mhz": list(self.in_force) if self.in_force else None,
            "known": self.known,
            "sm_clock_mhz": self.measured_mhz,
            "supported_mhz": [supported[0], supported[-1]] if supported else None,
            **self._status(),
            "fallbacks_total": self.fallbacks_total,
        }


def _fmt_lock(lock: Lock | None) -> str:
    return "unlocked" if lock is None else f"locked to {lock[0]}-{lock[1]} MHz"
