"""Energy accounting: the metered energy of each interval split over the requests that did work.

`attribution` is the rule (pure, clock-free); `accounting` runs it on the control loop's tick
for a host; `metrics`, `labels` and `usage` are where the figures show. See docs/energy.md.
"""

from powerbatch.energy.attribution import (
    DEFAULT_PREFILL_WEIGHT,
    EnergyLedger,
    EnergyMeter,
    IntervalSplit,
    RequestEnergy,
    split_energy,
)
from powerbatch.energy.settings import EnergySettings

__all__ = [
    "DEFAULT_PREFILL_WEIGHT",
    "EnergyLedger",
    "EnergyMeter",
    "EnergySettings",
    "IntervalSplit",
    "RequestEnergy",
    "split_energy",
]
