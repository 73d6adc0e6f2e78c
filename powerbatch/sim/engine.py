"""A vLLM-like continuous-batching engine driving the GPU model in real (monotonic) time.

The scheduler follows vLLM's V1 `Scheduler.schedule()` in outline: running requests first (decode
one token, or continue a chunked prefill), then admit from a FIFO waiting queue while the step
token budget, `max_num_seqs` and free KV blocks allow; when a running request cannot grow, the most
recently admitted one is preempted by recompute. Output length is always `max_tokens` (benchmarks'
ignore_eos), so the load is deterministic.

Modelling choice: a power limit or clock lock set while a step runs acts on the rest of that
step. A GPU's power management meets a limit by lowering its clock as it runs, not between a
server's steps, and a seconds-long prefill step is one kernel sequence to it. How fast a real
GPU follows a new limit is not measured here (the GPU check reads limits, it sets none). The
running step's remaining fraction of work is re-timed at the new setting and its energy
segment split there, so a long prefill step does not run out at a limit since lowered (over
the ceiling), nor at one since raised (slower than the device).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from powerbatch.errors import ClockError, ConfigError, PowerbatchError, PowerLimitError
from powerbatch.sim.gpu_model import (
    DEFAULT_KV_CAPACITY_TOKENS,
    DEFAULT_PROFILE,
    PROFILES,
    ClockedStep,
    GpuProfile,
    mean_noise_factor,
    noisy_readings_w,
    ou_noise_step_w,
    step_at_clock,
    supported_clocks_mhz,
)

_log = logging.getLogger(__name__)

__all__ = [
    "EngineStopped",
    "QueueFull",
    "RequestTooLarge",
    "SimEngine",
    "SimRequest",
    "StepRecord",
    "VirtualClock",
    "resolve_profile",
]


DEFAULT_MAX_NUM_SEQS = 256  # the simulated server's batch limit unless told (vLLM's --max-num-seqs)


class VirtualClock:
    """A clock that stands still until its owner moves `t`: `SimEngine(clock=...)` offline."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class QueueFull(PowerbatchError):
    """The waiting queue is at `max_num_queued_reqs` (vLLM answers 503)."""


class RequestTooLarge(PowerbatchError):
    """The request could never fit in the KV cache."""


class EngineStopped(PowerbatchError):
    """The engine stopped before the request finished."""


