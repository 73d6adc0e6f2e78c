"""Control: the decision each tick, from measured power, the learned model and latency.

This package's top level is light (plain data, enums, settings): the admission queue imports
`AdmissionLimits` from here without loading numpy. The controller itself is
`powerbatch.control.controller.Controller`, the loop both hosts run `powerbatch.control.loop`.
"""

from powerbatch.control.config import ControlConfig, Gains, Mode, ShapeSettings, prior_max_w
from powerbatch.control.latency import LatencySnapshot, LatencyWindow
from powerbatch.control.types import (
    CONSTRAINTS,
    AdmissionLimits,
    Binding,
    Decision,
    Deferrable,
    EngineLoad,
    Observation,
    QueueCounts,
    State,
)

__all__ = [
    "CONSTRAINTS",
    "AdmissionLimits",
    "Binding",
    "ControlConfig",
    "Decision",
    "Deferrable",
    "EngineLoad",
    "Gains",
    "LatencySnapshot",
    "LatencyWindow",
    "Mode",
    "Observation",
    "QueueCounts",
    "ShapeSettings",
    "State",
    "prior_max_w",
]
