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
the excess ratio (capped at 1), one request at least: once per `FAST_HOLD_SCRAPES` new scrapes
on the engine's measure, whose step now shows a shrink within them; once per `latency_hold_s` on
the p95 (its sliding window shows a smaller batch only as its older samples age out). A prefill
burst that slows a few steps leaves the average under the SLO, and a shrink that brought the
step back under stops the next even while the average remembers the slow steps. Under the SLO λ
decays each tick; once it is 0 the cap regrows by `latency_regrow` per tick plus one request,
but not while the step now is within `REGROW_BAND` of the SLO: a dead band, so the cap does not
regrow into a breach the step would show only a scrape later. p95 TTFT only speeds growth (see
the power law's step): the ceiling always wins.

A cut is judged by what it bought. A step is a fixed part (the weights' read; a long prompt's
prefill where every step carries one) and a part per running request (their KV reads and
compute): the roofline's shape, and vLLM's inter-token latency grows about so with the batch.
Once the running batch and what the proxy admitted have both halved (`JUDGE_FALL`) since the
cuts began, the line through the step now and at the latest cut a halving or more above it (each
against the batch it was averaged over) says which batch would meet the SLO: (SLO − fixed part)
/ per-request part. Where that is under `min_batch` (or the step did not fall), or the cap is at
`min_batch` and the step still over the SLO, no batch meets it, so the cuts only gave tokens
away: the cap goes back to where they began and the engine's measure cuts nothing for
`FUTILE_MEMORY_S`, twice as long after each such judgement until the step is back under the SLO;
then one cut tries again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from powerbatch.control.config import ControlConfig
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.types import EngineLoad

FAST_HOLD_SCRAPES = 3
"""New scrapes after a shrink on the engine's measure before the next: the step's EWMA
(`engine_queue.RATE_WEIGHT`, 0.3 a scrape) shows most of a shrink within three."""
REGROW_BAND = 0.1
"""The cap regrows only while the step now is under (1 − this) of the TPOT SLO."""
JUDGE_FALL = 2.0
"""A cut is judged once the running batch and what the proxy admitted both fell by this factor.
Over a smaller fall the step's noise and its curvature decide: a real vLLM (CPU build, the
plugin) moved its step by about its one-second noise over a 10 % fall, and the line through it
read a 20-ms SLO the engine meets at about 20 requests as out of reach (docs/vllm-plugin.md)."""
FUTILE_MEMORY_S = 30.0
"""After cuts that could not reach the SLO, the engine's measure cuts nothing this long (a
latency window's worth: the load's shape may have moved by then), doubling while they keep
failing."""


@dataclass(slots=True)
class _Cut:
    """Where the engine's measure began cutting (the cap before, what the proxy had admitted),
    and the (batch, step) it measured at each of its cuts since, oldest first."""

    cap: float
    admitted: int
    points: list[tuple[float, float]]

    def above(self, running: float) -> tuple[float, float] | None:
        """The latest point a halving (`JUDGE_FALL`) or more above `running`: on a step that
        grows faster than in proportion (a roofline's), a line from the cuts' first point
        underrates the fixed part ever more as the batch falls; the latest such point gives
        the most local line the step's noise allows."""
        far = [p for p in self.points if p[0] >= JUDGE_FALL * running]
        return far[-1] if far else None


class LatencyLaw:
    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.multiplier = 0.0
        self.batch = float(config.max_batch)
        self._hold_until_s = -math.inf
        self._hold_scrapes = 0  # new scrapes to wait for before the engine's measure acts again
        self._scrape_t_s: float | None = None
        self._cut: _Cut | None = None
        self._futile_until_s = -math.inf
        self._futile_memory_s = FUTILE_MEMORY_S
        self.undone_total = 0
        """Cuts undone because no batch met the SLO (/status `latency.cuts_undone_total`)."""
        self.last_undo = ""
        """Why the last undoing: the batch and step the line went through (logged)."""

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
            if not over:
                self._cut = None  # under the SLO: the cuts paid, or the load moved
                self._futile_memory_s = FUTILE_MEMORY_S
            elif ready and self._futile(t_s, engine):
                ready = False
            elif ready:  # a cut comes: note where it was measured
                point = (_running(engine), engine.step_s)
                if self._cut is None:  # the cuts begin here
                    self._cut = _Cut(self.batch, engine.in_flight, [point])
                else:
                    self._cut.points.append(point)
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
                # At least one request a cut: at a few requests a step a little over the SLO
                # cuts a fraction of one, and a warm-up's five took 44 s to wind down (the 70B
                # plant, docs/scenarios.md, stop 48).
                shrunk = base * (1.0 - g.latency_shrink * min(ratio - 1.0, 1.0))
                self.batch = min(shrunk, base - 1.0)
        else:
            self.multiplier = max(0.0, self.multiplier + g.latency_gain * (min(ratio, 1.0) - 1.0))
            if self.multiplier == 0.0 and not near:
                regrown = self.batch * (1.0 + g.latency_regrow) + 1
                self.batch = min(float(cfg.max_batch), regrown)
        self.batch = max(float(cfg.min_batch), self.batch)

    def _futile(self, t_s: float, engine: EngineLoad) -> bool:
        """Whether cutting now cannot bring the step under the SLO (see the module's last
        paragraph); on the first such judgement the cap goes back to where the cuts began."""
        if t_s < self._futile_until_s:
            return True
        cut, step_s = self._cut, engine.step_s
        if cut is None or step_s is None:
            return False
        running = _running(engine)
        slo_s = self.config.tpot_slo_s
        first = cut.points[0]
        then = cut.above(running)
        if int(self.batch) > self.config.min_batch:  # cuts left to make: judge them by the line
            if then is None:
                return False
            if cut.admitted < JUDGE_FALL * engine.in_flight:
                return False  # the engine queues more (a prefill backlog): not the cuts' doing
            per_request_s = (then[1] - step_s) / (then[0] - running)
            fixed_s = step_s - per_request_s * running
            needed = (slo_s - fixed_s) / per_request_s if per_request_s > 0 else 0.0
            if needed >= self.config.min_batch:
                return False
        # else the cap is at `min_batch` and the step is still over: measured, not drawn
        # (cuts that began at a small batch, the warm-up's, cannot halve it)
        self.last_undo = (
            f"admitted {cut.admitted} -> {engine.in_flight}, running {first[0]:.0f} -> "
            f"{running:.0f}, step {1000 * first[1]:.1f} -> {1000 * step_s:.1f} ms "
            f"(SLO {1000 * slo_s:.1f} ms): no batch meets it; cap back to {cut.cap:.0f} for "
            f"{self._futile_memory_s:.0f} s"
        )
        self.batch = max(self.batch, cut.cap)
        self.multiplier = 0.0
        self._cut = None
        self._futile_until_s = t_s + self._futile_memory_s
        self._futile_memory_s *= 2.0
        self.undone_total += 1
        return True

    def status(self, t_s: float) -> dict[str, object]:
        """/status `latency`: the undoings, and how long the engine's measure still cuts nothing."""
        return {
            "cuts_undone_total": self.undone_total,
            "cuts_paused_for_s": max(0.0, self._futile_until_s - t_s),
        }

    def step(self, step: int, lat: LatencySnapshot | None) -> int:
        """The growth step, boosted while p95 TTFT is over its SLO: queueing is hurting first
        tokens, so grow faster where watts allow."""
        ttft = lat.ttft_p95_s if lat else None
        if ttft is not None and ttft > self.config.ttft_slo_s:
            return math.ceil(step * self.config.gains.ttft_step_boost)
        return step


def _running(engine: EngineLoad) -> float:
    """The batch the step was measured at, at least one request: the requests decoding over
    the step's own scrapes where the engine says, else the running count now."""
    batch = engine.running if engine.step_batch is None else engine.step_batch
    return max(batch, 1.0)
