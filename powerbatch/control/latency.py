"""Sliding-window p95 of time to first token and time per output token, per priority class."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    """p95s over the window; None where the window holds too few samples to say."""

    ttft_p95_s: float | None
    tpot_p95_s: float | None
    ttft_by_class_s: dict[str, float | None]
    samples: int


class _Series:
    """Times and values in two deques, so a percentile is one C-speed conversion."""

    __slots__ = ("t", "v")

    def __init__(self, maxlen: int) -> None:
        self.t: deque[float] = deque(maxlen=maxlen)
        self.v: deque[float] = deque(maxlen=maxlen)

    def append(self, t_s: float, value: float) -> None:
        self.t.append(t_s)
        self.v.append(value)

    def values_since(self, since_s: float) -> np.ndarray:
        while self.t and self.t[0] < since_s:
            self.t.popleft()
            self.v.popleft()
        return np.fromiter(self.v, float, len(self.v))


class LatencyWindow:
    """Records per-request latencies and answers p95 over the last `window_s` seconds.

    Appends are O(1) on the request path; percentiles are computed on the control tick only.
    """

    def __init__(self, window_s: float = 30.0, min_samples: int = 5, maxlen: int = 50_000) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self._ttft: dict[str, _Series] = {}
        self._tpot = _Series(maxlen)
        self._maxlen = maxlen

    def record(
        self, now_s: float, priority: str, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        if ttft_s is not None:
            series = self._ttft.get(priority)
            if series is None:
                series = self._ttft[priority] = _Series(self._maxlen)
            series.append(now_s, ttft_s)
        if tpot_s is not None:
            self._tpot.append(now_s, tpot_s)

    def _p95(self, values: np.ndarray) -> float | None:
        if len(values) < self.min_samples:
            return None
        return float(np.percentile(values, 95))

    def snapshot(self, now_s: float, interactive: tuple[str, ...] | None = None) -> LatencySnapshot:
        """p95s now; the overall TTFT p95 counts only the `interactive` classes when given."""
        since = now_s - self.window_s
        values = {name: s.values_since(since) for name, s in self._ttft.items()}
        by_class = {name: self._p95(vs) for name, vs in values.items()}
        chosen = [name for name in values if interactive is None or name in interactive]
        # One class chosen (the usual case): its p95 is the overall one, not computed twice.
        # This runs every tick over up to maxlen samples a class.
        if len(chosen) == 1:
            ttft_p95_s = by_class[chosen[0]]
        else:
            ttft_p95_s = self._p95(np.concatenate([values[n] for n in chosen] or [np.empty(0)]))
        samples = sum(len(vs) for vs in values.values())
        return LatencySnapshot(
            ttft_p95_s, self._p95(self._tpot.values_since(since)), by_class, samples
        )
