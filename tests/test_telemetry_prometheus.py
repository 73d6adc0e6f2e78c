"""PrometheusPowerSource and UpstreamMetricsScraper against a real local HTTP server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web

from powerbatch.errors import SensorReadError, SensorUnavailable
from powerbatch.telemetry import PowerSource, PrometheusPowerSource, UpstreamMetricsScraper

T = TypeVar("T")

GPUS = [
    ("0", "GPU-1d3f0a8e-77b2-4c1a-9a55-0f2c3b9d8e11", "00000000:18:00.0"),
    ("1", "GPU-8a2b9c4d-1e5f-4a6b-8c7d-2e9f0a1b3c44", "00000000:2A:00.0"),
    ("2", "GPU-0c9d8e7f-6a5b-4c3d-2e1f-0a9b8c7d6e55", "00000000:3B:00.0"),
]


def dcgm_family(name: str, help_text: str, kind: str, values: list[str]) -> str:
    """One metric family as dcgm-exporter writes it, one line per GPU."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for (gpu, uuid, bus), value in zip(GPUS, values, strict=True):
        labels = (
            f'gpu="{gpu}",UUID="{uuid}",pci_bus_id="{bus}",device="nvidia{gpu}",'
            f'modelName="NVIDIA H200",Hostname="node-7",DCGM_FI_DRIVER_VERSION="565.57.01"'
        )
        lines.append(f"{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


DCGM = (
    dcgm_family("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "gauge", ["1980"] * 3)
    + dcgm_family(
        "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", ["512.25", "430.5", "88.0"]
    )
    + dcgm_family(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "Total energy consumption since boot (in mJ).",
        "counter",
        ["91234567890", "81234567000", "1000000"],
    )
)

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 123456.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7000.0
vllm:generation_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 30.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.5
"""


def serve(
    body: str, test: Callable[[str], Awaitable[T]], *, status: int = 200, delay_s: float = 0.0
) -> T:
    """Run `test(url)` against a real aiohttp server on 127.0.0.1 returning `body`."""

    async def handler(_: web.Request) -> web.Response:
        if delay_s:
            await asyncio.sleep(delay_s)
        return web.Response(text=body, status=status, content_type="text/plain")

    async def main() -> T:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await test(f"http://127.0.0.1:{port}/metrics")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


async def read_once(url: str, **kwargs: Any) -> Any:
    source = PrometheusPowerSource(url, **kwargs)
    try:
        return await source.read()
    finally:
        await source.close()


def test_sums_all_gpus_and_energy_without_filter() -> None:
    sample = serve(DCGM, read_once)
    assert sample.power_w == pytest.approx(512.25 + 430.5 + 88.0)
    assert sample.energy_j == pytest.approx((91234567890 + 81234567000 + 1000000) / 1000)


def test_label_filter_with_list_and_single_value() -> None:
    async def both(url: str) -> tuple[Any, Any]:
        pair = await read_once(url, labels={"gpu": ["0", "1"]})
        single = await read_once(url, labels={"gpu": "2", "Hostname": "node-7"})
        return pair, single

    pair, single = serve(DCGM, both)
    assert pair.power_w == pytest.approx(942.75)
    assert pair.energy_j == pytest.approx((91234567890 + 81234567000) / 1000)
    assert single.power_w == pytest.approx(88.0)
    assert single.energy_j == pytest.approx(1000.0)


def test_energy_absent_or_disabled_is_none() -> None:
    no_energy = "\n".join(line for line in DCGM.splitlines() if "ENERGY" not in line) + "\n"
    assert serve(no_energy, read_once).energy_j is None
    assert serve(DCGM, lambda url: read_once(url, energy_metric=None)).energy_j is None


def test_a_listed_gpu_missing_from_the_scrape_is_an_error() -> None:
    with pytest.raises(SensorReadError, match="'7'"):
        serve(DCGM, lambda url: read_once(url, labels={"gpu": ["0", "7"]}))


def test_missing_metric_and_no_match_are_read_errors() -> None:
    with pytest.raises(SensorReadError, match="absent"):
        serve(DCGM, lambda url: read_once(url, metric="DCGM_FI_DEV_POWER_USAGE_INSTANT"))
    with pytest.raises(SensorReadError, match="matches"):
        serve(DCGM, lambda url: read_once(url, labels={"Hostname": "node-8"}))


def test_nan_power_is_a_read_error() -> None:
    body = DCGM.replace("} 430.5", "} NaN")
    with pytest.raises(SensorReadError, match="not finite"):
        serve(body, read_once)


def test_http_error_and_garbage_are_read_errors() -> None:
    with pytest.raises(SensorReadError, match="500"):
        serve(DCGM, read_once, status=500)
    with pytest.raises(SensorReadError, match="not Prometheus"):
        serve("<html><body>502 Bad Gateway</body></html>", read_once)


def test_server_down_is_unavailable() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago, now closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SensorUnavailable):
        asyncio.run(read_once(f"http://127.0.0.1:{port}/metrics"))


def test_timeout_is_unavailable() -> None:
    with pytest.raises(SensorUnavailable, match="did not answer"):
        serve(DCGM, lambda url: read_once(url, timeout_s=0.1), delay_s=1.0)


def test_injected_session_is_not_closed() -> None:
    async def run(url: str) -> bool:
        async with aiohttp.ClientSession() as session:
            source = PrometheusPowerSource(url, session=session)
            assert isinstance(source, PowerSource)
            await source.read()
            await source.close()
            return session.closed

    assert serve(DCGM, run) is False


async def scrape_once(url: str) -> Any:
    scraper = UpstreamMetricsScraper(url)
    try:
        return await scraper.scrape()
    finally:
        await scraper.close()


def test_upstream_scraper_reads_vllm_metrics() -> None:
    signals = serve(VLLM, scrape_once)
    assert signals.requests_running == 21.0
    assert signals.requests_waiting == 3.0
    assert signals.kv_cache_usage == pytest.approx(0.375)  # a fraction: averaged over engines
    assert signals.requests_started_total == 42.0  # the TTFT histogram's count, every engine
    assert signals.generation_tokens_total == 7500.0  # tokens generated, every engine
    # Metrics the server does not export come back as None, not as zero.
    only_running = "\n".join(VLLM.splitlines()[:4]) + "\n"
    partial = serve(only_running, scrape_once)
    assert partial.requests_running == 21.0
    assert partial.requests_waiting is None
    assert partial.kv_cache_usage is None
    assert partial.requests_started_total is None
    assert partial.generation_tokens_total is None


def test_upstream_scraper_errors() -> None:
    with pytest.raises(SensorReadError):
        serve(VLLM, scrape_once, status=503)
    with pytest.raises(SensorReadError, match="not finite"):
        serve(VLLM.replace("} 0.25", "} NaN"), scrape_once)
