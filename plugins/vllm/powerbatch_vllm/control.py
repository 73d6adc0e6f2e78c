"""The control loop beside vLLM's scheduler: a daemon thread in the EngineCore process.

The thread owns an asyncio loop that runs the shared `ControlLoop` (powerbatch.control.loop):
the same power monitor, controller, feature window, status and trace as the proxy. Here the
engine's exact step counts are the feature source, and each decision becomes one immutable
`EngineLimits` that `schedule()` reads. The step never waits on this thread; if a tick fails,
safe limits hold. With `planner = on` the proxy's receding-horizon planner runs here too, on this
thread's loop (its LP in a worker thread), fed from the engine's own counts: arrivals per class,
completions and the requests not yet scheduled (StepStats), where the proxy reads its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from powerbatch.control import ControlConfig, Decision, LatencySnapshot
from powerbatch.control.clock import Boost
from powerbatch.control.controller import Controller
from powerbatch.control.engine_queue import EngineQueue
from powerbatch.control.loop import ControlLoop, HostSample
from powerbatch.control.record import open_trace
from powerbatch.energy.accounting import EnergyAccounting
from powerbatch.errors import ConfigError
from powerbatch.fleet import attach, join
from powerbatch.shape.runner import plan_runner
from powerbatch.shape.tracker import ShapeTracker
from powerbatch.telemetry import PowerSource, factory
from powerbatch_vllm.config import ENV_PREFIX, PluginConfig
from powerbatch_vllm.energy import EngineEnergy
from powerbatch_vllm.engine import EngineCaps, EngineLimits, StepStats, engine_limits
from powerbatch_vllm.metrics import ModelMeter, PluginMetrics, StatusServer

log = logging.getLogger("vllm.powerbatch")


def source_kind(cfg: PluginConfig) -> str:
    """The configured source; `auto` is NVML where it sees GPUs, else the dcgm-exporter URL."""
    try:
        return factory.source_kind(cfg.power, cfg.power.dcgm_url)
    except ConfigError:
        raise ConfigError(
            f"{ENV_PREFIX}POWER_SOURCE=auto: NVML sees no GPU here and no {ENV_PREFIX}DCGM_URL "
            f"is set; set {ENV_PREFIX}POWER_SOURCE=nvml on the GPU node, or {ENV_PREFIX}DCGM_URL "
            "to the node's dcgm-exporter"
        ) from None


def make_power_source(
    cfg: PluginConfig, kind: str, caps: EngineCaps, stats: StepStats
) -> PowerSource:
    """The configured source; `model` reads the engine's own steps through `stats`."""

    def model() -> PowerSource:
        # Imported here only: the simulator package brings its HTTP server (aiohttp.web) along,
        # which an engine reading a real sensor has no use for.
        from powerbatch.sim.power_source import ModelPowerSource

        def features() -> tuple[int, float, int]:
            batch, prefill, kv_blocks = stats.take_window()
            return round(batch), prefill, round(kv_blocks * caps.block_size)

        profile = cfg.simulation.model_profile
        return ModelPowerSource(features, profile, kv_capacity_tokens=max(caps.kv_tokens, 1))

    p = cfg.power
    return factory.make_power_source(p, kind, dcgm_url=p.dcgm_url, limiter=cfg.limiter, model=model)


