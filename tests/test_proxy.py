"""The proxy end to end on loopback: the official openai client through powerbatch to the
simulated server, plus the ways a request can go wrong."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from conftest import FuncPowerSource, run, serve
from helpers import async_wait_until

from powerbatch.cli.serve import build
from powerbatch.cli.settings import SERVE, ServeSettings
from powerbatch.proxy import Governor
from powerbatch.settings import load
from powerbatch.sim import SimEngine
from powerbatch.sim.server import SimServer, start_sim_server


def options(upstream: str, **overrides: Any) -> ServeSettings:
    base: dict[str, Any] = {
        "upstream": upstream,
        "ceiling_w": 600.0,
        "warmup_s": 0.5,
        "power_source": "dcgm",
        "dcgm_url": upstream + "/metrics",
    }
    settings: ServeSettings = load(SERVE, overrides=base | overrides)
    return settings


async def _with_stack(
    body: Callable[[SimServer, str, Governor], Awaitable[Any]],
    *,
    stream_interval_tokens: int = 1,
    **overrides: Any,
) -> Any:
    """The simulator with the proxy built from settings in front: run `body`, then clean up."""
    sim = await start_sim_server(SimEngine(seed=3), stream_interval_tokens=stream_interval_tokens)
    app, gov = build(options(sim.url, **overrides))
    runner, url = await serve(app)
    try:
        return await body(sim, url, gov)
    finally:
        await runner.cleanup()
        await sim.close()


def with_stack(body: Callable[[SimServer, str, Governor], Awaitable[Any]], **kw: Any) -> Any:
    return run(_with_stack(body, **kw))


def test_openai_client_streams_and_completes_through_the_proxy() -> None:
    async def body(sim: SimServer, url: str, gov: Governor) -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "hello " * 50}]
        stream = await client.chat.completions.create(
            model="sim-llama",
            messages=msgs,
            max_tokens=12,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            extra_headers={"x-priority": "high"},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 12 and text
        done = await client.chat.completions.create(
            model="sim-llama",
            messages=msgs,
            max_tokens=7,  # type: ignore[arg-type]
        )
        assert done.usage is not None and done.usage.completion_tokens == 7
        plain = await client.completions.create(model="sim-llama", prompt="hi " * 10, max_tokens=5)
        assert plain.usage is not None and plain.usage.completion_tokens == 5
        models = await client.models.list()  # passed through, not admission-controlled
        assert [m.id for m in models.data] == ["sim-llama"]
        await client.close()
        assert gov.queue.in_flight == 0
        metrics = gov.metrics.registry
        ttft_count = metrics.get_sample_value("powerbatch_ttft_seconds_count", {"priority": "high"})
        assert ttft_count == 1.0
        tokens = metrics.get_sample_value("powerbatch_output_tokens_total", {"priority": "high"})
        assert tokens == 12.0

    with_stack(body)


def test_bad_input_gets_openai_errors_with_the_right_status() -> None:
    async def body(sim: SimServer, url: str, gov: Governor) -> None:
        async with aiohttp.ClientSession() as s:
            cases: list[tuple[str, bytes, dict[str, str], int, str | None]] = [
                ("/v1/chat/completions", b"{not json", {}, 400, None),
                ("/v1/chat/completions", b"[1, 2]", {}, 400, None),
                ("/v1/chat/completions", b'{"model": "m"}', {}, 400, "messages"),
                (
                    "/v1/chat/completions",
                    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
                    {},
                    400,
                    "max_tokens",
                ),
                (
                    "/v1/chat/completions",
                    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
                    {},
                    400,
                    "max_tokens",
                ),
                (
                    "/v1/chat/completions",
                    b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
                    {},
                    400,
                    "stream",
                ),
                ("/v1/completions", b'{"prompt": 5}', {}, 400, "prompt"),
                (
                    "/v1/chat/completions",
                    b'{"messages": [{"role": "user", "content": "x"}]}',
                    {"x-priority": "urgent"},
                    400,
                    "x-priority",
                ),
                ("/v1/chat/completions", b"x" * (5 * 1024 * 1024), {}, 413, None),
                ("/nope", b"", {}, 404, None),
            ]
            for path, data, headers, status, param in cases:
                async with s.post(url + path, data=data, headers=headers) as resp:
                    payload = await resp.json()
                    assert resp.status == status, (path, data[:40], resp.status, payload)
                    err = payload["error"]
                    assert err["message"] and err["type"]
                    if param is not None:
                        assert err["param"] == param
        assert gov.queue.in_flight == 0 and gov.queue.queued == 0

    with_stack(body)


def test_client_disconnect_frees_the_slot_and_the_upstream_request() -> None:
    async def body(sim: SimServer, url: str, gov: Governor) -> None:
        req = {
            "model": "sim-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2000,
            "stream": True,
        }
        async with aiohttp.ClientSession() as s:
            resp = await s.post(url + "/v1/chat/completions", json=req)
            await resp.content.readuntil(b"\n\n")  # the stream is under way
            assert gov.queue.in_flight == 1 and sim.engine.num_running == 1
            resp.close()  # the client goes away mid-stream
        await async_wait_until(lambda: gov.queue.in_flight == 0, 2.0, "the slot to be released")
        await async_wait_until(
            lambda: sim.engine.num_running == 0, 2.0, "the upstream request cancelled"
        )
        cancelled = gov.metrics.registry.get_sample_value(
            "powerbatch_requests_total", {"priority": "normal", "outcome": "cancelled"}
        )
        assert cancelled == 1.0

    with_stack(body)


def test_operator_endpoints_answer() -> None:
    async def body(sim: SimServer, url: str, gov: Governor) -> None:
        await asyncio.sleep(0.6)  # a few ticks
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200
            async with s.get(url + "/ready") as r:
                assert r.status == 200, await r.text()
            async with s.get(url + "/status") as r:
                status = await r.json()
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
            async with s.get(url + "/status/history") as r:
                history = await r.json()
        assert status["power"]["ceiling_w"] == 600.0
        assert status["power"]["sensor_ok"] is True and status["power"]["measured_w"] > 0
        assert status["limits"]["enforced"]["max_requests"] >= 1
        assert set(status["multipliers"]) == {"power", "latency", "kv"}
        assert status["binding"] in ("warmup", "none", "power", "demand", "latency", "max_batch")
        for name in (
            "powerbatch_power_watts",
            "powerbatch_limit_requests",
            "powerbatch_binding_constraint",
            "powerbatch_ttft_seconds_bucket",
        ):
            assert name in metrics
        assert len(history["t_s"]) >= 2

    with_stack(body)


def test_upstream_down_is_503_and_the_proxy_recovers() -> None:
    async def main() -> None:
        sim = await start_sim_server(SimEngine(seed=1))
        port = sim.port
        app, gov = build(options(sim.url))
        runner, url = await serve(app)
        body = {
            "model": "sim-llama",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
        }
        try:
            await sim.close()
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == "upstream_unavailable"
                assert gov.queue.in_flight == 0
                sim = await start_sim_server(SimEngine(seed=2), port=port)  # back again
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
            await sim.close()

    run(main())


def test_upstream_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()  # the upstream process dies
        return resp

    async def main() -> None:
        stub = web.Application()
        stub.router.add_post("/v1/chat/completions", broken)
        stub_runner, stub_url = await serve(stub)
        app, gov = build(options(stub_url))
        runner, url = await serve(app)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    raw = await r.read()
            events = [e for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
            assert events[0].startswith(b"data: {")
            last = json.loads(events[-1][len(b"data: ") :])
            assert "upstream" in last["error"]["message"]
            assert gov.queue.in_flight == 0
        finally:
            await runner.cleanup()
            await stub_runner.cleanup()

    run(main())


def test_governor_limits_what_reaches_the_upstream() -> None:
    """A fake GPU whose watts follow what is in flight: the limit must settle where it fits."""

    async def main() -> None:
        sim = await start_sim_server(SimEngine(seed=5))
        app, gov = build(
            options(
                sim.url,
                ceiling_w=300.0,
                warmup_s=0.5,
                initial_batch=2,
                prefill_pacing=False,
                upstream_metrics=False,
            )
        )
        gov.monitor.source = FuncPowerSource(lambda: 100.0 + 25.0 * gov.queue.in_flight)
        runner, url = await serve(app)
        peak = 0
        try:
            async with aiohttp.ClientSession() as s:

                async def one() -> int:
                    nonlocal peak
                    body = {"messages": [{"role": "user", "content": "x " * 20}], "max_tokens": 40}
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        peak = max(peak, sim.engine.num_running + sim.engine.num_waiting)
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*(one() for _ in range(150)))
            assert statuses.count(200) == 150
            # 300 W allows 8 in flight; the margin, dead band and noise make it fewer.
            assert peak <= 8, peak
            assert gov.queue.in_flight == 0
            assert gov.last is not None and gov.last.binding in ("power", "none", "demand")
        finally:
            await runner.cleanup()
            await sim.close()

    run(main())


@pytest.mark.parametrize("metric", ["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_USAGE_INSTANT"])
def test_a_step_in_an_exporters_one_second_mean_is_not_held_back(metric: str) -> None:
    """dcgm-exporter serves one collection until the next. A median filter over polls of a
    held value sees no spread, so it would call every new 1-second mean an outlier and hold
    it back for half its window: the mean is used as read. Instant readings are despiked."""
    watts = {"now": 500.0}

    async def metrics(request: web.Request) -> web.Response:
        text = f'# TYPE {metric} gauge\n{metric}{{gpu="0"}} {watts["now"]}\n'
        return web.Response(text=text)

    async def main() -> list[float | None]:
        stub = web.Application()
        stub.router.add_get("/metrics", metrics)
        stub_runner, stub_url = await serve(stub)
        _, gov = build(options(stub_url, dcgm_metric=metric, upstream_metrics=False))
        monitor = gov.loop.monitor
        seen: list[float | None] = []
        try:
            await monitor.start()
            await asyncio.sleep(1.2)  # a full window of polls of the held value
            watts["now"] = 600.0
            await asyncio.sleep(0.15)  # one or two polls of the new collection
            seen.append(monitor.snapshot().filtered_w)
        finally:
            await monitor.stop()
            await stub_runner.cleanup()
        return seen

    (after_step_w,) = run(main())
    if metric.endswith("INSTANT"):
        assert after_step_w == 500.0  # a lone jump in instant readings is despiked
    else:
        assert after_step_w == 600.0


def test_a_whole_answer_gives_the_laws_no_first_token() -> None:
    """A whole answer's client sees its first token with its last: the proxy never sees when
    it came. Its end, taken for a first token, read a long answer's 15 s as a TTFT far over the
    SLO, and the SM clock's guard and the fleet bid's risk acted on it (docs/clock.md, stop 53).
    A stream's first token is seen, and counted."""

    async def body(sim: SimServer, url: str, gov: Governor) -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs: Any = [{"role": "user", "content": "hello"}]
        for _ in range(3):
            await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=40)
        lat = gov.latency.snapshot(asyncio.get_running_loop().time())
        assert lat.samples == 0, lat
        stream = await client.chat.completions.create(
            model="sim-llama", messages=msgs, max_tokens=40, stream=True
        )
        async for _ in stream:
            pass
        await client.close()
        lat = gov.latency.snapshot(asyncio.get_running_loop().time())
        assert lat.samples == 1, lat

    with_stack(body)
