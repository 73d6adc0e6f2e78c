"""What passes between vLLM's scheduler and the control thread; pure, no vLLM import.

The scheduler's step writes exact counts into `StepStats` (a lock held for a few additions) and
reads one immutable `EngineLimits` (a single attribute read); the thread does everything else.
So `schedule()` never waits on the controller, the regression or a power sensor.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from powerbatch.control import AdmissionLimits, LatencySnapshot, LatencyWindow, QueueCounts
from powerbatch.telemetry import UpstreamSignals
from powerbatch.telemetry.filters import ewma_step

# vLLM's priorities are integers with no names; the controller's TTFT p95 counts these classes.
LATENCY_CLASS = "normal"
CLASSES = ("high", "normal", "low")  # what vLLM's priorities map to (powerbatch_vllm.energy)


@dataclass(frozen=True, slots=True)
class EngineCaps:
    """What vLLM was configured with: the plugin never raises a limit above these."""

    max_active_reqs: int  # --max-num-seqs (or --max-num-active-seqs)
    max_step_tokens: int  # --max-num-batched-tokens / max_num_scheduled_tokens
    num_kv_blocks: int  # usable KV blocks (the pool less vLLM's null block)
    block_size: int
    tokens_per_decode: int = 1  # 1 + speculative tokens per request per step
    chunked_prefill: bool = True

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The limits `schedule()` applies; `prefill_tokens_per_step` None means unpaced."""

    max_active_reqs: int
    prefill_tokens_per_step: int | None
    max_kv_blocks: int
    min_step_tokens: int = 32

    @classmethod
    def unlimited(cls, caps: EngineCaps) -> EngineLimits:
        return cls(caps.max_active_reqs, None, caps.num_kv_blocks, caps.max_step_tokens)

    def step_tokens(self, caps: EngineCaps, running: int) -> int:
        """This step's token budget: every running decode, plus the paced prefill.

        Decodes always fit (a budget under them would stall running requests, not save power),
        and the budget is never above vLLM's own.
        """
        if self.prefill_tokens_per_step is None:
            return caps.max_step_tokens
        decode = min(running, self.max_active_reqs) * caps.tokens_per_decode
        budget = decode + max(self.prefill_tokens_per_step, self.min_step_tokens)
        return max(1, min(caps.max_step_tokens, budget))


def engine_limits(
    limits: AdmissionLimits,
    caps: EngineCaps,
    *,
    step_s: float | None,
    min_step_tokens: int = 32,
    pace_prefill: bool = True,
    cap_kv: bool = True,
) -> EngineLimits:
    """The controller's limits in the engine's units, each clamped to what vLLM was given.

    The controller paces prefill in tokens per second; a step lasts `step_s` (measured), so the
    step may carry `prefill_tok_s * step_s` prefill tokens. Without a measured step time, or with
    chunked prefill off (a prompt larger than the budget would never be scheduled), prefill is
    left unpaced.
    """
    active = max(1, min(limits.max_requests, caps.max_active_reqs))
    prefill: int | None = None
    if (
        pace_prefill
        and caps.chunked_prefill
        and limits.prefill_tok_s is not None
        and step_s is not None
        and step_s > 0
        and math.isfinite(limits.prefill_tok_s)
    ):
        prefill = max(0, round(limits.prefill_tok_s * step_s))
    blocks = caps.num_kv_blocks
    if cap_kv:
        wanted = math.ceil(limits.max_kv_tokens / max(caps.block_size, 1))
        blocks = max(1, min(wanted, caps.num_kv_blocks))
    return EngineLimits(active, prefill, blocks, min_step_tokens)


