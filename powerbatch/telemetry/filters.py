"""Small, pure filters for noisy power readings.

Instant power on H100/H200 carries single readings far above TDP (+-40 W typical, spikes to 850 W
at a 665 W mean): a controller that reacts to those sheds load for nothing. The Hampel filter
drops isolated spikes while letting real steps through after half a window; the EWMA smooths what
remains. Both cost O(window) per sample and hold no clock of their own.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

from powerbatch.errors import ConfigError

_MAD_TO_SIGMA = 1.4826  # MAD * this estimates the standard deviation of Gaussian noise


class HampelFilter:
    """Causal Hampel filter: replace a sample by the rolling median when it is an outlier.

    The window holds the newest `window` raw samples (the outlier is stored as read, not as its
    replacement), so a genuine step is accepted once it fills half the window instead of being
    suppressed forever. Until the window is full, samples pass through unchanged.
    """

    def __init__(self, window: int = 7, n_sigmas: float = 3.0) -> None:
        if window < 3:
            raise ConfigError(f"Hampel window must be at least 3 samples, got {window}")
        if not (math.isfinite(n_sigmas) and n_sigmas > 0):
            raise ConfigError(f"Hampel n_sigmas must be positive and finite, got {n_sigmas}")
        self.window = window
        self.n_sigmas = n_sigmas
        self._values: deque[float] = deque(maxlen=window)

    def update(self, x: float) -> float:
        """Feed one sample; return it, or the window median if it is an outlier.

        A non-finite `x` is never stored and yields the current median, so the output is never NaN;
        with nothing stored yet there is no median to give, hence ValueError.
        """
        if not math.isfinite(x):
            if not self._values:
                raise ValueError(f"Hampel filter got {x} before any finite sample")
            return median(list(self._values))
        self._values.append(x)
        if len(self._values) < self.window:
            return x
        values = list(self._values)
        mid = median(values)
        mad = median([abs(v - mid) for v in values])
        if abs(x - mid) > self.n_sigmas * _MAD_TO_SIGMA * mad:
            return mid
        return x

    def reset(self) -> None:
        """Forget the window, e.g. after a long sensor outage made it meaningless."""
        self._values.clear()


def ewma_step(average: float | None, x: float, alpha: float) -> float:
    """One step of an exponentially weighted moving average: `x` when there is no average yet,
    else `average + alpha * (x - average)`, never past either of the two (rounding)."""
    if average is None:
        return x
    blended = average + alpha * (x - average)
    return min(max(blended, min(average, x)), max(average, x))


def half_life_alpha(dt_s: float, half_life_s: float) -> float:
    """The EWMA weight of a sample `dt_s` after the previous one: 1 - 2**(-dt_s / half_life_s),
    so the old average's weight halves every `half_life_s` whatever the sampling rate."""
    return 1.0 - math.exp2(-dt_s / half_life_s)


class Ewma:
    """Exponentially weighted moving average over irregular sample times.

    Weights depend on elapsed time, not sample count (alpha = 1 - 2**(-dt / half_life_s)), so a
    missed poll or a slower source does not change how fast the average forgets. A sample at the
    same instant as the previous one (or earlier) adds no weight.
    """

    def __init__(self, half_life_s: float) -> None:
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ConfigError(f"EWMA half_life_s must be positive and finite, got {half_life_s}")
        self.half_life_s = half_life_s
        self._value: float | None = None
        self._t_s: float | None = None

    @property
    def value(self) -> float | None:
        """The current average; None before the first sample."""
        return self._value

    def update(self, x: float, t_s: float) -> float:
        """Fold in sample `x` taken at `t_s`; return the new average."""
        if not math.isfinite(x):
            raise ValueError(f"EWMA got a non-finite sample: {x}")
        if self._value is None or self._t_s is None:
            self._value, self._t_s = x, t_s
            return x
        dt_s = t_s - self._t_s
        if dt_s <= 0:
            return self._value
        self._value = ewma_step(self._value, x, half_life_alpha(dt_s, self.half_life_s))
        self._t_s = t_s
        return self._value

    def reset(self) -> None:
        """Start over; the next sample becomes the average."""
        self._value = None
        self._t_s = None
