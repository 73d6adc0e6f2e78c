"""Shape law: the grid wants slow ramps and a floor (`ShapeSettings`, off unless set).

The batch in flight may exceed the batch in flight a second ago only by what the model
predicts a second's ramp (`ramp_up`) buys, at least one request, so an unlearnt slope cannot
pin the batch; if that holds at every instant, 1-second power rises no faster than the ramp
either. The meter's own rise over the last second stops growth outright. A step down is
bounded where the model's predicted decrement reaches `ramp_down` (likewise a fall near the
limit stops a step down: the model's slope is least known at the small batches a fall ends
in), unless measured power is over `ceiling − margin` (the ceiling always wins; the caller
checks). Deferrable (low-class) work is the one load that may be moved in time: it is released
to hold `floor_w` or to slow a fall faster than half of `ramp_down`. A plan
(`Observation.plan_w`, see powerbatch.shape.planner) stops growth at the planned power, holds
deferrable work above it and releases it below. It does not lower the target: a plan one ramp
from the meter, used as a target, stepped interactive work down on every noisy second.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from powerbatch.control.config import ControlConfig, ShapeSettings
from powerbatch.control.types import Deferrable, Observation

EPS_S = 1e-9
FALLING_STOP = 0.75
"""The meter falling by this share of `ramp_down` in a second stops a step down."""
FALLING_RELEASE = 0.5
"""The meter falling by this share of `ramp_down` in a second releases deferrable work."""


@dataclass(frozen=True, slots=True)
class RampBounds:
    """The batch range the ramps allow this tick, and what admission does with low work."""

    up: int
    down: int
    deferrable: Deferrable


class RampLaw:
    def __init__(self, config: ControlConfig, shape: ShapeSettings, grid: np.ndarray) -> None:
        self.config = config
        self.shape = shape
        self._grid = grid
        self._flight: deque[tuple[float, int]] = deque()  # in flight over the last second

    def _second_ago(
        self, t_s: float, in_flight: int, recent_power: Iterable[tuple[float, float]]
    ) -> tuple[float | None, int]:
        """The 1-second power and the batch in flight a second before `t_s` (a ramp's origin)."""
        flight = self._flight
        flight.append((t_s, in_flight))
        while len(flight) > 1 and flight[1][0] <= t_s - 1.0 + EPS_S:
            flight.popleft()
        batch = flight[0][1] if flight[0][0] <= t_s - 1.0 + EPS_S else min(n for _, n in flight)
        for t, w in recent_power:
            if t >= t_s - 1.0 - EPS_S:
                return (w if t <= t_s - 0.5 else None), batch
        return None, batch

    def bounds(
        self,
        obs: Observation,
        power_w: float,
        in_flight: int,
        current: int,
        mean_w: np.ndarray,
        recent_power: Iterable[tuple[float, float]],
    ) -> RampBounds:
        cfg, sh = self.config, self.shape
        lo, hi = cfg.min_batch, cfg.max_batch
        before_w, base = self._second_ago(obs.t_s, in_flight, recent_power)
        base = min(max(base, lo), hi)
        delta_w = mean_w - mean_w[base - lo]
        up, down = hi, lo
        rise_w = power_w - before_w if before_w is not None else 0.0
        if sh.ramp_up is not None:
            ok = np.nonzero(delta_w <= sh.ramp_up)[0]
            up = max(int(self._grid[ok[-1]]) if len(ok) else lo, base + 1)
            if rise_w >= sh.ramp_up:
                up = min(up, current)
        if obs.plan_w is not None:
            # Grow only into the plan's headroom (stepping down stays the power law's).
            fits = np.nonzero(delta_w <= obs.plan_w - power_w)[0]
            up = min(up, max(int(self._grid[fits[-1]]) if len(fits) else lo, min(base, current)))
        if sh.ramp_down is not None:
            ok = np.nonzero(delta_w >= -sh.ramp_down)[0]
            down = int(self._grid[ok[0]]) if len(ok) else lo
            # Nor more requests than a second's ramp buys at the mean watts per request (an
            # upper bound on the marginal watts of a concave curve with an idle floor).
            per_request_w = power_w / max(base, 1)
            down = max(down, base - math.floor(sh.ramp_down / per_request_w))
            if -rise_w >= FALLING_STOP * sh.ramp_down:
                down = max(down, current)
        mode = Deferrable.DEFAULT
        waiting = obs.queued_deferrable > 0
        if obs.plan_w is not None:
            mode = Deferrable.HOLD if power_w > obs.plan_w else Deferrable.RELEASE
        if waiting and sh.floor_w is not None and power_w < sh.floor_w:
            mode = Deferrable.RELEASE
        if waiting and sh.ramp_down is not None and -rise_w > FALLING_RELEASE * sh.ramp_down:
            mode = Deferrable.RELEASE
        return RampBounds(up, down, mode)
