"""One power budget over many powerbatch instances, leased through Redis (docs/fleet.md)."""

from powerbatch.fleet.allocate import Bid, marginal_value, water_fill
from powerbatch.fleet.member import FleetMember, MemberSignals
from powerbatch.fleet.settings import FleetSettings

__all__ = ["Bid", "FleetMember", "FleetSettings", "MemberSignals", "marginal_value", "water_fill"]
