"""The asyncio admission queue: who goes upstream next, and who is told to come back later.

A request is dispatched only while both in-flight limits hold (requests and KV tokens) and the
prefill pace allows its prompt. Every class waits for the pace: prefill is where the watts
are, and a class that skipped it would spend the ceiling's margin on its own prompts (it is
first in line, so it waits only for its own prompt's share). Classes are served in strict
priority; within a class streams go first, then FIFO: a stream's client sees its first token,
a whole answer's client only the end, which a short wait before it starts barely moves.

Under overload a lane turns LIFO: while its oldest waiter has waited past `lifo_after_s` (the
TTFT SLO), the newest goes first. FIFO then serves every waiter just as late as the queue is
long, and none within its SLO; LIFO serves the fresh ones at once and the late ones, late
anyway, once the burst is over ("adaptive LIFO", B. Maurer, "Fail at Scale", ACM Queue 13(8),
2015). A waiter that has waited half its class's `max_wait_s` goes first again: LIFO may delay a
request, and should not turn a wait the queue would have served into a 429. The queue is bounded
in length and in wait; a full queue sheds its lowest-priority newest waiter before it refuses a
higher-priority arrival. Every granted `Slot` is released exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from powerbatch.admission.priority import DEFERRABLE, PRIORITIES, rank
from powerbatch.control import AdmissionLimits, Deferrable, QueueCounts
from powerbatch.errors import RequestError
from powerbatch.telemetry.filters import ewma_step

REJECTION_REASONS = ("queue_full", "queue_timeout", "shed", "draining")
"""Every `Rejected.reason`: the proxy creates a metric series for each at start-up."""
LANES: tuple[tuple[str, bool], ...] = tuple((p, s) for p in PRIORITIES for s in (True, False))
"""(class, stream) in the order waiters are served: by class, streams first within one."""


class Rejected(RequestError):
    """A request the queue will not serve; maps to an HTTP answer."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason  # one of REJECTION_REASONS
        self.message = message
        self.retry_after_s = retry_after_s


class Slot:
    """One request's place upstream. `release()` is idempotent; the first call frees the place."""

    __slots__ = ("_queue", "kv_tokens", "priority", "released", "requests")

    def __init__(self, queue: AdmissionQueue, priority: str, kv_tokens: int, requests: int = 1):
        self._queue = queue
        self.priority = priority
        self.kv_tokens = kv_tokens
        self.requests = requests
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._queue._on_release(self)


@dataclass(slots=True)
class _Waiter:
    priority: str
    kv_tokens: int
    prefill_tokens: int
    t_enqueued_s: float
    future: asyncio.Future[Slot]
    requests: int = 1
    stream: bool = False
    gone: bool = False

    @property
    def lane(self) -> tuple[str, bool]:
        return (self.priority, self.stream)


@dataclass(slots=True)
class QueueStats:
    admitted_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITIES, 0))
    rejected_total: dict[tuple[str, str], int] = field(default_factory=dict)
    prefill_tokens_admitted_total: int = 0
    requests_admitted_total: int = 0  # upstream requests (a slot may carry several)


