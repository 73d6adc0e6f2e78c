"""Control: the decision each tick, from measured power, the learned model and latency."""

from powerbatch.control.config import ControlConfig, Mode
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
]
