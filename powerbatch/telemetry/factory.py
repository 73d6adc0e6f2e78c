"""The one factory of a host's telemetry: power source, monitor, device limiter and actuator.

`powerbatch serve` and the vLLM plugin both build theirs here, so a setting means the same on
both: `auto` is NVML where it sees the GPUs, else the dcgm-exporter at the host's dcgm URL.
A source only one host has (the plugin's modelled one, which lives in the simulator, a layer
above) comes in as a callable, so nothing here imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from powerbatch.errors import ClockError, ConfigError, TelemetryError
from powerbatch.telemetry.base import PowerSource
from powerbatch.telemetry.clock import ClockActuator, NvmlClock, ZeusdClock, grid_mhz
from powerbatch.telemetry.filters import HampelFilter
from powerbatch.telemetry.gpu_ids import GpuId
from powerbatch.telemetry.limiter import (
    LimitActuator,
    NoLimiter,
    NvmlLimiter,
    PowerLimiter,
    ZeusdLimiter,
)
from powerbatch.telemetry.monitor import PowerMonitor
from powerbatch.telemetry.nvml import (
    NvmlClockLocker,
    NvmlPowerSource,
    default_power_limit_w,
    may_set_power_limit,
    nvml_available,
    nvml_pci_bus_ids,
)
from powerbatch.telemetry.prometheus import (
    DcgmClockReader,
    PrometheusPowerSource,
    dcgm_pci_bus_ids,
)
from powerbatch.telemetry.replay import ReplayPowerSource
from powerbatch.telemetry.settings import (
    ClockSettings,
    LimiterKind,
    LimiterSettings,
    PowerSettings,
)
from powerbatch.telemetry.zeusd import PciLookup, ZeusdClient, ZeusdPowerSource

log = logging.getLogger(__name__)


def source_kind(
    power: PowerSettings, dcgm_url: str | None, *, nvml: ModuleType | None = None
) -> str:
    """The configured source resolved: `auto` is NVML where it sees GPUs, else dcgm at
    `dcgm_url` (the host's: serve falls back to the upstream's /metrics, the plugin has none)."""
    if power.power_source != "auto":
        return power.power_source
    if nvml_available(nvml):
        return "nvml"
    if dcgm_url:
        return "dcgm"
    raise ConfigError(
        "power_source auto: NVML sees no GPU here and no dcgm_url is set; set power_source "
        "nvml on the GPU node, or dcgm_url to the node's dcgm-exporter"
    )


def pci_lookup(dcgm_url: str | None, *, nvml: ModuleType | None = None) -> PciLookup:
    """How zeusd's GPUs are found by UUID (zeusd lists PCI addresses only): NVML in this
    process where it sees the GPU, else the `pci_bus_id` label of a dcgm-exporter at
    `dcgm_url`. A UUID neither knows is left out (the caller says what to fix)."""

    async def lookup(uuids: Sequence[str]) -> Mapping[str, str]:
        found = nvml_pci_bus_ids(uuids, nvml=nvml)
        rest = [u for u in uuids if u not in found]
        if rest and dcgm_url:
            # Unreadable: those UUIDs stay unknown, and the caller's error says what to set.
            with contextlib.suppress(TelemetryError):
                found.update(await dcgm_pci_bus_ids(dcgm_url, rest))
        return found

    return lookup


def make_power_source(
    power: PowerSettings,
    kind: str,
    *,
    dcgm_url: str | None,
    limiter: LimiterSettings,
    model: Callable[[], PowerSource] | None = None,
) -> PowerSource:
    """The source of resolved `kind`; zeusd reads through the limiter's daemon settings, and
    `model` builds the plugin's modelled source (None on a host that has none)."""
    if kind == "nvml":
        return NvmlPowerSource(power.gpu_indices())
    if kind == "dcgm" and dcgm_url:
        return PrometheusPowerSource(dcgm_url, metric=power.dcgm_metric, labels=power.dcgm_labels())
    if kind == "replay" and power.replay_trace:
        return ReplayPowerSource(power.replay_trace, clock="wall")
    if kind == "zeusd" and limiter.zeusd_url:
        return ZeusdPowerSource(
            limiter.zeusd_url,
            power.gpu_indices(),
            token=limiter.zeusd_token,
            pci_lookup=pci_lookup(dcgm_url),
        )
    if kind == "model" and model is not None:
        return model()
    raise ConfigError(f"this host cannot read power from {kind!r} with these settings")


def make_monitor(
    power: PowerSettings, source: PowerSource, kind: str, ceiling_w: float
) -> PowerMonitor:
    """The monitor over `source`; a source that averages itself is not despiked again."""
    return PowerMonitor(
        source,
        interval_s=power.power_interval_s,
        stale_after_s=power.stale_after_s,
        max_plausible_w=power.plausible_w(ceiling_w),
        hampel=None if power.averages(kind) else HampelFilter(),
    )


def device_max_w(power: PowerSettings, kind: str, max_w: float | None) -> float | None:
    """With NVML and no `max_w` set: the GPUs' own default power limit, for the model's prior."""
    if max_w is not None or kind != "nvml":
        return None
    return default_power_limit_w(power.gpu_indices())


def limiter_kind(
    settings: LimiterSettings, *, backstop: bool = False, nvml: ModuleType | None = None
) -> LimiterKind:
    """The configured limiter resolved: `auto` is zeusd where a daemon is named (it is how an
    unprivileged pod gets the limit), else NVML where this process may set the limit, else none
    (admission alone). The hardware backstop sets the limit itself, so `auto` leaves it to it."""
    if settings.power_limiter != "auto":
        return settings.power_limiter
    if backstop:
        return "none"
    if settings.zeusd_url:
        return "zeusd"
    return "nvml" if may_set_power_limit(nvml) else "none"


