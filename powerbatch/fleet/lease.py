"""The lease as a member knows it, and the share it may use, by its own monotonic clock.

* live: the grant of its last renewal, for 2/3 of a TTL from when that renewal was SENT;
* fallback: then min(what it was using, safe share): never more than it had, so it is safe
  whatever the others do;
* safe: a full TTL after its first failed renewal, the safe share: by then every lease
  granted before Redis went away has been given up by its holder;
* starting: never leased, the minimum share, until a TTL of failures makes it safe.
"""

from __future__ import annotations

import math
from enum import StrEnum

from powerbatch.fleet.settings import FleetSettings


class Stage(StrEnum):
    STARTING = "starting"
    LIVE = "live"
    FALLBACK = "fallback"
    SAFE = "safe"


class Lease:
    """What the renewals told this member; `stage` reads it and changes nothing."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self.ttl_s = settings.fleet_lease_ttl_s
        self.grant_w: float | None = None  # None: never had one
        self.held_w: float | None = None  # what Redis holds for it after its last renewal
        self.last_ok_sent: float | None = None
        self.first_fail_sent: float | None = None
        self.members_seen = 0

    @property
    def safe_w(self) -> float:
        return self.settings.safe_share_w(self.members_seen)

    def stage(self, now: float) -> tuple[Stage, float]:
        """The stage and the share it allows at `now`. The fallback share needs no memory:
        the grant and the member count it is made of change only with a renewal."""
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
        stage, usable = self.stage(now)
        if stage != Stage.LIVE or power_w is None or self.held_w is None:
            return usable
        if not math.isfinite(power_w):
            return usable
        return max(usable, min(power_w, self.held_w))

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
