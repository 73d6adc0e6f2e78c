"""A member of a fleet budget: a `CeilingSource` whose ceiling is its leased share.

The member's Redis I/O runs in its own asyncio task on the event loop that ticks the control
loop (the proxy's; the plugin's control thread's), started on the first tick; `ceiling_w` only
reads local state and never waits. Its parts: the `Lease` and the share it allows by the
member's own clock (docs/fleet.md, "What a member may use"), the budget's keys (`RedisBook`,
book.py), the `Election`, and the allocation step (water-filling: allocate.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from powerbatch.fleet.allocate import Bid, allocate, hold_small_moves
from powerbatch.fleet.book import RedisBook
from powerbatch.fleet.lowering import Lowering, Meter
from powerbatch.fleet.settings import FleetSettings

log = logging.getLogger("powerbatch.fleet")

DEAD_BAND_FRAC = 0.1  # the leader moves no share by less than this share of the safe share
QUEUE_MIN, QUEUE_FRAC = 2, 0.25  # work waiting beyond this many, or this share of the batch


def work_waits(queued: int, in_flight: int) -> bool:
    """More work waits than a batch turning over absorbs: more watts would buy goodput."""
    return queued > max(QUEUE_MIN, QUEUE_FRAC * in_flight)


@dataclass(frozen=True, slots=True)
class MemberSignals:
    """What a member publishes about itself each period."""

    power_w: float | None = None
    in_flight: int = 0
    queued_by_class: dict[str, int] = field(default_factory=dict)
    value_per_w: float = 0.0  # d(goodput)/d(watts), requests per W, unweighted
    want_w: float = 0.0  # the power serving all its demand would draw
    floor_w: float = 0.0  # the least it can hold while it serves at all (0: any share)
    max_w: float = math.inf  # the most it can draw: its device's highest limit, or its TDP
    needy: bool = False  # work waits, or its device limit holds it with work
    keep_w: float = math.inf  # the most its fair floor keeps (inf: its whole split)


class Stage(StrEnum):
    STARTING = "starting"
    LIVE = "live"
    FALLBACK = "fallback"
    SAFE = "safe"


class Lease:
    """What the renewals told this member; `stage` reads it and changes nothing."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings, self.ttl_s = settings, settings.fleet_lease_ttl_s
        self.grant_w: float | None = None  # None: never had one
        self.held_w: float | None = None  # what Redis holds for it after its last renewal
        self.last_ok_sent: float | None = None
        self.first_fail_sent: float | None = None
        self.members_seen = 0

    @property
    def safe_w(self) -> float:
        return self.settings.safe_share_w(self.members_seen)

    def stage(self, now: float) -> tuple[Stage, float]:
        """The stage and its share at `now`; fallback's needs no memory (renewals alone move it)."""
        ttl = self.ttl_s
        if self.grant_w is not None and self.last_ok_sent is not None:
            if now - self.last_ok_sent < 2 * ttl / 3:
                return Stage.LIVE, self.grant_w
            failed = max(self.first_fail_sent or self.last_ok_sent, self.last_ok_sent)
            if now - failed >= ttl:
                return Stage.SAFE, self.safe_w
            return Stage.FALLBACK, min(self.grant_w, self.safe_w)
        # Never leased: others may hold leases this member cannot see; wait them out.
        if self.first_fail_sent is not None and now - self.first_fail_sent >= ttl:
            return Stage.SAFE, self.safe_w
        return Stage.STARTING, self.settings.fleet_min_share_w

    def usable_for_s(self, now: float) -> float | None:
        """Seconds until a live lease falls back (negative once it has)."""
        return None if self.last_ok_sent is None else self.last_ok_sent + 2 * self.ttl_s / 3 - now

    def using_w(
        self, now: float, power_w: float | None, shown_w: float, limit_w: float | None = None
    ) -> float:
        """What a renewal reports it may be drawing: its usable share, or on a live lease, where
        higher, the ceiling its loop was shown (`Lowering`) and its meter (admission reaches a
        cut only as requests finish; the watts are not paid to another until the meter shows
        them free), up to its last hold. A device limit in force bounds the draw whatever
        the meter, which lags it: then the limit stands for the meter and the ceiling."""
        stage, usable = self.stage(now)
        if stage != Stage.LIVE or self.held_w is None:
            return usable
        if limit_w is not None and math.isfinite(limit_w):
            return max(usable, min(limit_w, self.held_w))
        drawn = shown_w
        if power_w is not None and math.isfinite(power_w):
            drawn = max(drawn, power_w)
        return max(usable, min(drawn, self.held_w))

    def confirmed(self, sent: float, grant_w: float, using_w: float, members_seen: int) -> None:
        """A renewal sent at `sent`, reporting `using_w`, was granted `grant_w`."""
        self.grant_w = grant_w
        self.held_w = max(grant_w, using_w)
        self.last_ok_sent = sent
        self.first_fail_sent = None
        self.members_seen = members_seen

    def failed(self, sent: float) -> None:
        """A renewal sent at `sent` got no answer: the fallback clock runs from the first."""
        if self.first_fail_sent is None:
            self.first_fail_sent = sent


