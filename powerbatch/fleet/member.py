"""A member of a fleet budget: a `CeilingSource` whose ceiling is its leased share.

The member's Redis I/O runs in its own asyncio task on the event loop that ticks the control
loop (the proxy's; the plugin's control thread's), started on the first tick; `ceiling_w` only
reads local state and never waits. What it may use, by its own monotonic clock (docs/fleet.md):

* live: the grant of its last renewal, for 2/3 of a TTL from when that renewal was SENT;
* fallback: then min(what it was using, safe share): never more than it had, so it is safe
  whatever the others do;
* safe: a full TTL after its first failed renewal, the safe share: by then every lease
  granted before Redis went away has been given up by its holder.

Every member also stands for leader (`SET NX PX`); the leader runs the allocator each period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from powerbatch.fleet import scripts
from powerbatch.fleet.allocate import Bid, hold_small_moves, water_fill
from powerbatch.fleet.settings import FleetSettings

log = logging.getLogger("powerbatch.fleet")

DEAD_BAND_FRAC = 0.1  # the leader moves no share by less than this share of the safe share


@dataclass(frozen=True, slots=True)
class MemberSignals:
    """What a member publishes about itself each period."""

    power_w: float | None = None
    in_flight: int = 0
    queued_by_class: dict[str, int] = field(default_factory=dict)
    value_per_w: float = 0.0  # d(goodput)/d(watts), requests per W, unweighted
    want_w: float = 0.0  # the power serving all its demand would draw
    floor_w: float = 0.0  # the least it can hold while it serves at all (0: any share)


class FleetMetrics:
    """The member's gauges, in the host's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.share_w = Gauge(
            "powerbatch_fleet_share_watts", "This member's usable share of the budget", registry=r
        )
        self.lease_age_s = Gauge(
            "powerbatch_fleet_lease_age_seconds",
            "Seconds since the last confirmed renewal was sent",
            registry=r,
        )
        self.leader = Gauge(
            "powerbatch_fleet_leader", "1 while this member runs the allocator", registry=r
        )
        self.fallback = Gauge(
            "powerbatch_fleet_fallback", "1 while on a fallback share (no live lease)", registry=r
        )
        self.reallocations = Counter(
            "powerbatch_fleet_reallocations",
            "Allocations by this member (as leader) that moved watts",
            registry=r,
        )
        self.members = Gauge("powerbatch_fleet_members", "Live members seen", registry=r)


