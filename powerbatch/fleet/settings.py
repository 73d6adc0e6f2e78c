"""The fleet section: one power budget shared by many powerbatch instances through Redis."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from powerbatch.errors import ConfigError
from powerbatch.settings import check_bounds, setting


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """Fleet: one power budget over many servers, leased through Redis (docs/fleet.md)"""

    fleet_budget: str | None = setting(
        None, "name of the shared power budget this instance joins; unset: no fleet"
    )
    fleet_budget_w: float = setting(
        0.0, "the budget, W: the sum every member's share stays under", ge=0
    )
    fleet_redis_url: str = setting(
        "redis://127.0.0.1:6379/0", "Redis holding the budget", secret=True
    )
    fleet_member_id: str | None = setting(
        None, "this member's name in the budget", default_doc="host:port"
    )
    fleet_members: int = setting(
        4,
        "members expected; the safe share is budget over the larger of this and those seen",
        ge=1,
    )
    fleet_min_share_w: float = setting(
        0.0,
        "the smallest share this member asks for, W; it asks for no less than its device's "
        "lowest limit (with a limiter) or one request's power (without) either way",
        ge=0,
    )
    fleet_max_share_w: float | None = setting(
        None,
        "the largest share this member asks for, W; never more than its device's highest "
        "limit (or the GPUs' power limit without a limiter)",
        default_doc="the budget",
        gt=0,
    )
    fleet_safe_share_w: float | None = setting(
        None,
        "share used without a live lease, W; all members' must sum to at most the budget",
        default_doc="budget / members",
        gt=0,
    )
    fleet_lease_ttl_s: float = setting(
        3.0, "lease length, s: renewed every third, given up at two thirds", gt=0.3, le=600
    )
    fleet_publish_interval_s: float = setting(
        0.5,
        "the longest between renewals (at once where a move waits on it); at most TTL / 3",
        gt=0,
    )
    fleet_weight_high: float = setting(4.0, "value of a watt serving high-class demand", ge=0)
    fleet_weight_normal: float = setting(1.0, "value of a watt serving normal demand", ge=0)
    fleet_weight_low: float = setting(0.25, "value of a watt serving low-class demand", ge=0)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.fleet_budget is None:
            return
        if self.fleet_budget_w <= 0:
            raise ConfigError("fleet_budget needs fleet_budget_w > 0")
        if self.fleet_publish_interval_s > self.fleet_lease_ttl_s / 3 + 1e-9:
            raise ConfigError(
                "fleet_publish_interval_s must be at most a third of fleet_lease_ttl_s: a lease "
                "is renewed at a third and given up at two thirds of its length"
            )
        if self.fleet_min_share_w > self.max_share_w:
            raise ConfigError("fleet_min_share_w is above fleet_max_share_w")
        if self.fleet_min_share_w * self.fleet_members > self.fleet_budget_w:
            raise ConfigError("fleet_min_share_w times fleet_members is above the budget")

    @property
    def max_share_w(self) -> float:
        return self.fleet_max_share_w if self.fleet_max_share_w is not None else self.fleet_budget_w

    def safe_share_w(self, members_seen: int = 0) -> float:
        """budget/N, N the larger of the configured and the seen count: so N safe shares sum
        to at most the budget however many members turn up."""
        n = max(self.fleet_members, members_seen, 1)
        share = self.fleet_budget_w / n
        if self.fleet_safe_share_w is not None:
            share = min(share, self.fleet_safe_share_w)
        return min(max(share, self.fleet_min_share_w), self.max_share_w)

    def weights(self) -> dict[str, float]:
        return {
            "high": self.fleet_weight_high,
            "normal": self.fleet_weight_normal,
            "low": self.fleet_weight_low,
        }

    def member_id(self, port: int | None = None) -> str:
        if self.fleet_member_id:
            return self.fleet_member_id
        host = socket.gethostname()
        return f"{host}:{port}" if port is not None else host
