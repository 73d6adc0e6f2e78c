"""What the controller reads and writes each tick: plain data and the enums that name its states.

Nothing here imports numpy, so the admission queue (it only enforces `AdmissionLimits`) stays
light. The enums are `StrEnum`s: they print, compare and serialise as the strings `/status`, the
metrics and the trace have always carried.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from powerbatch.control.latency import LatencySnapshot
    from powerbatch.estimate import Features


class State(StrEnum):
    """The controller's state; `STARTING` is the loop's until its first tick."""

    STARTING = "starting"
    WARMUP = "warmup"
    ENFORCE = "enforce"
    OBSERVE = "observe"
    FAIL_CLOSED = "fail_closed"


class Binding(StrEnum):
    """The constraint that sets the batch (or holds work back) this tick."""

    NONE = "none"
    POWER = "power"
    LATENCY = "latency"
    KV = "kv"
    MAX_BATCH = "max_batch"
    DEMAND = "demand"
    SENSOR = "sensor"
    WARMUP = "warmup"
    RAMP = "ramp"
    ENGINE = "engine"


class Deferrable(StrEnum):
    """What admission does with deferrable (low-class) work: its usual turn, hold or release."""

    DEFAULT = "default"
    HOLD = "hold"
    RELEASE = "release"


CONSTRAINTS: tuple[str, ...] = ("power", "latency", "kv")
"""The constraints priced by a Lagrange multiplier, in the order `/status` lists them."""


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What admission enforces (the device's own power limit is `power_limit_w`, a number).
    `prefill_tok_s` None means prefill is not paced."""

    max_requests: int
    max_kv_tokens: int
    prefill_tok_s: float | None = None
    # Slots beyond max_requests that only the most urgent class may take: under a device limit
    # the cap holds the ceiling, so interactive work need not queue behind batch work.
    reserve_requests: int = 0


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """What a host counts of its requests (the proxy's queue, the engine's steps), read by the
    shape planner and the fleet's bid: cumulative arrivals per class, completions, what is in
    flight and waiting now, and how long the longest waiter has waited (None: not kept)."""

    arrived: Mapping[str, int]
    completed: int
    in_flight: int
    queued: Mapping[str, int]
    oldest_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The upstream engine's own queue, as of one scrape of its metrics (`t_s` tells one
    scrape from the next): `queued` requests it will not start this step (vLLM's waiting
    queue), out of the `in_flight` admitted then; `start_rate` the requests it starts per
    second; `token_s` the time a running request waits per output token, averaged over a
    request's decode time (what its TPOT will show), and `step_s` the same over the last few
    scrapes (whether the step is slow now); None where the engine does not say. `generated`:
    the last scrapes' (t_s, tokens generated ever), oldest first; empty where not exported."""

    queued: float
    in_flight: int
    start_rate: float
    t_s: float
    token_s: float | None = None
    step_s: float | None = None
    generated: tuple[tuple[float, float], ...] = ()
    step_batch: float | None = None
    """The requests decoding over the scrapes `step_s` averages, averaged the same way: with
    `step_s`, one point of the step against the batch (the running count now leads a step
    average that is seconds behind a cut)."""

    @property
    def running(self) -> float:
        """The engine's running batch: what was admitted less what it queues."""
        return max(0.0, self.in_flight - self.queued)


@dataclass(frozen=True, slots=True)
class Observation:
    """What the controller sees each tick; the caller smooths features like the power reading."""

    t_s: float
    power_w: float | None  # measured 1-second power; None when there is no trustworthy reading
    sensor_ok: bool
    features: Features
    in_flight: int
    queued: int
    sensor_error: str | None = None
    latency: LatencySnapshot | None = None
    kv_cache_usage: float | None = None  # upstream's, 0..1
    engine: EngineLoad | None = None  # upstream's own queue and start rate; None: not scraped
    ceiling_w: float | None = None  # this tick's ceiling (a fleet share); None: the configured
    power_limit_w: float | None = None  # device limit in force; None: no limiter, or degraded
    queued_deferrable: int = 0  # low-class requests waiting (they can fill a floor)
    plan_w: float | None = None  # the shape planner's power for this second; None: no plan
    # The features over the window `power_w` measured, where the meter lags the ticks (an
    # exporter that collects once a second); None: `features`. `reading_weight`: the samples
    # the reading stands for when learned (see window.ReadingAligner); 0 for a held value
    # already learned, which learned again against newer features would pair the watts of one
    # second with the load of another.
    reading_features: Features | None = None
    reading_weight: float = 1.0
    # On the tick the meter's learned lag changes: the readings kept, each paired with the load
    # of the new lag, (t, features, watts, weight). The model forgets and learns them anew.
    relearn: tuple[tuple[float, Features, float, float], ...] = ()

    @property
    def seen(self) -> Features:
        """The load the power reading measured."""
        return self.reading_features or self.features


@dataclass(frozen=True, slots=True)
class Decision:
    t_s: float
    enforced: AdmissionLimits  # what admission applies (in observe mode: the configured maxima)
    proposed: AdmissionLimits  # what the controller would enforce
    state: State
    binding: Binding
    power_w: float | None
    predicted_w: float  # model mean at the proposed batch
    predicted_upper_w: float  # upper bound at the proposed batch
    target_w: float
    multipliers: dict[str, float] = field(default_factory=dict)
    emergency: bool = False
    reason: str = ""
    ceiling_w: float = math.nan  # the ceiling this decision held
    power_limit_w: float | None = None  # the device limit to set (a limiter applies it)
    capped: bool = False  # a device limit in force held the ceiling this tick
    deferrable: Deferrable = Deferrable.DEFAULT  # what admission does with low-class work
