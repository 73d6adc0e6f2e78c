"""`powerbatch serve`: build the proxy from settings, run it, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from aiohttp import web

from powerbatch.admission import AdmissionQueue
from powerbatch.control import ControlConfig, Controller, Limits
from powerbatch.errors import ConfigError
from powerbatch.proxy import Governor, ProxyMetrics, ProxySettings, create_app
from powerbatch.telemetry import (
    NvmlPowerSource,
    PowerMonitor,
    PowerSource,
    PrometheusPowerSource,
    ReplayPowerSource,
    UpstreamMetricsScraper,
)
from powerbatch.telemetry.trace import write_trace

log = logging.getLogger("powerbatch")


def make_power_source(o: dict[str, Any]) -> PowerSource:
    gpus = [g.strip() for g in str(o["gpus"]).split(",") if g.strip()]
    kind = o["power_source"]
    if kind == "nvml":
        try:
            return NvmlPowerSource([int(g) for g in gpus])
        except ValueError as exc:
            raise ConfigError(f"--gpus must be integers for NVML, got {o['gpus']!r}") from exc
    if kind == "dcgm":
        url = o["dcgm_url"] or o["upstream"].rstrip("/") + "/metrics"
        return PrometheusPowerSource(url, metric=o["dcgm_metric"], labels={"gpu": gpus})
    if kind == "replay":
        if not o["replay_trace"]:
            raise ConfigError("--power-source replay needs --replay-trace")
        return ReplayPowerSource(o["replay_trace"], clock="wall")
    raise ConfigError(f"unknown power source {kind!r}")


def build(o: dict[str, Any]) -> tuple[web.Application, Governor]:
    """The whole proxy from resolved settings (see powerbatch.cli.options)."""
    if not o.get("upstream"):
        raise ConfigError("--upstream is required")
    if o.get("ceiling_w") is None:
        raise ConfigError("--ceiling-w is required")
    cfg = ControlConfig(
        ceiling_w=o["ceiling_w"],
        margin_w=o["margin_w"],
        max_w=o["max_w"],
        tick_hz=o["tick_hz"],
        min_batch=o["min_batch"],
        max_batch=o["max_batch"],
        initial_batch=o["initial_batch"],
        safe_batch=o["safe_batch"],
        max_kv_tokens=o["max_kv_tokens"],
        confidence=o["confidence"],
        warmup_s=o["warmup_s"],
        mode=o["mode"],
        ttft_slo_s=o["ttft_slo_s"],
        tpot_slo_s=o["tpot_slo_s"],
        prefill_pacing=o["prefill_pacing"],
    )
    controller = Controller(cfg)
    initial = Limits(cfg.initial_batch, cfg.max_kv_tokens, None)
    if cfg.mode == "observe":
        initial = Limits(cfg.max_batch, cfg.max_kv_tokens, None)
    waits = {"high": o["max_wait_s"], "normal": o["max_wait_s"]}
    waits["low"] = o["max_wait_s"] * (10 if o["valley_fill"] else 1)
    queue = AdmissionQueue(
        initial, max_queue_len=o["max_queue_len"], max_wait_s=waits, valley_fill=o["valley_fill"]
    )
    plausible = o["max_plausible_w"] or 3.0 * cfg.ceiling_w
    monitor = PowerMonitor(
        make_power_source(o),
        interval_s=o["power_interval_s"],
        stale_after_s=o["stale_after_s"],
        max_plausible_w=plausible,
    )
    scraper = None
    if o["upstream_metrics"]:
        scraper = UpstreamMetricsScraper(o["upstream"].rstrip("/") + "/metrics")
    averaged = o["power_source"] == "dcgm" and "INSTANT" not in o["dcgm_metric"].upper()
    gov = Governor(
        controller,
        queue,
        monitor,
        ProxyMetrics(),
        upstream_scraper=scraper,
        source_averages=averaged,
    )
    settings = ProxySettings(
        upstream_url=o["upstream"],
        max_body_bytes=o["max_body_bytes"],
        default_max_tokens=o["default_max_tokens"],
        read_timeout_s=o["read_timeout_s"],
    )
    return create_app(gov, settings), gov


async def serve(o: dict[str, Any]) -> None:
    """Run until SIGTERM/SIGINT; then stop admitting, let in-flight work finish, and exit."""
    app, gov = build(o)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, o["host"], o["port"])
    await site.start()
    log.info(
        "powerbatch listening on http://%s:%s -> %s, ceiling %.0f W (%s)",
        o["host"],
        o["port"],
        o["upstream"],
        o["ceiling_w"],
        o["mode"],
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining: %d in flight, %d queued", gov.queue.in_flight, gov.queue.queued)
    gov.queue.drain()
    try:
        async with asyncio.timeout(o["drain_grace_s"]):
            await gov.queue.wait_idle()
    except TimeoutError:
        log.warning("drain grace over with %d still in flight", gov.queue.in_flight)
    if o["record_trace"]:
        n = write_trace(o["record_trace"], gov.trace_rows())
        log.info("wrote %d trace rows to %s", n, o["record_trace"])
    await runner.cleanup()
