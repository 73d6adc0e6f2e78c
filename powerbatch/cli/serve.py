"""`powerbatch serve`: build the proxy from settings, run it, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web

from powerbatch.admission import AdmissionQueue
from powerbatch.control import ControlConfig, Controller, Limits, prior_max_w
from powerbatch.errors import ConfigError, PowerbatchError
from powerbatch.proxy import Governor, ProxyMetrics, ProxySettings, create_app
from powerbatch.proxy.app import create_admin_app
from powerbatch.proxy.auth import ApiKeys
from powerbatch.telemetry import (
    NvmlPowerLimiter,
    NvmlPowerSource,
    PowerMonitor,
    PowerSource,
    PrometheusPowerSource,
    ReplayPowerSource,
    UpstreamMetricsScraper,
    default_power_limit_w,
)
from powerbatch.telemetry.trace import write_trace

log = logging.getLogger("powerbatch")


def make_power_source(o: dict[str, Any]) -> PowerSource:
    gpus = [g.strip() for g in str(o["gpus"]).split(",") if g.strip()]
    kind = o["power_source"]
    if kind == "nvml":
        return NvmlPowerSource(_gpu_indices(o))
    if kind == "dcgm":
        url = o["dcgm_url"] or o["upstream"].rstrip("/") + "/metrics"
        return PrometheusPowerSource(url, metric=o["dcgm_metric"], labels={"gpu": gpus})
    if kind == "replay":
        if not o["replay_trace"]:
            raise ConfigError("--power-source replay needs --replay-trace")
        return ReplayPowerSource(o["replay_trace"], clock="wall")
    raise ConfigError(f"unknown power source {kind!r}")


def _gpu_indices(o: dict[str, Any]) -> list[int]:
    try:
        return [int(g) for g in str(o["gpus"]).split(",") if g.strip()]
    except ValueError as exc:
        raise ConfigError(f"--gpus must be integers for NVML, got {o['gpus']!r}") from exc


def device_max_w(o: dict[str, Any]) -> float | None:
    """With NVML and no --max-w: the GPUs' own default power limit, for the model's prior."""
    if o.get("max_w") is not None or o["power_source"] != "nvml":
        return None
    tdp_w = default_power_limit_w(_gpu_indices(o))
    if tdp_w is not None and tdp_w < o["ceiling_w"]:
        log.warning(
            "the ceiling (%.0f W) is above the GPUs' power limit (%.0f W): it cannot bind",
            o["ceiling_w"],
            tdp_w,
        )
    return tdp_w


def proxy_settings(o: dict[str, Any]) -> ProxySettings:
    """The proxy's settings, with client keys loaded and every timeout checked."""
    for name in ("connect_timeout_s", "headers_timeout_s", "read_timeout_s", "client_timeout_s"):
        if not o.get(name, 1.0) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {o[name]}")
    defaults = ProxySettings(upstream_url=o["upstream"])
    return ProxySettings(
        upstream_url=o["upstream"],
        max_body_bytes=o["max_body_bytes"],
        default_max_tokens=o["default_max_tokens"],
        max_tokens_limit=o.get("max_tokens_limit") or defaults.max_tokens_limit,
        connect_timeout_s=o.get("connect_timeout_s") or defaults.connect_timeout_s,
        headers_timeout_s=o.get("headers_timeout_s") or defaults.headers_timeout_s,
        read_timeout_s=o["read_timeout_s"],
        client_timeout_s=o.get("client_timeout_s") or defaults.client_timeout_s,
        api_keys=ApiKeys.load(o.get("api_keys"), o.get("api_keys_file")),
        upstream_api_key=o.get("upstream_api_key") or None,
        admin_on_main=o.get("admin_port") is None,
    )


def build_admin(o: dict[str, Any], gov: Governor) -> web.Application | None:
    """The admin listener's app when --admin-port is set."""
    if o.get("admin_port") is None:
        return None
    return create_admin_app(gov, proxy_settings(o))


