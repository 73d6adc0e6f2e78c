"""Poll a PowerSource in the background and keep a validated, filtered view of GPU power.

The controller must never act on a number it cannot trust, so every reading carries `ok`: False
when the last read failed, returned garbage, or the newest good sample is too old. The monitor
itself never raises out of its task; failures become state (and rate-limited log lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from powerbatch.errors import ConfigError
from powerbatch.telemetry.base import PowerSample, PowerSource
from powerbatch.telemetry.filters import Ewma, HampelFilter

logger = logging.getLogger("powerbatch.telemetry")

_LOG_EVERY_S = 10.0
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf", re.IGNORECASE)


class _Default(Enum):
    TOKEN = 0


_DEFAULT = _Default.TOKEN


@dataclass(frozen=True, slots=True)
class PowerReading:
    """The monitor's view at one instant.

    `t_s` is the newest good sample's own time (the source's clock); `age_s` is how long ago, on
    the monitor's clock, that sample arrived. Power fields keep the last good values while the
    source fails, so a caller can see what was last known, but must act on `ok`.
    """

    t_s: float | None
    raw_w: float | None
    filtered_w: float | None  # after the Hampel filter
    smoothed_w: float | None  # EWMA of filtered_w
    energy_j: float | None
    ok: bool
    stale: bool
    error: str | None
    consecutive_errors: int
    age_s: float


Listener = Callable[[PowerReading], None]


class PowerMonitor:
    """Background poller with validation, spike removal, smoothing and staleness tracking."""

    def __init__(
        self,
        source: PowerSource,
        *,
        interval_s: float = 0.1,
        stale_after_s: float = 1.0,
        hampel: HampelFilter | _Default | None = _DEFAULT,
        half_life_s: float = 0.5,
        max_plausible_w: float | None = None,
        history_s: float = 120.0,
        read_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`hampel=None` disables spike removal; by default a HampelFilter() is used.

        `read_timeout_s` (default: stale_after_s) bounds one `source.read()`, so a hung driver or
        endpoint shows up as an error instead of a silent stall. `clock` measures sample age.
        """
        for name, value in (
            ("interval_s", interval_s),
            ("stale_after_s", stale_after_s),
            ("history_s", history_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be positive and finite, got {value}")
        if max_plausible_w is not None and not max_plausible_w > 0:
            raise ConfigError(f"max_plausible_w must be positive, got {max_plausible_w}")
        self.source = source
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.max_plausible_w = max_plausible_w
        self.history_s = history_s
        self.read_timeout_s = stale_after_s if read_timeout_s is None else read_timeout_s
        self._hampel = HampelFilter() if isinstance(hampel, _Default) else hampel
        self._ewma = Ewma(half_life_s)
        self._clock = clock

        self.reads_total = 0
        self.read_errors_total = 0
        self.bad_samples_total = 0

        self._sample: PowerSample | None = None
        self._filtered_w: float | None = None
        self._smoothed_w: float | None = None
        self._received_s: float | None = None
        self._error: str | None = None
        self._consecutive_errors = 0
        self._history: deque[tuple[float, float, float | None]] = deque()  # (t_s, w, energy_j)
        self._listeners: list[Listener] = []
        self._logged_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    # --- state -------------------------------------------------------------------------------

    def _age(self) -> tuple[float, bool]:
        """(seconds since the newest good sample arrived, whether that is stale), as of now."""
        if self._received_s is None:
            return math.inf, True
        age_s = max(0.0, self._clock() - self._received_s)
        return age_s, age_s > self.stale_after_s

    def metered(self) -> tuple[float | None, float | None, float]:
        """What an energy meter reads: `snapshot()`'s raw_w where the reading is ok (else None),
        energy_j and age_s, without building the reading (the proxy meters at every request's
        end)."""
        sample = self._sample
        age_s, stale = self._age()
        if sample is None:
            return None, None, age_s
        ok = self._error_now(age_s, stale) is None
        return (sample.power_w if ok else None), sample.energy_j, age_s

    def _error_now(self, age_s: float, stale: bool) -> str | None:
        """Why the newest sample cannot be trusted now, None when it can."""
        if self._consecutive_errors:
            return self._error
        if stale:
            if self._received_s is None:
                return "stale: no good sample yet"
            return f"stale: no good sample for {age_s:.1f} s"
        return None

    def snapshot(self) -> PowerReading:
        """The current view; age and staleness are computed now, not at the last poll."""
        sample = self._sample
        age_s, stale = self._age()
        error = self._error_now(age_s, stale)
        return PowerReading(
            t_s=None if sample is None else sample.t_s,
            raw_w=None if sample is None else sample.power_w,
            filtered_w=self._filtered_w,
            smoothed_w=self._smoothed_w,
            energy_j=None if sample is None else sample.energy_j,
            ok=error is None,
            stale=stale,
            error=error,
            consecutive_errors=self._consecutive_errors,
            age_s=age_s,
        )

    def history(self) -> list[tuple[float, float]]:
        """(t_s, filtered_w) of good samples over the last `history_s` seconds, oldest first."""
        return [(t_s, w) for t_s, w, _ in self._history]

    def mean_w(self, window_s: float = 1.0) -> float | None:
        """Mean power over the newest `window_s` seconds of good samples; None without one.

        Comparable with NVML's 1-second averaged power. Where the source has an energy counter
        (NVML's nvmlDeviceGetTotalEnergyConsumption, dcgm-exporter's
        DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION), it is the counter's rise over the window: the
        exact mean, prefill bursts included. Instant readings polled every 0.1 s catch a burst
        of a few hundred milliseconds in one or two samples, which the despiking filter takes
        for glitches (it passes a step only once it fills half its window), so their mean
        misses the watts the ceiling is about, and a model learning from it prices prefill low.
        A counter that the driver updates every few tens of milliseconds is off by at most one
        update's energy at each end of the window: noise, not the filter's bias. Without a
        counter (or across a counter reset), the mean of the filtered samples.
        """
        if not self._history:
            return None
        t_new, _, e_new = self._history[-1]
        since_s = t_new - window_s
        total, count = 0.0, 0
        edge = self._history[0]
        for sample in reversed(self._history):  # newest first: stop at the window's edge
            edge = sample
            if sample[0] <= since_s:
                break
            total += sample[1]
            count += 1
        t_old, _, e_old = edge
        if e_new is not None and e_old is not None and t_new > t_old and e_new >= e_old:
            return (e_new - e_old) / (t_new - t_old)
        return total / count if count else self._history[-1][1]

    def add_listener(self, callback: Listener) -> None:
        """Call `callback` with every new good reading; its exceptions are logged, not raised."""
        self._listeners.append(callback)

    # --- polling -----------------------------------------------------------------------------

    def _log(self, message: str) -> None:
        """Warn at most once per 10 s per message, numbers ignored (a bad value varies)."""
        key = _NUMBER.sub("#", message)
        now = self._clock()
        last = self._logged_at.get(key)
        if last is not None and now - last < _LOG_EVERY_S:
            return
        if len(self._logged_at) > 256:
            self._logged_at = {k: t for k, t in self._logged_at.items() if now - t < _LOG_EVERY_S}
        self._logged_at[key] = now
        logger.warning("%s: %s", self.source.name, message)

    def _fail(self, message: str) -> None:
        self._consecutive_errors += 1
        self._error = message
        self._log(message)

    def _implausible(self, sample: PowerSample) -> str | None:
        power_w = sample.power_w
        if not isinstance(power_w, int | float) or not math.isfinite(power_w):
            return f"bad sample: power_w={power_w!r} is not a finite number"
        if power_w < 0:
            return f"bad sample: power_w={power_w} is negative"
        if self.max_plausible_w is not None and power_w > self.max_plausible_w:
            return f"bad sample: power_w={power_w} is above max_plausible_w={self.max_plausible_w}"
        return None

    def _accept(self, sample: PowerSample, received_s: float) -> PowerReading:
        if self._received_s is not None and received_s - self._received_s > self.stale_after_s:
            # After an outage the old window and average describe a different load: start over,
            # rather than judging fresh samples against them.
            if self._hampel is not None:
                self._hampel.reset()
            self._ewma.reset()
        energy_j = sample.energy_j
        if energy_j is not None and not (math.isfinite(energy_j) and energy_j >= 0):
            sample = PowerSample(t_s=sample.t_s, power_w=sample.power_w, energy_j=None)
        raw_w = float(sample.power_w)
        filtered_w = self._hampel.update(raw_w) if self._hampel is not None else raw_w
        self._smoothed_w = self._ewma.update(filtered_w, sample.t_s)
        self._filtered_w = filtered_w
        self._sample = sample
        self._received_s = received_s
        self._consecutive_errors = 0
        self._error = None
        self._history.append((sample.t_s, filtered_w, sample.energy_j))
        while self._history and self._history[0][0] < sample.t_s - self.history_s:
            self._history.popleft()
        reading = self.snapshot()
        for callback in list(self._listeners):
            try:
                callback(reading)
            except Exception as exc:
                self._log(f"listener {callback!r} failed: {type(exc).__name__}: {exc}")
        return reading

    async def poll_once(self) -> PowerReading:
        """Read the source once and update state; never raises (except on cancellation)."""
        self.reads_total += 1
        try:
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for can swallow a cancel that
            # lands as the read completes, and stop() then waited forever on a monitor that
            # kept polling (seen as a rare hang in the proxy's teardown).
            async with asyncio.timeout(self.read_timeout_s):
                sample = await self.source.read()
        except TimeoutError:
            self.read_errors_total += 1
            self._fail(f"TimeoutError: read took longer than {self.read_timeout_s} s")
            return self.snapshot()
        except Exception as exc:
            self.read_errors_total += 1
            self._fail(f"{type(exc).__name__}: {exc}")
            return self.snapshot()
        problem = self._implausible(sample)
        if problem is not None:
            self.bad_samples_total += 1
            self._fail(problem)
            return self.snapshot()
        return self._accept(sample, self._clock())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_s = loop.time()
        while True:
            try:
                await self.poll_once()
            except Exception as exc:  # a bug in a filter or listener must not end polling
                self._fail(f"internal error: {type(exc).__name__}: {exc}")
            next_s += self.interval_s
            delay_s = next_s - loop.time()
            if delay_s < 0:  # fell behind (slow source): skip missed ticks, don't burst
                next_s = loop.time()
                delay_s = 0.0
            await asyncio.sleep(delay_s)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Start polling in a background task; a no-op if already running."""
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"power-monitor:{self.source.name}"
        )

    async def stop(self) -> None:
        """Stop polling. The source is not closed: whoever made it owns it."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