class AdmissionQueue:
    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        max_queue_len: int = 1_000,
        max_wait_s: Mapping[str, float] | None = None,
        valley_fill: bool = False,
        fill_reserve_frac: float = 0.1,
        prefill_burst_s: float = 0.25,
        lifo_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.lifo_after_s = lifo_after_s  # None: FIFO always
        self.max_queue_len = max_queue_len
        waits = {"high": 30.0, "normal": 30.0, "low": 300.0 if valley_fill else 30.0}
        waits.update(max_wait_s or {})
        self.max_wait_s = waits
        self.valley_fill = valley_fill
        # With valley filling, what the controller's shape laws say of deferrable work:
        # default (keep the reserve), hold (wait while anything runs), release (no reserve).
        self.deferrable = Deferrable.DEFAULT
        self.fill_reserve_frac = fill_reserve_frac
        self.prefill_burst_s = prefill_burst_s
        self._clock = clock
        self._queues: dict[tuple[str, bool], deque[_Waiter]] = {lane: deque() for lane in LANES}
        self._live: dict[str, int] = dict.fromkeys(PRIORITIES, 0)
        self.in_flight = 0
        self.kv_in_flight = 0
        self.stats = QueueStats()
        self.draining = False
        self._bucket = 0.0
        self._bucket_t = clock()
        self._wakeup: asyncio.TimerHandle | None = None
        # EWMA of the time between grants, for a truthful Retry-After. The interval, not its
        # inverse, is averaged: a mean of 1/dt is dominated by grants that land together.
        self._grant_interval_s: float | None = None  # None until a waiter has been granted
        self._last_grant_t = clock()
        self._idle: asyncio.Event | None = None

    # -- public -------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return sum(self._live.values())

    def queued_by_class(self) -> dict[str, int]:
        return dict(self._live)

    def counts(self) -> QueueCounts:
        """Arrivals (grants, waiters and refusals) per class, completions, what is in flight and
        waiting, and the longest wait of a live waiter now: the shape planner's and the fleet
        bid's input, read off the request path."""
        st = self.stats
        queued = self.queued_by_class()
        rejected = dict.fromkeys(queued, 0)
        for (p, _), n in st.rejected_total.items():
            rejected[p] = rejected.get(p, 0) + n
        arrived = {p: st.admitted_total[p] + queued[p] + rejected[p] for p in queued}
        completed = sum(st.admitted_total.values()) - self.in_flight
        now = self._clock()
        live = (
            next((w for w in q if not (w.gone or w.future.done())), None)
            for q in self._queues.values()
        )
        oldest = max((now - w.t_enqueued_s for w in live if w is not None), default=0.0)
        return QueueCounts(arrived, completed, self.in_flight, queued, oldest)

    def set_limits(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._dispatch()

    def set_deferrable(self, mode: Deferrable | str) -> None:
        """What the controller's shape laws say of deferrable work (a `Deferrable`)."""
        mode = Deferrable(mode)
        if mode != self.deferrable:
            self.deferrable = mode
            self._dispatch()

    def try_admit(
        self, priority: str, kv_tokens: int, prefill_tokens: int, requests: int = 1
    ) -> Slot | None:
        """A slot now if one is free and nobody waits, else None (then `admit` to wait):
        the uncontended path, without a coroutine."""
        if self.draining or self.queued:
            return None
        now = self._clock()
        if self._fits(priority, kv_tokens, prefill_tokens, now, requests):
            return self._grant(priority, kv_tokens, prefill_tokens, now, requests=requests)
        return None

    async def admit(
        self,
        priority: str,
        kv_tokens: int,
        prefill_tokens: int,
        requests: int = 1,
        *,
        stream: bool = False,
    ) -> Slot:
        """Wait for a slot; raise Rejected when the request cannot be served in time.

        `requests` > 1 is one HTTP request the upstream runs as that many (a batch of
        conversations, an upload cut into windows): it holds that many places in the batch.
        `stream`: the answer is streamed, so it goes before whole answers of its class.
        """
        if self.draining:
            raise self._reject(priority, 503, "draining", "server is shutting down")
        slot = self.try_admit(priority, kv_tokens, prefill_tokens, requests)
        if slot is not None:
            return slot
        now = self._clock()
        if self.queued >= self.max_queue_len and not self._shed_below(priority):
            raise self._reject(
                priority, 429, "queue_full", "admission queue is full", self.retry_after_s(priority)
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            priority, kv_tokens, prefill_tokens, now, loop.create_future(), requests, stream
        )
        self._queues[waiter.lane].append(waiter)
        self._live[priority] += 1
        timer = loop.call_later(self.max_wait_s[priority], self._expire, waiter)
        try:
            self._dispatch()
            return await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()  # granted just as the client went away
            self._forget(waiter)
            raise
        finally:
            timer.cancel()

    def retry_after_s(self, priority: str) -> int:
        """Seconds until a request of this class could expect a slot, from the recent grant rate."""
        ahead = sum(self._live[p] for p in PRIORITIES[: rank(priority) + 1])
        interval_s = 1.0 if self._grant_interval_s is None else self._grant_interval_s
        if self.queued:  # nothing granted for a while (a stalled upstream): the silence counts
            interval_s = max(interval_s, self._clock() - self._last_grant_t)
        return int(min(60, max(1, math.ceil((ahead + 1) * interval_s))))

    @property
    def backlog(self) -> int:
        """Waiter records held, live or not: bounded by 2 x max_queue_len plus a constant."""
        return sum(len(q) for q in self._queues.values())

    async def wait_idle(self) -> None:
        """Return once nothing is in flight (used to drain on shutdown)."""
        if self.in_flight == 0:
            return
        self._idle = self._idle or asyncio.Event()
        await self._idle.wait()

    def drain(self) -> None:
        """Stop admitting; answer everyone still queued with 503."""
        self.draining = True
        for q in self._queues.values():
            while q:
                w = q.popleft()
                if not w.gone:
                    w.gone = True
                    self._live[w.priority] -= 1
                    w.future.set_exception(
                        self._reject(w.priority, 503, "draining", "server is shutting down")
                    )

    # -- internals ----------------------------------------------------------------------------

    def _reject(
        self, priority: str, status: int, reason: str, message: str, retry: int | None = None
    ) -> Rejected:
        key = (priority, reason)
        self.stats.rejected_total[key] = self.stats.rejected_total.get(key, 0) + 1
        return Rejected(status, reason, message, retry)

    def _refill(self, now: float) -> None:
        rate = self.limits.prefill_tok_s
        if rate is None:
            return
        cap = rate * self.prefill_burst_s
        self._bucket = min(cap, self._bucket + rate * (now - self._bucket_t))
        self._bucket_t = now

    def _fits(
        self, priority: str, kv_tokens: int, prefill_tokens: int, now: float, requests: int = 1
    ) -> bool:
        lim = self.limits
        allowed, kv_allowed = lim.max_requests, lim.max_kv_tokens
        if priority == PRIORITIES[0] and lim.reserve_requests:
            # The reserve's slots come with their share of the KV budget, which is sized per
            # batch slot: a slot the KV cap still blocks would be no reserve.
            allowed += lim.reserve_requests
            kv_allowed += lim.max_kv_tokens * lim.reserve_requests // max(lim.max_requests, 1)
        if self.valley_fill and priority == DEFERRABLE:
            if self.deferrable is Deferrable.HOLD and self.in_flight:
                return False
            if self.deferrable is not Deferrable.RELEASE:
                allowed -= math.ceil(self.fill_reserve_frac * lim.max_requests)
        # One request always fits an empty upstream, however many it runs as.
        if self.in_flight and self.in_flight + requests > max(allowed, 1):
            return False
        # One request always fits an empty upstream, however large, so nothing starves (the
        # pace still holds it while earlier prompts' debt is paid).
        if self.in_flight and self.kv_in_flight + kv_tokens > kv_allowed:
            return False
        if lim.prefill_tok_s is not None:
            self._refill(now)
            if self._bucket < self._bucket_needed(prefill_tokens):
                return False
        return True

    def _bucket_needed(self, prefill_tokens: int) -> float:
        """What the bucket must hold before this prompt goes: the prompt (or a whole burst, for
        one larger), since borrowing ahead would let one long prompt spike the second. Into an
        empty upstream, only no debt: the prompts before it borrowed ahead, and one request
        after another back to back is prefill at full power all the same."""
        rate = self.limits.prefill_tok_s or 0.0
        if not self.in_flight:
            return 0.0
        return min(prefill_tokens, rate * self.prefill_burst_s)

    def _grant(
        self,
        priority: str,
        kv_tokens: int,
        prefill_tokens: int,
        now: float,
        waited_since_s: float | None = None,
        requests: int = 1,
    ) -> Slot:
        self.in_flight += requests
        self.kv_in_flight += kv_tokens
        if self.limits.prefill_tok_s is not None:
            self._bucket -= prefill_tokens  # may go negative: a long prompt borrows ahead
        self.stats.admitted_total[priority] += 1
        self.stats.prefill_tokens_admitted_total += prefill_tokens
        self.stats.requests_admitted_total += requests
        if waited_since_s is not None:
            # Only grants to waiters measure the service rate; an immediate grant measures demand.
            dt = min(max(now - max(self._last_grant_t, waited_since_s), 0.0), 60.0)
            self._grant_interval_s = ewma_step(self._grant_interval_s, dt, 0.2)
        self._last_grant_t = now
        return Slot(self, priority, kv_tokens, requests)

    def _on_release(self, slot: Slot) -> None:
        self.in_flight -= slot.requests
        self.kv_in_flight -= slot.kv_tokens
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None
        if self.queued:  # nobody waiting: nothing to grant (records of the gone wait too)
            self._dispatch()

    def _head(self, now: float) -> _Waiter | None:
        """The next waiter: the first lane's oldest, or its newest while that lane is LIFO."""
        for lane in LANES:
            q = self._queues[lane]
            # A waiter whose task was cancelled may not have run its cleanup yet: skip it,
            # or its slot would be granted to no one and never released.
            while q and (q[0].gone or q[0].future.done()):
                self._forget(q.popleft())
            if not q:
                continue
            waited_s = now - q[0].t_enqueued_s
            late = self.lifo_after_s is not None and waited_s > self.lifo_after_s
            # LIFO delays the oldest, it must not refuse it: past half its longest wait, it goes.
            if not late or waited_s > 0.5 * self.max_wait_s[q[0].priority]:
                return q[0]
            while q[-1].gone or q[-1].future.done():  # q[0] is live: this stops there
                self._forget(q.pop())
            return q[-1]
        return None

    def _dispatch(self) -> None:
        now = self._clock()
        while (w := self._head(now)) is not None:
            if not self._fits(w.priority, w.kv_tokens, w.prefill_tokens, now, w.requests):
                self._schedule_refill_wakeup()
                return
            q = self._queues[w.lane]
            if q[0] is w:
                q.popleft()
            else:
                q.pop()
            w.gone = True
            self._live[w.priority] -= 1
            slot = self._grant(
                w.priority, w.kv_tokens, w.prefill_tokens, now, w.t_enqueued_s, w.requests
            )
            w.future.set_result(slot)

    def _schedule_refill_wakeup(self) -> None:
        rate = self.limits.prefill_tok_s
        if rate is None or self._wakeup is not None:
            return
        head = self._head(self._clock())
        want = self._bucket_needed(head.prefill_tokens) if head else 0.0
        if self._bucket >= want:
            return
        delay = max((want - self._bucket) / rate, 0.001)
        self._wakeup = asyncio.get_running_loop().call_later(delay, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._dispatch()

    def _forget(self, w: _Waiter) -> None:
        if not w.gone:
            w.gone = True
            self._live[w.priority] -= 1
            self._compact(w.lane)

    def _compact(self, lane: tuple[str, bool]) -> None:
        """Drop records of waiters that left from mid-queue, so overload cannot grow memory.

        Shed, expired and cancelled waiters are only marked gone; without this, a class that is
        never dispatched (low, under sustained overload) would keep every one of them.
        """
        q = self._queues[lane]
        if len(q) > 2 * self._live[lane[0]] + 32:
            # In place: callers (_head, _shed_below) may hold a reference to this deque.
            live = [w for w in q if not w.gone]
            q.clear()
            q.extend(live)

    def _expire(self, w: _Waiter) -> None:
        if w.gone or w.future.done():
            return
        self._forget(w)
        w.future.set_exception(
            self._reject(
                w.priority,
                429,
                "queue_timeout",
                f"no capacity within {self.max_wait_s[w.priority]:.0f} s",
                self.retry_after_s(w.priority),
            )
        )

    def _shed_below(self, priority: str) -> bool:
        """Make room by rejecting the newest waiter of the lowest class below `priority`."""
        for p in reversed(PRIORITIES[rank(priority) + 1 :]):
            lanes = (reversed(self._queues[(p, False)]), reversed(self._queues[(p, True)]))
            for w in itertools.chain(*lanes):  # whole answers before streams
                if not w.gone:
                    self._forget(w)
                    w.future.set_exception(
                        self._reject(
                            p, 429, "shed", "shed for higher-priority work", self.retry_after_s(p)
                        )
                    )
                    return True
        return False
