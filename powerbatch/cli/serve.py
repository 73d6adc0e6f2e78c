"""`powerbatch serve`: build the proxy from settings, run it, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
from types import ModuleType

from aiohttp import web

from powerbatch.admission import AdmissionQueue
from powerbatch.cli.settings import ServeSettings
from powerbatch.control import AdmissionLimits, prior_max_w
from powerbatch.control.controller import Controller
from powerbatch.control.record import open_trace
from powerbatch.errors import ConfigError, PowerbatchError, TelemetryError
from powerbatch.fleet import attach, join
from powerbatch.proxy import Governor, ProxyMetrics, create_app
from powerbatch.proxy.app import create_admin_app
from powerbatch.shape.runner import plan_runner
from powerbatch.telemetry import NvmlLimiter, PowerSource, UpstreamMetricsScraper, factory

log = logging.getLogger("powerbatch")


def source_kind(s: ServeSettings, *, nvml: ModuleType | None = None) -> str:
    """The configured source; `auto` is NVML where it sees GPUs (a GPU node), else dcgm."""
    return factory.source_kind(s.power, dcgm_url(s), nvml=nvml)


def dcgm_url(s: ServeSettings) -> str:
    return s.power.dcgm_url or s.proxy.metrics_url


def device_max_w(s: ServeSettings, kind: str) -> float | None:
    """With NVML and no max_w: the GPUs' own default power limit, for the model's prior."""
    tdp_w = factory.device_max_w(s.power, kind, s.control.max_w)
    if tdp_w is not None and tdp_w < s.control.ceiling_w:
        log.warning(
            "the ceiling (%.0f W) is above the GPUs' power limit (%.0f W): it cannot bind",
            s.control.ceiling_w,
            tdp_w,
        )
    return tdp_w


async def probe_power(source: PowerSource, s: ServeSettings, kind: str) -> None:
    """Refuse to start on a power source that yields no reading within `startup_probe_s`.

    Without this, a proxy in front of a real vLLM (whose /metrics has no power) would fail
    closed at the safe batch forever while its clients wonder why it is slow.
    """
    wait_s = s.power.startup_probe_s
    if wait_s <= 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            await source.read()
            return
        except TelemetryError as exc:
            if loop.time() >= deadline:
                raise ConfigError(_no_reading(s, kind, exc)) from None
        await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))


def _no_reading(s: ServeSettings, kind: str, exc: TelemetryError) -> str:
    waited = f"no power reading within {s.power.startup_probe_s:g} s from {kind}: {exc}. "
    if kind == "dcgm":
        auto = " (auto: NVML sees no GPU here)" if s.power.power_source == "auto" else ""
        return waited + (
            f"{dcgm_url(s)} serves no {s.power.dcgm_metric}{auto}. A real vLLM's /metrics has "
            "no power: run on the GPU node with --power-source nvml, or point --dcgm-url at the "
            "node's dcgm-exporter (e.g. http://127.0.0.1:9400/metrics)"
        )
    if kind == "nvml":
        return waited + "Check that the GPUs in --gpus are visible (nvidia-smi) to this process"
    return waited + "Check --replay-trace"


async def start_backstop(s: ServeSettings) -> NvmlLimiter | None:
    """With --hardware-backstop, set the GPUs' NVML power limit to the ceiling.

    A second line of defence under the controller: if powerbatch or its sensor misbehaves, the
    driver itself still holds the set at the ceiling. It goes through the limiter, so the limit
    is clamped to what the device accepts and read back, and a state file records what to put
    back: `stop_backstop` restores the previous limits, and after a crash the next start does.
    """
    if not s.hardware_backstop:
        return None
    ceiling_w = s.control.ceiling_w
    limiter = NvmlLimiter(
        s.power.gpu_indices(), state_dir=s.limiter.limit_state_dir, restore_to="previous"
    )
    try:
        await limiter.start()  # a limit a crashed run left is restored first
        in_force_w = await limiter.set_total_w(ceiling_w)
    except BaseException:
        with contextlib.suppress(Exception):
            await limiter.restore()
        await limiter.close()
        raise
    lo_w = sum(lo for lo, _ in limiter.constraints_w())
    if in_force_w > ceiling_w + 0.5:
        log.warning(
            "hardware backstop: the GPUs' lowest allowed power limit (%.0f W) is above the "
            "ceiling; %.0f W is in force, the controller alone keeps the ceiling",
            lo_w,
            in_force_w,
        )
    else:
        log.info("hardware backstop: NVML power limit %.0f W in force", in_force_w)
    return limiter


async def stop_backstop(limiter: NvmlLimiter | None) -> None:
    if limiter is None:
        return
    try:
        await limiter.restore()
        log.info("hardware backstop: previous NVML power limits restored")
    except PowerbatchError as exc:
        log.error("hardware backstop: could not restore the power limits: %s", exc)
    finally:
        await limiter.close()


def build(s: ServeSettings, kind: str | None = None) -> tuple[web.Application, Governor]:
    """The whole proxy from its settings; `kind` is the resolved power source."""
    kind = kind or source_kind(s)
    s = dataclasses.replace(
        s, limiter=factory.resolve_limiter(s.limiter, backstop=s.hardware_backstop)
    )
    if s.hardware_backstop and kind != "nvml":
        raise ConfigError("--hardware-backstop sets the limit through NVML: it needs nvml")
    cfg = s.control
    max_w = prior_max_w(cfg.max_w, device_max_w(s, kind), cfg.ceiling_w)
    if max_w != cfg.max_w:
        cfg = dataclasses.replace(cfg, max_w=max_w)
    controller = Controller(cfg, shape=s.shape)
    initial = AdmissionLimits(cfg.initial_batch, cfg.max_kv_tokens, None)
    if cfg.mode == "observe":
        initial = AdmissionLimits(cfg.max_batch, cfg.max_kv_tokens, None)
    a = s.admission
    queue = AdmissionQueue(
        initial,
        max_queue_len=a.max_queue_len,
        max_wait_s=a.waits_s(),
        valley_fill=a.valley_fill,
        prefill_burst_s=a.prefill_burst_s,
        lifo_after_s=cfg.ttft_slo_s if a.overload_lifo else None,
    )
    source = factory.make_power_source(s.power, kind, dcgm_url=dcgm_url(s), limiter=s.limiter)
    monitor = factory.make_monitor(s.power, source, kind, cfg.ceiling_w)
    scraper = None
    if s.proxy.upstream_metrics:
        scraper = UpstreamMetricsScraper(s.proxy.metrics_url)
    member = join(s.fleet, s.proxy.port)  # None without --fleet-budget
    client = factory.zeusd_client(s.limiter, s.clock)  # one for the limit and the clock
    gov = Governor(
        controller,
        queue,
        monitor,
        ProxyMetrics(),
        upstream_scraper=scraper,
        source_averages=s.power.averages(kind),
        trace=open_trace(s.trace),
        actuator=factory.make_actuator(
            s.limiter, s.power.gpu_indices(), dcgm_url=dcgm_url(s), client=client
        ),
        sm_clock=factory.make_clock_actuator(
            s.clock, s.limiter, s.power, dcgm_url=dcgm_url(s), client=client
        ),
        clock_policy=s.clock_policy,
        plan=plan_runner(s.shape, controller, queue.counts),
        ceiling=member,
        energy=s.energy,
    )
    attach(member, gov.loop, queue.counts)
    return create_app(gov, s.proxy), gov


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:  # in use, no such address, no permission: a settings problem
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _freeze_startup_heap() -> None:
    """Take what start-up allocated (modules, settings, the model) out of the collector's sight.

    The proxy's heap after start-up is some 90,000 tracked objects, and each full collection
    walked them all: about 50 ms of event loop stalled, several times a minute under load
    (docs/benchmarks.md). Frozen, they are never collected, and a collection walks only what
    the requests allocate (https://docs.python.org/3/library/gc.html#gc.freeze: collect first,
    so no garbage is frozen).
    """
    gc.collect()
    gc.freeze()


async def serve(s: ServeSettings, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set); then drain and exit.

    Draining: admission closes (new and queued requests get 503), in-flight requests get
    `drain_grace_s` to finish, then the listeners close and the hardware limit is restored.
    """
    p = s.proxy
    own = stop is None  # the process's own server (the CLI), not one inside a test
    if stop is None:
        # First: a SIGTERM during start-up or right after "listening" must drain and restore
        # the device limit, not kill the process with its limit set (a test's signal, sent
        # once the log said "listening", raced the handlers installed after that line).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    kind = source_kind(s)
    app, gov = build(s, kind)
    log.info("power source: %s (%s)", kind, gov.monitor.source.name)
    try:
        await probe_power(gov.monitor.source, s, kind)
    except BaseException:
        await gov.monitor.source.close()
        raise
    admin = create_admin_app(gov, p) if p.admin_port is not None else None
    limiter = await start_backstop(s)
    runners: list[web.AppRunner] = []
    try:
        # The drain below already waited for in-flight work; cleanup need not wait long again.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
        runners.append(runner)
        await runner.setup()
        await _listen(runner, p.host, p.port)
        if admin is not None and p.admin_port is not None:
            admin_runner = web.AppRunner(admin, access_log=None, shutdown_timeout=1)
            runners.append(admin_runner)
            await admin_runner.setup()
            await _listen(admin_runner, p.admin_host, p.admin_port)
            log.info("admin endpoints on http://%s:%s", p.admin_host, p.admin_port)
        log.info(
            "powerbatch listening on http://%s:%s -> %s, ceiling %.0f W (%s)%s",
            p.host,
            p.port,
            p.upstream_url,
            s.control.ceiling_w,
            s.control.mode,
            ", client API keys required" if p.api_keys or p.api_keys_file else "",
        )
        if own:
            _freeze_startup_heap()
        await stop.wait()
        log.info("draining: %d in flight, %d queued", gov.queue.in_flight, gov.queue.queued)
        gov.queue.drain()
        try:
            async with asyncio.timeout(p.drain_grace_s):
                await gov.queue.wait_idle()
        except TimeoutError:
            log.warning("drain grace over with %d still in flight", gov.queue.in_flight)
    finally:
        for r in reversed(runners):
            await r.cleanup()
        await gov.monitor.source.close()  # the monitor leaves its source to its owner: us
        if gov.scraper is not None:
            await gov.scraper.close()  # likewise the upstream scraper's HTTP session
        await stop_backstop(limiter)
