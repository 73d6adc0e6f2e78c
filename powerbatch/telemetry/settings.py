"""Where watts come from: the power source's settings, shared by the proxy and the vLLM plugin."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from powerbatch.errors import ConfigError
from powerbatch.settings import check_bounds, setting
from powerbatch.telemetry.gpu_ids import GpuId, is_gpu_uuid, parse_gpu_ids, visible_uuids

SourceKind = Literal["auto", "nvml", "dcgm", "zeusd", "replay", "model"]


@dataclass(frozen=True, slots=True)
class PowerSettings:
    """Power source: where watts come from and when a reading is trusted"""

    power_source: SourceKind = setting(
        "auto",
        "where watts come from: auto (NVML where it sees the GPUs, else the dcgm-exporter "
        "endpoint), nvml, dcgm, zeusd (the Zeus daemon at zeusd_url), replay (proxy: a recorded "
        "trace) or model (plugin: the simulator's power model fed with the engine's real steps)",
    )
    gpus: tuple[str, ...] = setting(
        (),
        "the GPUs to meter and limit, comma-separated or a list: UUIDs (GPU-…, the same GPU to "
        "NVML, dcgm and zeusd) or indices (NVML's in this process, dcgm's `gpu` label, zeusd's)",
        default_doc="the UUIDs in NVIDIA_VISIBLE_DEVICES where it holds UUIDs, else 0",
    )
    dcgm_url: str | None = setting(
        None,
        "dcgm-exporter /metrics URL",
        default_doc="the upstream's /metrics (proxy); required for dcgm in the plugin",
    )
    dcgm_metric: str = setting("DCGM_FI_DEV_POWER_USAGE", "power metric to sum over the GPUs")
    replay_trace: str | None = setting(None, "CSV trace for power_source replay")
    power_interval_s: float = setting(0.1, "power polling interval, s", gt=0, le=10)
    stale_after_s: float = setting(
        1.0, "a reading older than this fails the controller closed, s", gt=0
    )
    max_plausible_w: float | None = setting(
        None, "readings above this are garbage, watts", gt=0, default_doc="3 x the ceiling"
    )
    startup_probe_s: float = setting(
        15.0,
        "at start-up, wait this long for a first good reading, then refuse to start; 0: skip",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        gpus = tuple(g.strip() for g in self.gpus if g.strip())
        # Unset: the GPUs the device plugin gave this container, else GPU 0.
        object.__setattr__(self, "gpus", gpus or visible_uuids(os.environ) or ("0",))
        parse_gpu_ids(self.gpus)
        if self.power_source == "replay" and not self.replay_trace:
            raise ConfigError("power_source replay needs replay_trace (--replay-trace)")
        if self.stale_after_s < self.power_interval_s:
            raise ConfigError(
                f"stale_after_s ({self.stale_after_s:g} s) is shorter than the polling "
                f"interval ({self.power_interval_s:g} s): every reading would be stale"
            )

    def gpu_indices(self) -> list[GpuId]:
        """The GPUs as indices (int) or UUIDs (str): each backend finds a UUID its own way
        (powerbatch.telemetry.gpu_ids)."""
        return parse_gpu_ids(self.gpus)

    def dcgm_labels(self) -> dict[str, tuple[str, ...]]:
        """dcgm-exporter's series of these GPUs: by `UUID`, else by the `gpu` index label."""
        uuids = all(is_gpu_uuid(g) for g in self.gpus)
        return {"UUID" if uuids else "gpu": self.gpus}

    def averages(self, kind: str) -> bool:
        """Whether source `kind` (resolved, not auto) reports a 1-second mean itself:
        dcgm-exporter's DCGM_FI_DEV_POWER_USAGE does, its INSTANT field does not. Such a
        reading is used as it is (averaging it again lags it a second behind the load) and is
        not despiked: its spikes are real seconds of load, and a value held between an
        exporter's collections would make a median filter hold back every new one."""
        return kind == "dcgm" and "INSTANT" not in self.dcgm_metric.upper()

    def plausible_w(self, ceiling_w: float) -> float:
        return self.max_plausible_w if self.max_plausible_w is not None else 3.0 * ceiling_w

    def check_ceiling(self, ceiling_w: float) -> None:
        """Cross-check with the controller's ceiling (called by each surface)."""
        if self.max_plausible_w is not None and self.max_plausible_w <= ceiling_w:
            raise ConfigError(
                f"max_plausible_w ({self.max_plausible_w:g} W) must be above the ceiling "
                f"({ceiling_w:g} W): every reading near the ceiling would be thrown away"
            )


