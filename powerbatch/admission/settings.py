"""The admission queue's settings."""

from __future__ import annotations

from dataclasses import dataclass

from powerbatch.admission.priority import DEFERRABLE, PRIORITIES
from powerbatch.settings import check_bounds, setting


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """Admission queue: how much may wait, and for how long"""

    max_queue_len: int = setting(1_000, "requests waiting, all classes", ge=0)
    max_wait_s: float = setting(
        30.0, "longest wait in the queue, s (low class: 10x with valley fill)", gt=0
    )
    valley_fill: bool = setting(False, "hold deferrable (low) work for power troughs")
    # Adaptive LIFO (powerbatch.admission.queue): FIFO serves every waiter of an overloaded
    # class late; LIFO serves the fresh ones in time and the late ones after the burst.
    overload_lifo: bool = setting(
        True, "newest first in a class whose oldest waiter has waited past the TTFT SLO"
    )
    # The prefill pace is a token bucket this many seconds deep: in any one second, up to
    # (1 + prefill_burst_s) x the pace may start. Deeper lets an idle queue's first burst land
    # as a burst of watts; shallower makes a long prompt wait for a fuller bucket.
    prefill_burst_s: float = setting(
        0.25, "depth of the prefill pace's token bucket, s of the pace", gt=0, le=5
    )

    def __post_init__(self) -> None:
        check_bounds(self)

    def waits_s(self) -> dict[str, float]:
        """The longest wait per class: deferrable work may wait for a trough."""
        waits = dict.fromkeys(PRIORITIES, self.max_wait_s)
        waits[DEFERRABLE] = self.max_wait_s * (10 if self.valley_fill else 1)
        return waits
