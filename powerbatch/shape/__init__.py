"""Grid-friendly power: ramp limits, a floor, a receding-horizon plan, and what they measured."""

from powerbatch.shape.settings import ShapeSettings

__all__ = ["ShapeSettings"]
