"""Demand: what one request looks like, and how far the batch may lead the work there is.

The per-request shape (KV tokens, prefill and decode rates of one request in flight) follows
the load mix with an EWMA of `shape_rate` per tick; the KV cap, the power curve and the prefill
pace are priced at it. The batch may lead the last `demand_window_s`'s peak demand (in flight
plus queued) by `demand_headroom` and `demand_slack` requests, so a burst ramps in instead of
landing at once.
"""

from __future__ import annotations

import math
from collections import deque

from powerbatch.control.config import ControlConfig
from powerbatch.estimate import Features, PowerPrior


class DemandLaw:
    def __init__(self, config: ControlConfig, prior: PowerPrior) -> None:
        self.config = config
        self.per_request = Features(
            1.0, prior.kv_tokens_per_request, 100.0, prior.decode_tok_s_per_request
        )
        self._demand: deque[tuple[float, int]] = deque()
        self._prefill: deque[tuple[float, float]] = deque()

    def learn(self, f: Features) -> None:
        """Move the per-request shape towards the load now (nothing to learn from no load)."""
        if f.batch < 1:
            return
        per = f.per_request()
        a = self.config.gains.shape_rate
        s = self.per_request
        self.per_request = Features(
            1.0,
            (1 - a) * s.kv_tokens + a * per.kv_tokens,
            (1 - a) * s.prefill_tok_s + a * per.prefill_tok_s,
            (1 - a) * s.decode_tok_s + a * per.decode_tok_s,
        )

    def prefill_peak(self, t_s: float, seen: Features) -> float:
        """The highest prompt flow the meter has seen over `demand_window_s` (tokens/s): what
        the prefill pace may explore beyond, whatever the flow per request in flight says
        (under a binding pace, requests in flight are few, and so is their flow)."""
        window = self.config.gains.demand_window_s
        self._prefill.append((t_s, seen.prefill_tok_s))
        while self._prefill and self._prefill[0][0] < t_s - window:
            self._prefill.popleft()
        return max(r for _, r in self._prefill)

    def cap(self, t_s: float, demand: int) -> int:
        """The largest batch demand asks for: its recent peak with headroom."""
        g = self.config.gains
        self._demand.append((t_s, demand))
        while self._demand and self._demand[0][0] < t_s - g.demand_window_s:
            self._demand.popleft()
        peak = max(d for _, d in self._demand)
        return max(self.config.initial_batch, math.ceil(peak * g.demand_headroom) + g.demand_slack)