class FleetMetrics:
    """The member's gauges, in the host's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        g = functools.partial(Gauge, registry=r)
        self.share_w = g("powerbatch_fleet_share_watts", "This member's usable share of the budget")
        self.lease_age_s = g(
            "powerbatch_fleet_lease_age_seconds",
            "Seconds since the last confirmed renewal was sent",
        )
        self.leader = g("powerbatch_fleet_leader", "1 while this member runs the allocator")
        self.fallback = g(
            "powerbatch_fleet_fallback", "1 while on a fallback share (no live lease)"
        )
        self.reallocations = Counter(
            "powerbatch_fleet_reallocations",
            "Allocations by this member (as leader) that moved watts",
            registry=r,
        )
        self.members = g("powerbatch_fleet_members", "Live members seen")


class Election:
    """Whether this member leads (`gauge` shows it): all stand (`SET NX PX`); the leader renews."""

    def __init__(self, book: RedisBook, gauge: Gauge) -> None:
        self.book = book
        self.gauge = gauge
        self.leader = False
        self.leader_id = ""  # the last leader seen: this member, or a renewal's answer

    async def stand(self) -> bool:
        """Keep the lease if held, else try to take it; True while this member leads."""
        if self.leader:
            self.leader = await self.book.renew_leader()
        if not self.leader:
            self.leader = await self.book.claim_leader()
            if self.leader:
                log.info("fleet %s: %s is the allocator", self.book.prefix, self.book.id)
        self.gauge.set(1.0 if self.leader else 0.0)
        if self.leader:
            self.leader_id = self.book.id
        return self.leader

    def lost(self) -> None:
        """No longer the leader: Redis is unreachable, or a fenced write was refused."""
        self.leader = False
        self.gauge.set(0.0)


def share_bounds_w(settings: FleetSettings, sig: MemberSignals) -> tuple[float, float]:
    """The member's share bounds: the settings' (unset: 0 and the budget) narrowed to what its
    actuators can honour, its floor (a share it cannot hold is drawn anyway) and its maximum
    (watts above what it can draw are wasted), so the defaults need no calibration."""
    hi = settings.max_share_w
    if math.isfinite(sig.max_w) and sig.max_w > 0:
        hi = min(hi, sig.max_w)
    floor = sig.floor_w if math.isfinite(sig.floor_w) else 0.0
    return min(max(settings.fleet_min_share_w, floor), hi), hi


def bid_fields(settings: FleetSettings, sig: MemberSignals, using_w: float) -> dict[str, Any]:
    """A renewal's bid: its bounds (`share_bounds_w`); `value_per_w` times the demand's mean
    class weight (in-flight requests count as normal)."""
    w = settings.weights()
    n = sum(sig.queued_by_class.values()) + sig.in_flight
    weight = w["normal"]
    if n > 0:
        total = sum(w.get(c, w["normal"]) * k for c, k in sig.queued_by_class.items())
        weight = (total + w["normal"] * sig.in_flight) / n
    lo, hi = share_bounds_w(settings, sig)
    return {
        "power_w": "" if sig.power_w is None else round(sig.power_w, 2),
        "in_flight": sig.in_flight,
        "value_per_w": sig.value_per_w * weight,
        "want_w": sig.want_w,
        "min_w": lo,
        "max_w": hi,
        "needy": int(sig.needy),
        "keep_w": round(sig.keep_w, 2) if math.isfinite(sig.keep_w) else "",
        "using_w": using_w,
        **{f"demand_{c}": k for c, k in sig.queued_by_class.items()},
    }


class FleetMember:
    """One instance's membership: renews its lease, publishes, and allocates when leader."""

    def __init__(
        self,
        settings: FleetSettings,
        member_id: str,
        *,
        signals: Callable[[], MemberSignals] | None = None,
        meter: Callable[[], Meter] | None = None,
        client: aioredis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.id = member_id
        self.signals = signals or MemberSignals
        self.meter = meter
        self.lowering = Lowering()
        self._wake = asyncio.Event()  # an early renewal (`run`)
        self._waits = False  # work waited at the last tick
        self._busy = False  # work was in flight or queued at the last tick
        self.clock = clock
        self.metrics = FleetMetrics(registry)
        self.book = RedisBook(settings, member_id, client)
        self.lease = Lease(settings)
        self.election = Election(self.book, self.metrics.leader)
        self._task: asyncio.Task[None] | None = None
        self.reallocations = 0
        self.redis_error: str | None = None
        self.bid: dict[str, float] = {}  # what its last renewal published: the allocator's view

    # -- the ceiling --------------------------------------------------------------------------

    def usable_w(self, now: float | None = None) -> float:
        """The share this member may use now (`Lease.stage`)."""
        return self.lease.stage(self.clock() if now is None else now)[1]

    def ceiling_w(self, t_s: float) -> float | None:
        """The loop's ceiling this tick: the usable share, or while it falls one that follows
        the meter down to it (`Lowering`); at least 1 W (a ceiling of nothing would only make
        the controller hold its minimum batch, as 1 W does)."""
        self._ensure_started()
        now = self.clock()
        stage, share = self.lease.stage(now)
        meter = self.meter() if self.meter is not None else Meter()
        held = self.lease.held_w if self.lease.held_w is not None else share
        was = self.lowering.limit_holds
        shown = self.lowering.show(now, share, stage == Stage.LIVE, held, meter)
        if self.lowering.limit_holds and not was:
            self._wake.set()  # the lower limit is in force: confirm it now, not next period
        waits = work_waits(meter.queued, meter.in_flight)
        if waits and not self._waits and not self.bid.get("needy"):
            self._wake.set()  # work began to wait: bid needy now (the leader is woken in turn)
        self._waits = waits
        busy = meter.in_flight + meter.queued > 0
        if busy and not self._busy and not self._bid_has_work():
            # Work came where the last bid said none: bid it now. The leader lends an idle
            # member's split away, and an allocation on the old bid took a member that had
            # just been sent its first requests down to its lowest limit for 1-2 s (the
            # diurnal case's start, docs/fleet.md, stop 52).
            self._wake.set()
        self._busy = busy
        m = self.metrics
        m.share_w.set(share)
        m.fallback.set(0.0 if stage == Stage.LIVE else 1.0)
        if self.lease.last_ok_sent is not None:
            m.lease_age_s.set(now - self.lease.last_ok_sent)
        return max(shown, 1.0)

    def _bid_has_work(self) -> bool:
        """Whether the last bid told the allocator of any work (requests in flight, or a
        value: `allocate._idle` lends the split of a member with none)."""
        return bool(self.bid.get("in_flight")) or self.bid.get("value_per_w", 0.0) > 0.0

    def device_limit_w(self, t_s: float) -> float | None:
        """The device limit to ask for under the ceiling while a share falls (else None)."""
        return self.lowering.limit_w

    def status_extra(self) -> dict[str, Any]:
        """The `fleet` section of /status."""
        now = self.clock()
        stage, share = self.lease.stage(now)
        s, lease, election = self.settings, self.lease, self.election
        return {
            "fleet": {
                "budget": s.fleet_budget,
                "budget_w": s.fleet_budget_w,
                "member_id": self.id,
                "state": stage.value,
                "share_w": share,
                "grant_w": lease.grant_w,
                "safe_share_w": lease.safe_w,
                "lease_usable_for_s": lease.usable_for_s(now),
                "leader": election.leader,
                "leader_id": election.leader_id or None,
                "members_seen": lease.members_seen,
                "reallocations": self.reallocations,
                "redis_error": self.redis_error,
                "bid": dict(self.bid),
                "ceiling_shown_w": self.lowering.ceiling_w,  # above share_w while it falls
                "lower_limit_w": self.lowering.limit_w,  # the device limit asked for then
            }
        }

    def attach(
        self,
        signals: Callable[[], MemberSignals],
        registry: CollectorRegistry | None = None,
        meter: Callable[[], Meter] | None = None,
    ) -> None:
        """Bind the host's bid and meter, and put the gauges in its registry (once the loop
        exists)."""
        self.signals = signals
        self.meter = meter
        if registry is not None:
            self.metrics = FleetMetrics(registry)
            self.election.gauge = self.metrics.leader

    # -- running ------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a tick driven by hand, without a loop
            return
        self._task = loop.create_task(self.run(), name="powerbatch-fleet")

    async def start(self) -> None:
        self._ensure_started()

    async def stop(self) -> None:
        """Stop renewing; resign leadership so another member allocates at once."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # not `await task`: the caller's own cancel must stand

    async def run(self) -> None:
        """Renew a period after the last renewal began, or at once when woken: by this member's
        own loop (a lower limit in force, work that began to wait, work where its last bid said
        none) or by the scripts, through
        `_listen`. redis-py may drop a cancel (Python 3.11's `wait_for` returns an inner result
        ready when the cancel came): a cancel still pending after a step ends the loop too, else
        stop() or asyncio.run's shutdown waits for ever."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        listener = loop.create_task(self._listen(), name="powerbatch-fleet-wakes")
        try:
            while True:
                began = loop.time()
                await self.step()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError
                delay = max(began + self.settings.fleet_publish_interval_s - loop.time(), 0.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()
        finally:
            listener.cancel()
            await asyncio.wait([listener])
            await self._close()

    async def _listen(self) -> None:
        """Renew at once when the scripts say a move waits on this member (book.py): a cut
        to confirm, a raise to take up, a pending raise the pool can now pay, or, as leader, a
        member turned needy. Without these a move took a period at each of its four steps
        (needy, allocation, the cut confirmed, the raise paid): 1.5-2 s of a 3-5-s burst. Best
        effort: the periods stand alone, so a lost subscription is retried a period later."""
        while True:
            try:
                async for _ in self.book.wakes():
                    self._wake.set()
            except Exception as exc:  # nothing here may stop the renewals
                log.debug("fleet %s: wake-ups lost: %s", self.book.prefix, exc)
            await asyncio.sleep(self.settings.fleet_publish_interval_s)

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.fleet_publish_interval_s):
                if self.election.leader:
                    await self.book.resign_leader()
        self.election.lost()
        with contextlib.suppress(Exception):
            await self.book.close()

    async def step(self) -> None:
        """One period: renew and publish; then stand for leader, and allocate if leader."""
        try:
            await self.renew()
            if await self.election.stand():
                moved = await self.allocate()
                if moved is None:  # fenced: another member holds the leader lease now
                    self.election.lost()
                elif moved:
                    self.reallocations += 1
                    self.metrics.reallocations.inc()
            self.redis_error = None
        except (RedisError, OSError, TimeoutError) as exc:
            self.redis_error = f"{type(exc).__name__}: {exc}"
            if self.election.leader:
                log.warning("fleet %s: leader %s lost Redis: %s", self.book.prefix, self.id, exc)
            self.election.lost()
        except Exception:  # a bug must not stop the renewals' fallback clock
            log.exception("fleet step failed")

    async def allocate(self) -> bool | None:
        """Water-fill the budget over the live members' bids and write it, fenced: None where
        this member is no longer the leader, else whether any grant moved."""
        budget = self.settings.fleet_budget_w
        bids: dict[str, Bid] = {}
        grants: dict[str, float] = {}
        for i, h in (await self.book.members()).items():
            if not h:
                continue
            if h.get("lost") == "1":
                budget -= _f(h.get("safe_w"))  # reserved while it may be on it
                continue
            if h.get("grant") not in (None, ""):
                grants[i] = _f(h.get("grant"))
            bids[i] = Bid(
                value_per_w=_f(h.get("value_per_w")),
                want_w=_f(h.get("want_w")),
                min_w=_f(h.get("min_w")),
                max_w=_f(h.get("max_w"), budget),
                needy=h.get("needy") == "1",
                keep_w=_f(h.get("keep_w"), math.inf),
            )
        targets = allocate(bids, max(budget, 0.0))
        band_w = DEAD_BAND_FRAC * self.lease.safe_w
        needy = [k for k, b in bids.items() if b.needy]
        return await self.book.allocate(hold_small_moves(targets, grants, band_w, needy))

    async def renew(self) -> None:
        """Renew the lease on what this member may be drawing, and publish its bid."""
        sent = self.clock()
        sig = self.signals()
        limit = self.lowering.limit_w if self.lowering.limit_holds else None
        shown = self.lowering.ceiling_w if self.lowering.ceiling_w is not None else 0.0
        using = self.lease.using_w(sent, sig.power_w, shown, limit)
        fields = bid_fields(self.settings, sig, using)
        self.bid = {k: float(v) for k, v in fields.items() if isinstance(v, int | float)}
        try:
            grant_w, leader_id, live = await self.book.renew(using, self.lease.safe_w, fields)
        except BaseException:
            self.lease.failed(sent)
            raise
        self.lease.confirmed(sent, grant_w, using, live)
        self.election.leader_id = leader_id
        self.metrics.members.set(live)


def _f(x: Any, default: float = 0.0) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default
