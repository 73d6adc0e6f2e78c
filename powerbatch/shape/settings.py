"""Grid-friendly power shape: ramp limits, a floor held with deferrable work, and the planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from powerbatch.errors import ConfigError
from powerbatch.settings import check_bounds, setting


@dataclass(frozen=True, slots=True)
class ShapeSettings:
    """Power shape: ramp limits and a floor for the grid, and the receding-horizon planner"""

    ramp_up_w_per_s: float | None = setting(
        None, "largest rise of 1-second power per second, W/s; 0 or unset: off", ge=0
    )
    ramp_down_w_per_s: float | None = setting(
        None, "largest fall of 1-second power per second, W/s; 0 or unset: off", ge=0
    )
    floor_w: float | None = setting(
        None, "hold power at least here with deferrable (low) work while it waits, W", ge=0
    )
    swing_band_hz: tuple[float, ...] = setting(
        (0.2, 3.0), "band (lo, hi) whose swing energy is reported, Hz", default_doc="0.2, 3.0"
    )
    planner: Literal["off", "on"] = setting(
        "off", "plan per-second power over a horizon and follow it (off: reactive limits only)"
    )
    plan_horizon_s: float = setting(60.0, "the planner's horizon, s", ge=30, le=120)
    plan_every_s: float = setting(5.0, "re-plan this often, s", ge=0.5, le=60)

    def __post_init__(self) -> None:
        check_bounds(self)
        band = self.swing_band_hz
        if len(band) != 2 or not 0 <= band[0] < band[1]:
            raise ConfigError(f"swing_band_hz must be two numbers lo < hi, got {band}")

    @property
    def ramp_up(self) -> float | None:
        """The rise limit, W/s; None when off (unset or 0)."""
        return self.ramp_up_w_per_s or None

    @property
    def ramp_down(self) -> float | None:
        return self.ramp_down_w_per_s or None

    @property
    def active(self) -> bool:
        """Any limit set: the controller has shaping to do."""
        return bool(self.ramp_up or self.ramp_down or self.floor_w is not None)
