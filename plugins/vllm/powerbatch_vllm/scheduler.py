"""vLLM V1 schedulers that hold a power ceiling: pass one with `--scheduler-cls`.

    vllm serve MODEL --scheduler-cls powerbatch_vllm.scheduler.PowerbatchAsyncScheduler

Each `schedule()` applies the control thread's latest limits through vLLM's own knobs, then lets
vLLM schedule as usual:

* `max_num_active_reqs`: admission into the running set (requests already running finish; the
  set shrinks as they do, so nothing is preempted by a lower limit);
* `max_num_scheduled_tokens`: the step's token budget, running decodes plus the paced prefill
  (prefill is the main source of power spikes);
* KV: a new request is not admitted while the running set's KV commitment (prompt +
  max_tokens of each request, as the proxy counts it) would pass the cap; running requests
  keep growing (capping them would mean preempting).

`add_request()` counts each arrival by class (vLLM's priority) for the shape planner: O(1) per
request; starts and completions come from the step's new and finished request ids, O(new
requests) per step.

No value is ever raised above what vLLM was configured with. Use the async flavour wherever vLLM
would schedule asynchronously (GPU deployments); the plain one where it would not (e.g. CPU).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from powerbatch_vllm.compat import check_vllm_version, installed_vllm_version

check_vllm_version(installed_vllm_version())

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from powerbatch_vllm.config import load_config  # noqa: E402
from powerbatch_vllm.control import ControlThread  # noqa: E402
from powerbatch_vllm.energy import priority_class, streams  # noqa: E402
from powerbatch_vllm.engine import EngineCaps, StepStats  # noqa: E402

log = logging.getLogger("vllm.powerbatch")

_NEEDED = ("max_num_active_reqs", "max_num_scheduled_tokens", "kv_cache_manager", "running")
_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class _PowerbatchMixin:
    """The hooks, shared by both flavours; state lives in `_pb_*` attributes."""

    _pb: ControlThread
    _pb_caps: EngineCaps
    _pb_stats: StepStats
    _pb_kv_cap: int
    _pb_committed: int  # KV tokens the running set will hold at most: prompt + max_tokens
    _pb_prefilling: dict[str, Any]  # scheduled requests still without a first token
    _pb_boosted: set[str]  # of those, the ones whose prefill runs at the top clock
    _pb_unboost: list[str]  # boosted ones whose last prompt token the last step computed
    _pb_first_token_arrivals: list[float]  # arrival times of those the last step finished
    _pb_first_token_sched_t: float  # when that step was scheduled (wall clock)

    def _pb_setup(self) -> None:
        s: Any = self
        missing = [name for name in _NEEDED if not hasattr(s, name)]
        if missing:
            raise RuntimeError(
                f"powerbatch-vllm: this vLLM's scheduler lacks {', '.join(missing)}; "
                "the plugin does not support this version"
            )
        cfg = load_config()
        pool = s.kv_cache_manager.block_pool
        spec = int(getattr(s, "num_spec_tokens", 0) or 0)
        self._pb_caps = EngineCaps(
            max_active_reqs=int(s.max_num_active_reqs),
            max_step_tokens=int(s.max_num_scheduled_tokens),
            num_kv_blocks=int(pool.num_gpu_blocks) - 1,  # less vLLM's null block
            block_size=int(s.block_size),
            tokens_per_decode=1 + spec,
            chunked_prefill=bool(s.scheduler_config.enable_chunked_prefill),
        )
        self._pb_stats = StepStats()
        self._pb_kv_cap = self._pb_caps.num_kv_blocks
        self._pb_committed = 0
        self._pb_prefilling = {}
        self._pb_boosted = set()
        self._pb_unboost = []
        self._pb_first_token_arrivals = []
        self._pb_first_token_sched_t = 0.0
        parallel = s.vllm_config.parallel_config
        dp_rank = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank) or 0)
        model = s.vllm_config.model_config
        names = getattr(model, "served_model_name", None) or getattr(model, "model", "")
        model_name = str(names[0] if isinstance(names, list | tuple) and names else names)
        self._pb = ControlThread(
            cfg, self._pb_caps, self._pb_stats, dp_rank=dp_rank, model_name=model_name
        )
        # The KV cap gates admissions inside vLLM's own allocation call, so a refused request
        # takes exactly vLLM's "no room" path (stop admitting this step), nothing new.
        s.kv_cache_manager.allocate_slots = self._pb_wrap_allocate(
            s.kv_cache_manager.allocate_slots
        )
        if not self._pb_caps.chunked_prefill and cfg.control.prefill_pacing:
            log.warning("powerbatch-vllm: chunked prefill is off, so prefill is not paced")
        self._pb.start()
        log.info(
            "powerbatch-vllm %s: ceiling %.0f W, power source %s, mode %s; vLLM caps %s",
            type(self).__name__,
            cfg.control.ceiling_w,
            cfg.power.power_source,
            cfg.control.mode,
            self._pb_caps,
        )

    def _pb_wrap_allocate(self, allocate: Any) -> Any:
        s: Any = self
        cap_all = self._pb_caps.kv_tokens

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            admitting = request.status in _ADMITTING
            need = 0
            if admitting:
                need = int(request.num_prompt_tokens) + int(request.max_tokens)
                cap = self._pb_kv_cap * self._pb_caps.block_size
                if cap < cap_all and s.running and self._pb_committed + need > cap:
                    return None
            blocks = allocate(request, *args, **kwargs)
            if blocks is not None:
                self._pb_committed += need
            return blocks

        return allocate_slots

    def _pb_before(self) -> None:
        s: Any = self
        lim = self._pb.limits  # one attribute read: the thread swaps whole objects
        s.max_num_active_reqs = lim.max_active_reqs
        s.max_num_scheduled_tokens = lim.step_tokens(self._pb_caps, len(s.running))
        self._pb_kv_cap = lim.max_kv_blocks
        for req_id in self._pb_unboost:  # that step has run (async: is running): decode next
            self._pb.unboost(req_id)
        self._pb_unboost = []
        if self._pb_first_token_arrivals:
            # The step that computed their last prompt token has run (with async scheduling,
            # is running): its first token is out, or about to be, now. If the engine idled in
            # between (nothing left to schedule), count one usual step, not the idle time.
            now = time.time()  # vLLM stamps arrival_time with the wall clock
            step_s = self._pb_stats.step_s
            if step_s is not None:
                now = min(now, self._pb_first_token_sched_t + 2.0 * step_s)
            self._pb_stats.record_first_tokens([now - a for a in self._pb_first_token_arrivals])
            self._pb_first_token_arrivals = []

    def _pb_after(self, out: Any) -> None:
        s: Any = self
        threshold = self._pb_caps.tokens_per_decode
        prefill = decode = decode_reqs = 0
        work: dict[str, tuple[int, int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            if n > threshold:
                prefill += n
                work[req_id] = (n, 0)
            else:
                decode += n
                decode_reqs += 1
                work[req_id] = (0, n)
        self._pb_record_requests(out, work)
        # The KV cap is on what the running set will hold (prompt + max_tokens, as the proxy
        # counts), not on blocks in use now: a cap on current use would lock in a low level,
        # since requests still in prefill hold few blocks.
        self._pb_committed = sum(r.num_prompt_tokens + r.max_tokens for r in s.running)
        self._pb_track_first_tokens(out)
        running, waiting = s.get_request_counts()
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        self._pb_stats.record(
            running=running,
            waiting=waiting,
            decode_reqs=decode_reqs,
            decode_tokens=decode,
            prefill_tokens=prefill,
            kv_blocks_used=self._pb_caps.num_kv_blocks - free,
            kv_committed_tokens=self._pb_committed,
        )

    def _pb_record_requests(self, out: Any, work: dict[str, tuple[int, int]]) -> None:
        """Per-request tokens of this step, for the energy ledger (powerbatch_vllm.energy)."""
        s: Any = self
        classes = {}
        for new in out.scheduled_new_reqs:
            request = s.requests.get(new.req_id)
            priority = getattr(request, "priority", None) if request is not None else None
            classes[new.req_id] = priority_class(priority)
        finished = getattr(out, "finished_req_ids", None) or ()
        self._pb_stats.record_requests(work, classes, finished)

    def _pb_track_first_tokens(self, out: Any) -> None:
        """Note requests whose prompt this step completes: their TTFT is known next step.

        Only requests still in prefill are looked at (new ones join here), so the cost per
        step is the number of prompts in flight, not the batch. A streamed request of a
        boosted class (`clock_boost_classes`) runs its prefill at the top clock: lifted when
        it is first scheduled, given back once the step that ends its prompt has run.
        """
        s: Any = self
        boost_classes = self._pb.boost_classes
        for new in out.scheduled_new_reqs:
            request = s.requests.get(new.req_id)
            if request is not None and request.num_output_tokens == 0:
                self._pb_prefilling[new.req_id] = request
                if (
                    boost_classes
                    and priority_class(getattr(request, "priority", None)) in boost_classes
                    and streams(request)
                ):
                    self._pb_boosted.add(new.req_id)
                    self._pb.boost(new.req_id)
        if not self._pb_prefilling:
            return
        done = []
        for req_id, request in self._pb_prefilling.items():
            if request.is_finished():
                done.append(req_id)
            elif request.num_computed_tokens >= request.num_prompt_tokens:
                self._pb_first_token_arrivals.append(request.arrival_time)
                self._pb_first_token_sched_t = time.time()
                done.append(req_id)
        for req_id in done:
            del self._pb_prefilling[req_id]
            if req_id in self._pb_boosted:
                self._pb_boosted.discard(req_id)
                self._pb_unboost.append(req_id)

    def _pb_shutdown(self) -> None:
        pb = getattr(self, "_pb", None)
        if pb is not None:
            pb.stop()

    # The overrides, written once: the mixin comes first in each flavour's bases, so
    # super() is vLLM's Scheduler or AsyncScheduler.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pb_setup()

    def add_request(self, request: Any) -> None:
        # A request id vLLM already holds is the next chunk of a streaming input, no arrival.
        s: Any = self
        arriving = request.request_id not in s.requests
        super().add_request(request)  # type: ignore[misc]
        if arriving:
            cls = priority_class(getattr(request, "priority", None))
            self._pb_stats.record_arrival(request.request_id, cls)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._pb_before()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._pb_after(out)
        return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        self._pb_stats.step_done()
        return out

    def shutdown(self) -> None:
        self._pb_shutdown()
        super().shutdown()  # type: ignore[misc]


class PowerbatchScheduler(_PowerbatchMixin, Scheduler):
    """vLLM's synchronous V1 `Scheduler` under a power ceiling."""


class PowerbatchAsyncScheduler(_PowerbatchMixin, AsyncScheduler):
    """vLLM's `AsyncScheduler` (GPU deployments schedule asynchronously) under a power ceiling."""
