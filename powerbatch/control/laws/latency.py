"""Latency law: time per output token over its SLO shrinks the batch.

Two measures of it. The p95 TPOT of the requests finished in the latency window, the SLO's
own measure, shows a batch only as its requests end: a request's length later, tens of seconds
at a slow step. The engine's inter-token latency (`EngineLoad`) shows it within scrapes:
`token_s`, averaged over a request's decode time, is what the requests running now will show
at their end; `step_s`, over the last few scrapes, is the step now. Where the engine reports
them the law acts on them, not on the p95: the p95 then still holds the steps of a batch
already shrunk, and acting on it too wound the batch down to a few requests for the window's
length.

Over the SLO (the engine's average and its step now both over it, or the p95 where the engine
exports no inter-token latency; with no average yet, or nothing decoding, nothing shrinks),
λ_latency rises by `latency_gain × (ratio − 1)` and the batch cap shrinks by `latency_shrink ×`
the excess ratio (capped at 1): once per `FAST_HOLD_SCRAPES` new scrapes on the engine's
measure, whose step now shows a shrink within them; once per `latency_hold_s` on the p95 (its
sliding window shows a smaller batch only as its older samples age out). A prefill burst that
slows a few steps leaves the average under the SLO, and a shrink that brought the step back
under stops the next even while the average remembers the slow steps. Under the SLO λ decays
each tick; once it is 0 the cap regrows by `latency_regrow` per tick plus one request, but not
while the step now is within `REGROW_BAND` of the SLO: a dead band, so the cap does not regrow
into a breach the step would show only a scrape later. p95 TTFT only speeds growth (see the
power law's step): the ceiling always wins.
"""

from __future__ import annotations

import math

from powerbatch.control.config import ControlConfig
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.types import EngineLoad

FAST_HOLD_SCRAPES = 3
"""New scrapes after a shrink on the engine's measure before the next: the step's EWMA
(`engine_queue.RATE_WEIGHT`, 0.3 a scrape) shows most of a shrink within three."""
REGROW_BAND = 0.1
"""The cap regrows only while the step now is under (1 − this) of the TPOT SLO."""


class LatencyLaw:
    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.multiplier = 0.0
        self.batch = float(config.max_batch)
        self._hold_until_s = -math.inf
        self._hold_scrapes = 0  # new scrapes to wait for before the engine's measure acts again
        self._scrape_t_s: float | None = None

    def update(
        self,
        t_s: float,
        lat: LatencySnapshot | None,
        in_flight: int,
        engine: EngineLoad | None = None,
    ) -> None:
        cfg, g = self.config, self.config.gains
        slo_s = cfg.tpot_slo_s
        by_engine = engine is not None and engine.step_s is not None
        if by_engine:
            assert engine is not None and engine.step_s is not None
            # No average (no request has finished, or nothing decodes now): nothing to shrink
            # on, and the p95 is no better.
            now = engine.step_s / slo_s
            ratio = engine.token_s / slo_s if engine.token_s is not None else min(now, 1.0)
            if engine.t_s != self._scrape_t_s:
                self._scrape_t_s = engine.t_s
                self._hold_scrapes = max(0, self._hold_scrapes - 1)
            over = engine.token_s is not None and ratio > 1.0 and now > 1.0
            ready = self._hold_scrapes == 0
            near = now > 1.0 - REGROW_BAND
        else:
            tpot = lat.tpot_p95_s if lat else None
            if tpot is None:
                self.batch = max(float(cfg.min_batch), self.batch)
                return
            ratio = tpot / slo_s
            over, ready, near = ratio > 1.0, t_s >= self._hold_until_s, False
        if over:
            if ready:
                if by_engine:
                    self._hold_scrapes = FAST_HOLD_SCRAPES
                else:
                    self._hold_until_s = t_s + g.latency_hold_s
                self.multiplier += g.latency_gain * (ratio - 1.0)
                base = min(self.batch, float(max(in_flight, cfg.min_batch)))
                self.batch = base * (1.0 - g.latency_shrink * min(ratio - 1.0, 1.0))
        else:
            self.multiplier = max(0.0, self.multiplier + g.latency_gain * (min(ratio, 1.0) - 1.0))
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
