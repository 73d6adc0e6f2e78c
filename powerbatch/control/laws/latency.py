"""Latency law: time per output token over its SLO shrinks the batch.

Two measures of it. The p95 TPOT of the requests finished in the latency window, the SLO's
own measure, shows a batch only as its requests end: a request's length later, tens of seconds
at a slow step. The engine's step time now (`EngineLoad.token_s`, from its scraped running
count and generated tokens) shows it within a few scrapes, and is what the requests running now
will show at their end. The law acts on the step time where the engine reports it: the p95
then still holds the steps of a batch already shrunk, and acting on it too wound the batch
down to a few requests for the window's length. Elsewhere it acts on the p95.

Over the SLO, λ_latency rises by `latency_gain × (ratio − 1)` and the batch cap shrinks by
`latency_shrink ×` the excess ratio (capped at 1), at most once per `latency_hold_s` when the
p95 is the measure over (its sliding window shows a smaller batch only as its older samples age
out, and acting every tick on a stale window winds the batch down to one), or once per
`FAST_HOLD_SCRAPES` new scrapes when the step time is. Under the SLO λ decays each tick; once
it is 0 the cap regrows by `latency_regrow` per tick plus one request, but not while the step
time is within `REGROW_BAND` of the SLO: a dead band, so the cap does not regrow into the
breach the step time would show only a scrape later. p95 TTFT only speeds growth (see the
power law's step): the ceiling always wins.
"""

from __future__ import annotations

import math

from powerbatch.control.config import ControlConfig
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.types import EngineLoad

FAST_HOLD_SCRAPES = 3
"""Scrapes after a shrink the step time was over for before the next: the step time's EWMA
(`engine_queue.RATE_WEIGHT` 0.3 a scrape) shows most of a shrink within three."""
REGROW_BAND = 0.1
"""The cap regrows only while the step time is under (1 − this) of the TPOT SLO."""


class LatencyLaw:
    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.multiplier = 0.0
        self.batch = float(config.max_batch)
        self._hold_until_s = -math.inf
        self._hold_scrapes = 0  # new scrapes to wait for before the step time acts again
        self._scrape_t_s: float | None = None

    def update(
        self,
        t_s: float,
        lat: LatencySnapshot | None,
        in_flight: int,
        engine: EngineLoad | None = None,
    ) -> None:
        cfg, g = self.config, self.config.gains
        tpot = lat.tpot_p95_s if lat else None
        slow = None if tpot is None else tpot / cfg.tpot_slo_s
        fast = None
        if engine is not None and engine.token_s is not None:
            fast = engine.token_s / cfg.tpot_slo_s
            if engine.t_s != self._scrape_t_s:
                self._scrape_t_s = engine.t_s
                self._hold_scrapes = max(0, self._hold_scrapes - 1)
        ratio = fast if fast is not None else slow
        if ratio is not None:
            if ratio > 1.0:
                by_fast = fast is not None
                ready = self._hold_scrapes == 0 if by_fast else t_s >= self._hold_until_s
                if ready:
                    if by_fast:
                        self._hold_scrapes = FAST_HOLD_SCRAPES
                    else:
                        self._hold_until_s = t_s + g.latency_hold_s
                    self.multiplier += g.latency_gain * (ratio - 1.0)
                    base = min(self.batch, float(max(in_flight, cfg.min_batch)))
                    self.batch = base * (1.0 - g.latency_shrink * min(ratio - 1.0, 1.0))
            else:
                self.multiplier = max(0.0, self.multiplier + g.latency_gain * (ratio - 1.0))
                near = fast is not None and fast > 1.0 - REGROW_BAND
                if self.multiplier == 0.0 and not near:
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
