"""One power budget over many powerbatch instances, leased through Redis (docs/fleet.md). The
member (and the Redis client) is imported only where a budget is set: the vLLM plugin's
EngineCore, or any instance without a fleet, never loads it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from powerbatch.fleet.allocate import Bid, marginal_value, water_fill
from powerbatch.fleet.settings import FleetSettings

if TYPE_CHECKING:
    from powerbatch.control import QueueCounts
    from powerbatch.control.loop import ControlLoop
    from powerbatch.fleet.member import FleetMember

__all__ = ["Bid", "FleetSettings", "attach", "join", "marginal_value", "water_fill"]


def join(settings: FleetSettings, port: int | None = None) -> FleetMember | None:
    """The member for these settings, or None when no budget is set (no fleet)."""
    if settings.fleet_budget is None:
        return None
    from powerbatch.fleet.member import FleetMember

    return FleetMember(settings, settings.member_id(port))


def attach(
    member: FleetMember | None,
    loop: ControlLoop,
    counts: Callable[[], QueueCounts] | None = None,
) -> None:
    """Bid from the host's control loop and its counts of requests (`QueueCounts`: arrivals,
    waiters, the longest wait), and export into its metrics registry."""
    if member is None:
        return
    from powerbatch.fleet.signals import LoopSignals

    signals = LoopSignals(loop, counts, lambda: member.lease.safe_w)
    member.attach(signals, loop.metrics.registry, signals.meter)
