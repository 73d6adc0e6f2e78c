"""The loop's inputs over time: features over the last second, and which load a reading measured.

The model regresses the 1-second power (the quantity the ceiling is about) on features taken
over the same second, so cause and effect line up; a meter that lags the ticks is paired with
the load of the second it measured, not the load of the tick that reads it. How far it lags is
learned from the meter itself (`MeterLag`): an exporter's collect interval, its scrape and a
relay each add dead time that no setting knows.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

import numpy as np

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


def counter_rate(
    samples: Sequence[tuple[float, float]], start_s: float, end_s: float
) -> float | None:
    """The rate of a counter scraped at `samples` ((t_s, value), oldest first) over
    [start_s, end_s], interpolated linearly between scrapes. The part of the span after the
    last scrape is not known yet: the span is cut there, and where less than half of it is
    left, the rate between the last two scrapes stands for it. None with under two scrapes."""
    if len(samples) < 2 or end_s <= start_s:
        return None
    ts = [t for t, _ in samples]
    vs = [v for _, v in samples]
    end = min(end_s, ts[-1])
    start = max(start_s, ts[0])
    if end - start < 0.5 * (end_s - start_s):
        start, end = ts[-2], ts[-1]
    if end <= start:
        return None
    return max(0.0, float(np.interp(end, ts, vs) - np.interp(start, ts, vs)) / (end - start))


def _lag_row(f: Features) -> tuple[float, ...]:
    return (
        1.0,
        f.batch / 64.0,
        float(np.log2(1.0 + max(f.batch, 0.0))),
        f.prefill_tok_s / 10_000.0,
        f.decode_tok_s / 10_000.0,
    )


class MeterLag:
    """How far behind the load the meter's readings are, learned from the readings.

    Each new reading is paired with the load features of every candidate lag (0 to `max_lag_s`
    in ticks), and power is regressed on them (constant, batch, log2 batch, prefill and decode
    rates) over the last `window` readings; the lag whose fit leaves the least residual wins.
    A wrong lag pairs the watts of one second with the load of another: the model then learns
    that prefill is free and an idle batch is hot, and the laws act on a reading as if it were
    now. The lag moves only when another fits clearly better (`switch_ratio` of the residual),
    and only once the load has moved (a flat load says nothing about lag). Normal equations of
    5 regressors, solved per candidate once a reading: no BLAS on the window's rows.
    """

    def __init__(
        self,
        tick_s: float,
        *,
        max_lag_s: float = 3.0,
        window: int = 40,
        min_readings: int = 8,
        switch_ratio: float = 0.7,
        assume_late: bool = True,
    ) -> None:
        self.tick_s = tick_s
        self.lags_s = tuple(i * tick_s for i in range(round(max_lag_s / tick_s) + 1))
        self.window = window
        self.min_readings = min_readings
        self.switch_ratio = switch_ratio
        # Until the readings tell, a meter is taken to be as late as any candidate: the laws
        # then count every change since as not yet seen, which costs a cautious start, where
        # taking it as prompt would let the first seconds grow on readings of an idle GPU.
        self.lag_s = self.lags_s[-1] if assume_late else 0.0
        self._t: deque[float] = deque()
        self._f: deque[Features] = deque()
        # (t, watts, weight, the features at each candidate lag, their regression rows)
        self._rows: deque[tuple[float, float, float, tuple[Features, ...], np.ndarray]] = deque(
            maxlen=window
        )

    def remember(self, t_s: float, features: Features) -> None:
        self._t.append(t_s)
        self._f.append(features)
        horizon = self.lags_s[-1] + 2.0 * self.tick_s
        while len(self._t) > 2 and self._t[0] < t_s - horizon:
            self._t.popleft()
            self._f.popleft()

    def at(self, t_s: float) -> Features | None:
        """The features of the last tick at or before `t_s`; before the first tick, the first
        (the load the loop started on). None before any tick."""
        if not self._f:
            return None
        i = bisect.bisect_right(self._t, t_s + 1e-9) - 1
        return self._f[max(i, 0)]

    def learn(self, t_s: float, power_w: float, weight: float = 1.0) -> bool:
        """Pair a new reading with each candidate lag; True when the lag believed has changed
        (the readings so far, paired anew, are then in `pairs()`)."""
        if not self._t or self._t[0] > t_s - self.lags_s[-1]:
            return False  # too early to pair this reading with every candidate
        feats = tuple(f for lag in self.lags_s if (f := self.at(t_s - lag)) is not None)
        rows = np.array([_lag_row(f) for f in feats])  # built once per reading
        self._rows.append((t_s, power_w, weight, feats, rows))
        if len(self._rows) < self.min_readings:
            return False
        before = self.lag_s
        self._choose()
        return self.lag_s != before

    def pairs(self) -> list[tuple[float, Features, float, float]]:
        """The readings kept, each with the load of the lag now believed: (t, features, watts,
        weight), oldest first, for a model that learned them at the wrong lag to learn anew."""
        i = self.lags_s.index(self.lag_s)
        return [(t, f[i], p, w) for t, p, w, f, _ in self._rows]

    def _choose(self) -> None:
        x = np.stack([r[4] for r in self._rows], axis=1)  # (lags, readings, k)
        y = np.fromiter((r[1] for r in self._rows), float, len(self._rows))
        if np.ptp(y) <= 0.0:
            return
        xtx = np.einsum("lnj,lnk->ljk", x, x)
        xty = np.einsum("lnj,n->lj", x, y)
        k = x.shape[2]
        ridge = 1e-6 * np.trace(xtx, axis1=1, axis2=2)[:, None, None] * np.eye(k)
        beta = np.linalg.solve(xtx + ridge, xty[..., None])[..., 0]
        resid = y[None, :] - np.einsum("lnk,lk->ln", x, beta)
        sse = np.einsum("ln,ln->l", resid, resid)
        best = int(np.argmin(sse))
        now = self.lags_s.index(self.lag_s) if self.lag_s in self.lags_s else 0
        if sse[best] < self.switch_ratio * sse[now]:
            self.lag_s = self.lags_s[best]


class ReadingAligner:
    """Which load a power reading measured, and how much it weighs when learned.

    A source the monitor averages is read afresh every tick, over the same second as the
    features: each tick's reading weighs one. An exporter that collects once a second
    (dcgm-exporter's `--collect-interval`) serves one value for a whole period: it is new on
    the tick that first sees it, it measured the second before that tick, whatever the ticks
    after it see, and it weighs the ticks since the last new value (at most a window's worth:
    it is a mean over one window, however long it is then held). A held value weighs 0.
    """

    def __init__(self, every_tick: bool, max_weight: float = 5.0, tick_s: float = 0.2) -> None:
        self.every_tick = every_tick
        self.max_weight = max_weight
        # A mean the loop takes itself, every tick, is of the same second as the features.
        self.lag = MeterLag(tick_s, assume_late=not every_tick)
        self._key: tuple[float | None, float | None] | None = None
        self._features: Features | None = None
        self._ticks = 0
        self.relearn: list[tuple[float, Features, float, float]] = []
        """Set on the tick the lag changes: every kept reading, paired with the new lag's load."""

    def update(
        self,
        raw_w: float | None,
        energy_j: float | None,
        features: Features,
        t_s: float | None = None,
        power_w: float | None = None,
    ) -> tuple[float, Features]:
        """(weight, the features the reading measured) for this tick's reading and features.
        Without a raw value (an old trace) every reading is new. With the tick's time and the
        reading's watts, the meter's lag is learned and the reading paired with the load that
        long ago (`MeterLag`)."""
        self._ticks += 1
        if t_s is not None:
            self.lag.remember(t_s, features)
        key = (raw_w, energy_j)
        # A value repeated past two windows is a steady plant read again, not one collection
        # held: a meter whose watts repeat exactly must not freeze the load it is paired with.
        stale = self._ticks >= 2 * self.max_weight
        if self.every_tick or raw_w is None or key != self._key or self._features is None or stale:
            weight = 1.0 if self.every_tick else float(min(self._ticks, self.max_weight))
            measured = features
            self.relearn = []
            if t_s is not None and power_w is not None:
                if self.lag.learn(t_s, power_w, weight):
                    self.relearn = self.lag.pairs()
                measured = self.lag.at(t_s - self.lag.lag_s) or features
            self._key, self._features, self._ticks = key, measured, 0
            return weight, measured
        self.relearn = []
        return 0.0, self._features
