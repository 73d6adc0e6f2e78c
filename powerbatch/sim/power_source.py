"""PowerSource implementations backed by the simulator's model, read in-process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from powerbatch.errors import SensorReadError, SensorUnavailable
from powerbatch.sim.engine import SimEngine, resolve_profile
from powerbatch.sim.gpu_model import (
    DEFAULT_KV_CAPACITY_TOKENS,
    DEFAULT_PROFILE,
    GpuProfile,
    step_time_s,
)
from powerbatch.telemetry.base import PowerSample

__all__ = ["ModelPowerSource", "SimPowerSource"]


class SimPowerSource:
    """Reads a running `SimEngine` directly, as NVML would read the board.

    `kind="average"` (default) is the 1-second mean that nvmlDeviceGetPowerUsage returns on Hopper;
    `kind="instant"` is the noisy NVML_FI_DEV_POWER_INSTANT reading (NVML API reference, field
    value 186). Energy is the engine's exact counter, like nvmlDeviceGetTotalEnergyConsumption.
    """

    def __init__(
        self,
        engine: SimEngine,
        *,
        kind: Literal["average", "instant"] = "average",
        name: str = "sim",
    ) -> None:
        if kind not in ("average", "instant"):
            raise ValueError(f"kind must be 'average' or 'instant', got {kind!r}")
        self.engine = engine
        self.kind = kind
        self.name = name
        self._closed = False

    async def read(self) -> PowerSample:
        if self._closed:
            raise SensorUnavailable(f"{self.name}: source is closed")
        if not self.engine.started:
            raise SensorUnavailable(f"{self.name}: simulated engine is not running")
        now = time.monotonic()
        power_w = (
            self.engine.average_power_w()
            if self.kind == "average"
            else self.engine.instant_power_w()
        )
        return PowerSample(t_s=now, power_w=power_w, energy_j=self.engine.energy_j(now))

    async def close(self) -> None:
        self._closed = True


Features = Callable[[], tuple[int, float, int]]
"""Returns (running decode batch, prefill tokens per step, KV tokens resident)."""


class ModelPowerSource:
    """Modelled power from live scheduler features, for an engine with no power sensor of its own.

    It gives no energy counter: integrating a model between reads would look exact and is not.
    """

    def __init__(
        self,
        features: Features,
        profile: GpuProfile | str = DEFAULT_PROFILE,
        *,
        power_limit_w: float | None = None,
        kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
        name: str = "model",
    ) -> None:
        self.features = features
        self.profile = resolve_profile(profile)
        self.power_limit_w = power_limit_w
        self.kv_capacity_tokens = kv_capacity_tokens
        self.name = name

    async def read(self) -> PowerSample:
        try:
            batch, prefill_tokens, kv_tokens = self.features()
        except Exception as exc:
            raise SensorReadError(f"{self.name}: feature callback failed: {exc}") from exc
        _, power_w = step_time_s(
            self.profile,
            int(batch),
            round(prefill_tokens),
            int(kv_tokens),
            self.power_limit_w,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )
        return PowerSample(t_s=time.monotonic(), power_w=power_w)

    async def close(self) -> None:
        return None
