"""Controller settings, with the defaults a first deployment should start from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from powerbatch.errors import ConfigError

Mode = Literal["enforce", "observe"]


def prior_max_w(
    configured_w: float | None, device_w: float | None, ceiling_w: float
) -> float | None:
    """The power limit the model's prior scales with: the operator's figure, else the
    device's own (read through NVML) where the ceiling is within it, else None (ceiling / 0.7).
    """
    if configured_w is not None or device_w is None or device_w < ceiling_w:
        return configured_w
    return device_w


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """Everything the decision each tick depends on. Watts are for the whole GPU set."""

    ceiling_w: float
    margin_w: float | None = None  # default: 2% of the ceiling
    hysteresis_w: float | None = None  # default: 1% of the ceiling; the dead band for growing
    max_w: float | None = None  # the set's power limit (TDP); default ceiling / 0.7
    tick_hz: float = 5.0
    min_batch: int = 1
    max_batch: int = 256  # never above the upstream's own --max-num-seqs
    initial_batch: int = 8
    safe_batch: int = 2  # where the batch goes when no power reading can be trusted
    recover_s: float = 2.0  # good readings needed before leaving the safe batch
    max_kv_tokens: int = 2_000_000
    step_up_frac: float = 0.2  # largest growth of the batch per tick
    confidence: float = 0.95  # of the one-sided upper prediction bound
    model_half_life_s: float = 20.0
    model_window: int = 1_500
    warmup_s: float = 5.0
    mode: Mode = "enforce"
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    interactive_classes: tuple[str, ...] = ("high", "normal")
    kv_usage_target: float = 0.9  # upstream KV-cache usage above this shrinks the KV cap
    prefill_pacing: bool = True
    min_prefill_tok_s: float = 500.0
    power_gain: float = 0.25  # dual ascent step of the power multiplier, W per W of violation
    emergency_cut: float = 0.8  # on a measured breach, the batch drops to this share of in-flight
    cut_cooldown_s: float = 1.0  # no second cut before the first can show in the power
    demand_headroom: float = 1.25  # the batch may lead recent peak demand by this factor
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ceiling_w > 0:
            raise ConfigError(f"ceiling_w must be positive, got {self.ceiling_w}")
        if not 1 <= self.min_batch <= self.initial_batch <= self.max_batch:
            raise ConfigError("need 1 <= min_batch <= initial_batch <= max_batch")
        if not 1 <= self.safe_batch <= self.max_batch:
            raise ConfigError("need 1 <= safe_batch <= max_batch")
        if not 0.5 < self.confidence < 1:
            raise ConfigError("confidence must be in (0.5, 1)")
        if self.tick_hz <= 0 or self.tick_hz > 100:
            raise ConfigError("tick_hz must be in (0, 100]")
        if self.mode not in ("enforce", "observe"):
            raise ConfigError(f"mode must be enforce or observe, got {self.mode!r}")
        if self.max_w is not None and self.max_w < self.ceiling_w:
            raise ConfigError("max_w (the GPUs' power limit) is below the ceiling")

    @property
    def margin(self) -> float:
        return self.margin_w if self.margin_w is not None else 0.02 * self.ceiling_w

    @property
    def hysteresis(self) -> float:
        return self.hysteresis_w if self.hysteresis_w is not None else 0.01 * self.ceiling_w
