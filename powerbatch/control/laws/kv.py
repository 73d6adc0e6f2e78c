"""KV law: the upstream's KV-cache usage over target shrinks the cap on KV tokens in flight.

λ_kv rises by `kv_gain × (usage − target)`; over target the KV scale shrinks by `kv_shrink`
per tick down to `kv_min_scale`, and regrows by `kv_regrow` once λ_kv is 0. The cap is
`kv_lead ×` the batch's usual KV × the scale: room for the spread of context lengths (a single
long prompt must not idle the batch), yet a shift to much longer contexts is capped before the
power it costs shows on the meter.
"""

from __future__ import annotations

from powerbatch.control.config import ControlConfig

NEARLY_FULL = 0.9
"""KV tokens in flight at this share of the cap or more: the cap is what holds work back."""


class KvLaw:
    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.multiplier = 0.0
        self._scale = 1.0

    def update(self, usage: float | None) -> None:
        if usage is None:
            return
        g = self.config.gains
        over = usage - self.config.kv_usage_target
        self.multiplier = max(0.0, self.multiplier + g.kv_gain * over)
        if over > 0:
            self._scale = max(g.kv_min_scale, self._scale * (1.0 - g.kv_shrink))
        elif self.multiplier == 0.0:
            self._scale = min(1.0, self._scale * (1.0 + g.kv_regrow))

    def cap(self, batch: int, kv_per_request: float) -> int:
        by_shape = self.config.gains.kv_lead * batch * kv_per_request * self._scale
        return int(min(self.config.max_kv_tokens, max(by_shape, kv_per_request)))

    def binds(self, kv_tokens_in_flight: float, cap: int) -> bool:
        """The KV cap holds work back: it is shrunk by the multiplier, or nearly full."""
        return self.multiplier > 0.0 or kv_tokens_in_flight >= NEARLY_FULL * cap
