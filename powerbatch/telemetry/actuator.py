"""The skeleton of a device actuator: paced changes that degrade on failure, never raise.

Why it exists: the power limit's actuator (`LimitActuator`, telemetry.limiter) and the SM
clock's (`ClockActuator`, telemetry.clock) follow the same safety rules, and two copies of them
drift. `PacedActuator` holds them once: the backend is started, and each change made, within
`timeout_s` (a timeout is reported as the backend's own error, naming what timed out); a failure,
of `start()` too, is counted and sets `degraded` with a reason, and the retry waits on a
`Backoff` so a failing device is not hammered; the first success clears it; a change in the
paced direction waits `min_interval_s`; `status()` carries the same degraded, reason, changes
and failures fields for both.

Each actuator keeps its own law: what a request snaps or clamps to, its dead band, which
direction is paced (a limit's raises, a clock's cuts), and what a failure leaves in force (the
limit: unknown; the clock: a fall back to unlocked). Logs go to each actuator's module logger.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Generic, Protocol, TypedDict, TypeVar

from powerbatch.errors import PowerbatchError

__all__ = ["Backoff", "Device", "PacedActuator", "Pacing"]


class Backoff:
    """When a failed device change may be tried again: the wait doubles from `initial_s` to
    `max_s` with each failure, and a success starts it over."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        self.initial_s, self.max_s = initial_s, max_s
        self.wait_s = initial_s
        self.retry_at_s = -math.inf

    def ready(self, now_s: float) -> bool:
        return now_s >= self.retry_at_s

    def failed(self, now_s: float) -> float:
        """Schedule the retry; returns the wait it set."""
        wait_s = self.wait_s
        self.retry_at_s = now_s + wait_s
        self.wait_s = min(wait_s * 2.0, self.max_s)
        return wait_s

    def succeeded(self) -> None:
        self.wait_s = self.initial_s


class Device(Protocol):
    """What an actuator needs of its backend (a `PowerLimiter`, a `ClockBackend`)."""

    @property
    def name(self) -> str: ...

    @property
    def controls_device(self) -> bool: ...

    async def start(self) -> None: ...

    async def restore(self) -> None: ...


class Pacing(TypedDict, total=False):
    """The pacing and failure settings every actuator takes; defaults in `PacedActuator`."""

    min_interval_s: float
    timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    clock: Callable[[], float]


D = TypeVar("D", bound=Device)
T = TypeVar("T")


class PacedActuator(Generic[D]):
    """Degraded state, backoff, timed backend calls and their bookkeeping; subclasses add the
    law (`decide`, `apply`) and their own status fields."""

    error: ClassVar[type[PowerbatchError]]
    """The backend's error family: one of these degrades, anything else is a bug and raises."""
    timeout_error: ClassVar[type[PowerbatchError]]
    """What a backend call that outlives `timeout_s` is reported as."""
    control: ClassVar[str]
    """What the logs call this control ("power limit control")."""

    def __init__(
        self,
        device: D,
        *,
        min_interval_s: float = 2.0,
        timeout_s: float = 2.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval_s < 0 or timeout_s <= 0:
            raise ValueError("min_interval_s must be >= 0, timeout_s > 0")
        self.device = device
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._clock = clock
        self._log = logging.getLogger(type(self).__module__)
        self.degraded = False
        self.degraded_reason: str | None = None
        self.changes_total = 0
        self.failures_total = 0
        self.last_change_s: float | None = None
        self._started = False

    @property
    def name(self) -> str:
        return self.device.name

    async def start(self) -> bool:
        """Start the backend (its crash recovery first); False and degraded if it could not."""
        if self._started:
            return True
        try:
            await self._timed(self.device.start(), "start")
        except self.error as exc:
            self._fail(exc, self._clock(), "start")
            return False
        self._started = True
        return True

    def _gate(self, now_s: float) -> str | None:
        """The verdict before the law's own: inactive (no device), or, while degraded or not
        started, apply once the backoff allows, else backoff; None: the law decides."""
        if not self.device.controls_device:
            return "inactive"
        if self.degraded or not self._started:
            return "apply" if self.backoff.ready(now_s) else "backoff"
        return None

    def _paced(self, now_s: float) -> str:
        """A change in the paced direction: too_soon within `min_interval_s` of the last."""
        if self.last_change_s is not None and now_s - self.last_change_s < self.min_interval_s:
            return "too_soon"
        return "apply"

    async def _timed(self, call: Awaitable[T], what: str) -> T:
        """`call` within `timeout_s`; a timeout raised as `timeout_error`, naming `what`."""
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError as exc:
            raise self.timeout_error(f"{what}: no answer within {self.timeout_s:g} s") from exc

    def _succeeded(self, now_s: float) -> None:
        """A change went through: clear degraded, restart the backoff, count it."""
        if self.degraded:
            self._log.info("%s: %s recovered", self.name, self.control)
        self.degraded, self.degraded_reason = False, None
        self.backoff.succeeded()
        self.last_change_s = now_s
        self.changes_total += 1

    def _fail(self, exc: BaseException, now_s: float, what: str, *, note: str = "") -> None:
        """A failed call: count it, schedule the retry, degrade with the reason, log it."""
        reason = f"{type(exc).__name__}: {exc}"
        self.failures_total += 1
        wait_s = self.backoff.failed(now_s)
        self._log.warning(
            "%s: %s failed, %s degraded%s (retry in %.0f s): %s",
            self.name,
            what,
            self.control,
            note,
            wait_s,
            reason,
        )
        self.degraded, self.degraded_reason = True, reason

    async def restore(self) -> None:
        """Put the device back if started; raises the backend's error (TimeoutError past
        `timeout_s`) if that fails: the caller must know."""
        if self._started:
            await asyncio.wait_for(self.device.restore(), self.timeout_s)
            self._restored()

    def _restored(self) -> None:
        """What is in force after `restore()`; the subclass's."""

    def _status(self) -> dict[str, Any]:
        """The fields every actuator's status() carries (read by metrics, /status, docs)."""
        return {
            "degraded": self.degraded,
            "degraded_reason": self.degraded_reason,
            "changes_total": self.changes_total,
            "failures_total": self.failures_total,
        }
