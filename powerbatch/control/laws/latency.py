"""Latency law: p95 time per output token over its SLO shrinks the batch.

λ_latency rises by `latency_gain × (p95 TPOT / SLO − 1)` while over the SLO and the batch cap
shrinks by `latency_shrink ×` the excess ratio (capped at 1), at most once per
`latency_hold_s`: the p95's sliding window shows a smaller batch only as its older samples age
out, and acting every tick on a stale window winds the batch down to one. Under the SLO λ
decays each tick; once it is 0 the cap regrows by `latency_regrow` per tick plus one request.
p95 TTFT only speeds growth (see the power law's step): the ceiling always wins.
"""

from __future__ import annotations

import math

from powerbatch.control.config import ControlConfig
from powerbatch.control.latency import LatencySnapshot


class LatencyLaw:
    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.multiplier = 0.0
        self.batch = float(config.max_batch)
        self._hold_until_s = -math.inf

    def update(self, t_s: float, lat: LatencySnapshot | None, in_flight: int) -> None:
        cfg, g = self.config, self.config.gains
        tpot = lat.tpot_p95_s if lat else None
        if tpot is not None:
            ratio = tpot / cfg.tpot_slo_s
            if ratio > 1.0:
                if t_s >= self._hold_until_s:
                    self._hold_until_s = t_s + g.latency_hold_s
                    self.multiplier += g.latency_gain * (ratio - 1.0)
                    base = min(self.batch, float(max(in_flight, cfg.min_batch)))
                    self.batch = base * (1.0 - g.latency_shrink * min(ratio - 1.0, 1.0))
            else:
                self.multiplier = max(0.0, self.multiplier + g.latency_gain * (ratio - 1.0))
                if self.multiplier == 0.0:
                    regrown = self.batch * (1.0 + g.latency_regrow) + 1
                    self.batch = min(float(cfg.max_batch), regrown)
        self.batch = max(float(cfg.min_batch), self.batch)

    def step(self, step: int, lat: LatencySnapshot | None) -> int:
        """The growth step, boosted while p95 TTFT is over its SLO: queueing is hurting first
        tokens, so grow faster where watts allow."""
        ttft = lat.ttft_p95_s if lat else None
        if ttft is not None and ttft > self.config.ttft_slo_s:
            return math.ceil(step * self.config.gains.ttft_step_boost)
        return step
