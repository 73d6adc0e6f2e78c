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


class LatencyWindow:
    """Records per-request latencies and answers p95 over the last `window_s` seconds.

    Appends are O(1) on the request path; percentiles are computed on the control tick only.
    """

    def __init__(self, window_s: float = 30.0, min_samples: int = 5, maxlen: int = 50_000) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self._ttft: dict[str, deque[tuple[float, float]]] = {}
        self._tpot: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self._maxlen = maxlen

    def record(
        self, now_s: float, priority: str, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        if ttft_s is not None:
            q = self._ttft.get(priority)
            if q is None:
                q = self._ttft[priority] = deque(maxlen=self._maxlen)
            q.append((now_s, ttft_s))
        if tpot_s is not None:
            self._tpot.append((now_s, tpot_s))

    def _p95(self, q: deque[tuple[float, float]], since_s: float) -> float | None:
        while q and q[0][0] < since_s:
            q.popleft()
        if len(q) < self.min_samples:
            return None
        return float(np.percentile(np.fromiter((v for _, v in q), float, len(q)), 95))

    def snapshot(self, now_s: float, interactive: tuple[str, ...] | None = None) -> LatencySnapshot:
        """p95s now; the overall TTFT p95 counts only the `interactive` classes when given."""
        since = now_s - self.window_s
        by_class = {name: self._p95(q, since) for name, q in self._ttft.items()}
        chosen = [
            v
            for name, q in self._ttft.items()
            if interactive is None or name in interactive
            for t, v in q
            if t >= since
        ]
        ttft = float(np.percentile(chosen, 95)) if len(chosen) >= self.min_samples else None
        samples = sum(len(q) for q in self._ttft.values())
        return LatencySnapshot(ttft, self._p95(self._tpot, since), by_class, samples)
