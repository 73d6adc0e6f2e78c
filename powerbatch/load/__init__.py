"""Load: seeded OpenAI-API load for the demo, the comparison bench and tests."""

from powerbatch.load.client import RequestResult, run_load, send_one
from powerbatch.load.profile import PROFILES, LoadProfile, Phase, PlannedRequest, bursty, steady

__all__ = [
    "PROFILES",
    "LoadProfile",
    "Phase",
    "PlannedRequest",
    "RequestResult",
    "bursty",
    "run_load",
    "send_one",
    "steady",
]
