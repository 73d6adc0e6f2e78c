"""The simulator's zeusd API, end to end over HTTP on 127.0.0.1 with powerbatch's own zeusd client
(ZeusdLimiter, ZeusdPowerSource): per-GPU limits within constraints, applied after ~100 ms, seen
by the throttle, in /metrics and in the step trace; the bearer token."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import run
from prometheus_client.parser import text_string_to_metric_families

from powerbatch.cli.main import build_parser
from powerbatch.errors import LimiterPermissionDenied
from powerbatch.sim import SimEngine
from powerbatch.sim.gpu_model import PROFILES, step_time_s
from powerbatch.sim.server import SimServer, start_sim_server
from powerbatch.telemetry.limiter import ZeusdLimiter
from powerbatch.telemetry.zeusd import ZeusdPowerSource

TOKEN = "sim-token-0123"


def with_sim(body: Callable[[SimServer], Awaitable[Any]], token: str | None = TOKEN) -> Any:
    async def main() -> Any:
        engine = SimEngine("h100x4-llama70b", seed=3)
        server = await start_sim_server(engine, zeusd_token=token)
        try:
            return await body(server)
        finally:
            await server.close()

    return run(main())


async def limits_in_metrics(server: SimServer) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        if family.name == "DCGM_FI_DEV_POWER_MGMT_LIMIT":
            return {sample.labels["gpu"]: sample.value for sample in family.samples}
    raise AssertionError("no DCGM_FI_DEV_POWER_MGMT_LIMIT in /metrics")


def test_limiter_and_power_source_against_the_sim(tmp_path: Path) -> None:
    async def body(server: SimServer) -> None:
        engine = server.engine
        limiter = ZeusdLimiter(server.url, [0, 1, 2, 3], token=TOKEN, state_dir=tmp_path)
        await limiter.start()
        assert limiter.constraints_w() == [(200.0, 700.0)] * 4  # an H100's, per GPU
        assert limiter.default_w() == [700.0] * 4
        assert await limits_in_metrics(server) == {str(i): 700.0 for i in range(4)}

        t0 = time.monotonic()
        assert await limiter.set_total_w(1600.0) == pytest.approx(1600.0)
        assert time.monotonic() - t0 >= 0.09  # the change takes ~100 ms, not no time
        assert engine.power_limit_w == pytest.approx(1600.0)
        assert engine.gpu_power_limits_w == [400.0] * 4
        assert await limits_in_metrics(server) == {str(i): 400.0 for i in range(4)}

        source = ZeusdPowerSource(server.url, [0, 1, 2, 3], token=TOKEN)
        sample = await source.read()
        assert 4 * 78.0 - 200 < sample.power_w < 4 * 78.0 + 400  # idle, with sensor noise
        assert sample.energy_j is not None and sample.energy_j >= 0
        await source.close()

        # The throttle sees it: a step under load stays at the new limit, and the trace says so.
        request = engine.add_request(4000, 4)
        await request.wait_tokens(4)
        busy = [r for r in engine.trace if r.prefill_tokens or r.decode_tokens]
        assert busy and all(r.power_limit_w == pytest.approx(1600.0) for r in busy)
        assert max(r.power_w for r in busy) <= 1600.0 + 1e-6
        async with aiohttp.ClientSession() as s, s.get(server.url + "/sim/trace") as r:
            assert 1600.0 in (await r.json())["power_limit_w"]

        await limiter.restore()
        assert engine.power_limit_w == pytest.approx(2800.0)
        assert not limiter.state_file.exists()
        await limiter.close()

    with_sim(body)


def test_a_restart_under_a_lowered_limit_restores_the_device_default(tmp_path: Path) -> None:
    # A container restarted after a crash, its state file lost (it was in the container's /tmp):
    # the GPUs still carry the lowered cap. The default is the device's, not what is in force.
    async def body(server: SimServer) -> None:
        engine = server.engine
        for gpu in range(4):
            engine.set_gpu_power_limit_w(gpu, 300.0)
        limiter = ZeusdLimiter(server.url, [0, 1, 2, 3], token=TOKEN, state_dir=tmp_path)
        await limiter.start()
        assert not limiter.recovered  # no state file: nothing to recover
        assert engine.gpu_power_limits_w == [300.0] * 4  # a clean start changes nothing
        assert limiter.default_w() == [700.0] * 4  # the H100's max, its boot default
        await limiter.set_total_w(1000.0)
        record = json.loads(limiter.state_file.path.read_text())
        assert record["restore_w"] == [700.0] * 4
        await limiter.restore()
        assert await limits_in_metrics(server) == {str(i): 700.0 for i in range(4)}
        await limiter.close()

    with_sim(body)


def test_a_non_blocking_change_lands_after_about_100_ms() -> None:
    async def body(server: SimServer) -> list[float]:
        params = {"gpu_ids": "0,1", "power_limit_mw": "300000", "block": "false"}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.post(server.url + "/gpu/set_power_limit", params=params) as r:
                assert r.status == 200
            before = server.engine.gpu_power_limits_w
            await asyncio.sleep(0.2)
            async with s.get(server.url + "/gpu/get_power_limit") as r:
                after = await r.json()
        assert before == [700.0] * 4
        assert after == {
            "0": {"power_limit_mw": 300000},
            "1": {"power_limit_mw": 300000},
            "2": {"power_limit_mw": 700000},
            "3": {"power_limit_mw": 700000},
        }
        # Tensor-parallel GPUs step together: the lowest limit paces the set.
        return [server.engine.power_limit_w]

    assert with_sim(body) == [pytest.approx(1200.0)]


def test_constraints_and_bad_input_are_zeusd_style_400s() -> None:
    async def body(server: SimServer) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        url = server.url + "/gpu/set_power_limit"
        async with aiohttp.ClientSession(headers=headers) as s:
            for mw in ("150000", "700001"):
                params = {"gpu_ids": "0,3", "power_limit_mw": mw, "block": "true"}
                async with s.post(url, params=params) as r:
                    assert r.status == 400
                    assert set((await r.json())["errors"]) == {"0", "3"}
            for params in (
                {"gpu_ids": "7", "power_limit_mw": "300000", "block": "true"},
                {"power_limit_mw": "300000", "block": "true"},
                {"gpu_ids": "0", "power_limit_mw": "lots", "block": "true"},
            ):
                async with s.post(url, params=params) as r:
                    assert r.status == 400
            async with s.get(
                server.url + "/gpu/get_power_limit_constraints", params={"gpu_ids": "2"}
            ) as r:
                assert await r.json() == {
                    "2": {"min_power_limit_mw": 200000, "max_power_limit_mw": 700000}
                }
        assert server.engine.gpu_power_limits_w == [700.0] * 4

    with_sim(body)


def test_the_token_guards_gpu_routes_not_discovery(tmp_path: Path) -> None:
    async def body(server: SimServer) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/discover") as r:
                discovered = await r.json()
            assert discovered["auth_required"] is True
            assert [g["id"] for g in discovered["gpus"]] == [0, 1, 2, 3]
            assert {"gpu-read", "gpu-control"} <= set(discovered["enabled_api_groups"])
            for path in ("/gpu/get_power_limit", "/gpu/get_power"):
                async with s.get(server.url + path) as r:
                    assert r.status == 401
            wrong = {"Authorization": "Bearer nope"}
            async with s.get(server.url + "/gpu/get_power", headers=wrong) as r:
                assert r.status == 401
        limiter = ZeusdLimiter(server.url, [0], state_dir=tmp_path)
        with pytest.raises(LimiterPermissionDenied):
            await limiter.start()
        await limiter.close()

    with_sim(body)


def test_stream_power_is_sse_per_gpu_and_open_without_a_token() -> None:
    async def body(server: SimServer) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        async with (
            aiohttp.ClientSession() as s,
            s.get(server.url + "/gpu/stream_power", params={"gpu_ids": "1,2"}) as r,
        ):
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 4:
                    break
        return events

    events = with_sim(body, token=None)
    assert [e["gpu_id"] for e in events] == [1, 2, 1, 2]
    assert all(e["power_mw"] >= 0 and e["timestamp_ms"] > 0 for e in events)


def test_a_power_limit_slows_prefill_more_than_decode() -> None:
    """Prefill is compute-bound and slows about in proportion to the cut; decode is memory-bound
    and loses little (Patel et al., "Characterizing Power Management Opportunities for LLMs in
    the Cloud", ASPLOS'24)."""
    profile = PROFILES["h100-llama8b"]
    limit_w = 450.0
    prefill_free, _ = step_time_s(profile, 0, 4096)
    prefill_capped, _ = step_time_s(profile, 0, 4096, power_limit_w=limit_w)
    decode_free, _ = step_time_s(profile, 256, 0)
    decode_capped, _ = step_time_s(profile, 256, 0, power_limit_w=limit_w)
    prefill_slowdown = prefill_capped / prefill_free
    decode_slowdown = decode_capped / decode_free
    assert prefill_slowdown > decode_slowdown > 1.0
    assert prefill_slowdown > 1.3 and decode_slowdown < 1.3


def test_sim_cli_takes_a_zeusd_token() -> None:
    args = build_parser().parse_args(["sim", "--zeusd-token", "abc"])
    assert args.zeusd_token == "abc"
    assert build_parser().parse_args(["sim"]).zeusd_token is None
