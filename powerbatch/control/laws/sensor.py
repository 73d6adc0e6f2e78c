"""Sensor gate: no trustworthy watts, no growth.

A reading that is missing, flagged bad or not finite fails the tick closed (the safe batch).
A sensor that was good and went bad must then stay good for `recover_s` before the laws act
again, so a flapping sensor does not flap the batch; no reading yet at start-up is not a fault.
"""

from __future__ import annotations

import math

from powerbatch.control.types import Observation


class SensorGate:
    def __init__(self, recover_s: float) -> None:
        self.recover_s = recover_s
        self._good_since_s: float | None = None
        self._failed_before = False

    def distrust(self, obs: Observation) -> str | None:
        """Why this tick's reading cannot be acted on, or None when it can."""
        if obs.sensor_ok and obs.power_w is not None and math.isfinite(obs.power_w):
            if self._good_since_s is None:
                self._good_since_s = obs.t_s
        else:
            self._failed_before = self._failed_before or self._good_since_s is not None
            self._good_since_s = None
        recovering = (
            self._failed_before
            and self._good_since_s is not None
            and obs.t_s - self._good_since_s < self.recover_s
        )
        if recovering:
            return "sensor recovering"
        if obs.power_w is None or self._good_since_s is None:
            return obs.sensor_error or "unknown"
        return None
