"""Admission: the priority queue that holds requests until the limits allow them upstream."""

from powerbatch.admission.priority import (
    DEFAULT_PRIORITY,
    DEFERRABLE,
    PRIORITIES,
    parse_priority,
    rank,
)
from powerbatch.admission.queue import (
    REJECTION_REASONS,
    AdmissionQueue,
    QueueStats,
    Rejected,
    Slot,
)

__all__ = [
    "DEFAULT_PRIORITY",
    "DEFERRABLE",
    "PRIORITIES",
    "REJECTION_REASONS",
    "AdmissionQueue",
    "QueueStats",
    "Rejected",
    "Slot",
    "parse_priority",
    "rank",
]