class FleetMember:
    """One instance's membership: renews its lease, publishes, and allocates when leader."""

    def __init__(
        self,
        settings: FleetSettings,
        member_id: str,
        *,
        signals: Callable[[], MemberSignals] | None = None,
        client: aioredis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        budget = settings.fleet_budget
        assert budget is not None, "a member needs fleet_budget"
        self.settings = s = settings
        self.id = member_id
        self.signals = signals or MemberSignals
        self.clock = clock
        self.ttl_s = s.fleet_lease_ttl_s
        self.interval_s = s.fleet_publish_interval_s
        self.prefix = scripts.prefix(budget)
        self.metrics = FleetMetrics(registry)
        self._client = client
        self._task: asyncio.Task[None] | None = None
        self.started_at = clock()
        # The lease as this member knows it.
        self.grant_w: float | None = None  # None: never had one
        self.held_w: float | None = None  # what Redis holds for it after its last renewal
        self.last_ok_sent: float | None = None
        self.first_fail_sent: float | None = None
        self.fallback_w: float | None = None  # what it fell back to (min(using, safe))
        self.members_seen = 0
        self.leader = False
        self.leader_id = ""
        self.lease_expires_ms: float | None = None
        self.reallocations = 0
        self.redis_error: str | None = None
        self.committed_w: float | None = None
        self.bid: dict[str, float] = {}  # what its last renewal published: the allocator's view

    # -- the ceiling --------------------------------------------------------------------------

    @property
    def safe_w(self) -> float:
        return self.settings.safe_share_w(self.members_seen)

    def usable_w(self, now: float | None = None) -> float:
        """The share this member may use now (see the module's docstring)."""
        now = self.clock() if now is None else now
        return self._stage(now)[1]

    def _stage(self, now: float) -> tuple[str, float]:
        ttl = self.ttl_s
        if self.grant_w is not None and self.last_ok_sent is not None:
            if now - self.last_ok_sent < 2 * ttl / 3:
                self.fallback_w = None
                return "live", self.grant_w
            failed = max(self.first_fail_sent or self.last_ok_sent, self.last_ok_sent)
            if now - failed >= ttl:
                return "safe", self.safe_w
            if self.fallback_w is None:
                self.fallback_w = min(self.grant_w, self.safe_w)
            return "fallback", self.fallback_w
        # Never leased: others may hold leases this member cannot see; wait them out.
        if self.first_fail_sent is not None and now - self.first_fail_sent >= ttl:
            return "safe", self.safe_w
        return "starting", self.settings.fleet_min_share_w

    def ceiling_w(self, t_s: float) -> float | None:
        """The loop's ceiling this tick: the usable share (at least 1 W: a ceiling of nothing
        would only make the controller hold its minimum batch, as 1 W does)."""
        self._ensure_started()
        stage, share = self._stage(self.clock())
        m = self.metrics
        m.share_w.set(share)
        m.fallback.set(0.0 if stage == "live" else 1.0)
        if self.last_ok_sent is not None:
            m.lease_age_s.set(self.clock() - self.last_ok_sent)
        return max(share, 1.0)

    def status_extra(self) -> dict[str, Any]:
        """The `fleet` section of /status."""
        now = self.clock()
        stage, share = self._stage(now)
        expires_in = None
        if self.last_ok_sent is not None:
            expires_in = self.last_ok_sent + 2 * self.ttl_s / 3 - now
        return {
            "fleet": {
                "budget": self.settings.fleet_budget,
                "budget_w": self.settings.fleet_budget_w,
                "member_id": self.id,
                "state": stage,
                "share_w": share,
                "grant_w": self.grant_w,
                "safe_share_w": self.safe_w,
                "lease_usable_for_s": expires_in,
                "leader": self.leader,
                "leader_id": self.leader_id or None,
                "members_seen": self.members_seen,
                "reallocations": self.reallocations,
                "redis_error": self.redis_error,
                "bid": dict(self.bid),
            }
        }

    def attach(
        self,
        signals: Callable[[], MemberSignals],
        registry: CollectorRegistry | None = None,
    ) -> None:
        """Bind the host's bid and put the gauges in its registry (once the loop exists)."""
        self.signals = signals
        if registry is not None:
            self.metrics = FleetMetrics(registry)

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
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            t = min(self.interval_s, self.ttl_s / 6)
            self._client = aioredis.Redis.from_url(
                self.settings.fleet_redis_url,
                socket_timeout=t,
                socket_connect_timeout=t,
                decode_responses=True,
            )
        return self._client

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        try:
            while True:
                await self.step()
                next_t += self.interval_s
                delay = next_t - loop.time()
                if delay < 0:
                    next_t, delay = loop.time(), 0.0
                await asyncio.sleep(delay)
        finally:
            await self._close()

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.interval_s):
                if self.leader:
                    await client.eval(scripts.RESIGN_LEADER, 1, self.prefix + ":leader", self.id)
        self.leader = False
        self.metrics.leader.set(0.0)
        with contextlib.suppress(Exception):
            await client.aclose()

    async def step(self) -> None:
        """One period: renew and publish; then stand for leader, and allocate if leader."""
        try:
            await self.renew()
            await self.lead()
            self.redis_error = None
        except (RedisError, OSError, TimeoutError) as exc:
            self.redis_error = f"{type(exc).__name__}: {exc}"
            if self.leader:
                log.warning("fleet %s: leader %s lost Redis: %s", self.prefix, self.id, exc)
            self.leader = False
            self.metrics.leader.set(0.0)
        except Exception:  # a bug must not stop the renewals' fallback clock
            log.exception("fleet step failed")

    def using_w(self, now: float, power_w: float | None) -> float:
        """What this member may be drawing now, as a renewal reports it: its usable share, or
        its measured power where that is higher, up to what its last renewal held.

        A lower share takes effect in the ceiling at once, but admission control reaches it
        only as requests in flight finish (seconds). Reporting the share alone would let Redis
        pay those watts to another member while this one still draws them; so the watts are
        freed only once the meter shows them free. Capped at the last confirmed hold: a
        renewal never raises what Redis holds for it (a member over its share is a control
        error the hold must not grow with). Only on a live lease: a member whose lease may have
        lapsed in Redis rejoins on what the pool gives it."""
        stage, usable = self._stage(now)
        if stage != "live" or power_w is None or self.held_w is None:
            return usable
        if not math.isfinite(power_w):
            return usable
        return max(usable, min(power_w, self.held_w))

    async def renew(self) -> None:
        sent = self.clock()
        sig = self.signals()
        using = self.using_w(sent, sig.power_w)
        demand = {f"demand_{c}": n for c, n in sig.queued_by_class.items()}
        weight = self._weight(sig)
        fields: dict[str, Any] = {
            "power_w": "" if sig.power_w is None else round(sig.power_w, 2),
            "in_flight": sig.in_flight,
            "value_per_w": sig.value_per_w * weight,
            "want_w": sig.want_w,
            "min_w": self.min_share_w(sig),
            "max_w": self.settings.max_share_w,
            "using_w": using,
            **demand,
        }
        args: list[Any] = [
            self.id,
            int(self.ttl_s * 1000),
            using,
            self.safe_w,
            self.settings.fleet_budget_w,
        ]
        for k, v in fields.items():
            args += [k, v]
        self.bid = {k: float(v) for k, v in fields.items() if isinstance(v, int | float)}
        try:
            reply = await self.client.eval(scripts.RENEW, 1, self.prefix, *args)
        except BaseException:
            if self.first_fail_sent is None:
                self.first_fail_sent = sent
            raise
        grant, expires, _now, _fresh, leader, live, committed = reply
        self.grant_w = float(grant)
        self.held_w = max(self.grant_w, using)
        self.last_ok_sent = sent
        self.first_fail_sent = None
        self.fallback_w = None
        self.lease_expires_ms = float(expires)
        self.leader_id = leader
        self.members_seen = int(live)
        self.committed_w = float(committed)
        self.metrics.members.set(self.members_seen)

    def min_share_w(self, sig: MemberSignals) -> float:
        """The smallest share to ask for: the configured one, or the member's floor where that
        is higher. A share below what the server draws serving a single request cannot be held
        by admission alone (it can only idle or exceed it), so it would be a share on paper: the
        watts given to others would be drawn here too."""
        floor = sig.floor_w if math.isfinite(sig.floor_w) else 0.0
        return min(max(self.settings.fleet_min_share_w, floor), self.settings.max_share_w)

    def _weight(self, sig: MemberSignals) -> float:
        """The mean priority weight of the demand: high-class work makes a watt worth more.
        In-flight requests of unknown class count as normal."""
        w = self.settings.weights()
        n = sum(sig.queued_by_class.values()) + sig.in_flight
        if n <= 0:
            return w["normal"]
        total = sum(w.get(c, w["normal"]) * k for c, k in sig.queued_by_class.items())
        return (total + w["normal"] * sig.in_flight) / n

    async def lead(self) -> None:
        key = self.prefix + ":leader"
        ttl_ms = int(self.ttl_s * 1000)
        c = self.client
        if self.leader:
            self.leader = bool(await c.eval(scripts.RENEW_LEADER, 1, key, self.id, ttl_ms))
        if not self.leader:
            self.leader = bool(await c.set(key, self.id, nx=True, px=ttl_ms))
            if self.leader:
                log.info("fleet %s: %s is the allocator", self.prefix, self.id)
        self.metrics.leader.set(1.0 if self.leader else 0.0)
        if self.leader:
            self.leader_id = self.id
            await self.allocate()

    async def allocate(self) -> None:
        """Water-fill the budget over the live members' bids and write it, fenced."""
        c = self.client
        ids = sorted(str(i) for i in await c.smembers(self.prefix + ":members"))
        async with c.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(f"{self.prefix}:m:{i}")
            rows = await pipe.execute()
        budget = self.settings.fleet_budget_w
        bids: dict[str, Bid] = {}
        grants: dict[str, float] = {}
        for i, h in zip(ids, rows, strict=True):
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
            )
        targets = water_fill(bids, max(budget, 0.0))
        targets = hold_small_moves(targets, grants, DEAD_BAND_FRAC * self.safe_w)
        args: list[Any] = [self.id, int(self.ttl_s * 1000), self.settings.fleet_budget_w]
        for i, w in targets.items():
            args += [i, round(w, 3)]
        reply = await c.eval(scripts.ALLOCATE, 1, self.prefix, *args)
        if reply[0] == "-1":
            self.leader = False
            self.metrics.leader.set(0.0)
            return
        if reply[2] == "1":
            self.reallocations += 1
            self.metrics.reallocations.inc()


def _f(x: Any, default: float = 0.0) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default
