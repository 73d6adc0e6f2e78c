"""The plugin's settings: `POWERBATCH_VLLM_*` environment variables and/or a TOML file.

vLLM owns the command line, so the plugin cannot add flags; environment variables reach the
EngineCore process (where the scheduler runs) whichever way vLLM is started. Precedence:
default < file (`POWERBATCH_VLLM_CONFIG`, top level or a `[powerbatch_vllm]` table) < environment.
`docs/vllm-plugin.md` lists every setting; `reference_markdown()` prints the same table.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from powerbatch.control import ControlConfig, prior_max_w
from powerbatch.errors import ConfigError

ENV_PREFIX = "POWERBATCH_VLLM_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
POWER_SOURCES = ("nvml", "dcgm", "model")
MODES = ("enforce", "observe")

_HELP: dict[str, str] = {
    "ceiling_w": "hard power ceiling for the engine's GPU set, watts (required)",
    "max_w": "the GPU set's power limit (TDP), watts; prior only; default: NVML's default "
    "limit with power_source=nvml, else ceiling / 0.7",
    "margin_w": "stay this far under the ceiling; default 2% of it",
    "mode": "enforce the limits, or observe (decide and report, leave vLLM's limits alone)",
    "power_source": "where watts come from: nvml, dcgm (a dcgm-exporter URL) or model "
    "(the simulator's power model fed with the engine's real batch)",
    "gpus": "comma-separated GPU indices (nvml) or `gpu` label values (dcgm)",
    "dcgm_url": "dcgm-exporter /metrics URL (required for power_source=dcgm)",
    "dcgm_metric": "power metric to sum over the GPUs",
    "model_profile": "GPU profile of the power model (power_source=model)",
    "power_interval_s": "power polling interval",
    "stale_after_s": "a reading older than this fails the controller closed (safe batch)",
    "max_plausible_w": "readings above this are garbage; default 3 x ceiling",
    "tick_hz": "control decisions per second (off the step's hot path)",
    "warmup_s": "silent warm-up: learn at the initial batch",
    "min_batch": "smallest running-set limit",
    "max_batch": "largest running-set limit; default and upper bound: vLLM's own",
    "initial_batch": "running-set limit during warm-up",
    "safe_batch": "running-set limit while no power reading can be trusted",
    "confidence": "confidence of the power model's upper prediction bound",
    "kv_usage_target": "KV-cache usage above this shrinks the KV cap",
    "ttft_slo_s": "p95 time to first token (arrival in vLLM to first token) over which "
    "growth speeds up where power allows",
    "tpot_slo_s": "p95 time per output token (interval between decode steps) over which "
    "the batch shrinks",
    "prefill_pacing": "pace prefill through the step's token budget",
    "min_step_tokens": "the step's token budget never drops below decodes plus this",
    "kv_cap": "cap the KV-cache blocks new requests may bring in",
    "metrics_host": "address of the plugin's /metrics and /status endpoint",
    "metrics_port": "its port (data-parallel rank r uses port + r); 0 turns it off",
    "trace_path": "write the control trace (CSV, one row per tick) here at shutdown",
}


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """Resolved settings; `max_batch` None means "whatever vLLM was configured with"."""

    ceiling_w: float
    max_w: float | None = None
    margin_w: float | None = None
    mode: str = "enforce"
    power_source: str = "nvml"
    gpus: str = "0"
    dcgm_url: str | None = None
    dcgm_metric: str = "DCGM_FI_DEV_POWER_USAGE"
    model_profile: str = "h100-llama8b"
    power_interval_s: float = 0.1
    stale_after_s: float = 1.0
    max_plausible_w: float | None = None
    tick_hz: float = 5.0
    warmup_s: float = 5.0
    min_batch: int = 1
    max_batch: int | None = None
    initial_batch: int = 8
    safe_batch: int = 2
    confidence: float = 0.95
    kv_usage_target: float = 0.9
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    prefill_pacing: bool = True
    min_step_tokens: int = 32
    kv_cap: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9465
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"{ENV_PREFIX}MODE must be one of {', '.join(MODES)}")
        if self.power_source not in POWER_SOURCES:
            raise ConfigError(
                f"{ENV_PREFIX}POWER_SOURCE must be one of {', '.join(POWER_SOURCES)}, "
                f"got {self.power_source!r}"
            )
        if self.power_source == "dcgm" and not self.dcgm_url:
            raise ConfigError(f"{ENV_PREFIX}POWER_SOURCE=dcgm needs {ENV_PREFIX}DCGM_URL")
        if self.min_step_tokens < 1:
            raise ConfigError(f"{ENV_PREFIX}MIN_STEP_TOKENS must be at least 1")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"{ENV_PREFIX}METRICS_PORT must be a port number or 0")
        # Fail at start-up, not on the first tick: build the controller config once here.
        self.control_config(engine_max_batch=self.max_batch or 256, max_kv_tokens=1)

    @property
    def gpu_list(self) -> list[str]:
        return [g.strip() for g in self.gpus.split(",") if g.strip()]

    def control_config(
        self, *, engine_max_batch: int, max_kv_tokens: int, device_max_w: float | None = None
    ) -> ControlConfig:
        """The shared controller's settings, bounded by what vLLM was configured with.

        `device_max_w` (the GPUs' own power limit, read through NVML) stands in for `max_w`
        when that is not set and the ceiling is within it.
        """
        max_batch = min(self.max_batch or engine_max_batch, engine_max_batch)
        initial = min(self.initial_batch, max_batch)
        return ControlConfig(
            ceiling_w=self.ceiling_w,
            margin_w=self.margin_w,
            max_w=prior_max_w(self.max_w, device_max_w, self.ceiling_w),
            tick_hz=self.tick_hz,
            min_batch=min(self.min_batch, initial),
            max_batch=max_batch,
            initial_batch=initial,
            safe_batch=min(self.safe_batch, max_batch),
            max_kv_tokens=max(1, max_kv_tokens),
            confidence=self.confidence,
            warmup_s=self.warmup_s,
            mode="observe" if self.mode == "observe" else "enforce",
            kv_usage_target=self.kv_usage_target,
            ttft_slo_s=self.ttft_slo_s,
            tpot_slo_s=self.tpot_slo_s,
            prefill_pacing=self.prefill_pacing,
        )


def _field_types() -> dict[str, str]:
    return {f.name: str(f.type) for f in fields(PluginConfig)}


def _coerce(name: str, kind: str, value: Any, where: str) -> Any:
    if value is None:
        return None
    text = str(value).strip()
    if kind.endswith("| None") and text.lower() in ("", "none"):
        return None
    base = kind.split("|")[0].strip()
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base == "int":
            return int(value)
        if base == "float":
            return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {name} must be {base}, got {value!r}") from exc
    return text


def load_config(environ: Mapping[str, str] | None = None) -> PluginConfig:
    """Settings from the file named by POWERBATCH_VLLM_CONFIG, then the environment."""
    env = os.environ if environ is None else environ
    types = _field_types()
    values: dict[str, Any] = {}
    path = env.get(CONFIG_ENV)
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {CONFIG_ENV}={path}: {exc}") from exc
        table = data.get("powerbatch_vllm", data)
        unknown = sorted(set(table) - set(types))
        if unknown:
            raise ConfigError(f"{path}: unknown keys {', '.join(unknown)}")
        for key, value in table.items():
            values[key] = _coerce(key, types[key], value, path)
    known_env = {ENV_PREFIX + name.upper() for name in types} | {
        CONFIG_ENV,
        ENV_PREFIX + "ALLOW_UNSUPPORTED",
    }
    unknown_env = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known_env)
    if unknown_env:
        raise ConfigError(f"unknown settings {', '.join(unknown_env)} (typo?)")
    for name, kind in types.items():
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = _coerce(name, kind, env[key], key)
    if values.get("ceiling_w") is None:
        raise ConfigError(f"{ENV_PREFIX}CEILING_W is required (watts for the engine's GPUs)")
    return PluginConfig(**values)


def reference_markdown() -> str:
    """Every setting as a markdown table, for the docs."""
    lines = ["| environment | file key | default | meaning |", "|---|---|---|---|"]
    for f in fields(PluginConfig):
        default = "required" if f.name == "ceiling_w" else f"`{f.default}`"
        if f.default is None and f.name != "ceiling_w":
            default = "—"
        lines.append(
            f"| `{ENV_PREFIX}{f.name.upper()}` | `{f.name}` | {default} | {_HELP[f.name]} |"
        )
    return "\n".join(lines) + "\n"