class StepStats:
    """Exact per-step counts from the scheduler, read as windows by the thread.

    Two readers: the power model source (means since its last read, like NVML's averaged power)
    and the controller (cumulative counters, turned into rates there).
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, latency_window_s: float = 30.0
    ) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        # TTFT per request (arrival to first token) and TPOT per decode step (the interval
        # between busy steps is every running decode's time to its next token).
        self._latency = LatencyWindow(latency_window_s)
        self.steps_total = 0
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.running = 0
        self.waiting = 0
        self.decode_reqs = 0
        self.kv_blocks_used = 0
        self.kv_committed_tokens = 0
        self.step_s: float | None = None  # EWMA of the interval between busy steps
        # What vLLM's inter-token latency histogram sums and counts (each decoding request
        # waited the interval for its token), kept exactly: the latency law's step (`upstream`).
        self.itl_sum_s = 0.0
        self.itl_count = 0
        self._last_busy_t: float | None = None
        # Per-request work since the last `take_requests()`, for energy attribution.
        self._req_work: dict[str, list[int]] = {}  # req_id -> [prefill, decode]
        self._req_class: dict[str, str] = {}
        self._req_done: list[str] = []
        # Steps scheduled and not yet returned, and the shape of the newest: while a step runs
        # (a long prefill may take seconds), the device draws its power, not idle.
        self._steps_pending = 0
        self._running_shape = (0.0, 0.0, 0.0)
        # Arrivals per class, completions, and requests not yet scheduled once (the planner's
        # queue), kept by the requests that come, start and finish: O(1) each, no queue scans.
        self._arrived = dict.fromkeys(CLASSES, 0)
        self._unstarted: dict[str, str] = {}  # req_id -> class
        self._queued = dict.fromkeys(CLASSES, 0)
        self._completed = 0
        self._started = 0
        # window sums since the last `take_window()`
        self._w_steps = 0
        self._w_decode_reqs = 0
        self._w_prefill = 0
        self._w_kv_blocks = 0

    def record(
        self,
        *,
        running: int,
        waiting: int,
        decode_reqs: int,
        decode_tokens: int,
        prefill_tokens: int,
        kv_blocks_used: int,
        kv_committed_tokens: int = 0,
        t_s: float | None = None,
    ) -> None:
        """One scheduled step; called by `schedule()`, so it only adds and assigns."""
        now = self.clock() if t_s is None else t_s
        busy = decode_tokens + prefill_tokens > 0
        with self._lock:
            self.running, self.waiting, self.kv_blocks_used = running, waiting, kv_blocks_used
            self.decode_reqs = decode_reqs
            self.kv_committed_tokens = kv_committed_tokens
            if not busy:
                self._last_busy_t = None
                return
            self.steps_total += 1
            self._steps_pending += 1
            self._running_shape = (float(decode_reqs), float(prefill_tokens), float(kv_blocks_used))
            self.prefill_tokens_total += prefill_tokens
            self.decode_tokens_total += decode_tokens
            self._w_steps += 1
            self._w_decode_reqs += decode_reqs
            self._w_prefill += prefill_tokens
            self._w_kv_blocks += kv_blocks_used
            if self._last_busy_t is not None:
                dt = now - self._last_busy_t
                if 0 < dt < 10.0:
                    self.step_s = ewma_step(self.step_s, dt, 0.1)
                    if decode_reqs:
                        self._latency.record(now, LATENCY_CLASS, None, dt)
                        self.itl_sum_s += dt * decode_reqs
                        self.itl_count += decode_reqs
            self._last_busy_t = now

    def step_done(self) -> None:
        """A scheduled step's output came back (`update_from_output`)."""
        with self._lock:
            self._steps_pending = max(0, self._steps_pending - 1)

    def record_arrival(self, req_id: str, cls: str) -> None:
        """A request reached the engine's queue (called from `add_request`)."""
        with self._lock:
            self._arrived[cls] = self._arrived.get(cls, 0) + 1
            self._queued[cls] = self._queued.get(cls, 0) + 1
            self._unstarted[req_id] = cls

    def record_requests(
        self,
        work: dict[str, tuple[int, int]],
        classes: dict[str, str],
        finished: Iterable[str] = (),
    ) -> None:
        """One step's tokens per request (prefill, decode), the classes of requests new to the
        step, and requests that finished: the energy ledger's input, and the planner's counts
        (a request new to a step has left the queue; one that finishes without ever being
        scheduled, aborted in the queue, is no completion)."""
        finished = list(finished)
        with self._lock:
            for req_id in classes:
                self._start(req_id)
            for req_id in finished:
                if not self._start(req_id):
                    self._completed += 1
            acc = self._req_work
            for req_id, (prefill, decode) in work.items():
                row = acc.get(req_id)
                if row is None:
                    acc[req_id] = [prefill, decode]
                else:
                    row[0] += prefill
                    row[1] += decode
            self._req_class.update(classes)
            self._req_done.extend(finished)

    def _start(self, req_id: str) -> bool:
        """Take `req_id` off the queue; False if it was not there. The lock is held."""
        cls = self._unstarted.pop(req_id, None)
        if cls is None:
            return False
        self._queued[cls] -= 1
        self._started += 1
        return True

    def upstream(self, t_s: float) -> UpstreamSignals:
        """The counters a scrape of vLLM's metrics gives the proxy, exact, for the same
        `EngineQueue` (powerbatch.control.engine_queue): the step's inter-token latency sums,
        starts, and completions against the decode time summed over every request (their
        ratio is a request's mean decode time, the horizon its TPOT averages over). Nothing
        waits in the engine's queue as far as the engine law knows: `schedule()` applies the
        cap on the running set itself, so vLLM's waiting queue is admission's queue here."""
        with self._lock:
            return UpstreamSignals(
                requests_running=float(self.running),
                requests_waiting=0.0,
                kv_cache_usage=None,
                t_s=t_s,
                requests_started_total=float(self._started),
                itl_sum_s=self.itl_sum_s,
                itl_count=float(self.itl_count),
                decode_sum_s=self.itl_sum_s,
                decode_count=float(self._completed),
            )

    def queue_counts(self) -> QueueCounts:
        """What the shape planner reads (powerbatch.shape.runner): cumulative arrivals per
        class and completions, the running set and the requests never scheduled, per class."""
        with self._lock:
            return QueueCounts(
                dict(self._arrived), self._completed, self.running, dict(self._queued)
            )

    @property
    def queued_deferrable(self) -> int:
        """Low-class requests waiting for their first step."""
        with self._lock:
            return self._queued.get("low", 0)

    def take_requests(self) -> tuple[dict[str, list[int]], dict[str, str], list[str]]:
        """Work, classes and finished requests since the last call."""
        with self._lock:
            out = (self._req_work, self._req_class, self._req_done)
            self._req_work, self._req_class, self._req_done = {}, {}, []
            return out

    def record_first_tokens(self, ttfts_s: list[float], t_s: float | None = None) -> None:
        """Times to first token of requests whose first token the last step produced."""
        now = self.clock() if t_s is None else t_s
        with self._lock:
            for ttft in ttfts_s:
                if ttft >= 0.0:
                    self._latency.record(now, LATENCY_CLASS, ttft, None)

    def latency(self, t_s: float) -> LatencySnapshot:
        with self._lock:
            return self._latency.snapshot(t_s)

    def take_window(self) -> tuple[float, float, float]:
        """Means since the last call: (decode batch, prefill tokens per step, KV blocks used).

        With no step scheduled in the window, either one step ran through it (its shape: a
        device draws a step's power until the step returns) or the engine idled (zero work, KV
        as it stands now).
        """
        with self._lock:
            n = self._w_steps
            if n == 0:
                if self._steps_pending:
                    return self._running_shape
                return 0.0, 0.0, float(self.kv_blocks_used)
            out = (self._w_decode_reqs / n, self._w_prefill / n, self._w_kv_blocks / n)
            self._w_steps = self._w_decode_reqs = self._w_prefill = self._w_kv_blocks = 0
            return out

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                "steps_total": float(self.steps_total),
                "prefill_tokens_total": float(self.prefill_tokens_total),
                "decode_tokens_total": float(self.decode_tokens_total),
                "running": float(self.running),
                "waiting": float(self.waiting),
                "decode_reqs": float(self.decode_reqs),
                "kv_blocks_used": float(self.kv_blocks_used),
                "kv_committed_tokens": float(self.kv_committed_tokens),
                "step_s": math.nan if self.step_s is None else self.step_s,
            }
