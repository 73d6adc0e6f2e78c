"""Control: the decision each tick, from measured power, the learned model and latency."""

from powerbatch.control.config import ControlConfig, Mode, prior_max_w
from powerbatch.control.controller import (
    BINDINGS,
    CONSTRAINTS,
    Controller,
    Decision,
    Limits,
    Observation,
)
from powerbatch.control.latency import LatencySnapshot, LatencyWindow

__all__ = [
    "BINDINGS",
    "CONSTRAINTS",
    "ControlConfig",
    "Controller",
    "Decision",
    "LatencySnapshot",
    "LatencyWindow",
    "Limits",
    "Mode",
    "Observation",
    "prior_max_w",
]
