"""Every setting of `powerbatch serve`: the sections of each layer, gathered into one surface.

Flags, `POWERBATCH_*` variables, TOML keys (top level or a `[powerbatch]` table of the file
named by `--config` or `POWERBATCH_CONFIG`) and the reference table in docs/operations.md
(`powerbatch config-reference`) all come from these dataclasses; see `powerbatch.settings`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from powerbatch.admission.priority import PRIORITIES
from powerbatch.admission.settings import AdmissionSettings
from powerbatch.control.config import ClockPolicy, ControlConfig, ShapeSettings, TraceSettings
from powerbatch.energy.settings import EnergySettings
from powerbatch.errors import ConfigError
from powerbatch.fleet.settings import FleetSettings
from powerbatch.proxy.settings import ProxySettings
from powerbatch.settings import Surface, setting
from powerbatch.telemetry.settings import ClockSettings, LimiterSettings, PowerSettings

log = logging.getLogger("powerbatch")


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Process: logging and the optional hardware backstop"""

    control: ControlConfig
    power: PowerSettings
    proxy: ProxySettings
    admission: AdmissionSettings
    trace: TraceSettings = field(default_factory=TraceSettings)
    limiter: LimiterSettings = field(default_factory=LimiterSettings)
    shape: ShapeSettings = field(default_factory=ShapeSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    energy: EnergySettings = field(default_factory=EnergySettings)
    clock: ClockSettings = field(default_factory=ClockSettings)
    clock_policy: ClockPolicy = field(default_factory=ClockPolicy)
    hardware_backstop: bool = setting(
        False,
        "also set the GPUs' NVML power limit to the ceiling, restored on exit (needs nvml, root)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "logging level")

    def __post_init__(self) -> None:
        self.power.check_ceiling(self.control.ceiling_w)
        if self.power.power_source == "model":
            raise ConfigError(
                "power_source model is the vLLM plugin's (it reads the engine's steps); the "
                "proxy takes auto, nvml, dcgm or replay"
            )
        if self.hardware_backstop and self.power.power_source not in ("nvml", "auto"):
            raise ConfigError("hardware_backstop sets the limit through NVML: it needs nvml")
        if self.hardware_backstop and self.limiter.power_limiter not in ("none", "auto"):
            raise ConfigError(
                "hardware_backstop and power_limiter both set the GPUs' power limit: the "
                "limiter already holds the ceiling with the device limit; drop the backstop"
            )
        if self.clock.clock_control == "zeusd" and not self.limiter.zeusd_url:
            raise ConfigError("clock_control zeusd sets the clock through zeusd: set --zeusd-url")
        if self.clock.clock_control != "none" and self.clock_policy.clock_objective == "throughput":
            log.info("clock_control is set but clock_objective is throughput: clocks stay unlocked")
        if self.power.power_source == "zeusd" and not self.limiter.zeusd_url:
            raise ConfigError("power_source zeusd reads zeusd_url: set --zeusd-url")
        unknown = sorted(set(self.control.interactive_classes) - set(PRIORITIES))
        if unknown:
            raise ConfigError(
                f"interactive_classes: unknown classes {', '.join(unknown)} "
                f"(the classes are {', '.join(PRIORITIES)})"
            )


# What an operator sets, and `serve --help` shows; the rest is under --help-all.
# fmt: off
OPERATOR = frozenset((
    "ceiling_w", "margin_w", "mode", "max_batch", "ttft_slo_s", "tpot_slo_s",
    "interactive_classes",
    "power_source", "gpus", "dcgm_url", "replay_trace", "power_limiter", "zeusd_url",
    "zeusd_token", "hardware_backstop", "clock_control", "clock_objective",
    "upstream", "host", "port", "admin_port", "api_keys", "api_keys_file",
    "max_queue_len", "max_wait_s", "valley_fill",
    "ramp_up_w_per_s", "ramp_down_w_per_s", "floor_w",
    "fleet_budget", "fleet_budget_w", "fleet_redis_url", "fleet_member_id",
    "record_trace", "log_level",
))
# fmt: on

SERVE = Surface(
    ServeSettings,
    env_prefix="POWERBATCH_",
    config_env="POWERBATCH_CONFIG",
    table="powerbatch",
    # Not settings of serve: the container's health check URL (Dockerfile), the compose file's
    # image and user, the local Grafana's dashboard folder; and the plugin's own settings.
    other_env=(
        "POWERBATCH_HEALTH_URL",
        "POWERBATCH_IMAGE",
        "POWERBATCH_UID",
        "POWERBATCH_DASHBOARDS",
    ),
    other_prefixes=("POWERBATCH_VLLM_",),
    operator=OPERATOR,
)
