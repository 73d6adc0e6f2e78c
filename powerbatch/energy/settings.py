"""Settings of the energy attribution, shared by the proxy and the vLLM plugin."""

from __future__ import annotations

from dataclasses import dataclass

from powerbatch.settings import check_bounds, setting


@dataclass(frozen=True, slots=True)
class EnergySettings:
    """Energy: how the metered energy is split over requests (docs/energy.md)"""

    prefill_weight: float | None = setting(
        None,
        "energy of a prompt token relative to a generated token",
        gt=0,
        le=10,
        default_doc="learned from the power model, else 0.25",
    )
    idle_w: float | None = setting(
        None,
        "power drawn with nothing in flight, never charged to requests, W",
        ge=0,
        default_doc="learned: the power model at batch 0",
    )

    def __post_init__(self) -> None:
        check_bounds(self)