LimiterKind = Literal["auto", "none", "nvml", "zeusd"]


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    """Power limiter: the GPUs' power limit as a second, fast actuator"""

    power_limiter: LimiterKind = setting(
        "auto",
        "how the GPUs' power limit is set: auto (zeusd where zeusd_url is set, else nvml where "
        "this process may set the limit, else none), none (admission alone), nvml (this "
        "process needs root or CAP_SYS_ADMIN) or zeusd (through the Zeus node daemon)",
    )
    zeusd_url: str | None = setting(
        None, "the zeusd daemon: http://host:port or unix:///run/zeusd/zeusd.sock"
    )
    zeusd_token: str | None = setting(
        None,
        "bearer token for zeusd (scopes gpu-read,gpu-control), if it requires one",
        secret=True,
    )
    limit_dead_band_w: float = setting(
        10.0,
        "a raise of the total limit within this of the one in force is not applied (cuts,"
        " and a fleet share that rose, are, however small), watts",
        ge=0,
    )
    limit_min_interval_s: float = setting(
        2.0,
        "raises of the limit wait this long after the last change (cuts, and a fleet share"
        " that rose, go at once), s",
        ge=0,
        le=3600,
    )
    limit_state_dir: str | None = setting(
        None,
        "where the crash-recovery file lives (it says a limit was changed and must be restored)",
        default_doc="$XDG_RUNTIME_DIR/powerbatch, else /tmp/powerbatch-<uid>",
    )
    limit_timeout_s: float = setting(
        2.0, "a limit change or read that takes longer has failed, s", gt=0, le=60
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.power_limiter == "zeusd" and not self.zeusd_url:
            raise ConfigError(
                "power_limiter zeusd needs zeusd_url (http://host:port or unix:///path)"
            )
        if self.zeusd_url is not None and not self.zeusd_url.startswith(
            ("http://", "https://", "unix:///")
        ):
            raise ConfigError(
                f"zeusd_url must be http://host:port or unix:///path, got {self.zeusd_url!r}"
            )


ClockKind = Literal["none", "nvml", "zeusd"]


@dataclass(frozen=True, slots=True)
class ClockSettings:
    """SM clock: the GPUs' locked clock range as a third actuator (docs/clock.md)"""

    clock_control: ClockKind = setting(
        "none",
        "how the GPUs' SM clock is locked: none (the driver's own policy), nvml (this process "
        "needs root or CAP_SYS_ADMIN) or zeusd (through the Zeus node daemon at zeusd_url)",
    )
    clock_dead_band_mhz: float = setting(
        45.0, "a requested lock within this of the one in force is not applied, MHz", ge=0
    )
    clock_min_interval_s: float = setting(
        2.0,
        "lowering the clock waits this long after the last change (raising goes at once), s",
        ge=0,
        le=3600,
    )
    clock_timeout_s: float = setting(
        2.0, "a clock change or read that takes longer has failed, s", gt=0, le=60
    )
    clock_range_mhz: tuple[int, ...] = setting(
        (),
        "lowest and highest SM clock the GPUs support, MHz, where NVML cannot read them (zeusd "
        "from a process that does not see the GPUs)",
        default_doc="read from NVML (nvmlDeviceGetSupportedGraphicsClocks)",
    )
    clock_step_mhz: int = setting(
        15, "the grid of supported clocks with clock_range_mhz, MHz (15 on H100)", ge=1
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        r = self.clock_range_mhz
        if r and (len(r) != 2 or not 0 < r[0] < r[1]):
            raise ConfigError(f"clock_range_mhz must be two clocks lowest < highest, got {r}")