def start_backstop(o: dict[str, Any]) -> NvmlPowerLimiter | None:
    """With --hardware-backstop, set the GPUs' NVML power limit to the ceiling.

    A second line of defence under the controller: if powerbatch or its sensor misbehaves, the
    driver itself still holds the set at the ceiling. The limit is clamped to what the device
    accepts and read back; `stop_backstop` puts the previous limits back.
    """
    if not o.get("hardware_backstop"):
        return None
    limiter = NvmlPowerLimiter(_gpu_indices(o))
    try:
        in_force_w = limiter.set_total_limit_w(o["ceiling_w"])
    except BaseException:
        with contextlib.suppress(Exception):
            limiter.restore()
        limiter.close()
        raise
    lo_w = sum(lo for lo, _ in limiter.constraints_w())
    if in_force_w > o["ceiling_w"] + 0.5:
        log.warning(
            "hardware backstop: the GPUs' lowest allowed power limit (%.0f W) is above the "
            "ceiling; %.0f W is in force, the controller alone keeps the ceiling",
            lo_w,
            in_force_w,
        )
    else:
        log.info("hardware backstop: NVML power limit %.0f W in force", in_force_w)
    return limiter


def stop_backstop(limiter: NvmlPowerLimiter | None) -> None:
    if limiter is None:
        return
    try:
        limiter.restore()
        log.info("hardware backstop: previous NVML power limits restored")
    except PowerbatchError as exc:
        log.error("hardware backstop: could not restore the power limits: %s", exc)
    finally:
        limiter.close()


def build(o: dict[str, Any]) -> tuple[web.Application, Governor]:
    """The whole proxy from resolved settings (see powerbatch.cli.options)."""
    if not o.get("upstream"):
        raise ConfigError("--upstream is required")
    if o.get("ceiling_w") is None:
        raise ConfigError("--ceiling-w is required")
    if o.get("hardware_backstop") and o["power_source"] != "nvml":
        raise ConfigError(
            "--hardware-backstop sets the limit through NVML: it needs --power-source nvml"
        )
    settings = proxy_settings(o)
    cfg = ControlConfig(
        ceiling_w=o["ceiling_w"],
        margin_w=o["margin_w"],
        max_w=prior_max_w(o["max_w"], device_max_w(o), o["ceiling_w"]),
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
    return create_app(gov, settings), gov


async def serve(o: dict[str, Any], stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set); then drain and exit.

    Draining: admission closes (new and queued requests get 503), in-flight requests get
    `drain_grace_s` to finish, then the listeners close and the hardware limit is restored.
    """
    app, gov = build(o)
    admin = build_admin(o, gov)
    limiter = start_backstop(o)
    runners: list[web.AppRunner] = []
    try:
        # The drain below already waited for in-flight work; cleanup need not wait long again.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
        runners.append(runner)
        await runner.setup()
        await web.TCPSite(runner, o["host"], o["port"]).start()
        if admin is not None:
            admin_runner = web.AppRunner(admin, access_log=None, shutdown_timeout=1)
            runners.append(admin_runner)
            await admin_runner.setup()
            await web.TCPSite(admin_runner, o["admin_host"], o["admin_port"]).start()
            log.info("admin endpoints on http://%s:%s", o["admin_host"], o["admin_port"])
        log.info(
            "powerbatch listening on http://%s:%s -> %s, ceiling %.0f W (%s)%s",
            o["host"],
            o["port"],
            o["upstream"],
            o["ceiling_w"],
            o["mode"],
            ", client API keys required" if o.get("api_keys") or o.get("api_keys_file") else "",
        )
        if stop is None:
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
    finally:
        for r in reversed(runners):
            await r.cleanup()
        await gov.monitor.source.close()  # the monitor leaves its source to its owner: us
        if gov.scraper is not None:
            await gov.scraper.close()  # likewise the upstream scraper's HTTP session
        stop_backstop(limiter)