class EngineFeatures:
    """The engine's exact counts as the loop's feature source. Once every `SCRAPE_S` its step
    counters go through the proxy's `EngineQueue`, as the proxy's scrape of vLLM's metrics
    does: the latency law then reads the step now and a request's TPOT to come (and judges
    its cuts by them), not a window's p95 of steps a shrunk batch no longer runs."""

    SCRAPE_S = 1.0  # the proxy's scrape period: the latency law's holds count these

    def __init__(
        self,
        stats: StepStats,
        caps: EngineCaps,
        metrics: PluginMetrics,
        sink: EngineSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats, self.caps, self.metrics, self.sink = stats, caps, metrics, sink
        self.clock = clock
        self.engine = EngineQueue()
        self._scraped_s = -math.inf

    def sample(self) -> HostSample:
        now = self.clock()
        if now - self._scraped_s >= self.SCRAPE_S:
            self._scraped_s = now
            self.engine.update(self.stats.upstream(now), 0, self.stats.running)
        snap = self.stats.snapshot()
        usage = snap["kv_blocks_used"] / max(self.caps.num_kv_blocks, 1)
        m = self.metrics
        m.running.set(snap["running"])
        m.waiting.set(snap["waiting"])
        m.kv_usage.set(usage)
        m.step_s.set(snap["step_s"])
        return HostSample(
            in_flight=int(snap["running"]),
            queued=int(snap["waiting"]),
            # KV committed (prompt + max_tokens per running request), what the KV cap limits.
            kv_tokens=snap["kv_committed_tokens"],
            prefill_tokens_total=snap["prefill_tokens_total"],
            decode_tokens_total=snap["decode_tokens_total"],
            kv_cache_usage=usage,
            engine=self.engine.load,
            queued_deferrable=self.stats.queued_deferrable,
        )

    def latency(self, t_s: float) -> LatencySnapshot:
        return self.stats.latency(t_s)

    def status_extra(self) -> dict[str, Any]:
        snap, caps, lim = self.stats.snapshot(), self.caps, self.sink.limits
        counts = self.stats.queue_counts()
        return {
            "queue": {  # live, not as of the last tick
                "in_flight": int(snap["running"]),
                "kv_tokens_in_flight": snap["kv_committed_tokens"],
                "queued_total": int(snap["waiting"]),  # vLLM calls them waiting
            },
            "engine": {
                "limits": {
                    "max_active_reqs": lim.max_active_reqs,
                    "step_tokens": lim.step_tokens(caps, int(snap["running"])),
                    "prefill_tokens_per_step": lim.prefill_tokens_per_step,
                    "max_kv_blocks": lim.max_kv_blocks,
                },
                "configured": {
                    "max_active_reqs": caps.max_active_reqs,
                    "step_tokens": caps.max_step_tokens,
                    "kv_blocks": caps.num_kv_blocks,
                    "block_size": caps.block_size,
                },
                "counters": dict(snap),
                # What the TPOT law reads, as of the last second's counts: a running request's
                # time per token to come and the step now (the proxy's `upstream` pair).
                "token_s": load.token_s if (load := self.engine.load) else None,
                "step_s": load.step_s if load else None,
                # What the shape planner reads: arrivals by class (vLLM's priority), requests
                # finished after running, and those not yet scheduled, by class.
                "requests": {
                    "arrived": dict(counts.arrived),
                    "completed": counts.completed,
                    "queued": dict(counts.queued),
                },
            },
        }


class EngineSink:
    """The decision in vLLM's units: `limits` is swapped whole, so `schedule()` reads one
    attribute and never sees a half-made update."""

    def __init__(
        self,
        cfg: PluginConfig,
        control: ControlConfig,
        caps: EngineCaps,
        stats: StepStats,
        metrics: PluginMetrics,
    ) -> None:
        self.engine, self.caps, self.stats, self.metrics = cfg.engine, caps, stats, metrics
        self.enforce = control.mode == "enforce"
        self.pace_prefill = control.prefill_pacing
        self.safe_batch = control.safe_batch
        # Until the first tick: warm-up limits, as the controller itself starts.
        self.limits = EngineLimits.unlimited(caps)
        if self.enforce:
            self.limits = EngineLimits(
                control.initial_batch, None, caps.num_kv_blocks, cfg.engine.min_step_tokens
            )
        self._export()

    def apply(self, decision: Decision) -> None:
        if self.enforce:
            step_s = self.stats.step_s
            self.limits = engine_limits(
                decision.enforced,
                self.caps,
                step_s=None if step_s is None or math.isnan(step_s) else step_s,
                min_step_tokens=self.engine.min_step_tokens,
                pace_prefill=self.pace_prefill,
                cap_kv=self.engine.kv_cap,
            )
        self._export()

    def fail_safe(self) -> None:
        if self.enforce:
            cur = self.limits
            self.limits = EngineLimits(
                min(cur.max_active_reqs, self.safe_batch),
                self.engine.min_step_tokens,
                cur.max_kv_blocks,
                self.engine.min_step_tokens,
            )
        self._export()

    def _export(self) -> None:
        lim, m = self.limits, self.metrics
        m.engine_limit.labels("active_requests").set(lim.max_active_reqs)
        m.engine_limit.labels("step_tokens").set(lim.step_tokens(self.caps, self.stats.running))
        m.engine_limit.labels("kv_blocks").set(lim.max_kv_blocks)


class ControlThread:
    """Runs the control loop for one engine; `limits` is what the scheduler applies."""

    def __init__(
        self,
        cfg: PluginConfig,
        caps: EngineCaps,
        stats: StepStats,
        *,
        dp_rank: int = 0,
        source: PowerSource | None = None,
        history_len: int = 36_000,
        model_name: str = "",
    ) -> None:
        cfg = dataclasses.replace(cfg, limiter=factory.resolve_limiter(cfg.limiter))
        self.cfg, self.caps, self.stats = cfg, caps, stats
        self.kind = "custom" if source is not None else source_kind(cfg)
        self.control = cfg.control_config(
            engine_max_batch=caps.max_active_reqs,
            max_kv_tokens=caps.kv_tokens,
            device_max_w=factory.device_max_w(cfg.power, self.kind, cfg.control.max_w),
        )
        self.controller = Controller(self.control, shape=cfg.shape)
        self.source = source or make_power_source(cfg, self.kind, caps, stats)
        self.monitor = factory.make_monitor(
            cfg.power, self.source, self.kind, cfg.control.ceiling_w
        )
        self.meter = ModelMeter()
        if self.kind == "model":
            self.monitor.add_listener(self.meter)
        self.metrics = m = PluginMetrics()
        m.engine_configured.labels("active_requests").set(caps.max_active_reqs)
        m.engine_configured.labels("step_tokens").set(caps.max_step_tokens)
        m.engine_configured.labels("kv_blocks").set(caps.num_kv_blocks)
        self.sink = EngineSink(cfg, self.control, caps, stats, m)
        self.features = EngineFeatures(stats, caps, m, self.sink, clock=stats.clock)
        # A fleet member's Redis task runs on this thread's loop, started by the first tick.
        member = join(cfg.fleet, cfg.engine.metrics_port + dp_rank)
        self.energy = _energy_accounting(self, model_name)
        # The proxy's planner, fed from the engine's own arrivals, completions and queue;
        # it solves in a worker thread of this thread's loop, never in `schedule()`.
        plan = plan_runner(cfg.shape, self.controller, stats.queue_counts)
        zeusd = factory.zeusd_client(cfg.limiter, cfg.clock)  # one for the limit and the clock
        self.loop = ControlLoop(
            self.controller,
            self.monitor,
            self.features,
            [self.sink],
            m,
            observers=[ShapeTracker(cfg.shape, m.shape, plan), self.energy],
            source_averages=cfg.power.averages(self.kind),
            history_len=history_len,
            trace=open_trace(cfg.trace),
            # Created here, started (crash recovery first) and used on the control thread's
            # own event loop, which owns its HTTP session.
            actuator=factory.make_actuator(
                cfg.limiter, cfg.power.gpu_indices(), dcgm_url=cfg.power.dcgm_url, client=zeusd
            ),
            # The same SM clock actuator and law as the proxy's, on this thread's loop too.
            sm_clock=factory.make_clock_actuator(
                cfg.clock, cfg.limiter, cfg.power, dcgm_url=cfg.power.dcgm_url, client=zeusd
            ),
            clock_policy=cfg.clock_policy,
            ceiling=member,
            plan=plan,
        )
        attach(member, self.loop, stats.queue_counts)
        self.dp_rank = dp_rank
        self._boosts: dict[str, Boost] = {}  # on this thread's loop only
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: StatusServer | None = None

    @property
    def limits(self) -> EngineLimits:
        return self.sink.limits

    @property
    def last(self) -> Decision | None:
        return self.loop.last

    @property
    def history(self) -> Any:
        return self.loop.history

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self.cfg.engine.metrics_port:
            port = self.cfg.engine.metrics_port + self.dp_rank
            try:
                self._server = StatusServer(
                    self.cfg.engine.metrics_host,
                    port,
                    self.metrics,
                    self._extra_text,
                    self.status,
                    self.loop.history_rows,
                )
                self._server.start()
                log.info("powerbatch-vllm metrics on http://%s:%d/metrics", *self._server.address)
            except OSError as exc:  # the ceiling matters more than its dashboard
                log.error("powerbatch-vllm cannot serve metrics on port %d: %s", port, exc)
                self._server = None
        self._thread = threading.Thread(target=self._run, name="powerbatch-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._server is not None:
            self._server.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("powerbatch control thread died; holding the safe batch")
            self.sink.fail_safe()

    async def _main(self) -> None:
        self._aloop = asyncio.get_running_loop()
        await self.loop.start()
        try:
            await asyncio.to_thread(self._stop.wait)
        finally:
            await self.loop.stop()
            with contextlib.suppress(Exception):
                await self.source.close()

    # -- the prefill boost, from the scheduler's thread ----------------------------------------

    @property
    def boost_classes(self) -> frozenset[str]:
        """The classes whose streamed requests run their prefill at the top clock."""
        clock = self.loop.sm_clock
        return clock.boost_classes if clock is not None else frozenset()

    def boost(self, req_id: str) -> None:
        """This request's prefill runs at the top clock until `unboost` (DeviceClock.boost)."""
        self._call(self._boost, req_id)

    def unboost(self, req_id: str) -> None:
        self._call(self._unboost, req_id)

    def _call(self, fn: Callable[[str], None], req_id: str) -> None:
        if self._aloop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to lift
                self._aloop.call_soon_threadsafe(fn, req_id)

    def _boost(self, req_id: str) -> None:
        clock = self.loop.sm_clock
        if clock is not None and req_id not in self._boosts:
            self._boosts[req_id] = clock.boost()

    def _unboost(self, req_id: str) -> None:
        boost = self._boosts.pop(req_id, None)
        if boost is not None:
            boost.end()

    # -- one tick, for tests and the loop -----------------------------------------------------

    def tick(self, t_s: float) -> Decision:
        return self.loop.tick(t_s)

    def _extra_text(self) -> str:
        if self.kind != "model":
            return ""
        gpu = self.cfg.power.gpus[0]
        name = f"powerbatch-model:{self.cfg.simulation.model_profile}"
        return self.meter.text(gpu, name)

    def status(self) -> dict[str, Any]:
        return self.loop.status()


def _energy_accounting(ct: ControlThread, model_name: str) -> EnergyAccounting:
    """Energy per request from the engine's steps (powerbatch_vllm.energy), settled each tick."""
    engine = EngineEnergy(ct.stats, model_name or "unknown")
    return EnergyAccounting(
        ct.monitor, ct.controller.model, ct.metrics.energy, ct.cfg.energy, pull=engine.pull
    )