def resolve_limiter(
    settings: LimiterSettings, *, backstop: bool = False, nvml: ModuleType | None = None
) -> LimiterSettings:
    """`settings` with `auto` resolved (`limiter_kind`) and the choice logged: each surface
    resolves once, at start; any other setting comes back as it is."""
    if settings.power_limiter != "auto":
        return settings
    kind = limiter_kind(settings, backstop=backstop, nvml=nvml)
    log.info("power limiter auto: %s", kind)
    return dataclasses.replace(settings, power_limiter=kind)


def zeusd_client(
    settings: LimiterSettings, clock: ClockSettings | None = None
) -> ZeusdClient | None:
    """One zeusd client for the limiter and the clock, where either goes through zeusd."""
    uses = limiter_kind(settings) == "zeusd" or (
        clock is not None and clock.clock_control == "zeusd"
    )
    if not uses or not settings.zeusd_url:
        return None
    timeout_s = settings.limit_timeout_s
    if clock is not None and clock.clock_control == "zeusd":
        timeout_s = max(timeout_s, clock.clock_timeout_s)
    return ZeusdClient(settings.zeusd_url, token=settings.zeusd_token, timeout_s=timeout_s)


def make_limiter(
    settings: LimiterSettings,
    gpus: Sequence[GpuId],
    *,
    dcgm_url: str | None = None,
    client: ZeusdClient | None = None,
) -> PowerLimiter:
    """The configured backend, not started (call `await limiter.start()`); `dcgm_url` helps
    zeusd find GPUs given by UUID (`pci_lookup`)."""
    kind = limiter_kind(settings)
    if kind == "nvml":
        return NvmlLimiter(gpus, state_dir=settings.limit_state_dir)
    if kind == "zeusd":
        assert settings.zeusd_url is not None  # LimiterSettings refuses zeusd without a URL
        return ZeusdLimiter(
            settings.zeusd_url,
            gpus,
            token=settings.zeusd_token,
            timeout_s=settings.limit_timeout_s,
            state_dir=settings.limit_state_dir,
            client=client,
            pci_lookup=pci_lookup(dcgm_url),
        )
    return NoLimiter()


def make_actuator(
    settings: LimiterSettings,
    gpus: Sequence[GpuId],
    *,
    dcgm_url: str | None = None,
    client: ZeusdClient | None = None,
) -> LimitActuator | None:
    """The configured limiter behind its actuator, or None for admission alone (not started:
    the control loop starts it first thing, so crash recovery runs before anything else)."""
    if limiter_kind(settings) == "none":
        return None
    limiter = make_limiter(settings, gpus, dcgm_url=dcgm_url, client=client)
    return LimitActuator.from_settings(limiter, settings)


def _supported_clocks(clock: ClockSettings, gpus: Sequence[GpuId]) -> Callable[[], Any]:
    """zeusd reads no clocks: NVML's list (read-only, unprivileged) where this process sees the
    GPUs, else the configured range on its grid."""

    async def supported() -> list[int]:
        try:
            locker = NvmlClockLocker(gpus)
        except ClockError:
            locker = None
        if locker is not None:
            try:
                per_gpu = locker.supported_mhz()
                return sorted(set(per_gpu[0]).intersection(*per_gpu[1:]))
            except ClockError:
                pass
            finally:
                locker.close()
        if clock.clock_range_mhz:
            lo, hi = clock.clock_range_mhz
            return grid_mhz(lo, hi, clock.clock_step_mhz)
        raise ClockError(
            "zeusd reads no clocks and NVML does not see these GPUs: set clock_range_mhz to "
            "the GPUs' lowest and highest SM clock (nvidia-smi -q -d SUPPORTED_CLOCKS)"
        )

    return supported


def make_clock_actuator(
    clock: ClockSettings,
    limiter: LimiterSettings,
    power: PowerSettings,
    *,
    dcgm_url: str | None = None,
    client: ZeusdClient | None = None,
) -> ClockActuator | None:
    """The configured clock backend behind its actuator, or None (the driver's own policy).
    zeusd shares the limiter's client (`client`) and state directory; the clock now is read
    from NVML, or from dcgm-exporter's DCGM_FI_DEV_SM_CLOCK at `dcgm_url` with zeusd."""
    gpus = power.gpu_indices()
    backend: NvmlClock | ZeusdClock
    if clock.clock_control == "none":
        return None
    if clock.clock_control == "nvml":
        backend = NvmlClock(gpus, state_dir=limiter.limit_state_dir)
    else:
        if client is None:
            client = zeusd_client(limiter, clock)
        if client is None:
            raise ConfigError("clock_control zeusd needs zeusd_url")
        reader = None
        if dcgm_url:
            reader = DcgmClockReader(dcgm_url, labels=power.dcgm_labels())
        backend = ZeusdClock(
            client,
            gpus,
            supported=_supported_clocks(clock, gpus),
            reader=reader,
            token=limiter.zeusd_token,
            state_dir=limiter.limit_state_dir,
            pci_lookup=pci_lookup(dcgm_url),
        )
    return ClockActuator(
        backend,
        dead_band_mhz=clock.clock_dead_band_mhz,
        min_interval_s=clock.clock_min_interval_s,
        timeout_s=clock.clock_timeout_s,
    )
