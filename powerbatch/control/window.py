"""The loop's inputs over time: features over the last second, and which load a reading measured.

The model regresses the 1-second power (the quantity the ceiling is about) on features taken
over the same second, so cause and effect line up; a meter that lags the ticks is paired with
the load of the second it measured, not the load of the tick that reads it.
"""

from __future__ import annotations

from collections import deque

from powerbatch.estimate import Features


class FeatureWindow:
    """Levels averaged and counters differenced over the last `window_s` of ticks."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._ticks: deque[tuple[float, float, float, float, float]] = deque()

    def update(
        self, t_s: float, batch: float, kv: float, prefill_total: float, decode_total: float
    ) -> Features:
        ticks = self._ticks
        ticks.append((t_s, batch, kv, prefill_total, decode_total))
        while len(ticks) > 2 and ticks[1][0] <= t_s - self.window_s:
            ticks.popleft()
        first = ticks[0]
        dt = t_s - first[0]
        n = len(ticks)
        return Features(
            batch=sum(x[1] for x in ticks) / n,
            kv_tokens=sum(x[2] for x in ticks) / n,
            prefill_tok_s=(prefill_total - first[3]) / dt if dt > 0 else 0.0,
            decode_tok_s=(decode_total - first[4]) / dt if dt > 0 else 0.0,
        )


class ReadingAligner:
    """Which load a power reading measured, and how much it weighs when learned.

    A source the monitor averages is read afresh every tick, over the same second as the
    features: each tick's reading weighs one. An exporter that collects once a second
    (dcgm-exporter's `--collect-interval`) serves one value for a whole period: it is new on
    the tick that first sees it, it measured the second before that tick, whatever the ticks
    after it see, and it weighs the ticks since the last new value (at most a window's worth:
    it is a mean over one window, however long it is then held). A held value weighs 0.
    """

    def __init__(self, every_tick: bool, max_weight: float = 5.0) -> None:
        self.every_tick = every_tick
        self.max_weight = max_weight
        self._key: tuple[float | None, float | None] | None = None
        self._features: Features | None = None
        self._ticks = 0

    def update(
        self, raw_w: float | None, energy_j: float | None, features: Features
    ) -> tuple[float, Features]:
        """(weight, the features the reading measured) for this tick's reading and features.
        Without a raw value (an old trace) every reading is new."""
        self._ticks += 1
        key = (raw_w, energy_j)
        if self.every_tick or raw_w is None or key != self._key or self._features is None:
            weight = 1.0 if self.every_tick else float(min(self._ticks, self.max_weight))
            self._key, self._features, self._ticks = key, features, 0
            return weight, features
        return 0.0, self._features
