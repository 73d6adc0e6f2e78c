"""The plugin's settings: `POWERBATCH_VLLM_*` environment variables and/or a TOML file.

vLLM owns the command line, so the plugin has no flags; environment variables reach the
EngineCore process (where the scheduler runs) whichever way vLLM is started. Precedence:
default < file (`POWERBATCH_VLLM_CONFIG`, top level or a `[powerbatch_vllm]` table) <
environment. The controller and power-source settings are the proxy's own sections
(`powerbatch.settings`); `reference_markdown()` prints the table in docs/vllm-plugin.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from powerbatch.control import ControlConfig, prior_max_w
from powerbatch.control.config import ClockPolicy, ShapeSettings, TraceSettings
from powerbatch.energy.settings import EnergySettings
from powerbatch.errors import ConfigError
from powerbatch.fleet.settings import FleetSettings
from powerbatch.settings import Surface, check_bounds, load, setting
from powerbatch.settings import reference_markdown as _reference
from powerbatch.telemetry.settings import ClockSettings, LimiterSettings, PowerSettings

ENV_PREFIX = "POWERBATCH_VLLM_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Engine: how the limits reach vLLM's scheduler, and the plugin's endpoint"""

    min_step_tokens: int = setting(
        32, "the step's token budget never drops below decodes plus this", ge=1
    )
    kv_cap: bool = setting(True, "cap the KV-cache blocks new requests may bring in")
    metrics_host: str = setting("127.0.0.1", "address of the plugin's /metrics and /status")
    metrics_port: int = setting(
        9465, "its port (data-parallel rank r uses port + r); 0 turns it off", ge=0, le=65_535
    )

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class SimulationSettings:
    """Simulation (tests and demos, not production): the modelled power source"""

    model_profile: str = setting(
        "h100-llama8b", "GPU profile of the simulator's power model (power_source model)"
    )


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """The plugin's settings: the controller's, the power source's and the engine's"""

    control: ControlConfig
    power: PowerSettings = dataclasses.field(default_factory=PowerSettings)
    engine: EngineSettings = dataclasses.field(default_factory=EngineSettings)
    trace: TraceSettings = dataclasses.field(default_factory=TraceSettings)
    limiter: LimiterSettings = dataclasses.field(default_factory=LimiterSettings)
    shape: ShapeSettings = dataclasses.field(default_factory=ShapeSettings)
    fleet: FleetSettings = dataclasses.field(default_factory=FleetSettings)
    energy: EnergySettings = dataclasses.field(default_factory=EnergySettings)
    simulation: SimulationSettings = dataclasses.field(default_factory=SimulationSettings)
    clock: ClockSettings = dataclasses.field(default_factory=ClockSettings)
    clock_policy: ClockPolicy = dataclasses.field(default_factory=ClockPolicy)

    def __post_init__(self) -> None:
        self.power.check_ceiling(self.control.ceiling_w)
        if self.power.power_source == "replay":
            raise ConfigError(
                f"{ENV_PREFIX}POWER_SOURCE=replay is the proxy's; the plugin takes auto, nvml, "
                "dcgm or model"
            )
        if self.power.power_source == "dcgm" and not self.power.dcgm_url:
            raise ConfigError(f"{ENV_PREFIX}POWER_SOURCE=dcgm needs {ENV_PREFIX}DCGM_URL")
        if self.power.power_source == "zeusd" and not self.limiter.zeusd_url:
            raise ConfigError(f"{ENV_PREFIX}POWER_SOURCE=zeusd needs {ENV_PREFIX}ZEUSD_URL")
        if self.clock.clock_control == "zeusd" and not self.limiter.zeusd_url:
            raise ConfigError(f"{ENV_PREFIX}CLOCK_CONTROL=zeusd needs {ENV_PREFIX}ZEUSD_URL")

    def control_config(
        self, *, engine_max_batch: int, max_kv_tokens: int, device_max_w: float | None = None
    ) -> ControlConfig:
        """The controller's settings, bounded by what vLLM was configured with.

        `device_max_w` (the GPUs' own power limit, read through NVML) stands in for `max_w`
        when that is not set and the ceiling is within it.
        """
        c = self.control
        max_batch = min(c.max_batch, engine_max_batch)
        initial = min(c.initial_batch, max_batch)
        return dataclasses.replace(
            c,
            max_w=prior_max_w(c.max_w, device_max_w, c.ceiling_w),
            min_batch=min(c.min_batch, initial),
            max_batch=max_batch,
            initial_batch=initial,
            safe_batch=min(c.safe_batch, max_batch),
            max_kv_tokens=max(1, max_kv_tokens),
        )


PLUGIN = Surface(
    PluginConfig,
    env_prefix=ENV_PREFIX,
    config_env=CONFIG_ENV,
    table="powerbatch_vllm",
    has_flags=False,
    other_env=(ENV_PREFIX + "ALLOW_UNSUPPORTED",),
    # Unset, the running-set limit is whatever vLLM was configured with (--max-num-seqs).
    defaults={"max_batch": (65_536, "vLLM's max_num_seqs")},
)


def load_config(environ: Mapping[str, str] | None = None) -> PluginConfig:
    """Settings from the file named by POWERBATCH_VLLM_CONFIG, then the environment."""
    config: PluginConfig = load(PLUGIN, environ=os.environ if environ is None else environ)
    return config


def reference_markdown() -> str:
    """Every setting as markdown tables, for the docs."""
    return _reference(PLUGIN)