def resolve_profile(profile: GpuProfile | str) -> GpuProfile:
    if isinstance(profile, GpuProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ConfigError(f"unknown GPU profile {profile!r}; known: {sorted(PROFILES)}") from None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One trace entry: an engine step, or an idle stretch (no prefill or decode tokens)."""

    t_s: float
    step_s: float
    power_w: float
    running: int
    waiting: int
    kv_tokens: int
    prefill_tokens: int
    decode_tokens: int
    energy_j: float
    """Cumulative energy at the end of this entry."""
    power_limit_w: float = math.inf
    """The total power limit the step ran under (the set's limit as the throttle sees it)."""
    sm_clock_mhz: float = math.nan
    """The SM clock the step ran at (the locked top, or lower where the limit bound it)."""


class SimRequest:
    """One request's state and its token channel (a single consumer awaits `wait_tokens`)."""

    __slots__ = (
        "_notify_at",
        "_waiter",
        "arrival_s",
        "blocks",
        "finish_reason",
        "first_token_s",
        "last_token_s",
        "max_tokens",
        "num_computed",
        "num_output",
        "pooling",
        "preemptions",
        "prompt_tokens",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        now_s: float,
        *,
        pooling: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.pooling = pooling  # prefill only (an embedding): done when the prompt is computed
        self.arrival_s = now_s
        self.num_computed = 0
        self.num_output = 0
        self.blocks = 0
        self.preemptions = 0
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.finish_reason: str | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._notify_at = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.num_output

    @property
    def tpot_s(self) -> float | None:
        """The mean gap between its output tokens after the first (what TPOT measures); None
        before it has two."""
        gaps = self.num_output - 1
        if self.first_token_s is None or gaps < 1:
            return None
        return (self.last_token_s - self.first_token_s) / gaps

    async def wait_tokens(self, at_least: int) -> int:
        """Wait until `at_least` tokens exist or the request ends; return the token count.

        The engine wakes the consumer only at that threshold, so coalesced streaming costs one
        wake-up per chunk, not per token.
        """
        while self.num_output < at_least and self.finish_reason is None:
            self._notify_at = at_least
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.finish_reason == "stopped":
            raise EngineStopped(f"request {self.request_id}: engine stopped")
        return self.num_output

    def _notify(self, force: bool = False) -> None:
        waiter = self._waiter
        if (
            waiter is not None
            and not waiter.done()
            and (force or self.num_output >= self._notify_at)
        ):
            waiter.set_result(None)


class SimEngine:
    """Simulated vLLM engine + GPU set. Start it with `await start()` inside an event loop.

    `step()` runs one step synchronously on the engine's own clock without sleeping, for tests and
    offline use; do not mix it with a started engine. `clock` replaces `time.monotonic` there:
    a virtual clock the caller advances runs the engine faster than real time (`powerbatch.sim.
    capacity.served_in_slo`, benchmarks/clock_plants.py).
    """

    def __init__(
        self,
        profile: GpuProfile | str = DEFAULT_PROFILE,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = 8192,
        kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
        block_size: int = 16,
        max_num_queued_reqs: int | None = None,
        power_limit_w: float | None = None,
        seed: int = 0,
        trace_capacity: int = 200_000,
        max_lag_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = resolve_profile(profile)
        self._now = clock  # virtual time for offline runs (`step()`); the loop sleeps in real time
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("kv_capacity_tokens", kv_capacity_tokens),
            ("block_size", block_size),
            ("trace_capacity", trace_capacity),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if max_num_queued_reqs is not None and max_num_queued_reqs < 0:
            raise ConfigError(f"max_num_queued_reqs must be >= 0, got {max_num_queued_reqs}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.num_blocks = kv_capacity_tokens // block_size
        self.kv_capacity_tokens = self.num_blocks * block_size
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_lag_s = max_lag_s
        self._step_work: tuple[int, int, int] | None = None  # running (decode, prefill, kv)
        self._power_limit_w = self.profile.tdp_w
        self._gpu_limits_w = [self.profile.tdp_w_per_gpu] * self.profile.num_gpus
        if self.profile.gpu_power_shares:  # the hottest GPU meets its board limit first
            self._power_limit_w = self.profile.set_limit_w(self._gpu_limits_w)
        # Per GPU (min, max) locked SM clock, MHz; None: the driver's default policy (unlocked).
        self._locked_mhz: list[tuple[int, int] | None] = [None] * self.profile.num_gpus
        self._sm_clock_mhz = float(self.profile.sm_clock_min_mhz)  # now: idle
        self._noise_w = [0.0] * self.profile.num_gpus  # OU state, where noise_tau_s > 0
        self._noise_t_s: float | None = None
        if power_limit_w is not None:
            self.power_limit_w = power_limit_w
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()

        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._by_id: dict[str, SimRequest] = {}
        self._free_blocks = self.num_blocks

        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_started_total = 0  # first outputs, as vLLM's TTFT histogram counts them
        self.ttft_total_s = 0.0
        # vLLM's inter-token latency histogram (vllm/v1/metrics/stats.py): each output after a
        # request's first, the time since its last.
        self.itl_total_s = 0.0
        self.itl_count = 0
        self.decode_total_s = 0.0
        self.decode_count = 0
        self.preemptions_total = 0
        self.steps_total = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.trace: deque[StepRecord] = deque(maxlen=trace_capacity)

        # The energy timeline: contiguous segments; the open one is [seg_t0, seg_t1) at seg_power.
        now = self._now()
        self._t_start = now
        self._clock_s = now  # end of the last closed segment: the engine's own time
        self._energy_j = 0.0  # at _clock_s
        self._seg_t1: float | None = None  # None: idle, open-ended
        self._seg_power_w = self.profile.idle_w
        self._seg_full_s = 0.0  # the running step's whole length at the setting in force
        self._retimed = False  # the running step's setting changed while it ran
        self._sleep: asyncio.Future[None] | None = None  # the loop's wait for the step's end
        self._history: deque[tuple[float, float, float]] = deque()  # closed (t0, e0, power_w)

        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # ---- configuration -------------------------------------------------------------------

    @property
    def power_limit_w(self) -> float:
        return self._power_limit_w

    @power_limit_w.setter
    def power_limit_w(self, value: float) -> None:
        """The set's total, split evenly over its GPUs; out-of-range values are refused, like
        nvmlDeviceSetPowerManagementLimit (NVML API reference: INVALID_ARGUMENT outside
        nvmlDeviceGetPowerManagementLimitConstraints)."""
        if not (math.isfinite(value) and 0.0 < value <= self.profile.tdp_w):
            raise PowerLimitError(
                f"power limit must be in (0, {self.profile.tdp_w:g}] W, got {value!r}"
            )
        n = self.profile.num_gpus
        self._gpu_limits_w = [float(value) / n] * n
        self._power_limit_w = (
            self.profile.set_limit_w(self._gpu_limits_w)
            if self.profile.gpu_power_shares
            else float(value)
        )
        self._retime()

    @property
    def gpu_power_limits_w(self) -> list[float]:
        """Per GPU limit in force."""
        return list(self._gpu_limits_w)

    def gpu_limit_constraints_w(self) -> tuple[float, float]:
        """(min_w, max_w) one GPU accepts, like nvmlDeviceGetPowerManagementLimitConstraints."""
        return self.profile.min_limit_w_per_gpu, self.profile.tdp_w_per_gpu

    def set_gpu_power_limit_w(self, gpu: int, value: float) -> None:
        """One GPU's limit, refused outside its constraints as nvmlDeviceSetPowerManagementLimit
        refuses it (NVML_ERROR_INVALID_ARGUMENT).

        Modelling choice: the GPUs of a tensor-parallel set step in lockstep, so the slowest
        (lowest-limited) GPU paces them all: the set runs as if every GPU had the lowest limit.
        """
        lo, hi = self.gpu_limit_constraints_w()
        if not 0 <= gpu < self.profile.num_gpus:
            raise PowerLimitError(f"GPU index {gpu} does not exist")
        if not (math.isfinite(value) and lo <= value <= hi):
            raise PowerLimitError(
                f"GPU {gpu}: power limit must be in [{lo:g}, {hi:g}] W, got {value!r}"
            )
        self._gpu_limits_w[gpu] = float(value)
        self._power_limit_w = self.profile.set_limit_w(self._gpu_limits_w)
        self._retime()

    # ---- the SM clock --------------------------------------------------------------------

    def supported_clocks_mhz(self) -> list[int]:
        """SM clocks one GPU accepts, highest first (nvmlDeviceGetSupportedGraphicsClocks)."""
        return supported_clocks_mhz(self.profile)

    @property
    def gpu_locked_clocks_mhz(self) -> list[tuple[int, int] | None]:
        return list(self._locked_mhz)

    def set_gpu_locked_clocks(self, gpu: int, min_mhz: int, max_mhz: int) -> None:
        """Lock one GPU's SM clock to [min, max] (nvmlDeviceSetGpuLockedClocks). Modelling
        choice: values outside the supported range, or min over max, are refused with
        INVALID_ARGUMENT (NVML's reference does not say; refusing is the strict reading). A
        busy GPU runs at the top of its range; the set steps in lockstep at the lowest top."""
        p = self.profile
        if not 0 <= gpu < p.num_gpus:
            raise ClockError(f"GPU index {gpu} does not exist")
        lo, hi = p.sm_clock_min_mhz, p.sm_clock_max_mhz
        if not (lo <= min_mhz <= max_mhz <= hi):
            raise ClockError(
                f"GPU {gpu}: locked clocks must satisfy {lo} <= min <= max <= {hi} MHz, "
                f"got {min_mhz}..{max_mhz}"
            )
        self._locked_mhz[gpu] = (int(min_mhz), int(max_mhz))
        self._retime()

    def reset_gpu_locked_clocks(self, gpu: int) -> None:
        """Back to the driver's default policy (nvmlDeviceResetGpuLockedClocks)."""
        if not 0 <= gpu < self.profile.num_gpus:
            raise ClockError(f"GPU index {gpu} does not exist")
        self._locked_mhz[gpu] = None
        self._retime()

    def locked_top_mhz(self) -> float | None:
        """The clock the set runs busy steps at under its locks; None: unlocked."""
        tops = [lock[1] for lock in self._locked_mhz if lock is not None]
        return float(min(tops)) if tops else None

    def sm_clock_mhz(self) -> float:
        """The SM clock now (DCGM_FI_DEV_SM_CLOCK): the step's, or idle's (the lowest clock,
        or the bottom of a locked range)."""
        return self._sm_clock_mhz

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt_tokens: int,
        max_tokens: int,
        request_id: str | None = None,
        *,
        pooling: bool = False,
    ) -> SimRequest:
        """Queue a request. `pooling`: prefill only (embeddings), with max_tokens 0: it holds
        KV for its prompt while it runs and finishes when the prompt is computed, as vLLM's
        pooling models do, so power and in-flight counts see it."""
        if pooling and max_tokens != 0:
            raise RequestTooLarge("a pooling request decodes nothing: max_tokens must be 0")
        if prompt_tokens < 1 or (max_tokens < 1 and not pooling):
            raise RequestTooLarge("prompt_tokens and max_tokens must be >= 1")
        if self._stopped:
            raise EngineStopped("engine is stopped")
        if prompt_tokens + max_tokens > self.kv_capacity_tokens:
            raise RequestTooLarge(
                f"{prompt_tokens + max_tokens} tokens exceed the KV capacity "
                f"({self.kv_capacity_tokens} tokens)"
            )
        if self.max_num_queued_reqs is not None and len(self._waiting) >= self.max_num_queued_reqs:
            raise QueueFull(f"waiting queue is full ({self.max_num_queued_reqs} requests)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._by_id:
            raise ConfigError(f"duplicate request id {rid!r}")
        req = SimRequest(rid, prompt_tokens, max_tokens, self._now(), pooling=pooling)
        self._by_id[rid] = req
        self._waiting.append(req)
        self._wake.set()
        return req

    def abort(self, request: SimRequest | str) -> bool:
        """Drop a request wherever it is and free its KV; False if it had already ended."""
        req = self._by_id.get(request) if isinstance(request, str) else request
        if req is None or req.finished:
            return False
        if req in self._running:
            self._running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(req)
        self._end(req, "abort")
        self.requests_aborted += 1
        return True

    def _end(self, req: SimRequest, reason: str) -> None:
        if reason in ("length", "stop") and req.num_output > 0 and not req.pooling:
            # vLLM's request decode time histogram: first token to last, per finished request
            self.decode_total_s += req.last_token_s - (req.first_token_s or req.last_token_s)
            self.decode_count += 1
        self._free_blocks += req.blocks
        req.blocks = 0
        req.finish_reason = reason
        self._by_id.pop(req.request_id, None)
        req._notify(force=True)

    # ---- state ---------------------------------------------------------------------------

    @property
    def clock_s(self) -> float:
        """The engine's own time: the end of its last step or idle spell (`step()` moves it)."""
        return self._clock_s

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefill_pending(self) -> bool:
        """Whether the next step carries prompt tokens (as `_schedule` counts them): a running
        request's prompt (or a preempted one's recompute) is not all computed yet, or one waits
        with a seat free (and the KV cache has room: not checked here)."""
        if self._waiting and len(self._running) < self.max_num_seqs:
            return True
        return any(
            not (r.seq_tokens - r.num_computed == 1 and r.num_output > 0) for r in self._running
        )

    @property
    def kv_tokens(self) -> int:
        """KV tokens held, counted in whole blocks as vLLM's block manager does."""
        return (self.num_blocks - self._free_blocks) * self.block_size

    @property
    def kv_usage(self) -> float:
        return 1.0 - self._free_blocks / self.num_blocks

    def power_w(self) -> float:
        """True power of the GPU set right now (no sensor noise)."""
        return self._seg_power_w

    def energy_j(self, at_s: float | None = None) -> float:
        """Cumulative energy (true power, idle included) since the engine was made."""
        t = self._now() if at_s is None else at_s
        if t >= self._clock_s:
            end = t if self._seg_t1 is None else min(t, self._seg_t1)
            return self._energy_j + self._seg_power_w * max(0.0, end - self._clock_s)
        for t0, e0, p in reversed(self._history):
            if t >= t0:
                return e0 + p * (t - t0)
        return 0.0

    def average_power_w(self, window_s: float = 1.0) -> float:
        """Mean true power over the last `window_s`: what nvmlDeviceGetPowerUsage gives on Hopper
        (NVML API reference: a 1-second average on Ampere, except GA100, and newer)."""
        now = self._now()
        start = max(now - window_s, self._t_start)
        if now <= start:
            return self._seg_power_w
        return (self.energy_j(now) - self.energy_j(start)) / (now - start)

    def instant_power_per_gpu_w(self) -> list[float]:
        """Noisy instant readings, one per GPU (NVML_FI_DEV_POWER_INSTANT); draws from the RNG.

        With `noise_tau_s` > 0 the noise is slow (OU, advanced to now) and spikes stay fresh."""
        p = self.profile
        if p.noise_tau_s <= 0:
            return noisy_readings_w(p, self._seg_power_w, self._rng)
        now = self._now()
        dt = math.inf if self._noise_t_s is None else now - self._noise_t_s
        self._noise_w = ou_noise_step_w(p, self._noise_w, dt, self._rng)
        self._noise_t_s = now
        spikes = np.where(
            self._rng.random(p.num_gpus) < p.spike_prob,
            self._rng.uniform(p.spike_min_w, p.spike_max_w, p.num_gpus),
            0.0,
        )
        return [
            max(0.0, self._seg_power_w * s + x + float(k))
            for s, x, k in zip(p.shares(), self._noise_w, spikes, strict=True)
        ]

    def mean_power_per_gpu_w(self, window_s: float = 1.0) -> list[float]:
        """Per-GPU `window_s` means (dcgm-exporter's DCGM_FI_DEV_POWER_USAGE): the GPUs' shares
        of the true mean, plus what slow noise leaves after averaging (`mean_noise_factor`)."""
        avg = self.average_power_w(window_s)
        f = mean_noise_factor(self.profile.noise_tau_s, window_s)
        return [
            max(0.0, avg * s + f * x)
            for s, x in zip(self.profile.shares(), self._noise_w, strict=True)
        ]

    def instant_power_w(self) -> float:
        return sum(self.instant_power_per_gpu_w())

    def trace_since(self, since_s: float = -math.inf) -> Iterator[StepRecord]:
        """Trace entries starting at or after `since_s` (the engine's clock)."""
        return (r for r in self.trace if r.t_s >= since_s)

    def snapshot(self) -> dict[str, float | int | str]:
        return {
            "t_s": self._now(),
            "profile": self.profile.name,
            "num_gpus": self.profile.num_gpus,
            "tdp_w": self.profile.tdp_w,
            "power_limit_w": self._power_limit_w,
            "gpu_power_limits_w": ",".join(f"{w:g}" for w in self._gpu_limits_w),
            "power_w": self._seg_power_w,
            "power_avg_w": self.average_power_w(),
            "sm_clock_mhz": self._sm_clock_mhz,
            "gpu_locked_clocks_mhz": ",".join(
                "unlocked" if lock is None else f"{lock[0]}-{lock[1]}" for lock in self._locked_mhz
            ),
            "energy_j": self.energy_j(),
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_tokens": self.kv_tokens,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_usage": self.kv_usage,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "preemptions_total": self.preemptions_total,
            "steps_total": self.steps_total,
            "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted,
        }

    # ---- the energy timeline -------------------------------------------------------------

    def _close_segment(self, t1: float, record: StepRecord | None) -> None:
        t0 = self._clock_s
        self._history.append((t0, self._energy_j, self._seg_power_w))
        self._energy_j += self._seg_power_w * max(0.0, t1 - t0)
        self._clock_s = t1
        while len(self._history) > 1 and self._history[1][0] <= t1 - 2.0:
            self._history.popleft()
        if record is not None:
            self.trace.append(record)

    def _close_idle(self, t1: float) -> None:
        """End an idle stretch at `t1` and trace it (zero-length stretches are skipped)."""
        if self._seg_t1 is not None or t1 <= self._clock_s:
            return
        t0 = self._clock_s
        e1 = self._energy_j + self._seg_power_w * (t1 - t0)
        rec = StepRecord(
            t0, t1 - t0, self._seg_power_w, 0, 0, 0, 0, 0, e1, self._power_limit_w,
            self._sm_clock_mhz,
        )  # fmt: skip
        self._close_segment(t1, rec)

    def _open_idle(self) -> None:
        self._seg_t1 = None
        self._seg_power_w = self.profile.idle_w
        # Modelling choice: idle power is the unlocked idle's; a GPU idles at its lowest clock,
        # or at the bottom of its locked range.
        bottoms = [lock[0] for lock in self._locked_mhz if lock is not None]
        self._sm_clock_mhz = float(max(bottoms, default=self.profile.sm_clock_min_mhz))

    # ---- scheduling ----------------------------------------------------------------------

    def _try_allocate(self, req: SimRequest, num_tokens: int) -> bool:
        needed = -(-(req.num_computed + num_tokens) // self.block_size) - req.blocks
        if needed > self._free_blocks:
            return False
        if needed > 0:
            req.blocks += needed
            self._free_blocks -= needed
        return True

    def _preempt(self, req: SimRequest) -> None:
        """Recompute preemption: free KV, forget computed tokens, go to the queue's front."""
        self._free_blocks += req.blocks
        req.blocks = 0
        req.num_computed = 0
        req.preemptions += 1
        self.preemptions_total += 1
        self._waiting.appendleft(req)

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], int, int]:
        """Pick this step's work: (scheduled (request, tokens), prefill tokens, decode count)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        prefill = 0
        decode = 0
        preempted = False
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.seq_tokens - req.num_computed, budget)
            while not self._try_allocate(req, n):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                if n == 1 and req.num_output > 0:
                    decode += 1
                else:
                    prefill += n
                i += 1
        if not preempted:
            waiting = self._waiting
            while waiting and len(running) < self.max_num_seqs and budget > 0:
                req = waiting[0]
                n = min(req.seq_tokens - req.num_computed, budget)
                if not self._try_allocate(req, n):
                    break
                waiting.popleft()
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                prefill += n
        return scheduled, prefill, decode

    def _complete(self, scheduled: list[tuple[SimRequest, int]], now_s: float) -> None:
        """Apply a finished step: sample tokens, finish requests, wake their consumers."""
        any_done = False
        for req, n in scheduled:
            if req.finish_reason is not None:  # aborted while the step ran
                continue
            req.num_computed += n
            if req.num_computed < req.seq_tokens:
                continue  # a prefill chunk that does not reach the end yet
            if req.num_output == 0:
                self.prompt_tokens_total += req.prompt_tokens
                req.first_token_s = now_s
                self.requests_started_total += 1
                self.ttft_total_s += now_s - req.arrival_s
            if req.pooling:
                self._end(req, "stop")
                self.requests_finished += 1
                any_done = True
                continue
            if req.num_output > 0:
                self.itl_total_s += now_s - req.last_token_s
                self.itl_count += 1
            req.last_token_s = now_s
            req.num_output += 1
            self.generation_tokens_total += 1
            if req.num_output >= req.max_tokens:
                self._end(req, "length")
                self.requests_finished += 1
                any_done = True
            else:
                req._notify()
        if any_done:
            self._running = [r for r in self._running if r.finish_reason is None]

    def _plan(self, t0: float) -> tuple[list[tuple[SimRequest, int]], StepRecord]:
        """Schedule a step starting at `t0` and open its energy segment; return (work, record)."""
        scheduled, prefill, decode = self._schedule()
        self._step_work = (decode, prefill, self.kv_tokens)
        self._retimed = False
        st = self._step_at_setting()
        step_s, power_w = st.step_s, st.power_w
        self._seg_t1 = t0 + step_s
        self._seg_full_s = step_s
        self._seg_power_w = power_w
        self._sm_clock_mhz = st.sm_clock_mhz
        rec = StepRecord(
            t0,
            step_s,
            power_w,
            len(self._running),
            len(self._waiting),
            self.kv_tokens,
            prefill,
            decode,
            self._energy_j + power_w * step_s,
            self._power_limit_w,
            st.sm_clock_mhz,
        )
        return scheduled, rec

    def _step_at_setting(self) -> ClockedStep:
        assert self._step_work is not None
        decode, prefill, kv_tokens = self._step_work
        return step_at_clock(
            self.profile,
            decode,
            prefill,
            kv_tokens,
            self._power_limit_w,
            kv_capacity_tokens=self.kv_capacity_tokens,
            sm_clock_mhz=self.locked_top_mhz(),
        )

    def _retime(self) -> None:
        """A setting changed: run the rest of a running step at it (see the module docstring)."""
        if self._step_work is None or (t1 := self._seg_t1) is None:
            return
        now = self._now()
        if not self._clock_s <= now < t1:
            return
        left = (t1 - now) / self._seg_full_s
        self._close_segment(now, None)
        st = self._step_at_setting()
        self._seg_full_s = st.step_s
        self._seg_t1 = now + left * st.step_s
        self._seg_power_w = st.power_w
        self._sm_clock_mhz = st.sm_clock_mhz
        self._retimed = True
        if self._sleep is not None:
            _wake(self._sleep)

    def _end_step(self, t0: float, t1: float, rec: StepRecord) -> StepRecord:
        """Close the running step's last segment; a re-timed step's record carries its whole
        length, its mean power and the setting it ended under."""
        self._step_work = None
        if self._retimed:
            e1 = self._energy_j + self._seg_power_w * max(0.0, t1 - self._clock_s)
            e0 = rec.energy_j - rec.power_w * rec.step_s
            rec = replace(
                rec,
                step_s=t1 - t0,
                power_w=(e1 - e0) / (t1 - t0) if t1 > t0 else self._seg_power_w,
                energy_j=e1,
                power_limit_w=self._power_limit_w,
                sm_clock_mhz=self._sm_clock_mhz,
            )
        self._close_segment(t1, rec)
        return rec

    async def _sleep_to_step_end(self) -> float:
        """Sleep until the running step ends; a re-time wakes it to sleep to the new end."""
        loop = asyncio.get_running_loop()
        while True:
            t1 = self._seg_t1
            assert t1 is not None
            delay = t1 - self._now()
            if delay <= 0:
                return t1
            self._sleep = fut = loop.create_future()
            handle = loop.call_later(delay, _wake, fut)
            try:
                await fut
            finally:
                handle.cancel()
                self._sleep = None

    def _has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> StepRecord | None:
        """Run one step at once on the engine clock (no sleep); None when there is no work."""
        if not self._has_work():
            return None
        self._close_idle(max(self._clock_s, self._now()))
        t0 = self._clock_s
        scheduled, rec = self._plan(t0)
        self._end_step(t0, t0 + rec.step_s, rec)
        self.steps_total += 1
        self._complete(scheduled, t0 + rec.step_s)
        if not self._has_work():
            self._open_idle()
        return rec

    # ---- the asyncio loop ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the step loop (idempotent)."""
        if self._task is None or self._task.done():
            self._stopped = False
            self._task = asyncio.get_running_loop().create_task(self._guarded(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop and end every pending request with EngineStopped."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for req in [*self._running, *self._waiting]:
            self._end(req, "stopped")
        self._running.clear()
        self._waiting.clear()
        if self._seg_t1 is not None:  # a step was cut short: account it up to now
            now = self._now()
            self._close_segment(min(now, self._seg_t1), None)
            self._step_work = None
            self._open_idle()

    @property
    def started(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _guarded(self) -> None:
        """A bug in the loop must not leave clients waiting forever: end their requests."""
        try:
            await self._loop()
        except Exception:
            _log.exception("simulated engine loop failed")
            self._stopped = True
            for req in [*self._running, *self._waiting]:
                self._end(req, "stopped")
            self._running.clear()
            self._waiting.clear()
            raise

    async def _loop(self) -> None:
        """Steps run back to back on the engine clock; sleeping to each deadline (rather than for
        each step) keeps event-loop jitter from accumulating. A lag beyond `max_lag_s` (a stalled
        host) is resynchronised and counted as idle time."""
        while True:
            if not self._has_work():
                self._open_idle()
                self._wake.clear()
                await self._wake.wait()
                self._close_idle(self._now())
                continue
            now = self._now()
            if now - self._clock_s > self.max_lag_s:
                self._close_idle_gap(now)
            t0 = self._clock_s
            scheduled, rec = self._plan(t0)
            t1 = await self._sleep_to_step_end()
            self._end_step(t0, t1, rec)
            self.steps_total += 1
            self._complete(scheduled, t1)

    def _close_idle_gap(self, t1: float) -> None:
        self._open_idle()
        self._close_idle(t1)


def _wake(fut: asyncio.Future[None]) -> None:
    """End the loop's sleep (at the step's end, or early when a re-time moved it)."""
    if not fut.done():
        fut.set_result(None)
