"""The simulator's HTTP API against the official openai client, raw HTTP and Prometheus parsing."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from helpers import async_wait_until
from prometheus_client.parser import text_string_to_metric_families

from powerbatch.sim import SimEngine
from powerbatch.sim.server import SimServer, dump_trace_csv, start_sim_server
from powerbatch.telemetry.trace import read_trace

T = TypeVar("T")


def with_server(
    body: Callable[[SimServer], Awaitable[T]],
    *,
    timeout_s: float = 15.0,
    app_kwargs: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> T:
    async def main() -> T:
        server = await start_sim_server(SimEngine(**engine_kwargs), **(app_kwargs or {}))
        try:
            return await body(server)
        finally:
            await server.close()

    coro: Coroutine[Any, Any, T] = asyncio.wait_for(main(), timeout_s)
    return asyncio.run(coro)


def client(server: SimServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_openai_chat_non_stream() -> None:
    async def body(server: SimServer) -> None:
        async with client(server) as c:
            r = await c.chat.completions.create(
                model="sim-llama",
                messages=[{"role": "user", "content": "x" * 400}],
                max_tokens=12,
            )
        assert r.object == "chat.completion"
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content
        assert r.usage is not None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (100, 12)
        assert r.usage.total_tokens == 112
        assert server.engine.generation_tokens_total == 12

    with_server(body)


def test_openai_completions_non_stream_and_default_max_tokens() -> None:
    async def body(server: SimServer) -> None:
        async with client(server) as c:
            r = await c.completions.create(model="sim-llama", prompt="hello world!")
        assert r.object == "text_completion"
        assert r.usage is not None and r.usage.completion_tokens == 20
        assert r.usage.prompt_tokens == 3
        assert r.choices[0].text

    # max_model_len 23 caps the default 256 to 23 - 3 prompt tokens.
    with_server(body, app_kwargs={"max_model_len": 23})


def test_openai_chat_stream_with_usage() -> None:
    async def body(server: SimServer) -> None:
        async with client(server) as c:
            stream = await c.chat.completions.create(
                model="sim-llama",
                messages=[
                    {"role": "system", "content": "abcd"},
                    {"role": "user", "content": "efgh"},
                ],
                max_tokens=9,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        content = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(content) == 9  # stream_interval_tokens=1: one event per token
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and finishes.count("length") == 1
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 9
        assert chunks[-1].usage.prompt_tokens == 2
        assert all(c.object == "chat.completion.chunk" for c in chunks)

    with_server(body)


def test_raw_sse_format_and_coalescing() -> None:
    async def body(server: SimServer) -> list[bytes]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                server.url + "/v1/completions",
                json={"prompt": "abcdefgh", "max_tokens": 20, "stream": True},
            ) as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return [line async for line in r.content]

    lines = with_server(body, app_kwargs={"stream_interval_tokens": 8})
    events = [line for line in lines if line.strip()]
    assert all(line.startswith(b"data: ") and line.endswith(b"\n") for line in events)
    assert b"".join(lines).endswith(b"data: [DONE]\n\n")
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    texts = [p["choices"][0]["text"] for p in payloads]
    # 20 tokens in events of 8 after the first, sent at once as vLLM does: 1, 8, 8, 3 (the
    # last carries finish_reason).
    assert [len(t.split()) for t in texts] == [1, 8, 8, 3]
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, None, "length"]
    assert all(p["object"] == "text_completion" for p in payloads)


def test_validation_errors() -> None:
    async def body(server: SimServer) -> list[tuple[int, dict[str, Any]]]:
        out = []
        url = server.url + "/v1/chat/completions"
        cases: list[Any] = [
            b"{not json",
            json.dumps({"messages": []}).encode(),
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
            json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}
            ).encode(),
            json.dumps(
                {"model": "other", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            json.dumps({"messages": [{"role": "user", "content": "x" * 40_000}]}).encode(),
        ]
        async with aiohttp.ClientSession() as s:
            for data in cases:
                async with s.post(url, data=data) as r:
                    out.append((r.status, await r.json()))
        return out

    results = with_server(body)
    assert [status for status, _ in results] == [400, 400, 400, 400, 404, 400]
    for _, err in results:
        assert set(err["error"]) == {"message", "type", "param", "code"}
    assert results[0][1]["error"]["type"] == "invalid_request_error"
    assert results[2][1]["error"]["param"] == "max_tokens"
    assert "context length" in results[5][1]["error"]["message"]


def test_queue_limit_answers_503() -> None:
    async def body(server: SimServer) -> int:
        server.engine.add_request(10, 10_000)
        await asyncio.sleep(0.05)  # let the engine admit it
        server.engine.add_request(10, 10_000)  # waits: max_num_seqs=1
        async with aiohttp.ClientSession() as s:
            payload = {"prompt": "hi", "max_tokens": 5}
            async with s.post(server.url + "/v1/completions", json=payload) as r:
                assert (await r.json())["error"]["code"] == 503
                return r.status

    assert with_server(body, max_num_seqs=1, max_num_queued_reqs=1) == 503


def test_models_health_state() -> None:
    async def body(server: SimServer) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
            async with s.get(server.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "sim-llama"
            async with s.get(server.url + "/sim/state") as r:
                state = await r.json()
        assert state["profile"] == "h100-llama8b"
        assert state["running"] == 0 and state["power_w"] == 78.0

    with_server(body)


METRIC_NAMES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_count",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_POWER_USAGE_INSTANT",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
}


def test_metrics_names_and_values() -> None:
    async def body(server: SimServer) -> tuple[str, float, float]:
        async with client(server) as c:
            await c.completions.create(model="sim-llama", prompt="x" * 40, max_tokens=7)
        before_j = server.engine.energy_j()
        async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
            assert r.status == 200
            return await r.text(), before_j, server.engine.energy_j()

    text, before_j, after_j = with_server(body, profile="h100x4-llama70b")
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    assert set(samples) >= METRIC_NAMES
    # Exact names on the wire, as vLLM and dcgm-exporter write them.
    for name in METRIC_NAMES:
        assert any(line.startswith(name + "{") for line in text.splitlines()), name
    assert samples["vllm:generation_tokens_total"][0].value == 7
    assert samples["vllm:prompt_tokens_total"][0].value == 10
    assert samples["vllm:time_to_first_token_seconds_count"][0].value == 1  # one request started
    assert samples["vllm:num_requests_running"][0].labels == {"model_name": "sim-llama"}
    power = samples["DCGM_FI_DEV_POWER_USAGE"]
    assert sorted(s.labels["gpu"] for s in power) == ["0", "1", "2", "3"]
    assert {"gpu", "UUID", "modelName"} <= set(power[0].labels)
    energy_mj = sum(s.value for s in samples["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"])
    # The counter as of the scrape: between the readings taken around it (the GPUs idle on).
    assert before_j - 1e-6 <= energy_mj / 1000 <= after_j + 1e-6  # summed per GPU: rounding
    total_avg_w = sum(s.value for s in power)
    assert 4 * 78.0 <= total_avg_w <= 2800.0


def _dcgm(text: str) -> tuple[float, float, float]:
    """The 1-s mean, the instant power and the energy, summed over the GPUs."""
    sums = dict.fromkeys(
        (
            "DCGM_FI_DEV_POWER_USAGE",
            "DCGM_FI_DEV_POWER_USAGE_INSTANT",
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        ),
        0.0,
    )
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    mean_w, instant_w, energy_mj = sums.values()
    return mean_w, instant_w, energy_mj


@pytest.mark.parametrize("interval_s", [0.0, 0.4])
def test_dcgm_fields_are_held_for_the_exporters_collect_interval(interval_s: float) -> None:
    # dcgm-exporter serves its last collection between collections; vLLM's metrics are live.
    async def body(server: SimServer) -> tuple[list[tuple[float, float, float]], float]:
        scrapes = []
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            for _ in range(12):
                async with s.get(server.url + "/metrics") as r:
                    scrapes.append(_dcgm(await r.text()))
                await asyncio.sleep(0.05)
        return scrapes, time.monotonic() - t0

    values, elapsed_s = with_server(body, app_kwargs={"dcgm_interval_s": interval_s})
    changes = sum(a != b for a, b in itertools.pairwise(values))
    if interval_s == 0:
        assert changes == len(values) - 1  # the energy counter moves at every scrape
    else:  # a change per collection the scrapes spanned, and no more
        assert 1 <= changes <= math.ceil(elapsed_s / interval_s), (changes, elapsed_s)


def test_power_limit_admin_endpoint() -> None:
    async def body(server: SimServer) -> list[float]:
        url = server.url + "/sim/power_limit"
        async with aiohttp.ClientSession() as s:
            for bad in ({"power_limit_w": -1}, {"power_limit_w": "x"}, {"power_limit_w": 5000}):
                async with s.post(url, json=bad) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == "power_limit_w"
            async with s.post(url, json={"power_limit_w": 350.0}) as r:
                assert r.status == 200 and (await r.json())["power_limit_w"] == 350.0
            async with s.get(url) as r:
                assert (await r.json())["power_limit_w"] == 350.0
            t0 = server.engine.energy_j()
            async with client(server) as c:
                await asyncio.gather(
                    *(
                        c.completions.create(model="sim-llama", prompt="y" * 8000, max_tokens=3)
                        for _ in range(4)
                    )
                )
            assert t0 < server.engine.energy_j()
            async with s.get(server.url + "/sim/trace", params={"since_s": "0"}) as r:
                trace = await r.json()
        assert set(trace) >= {"t_s", "step_s", "power_w", "prefill_tokens", "decode_tokens"}
        return [p for p, n in zip(trace["power_w"], trace["prefill_tokens"], strict=True) if n]

    prefill_powers = with_server(body)
    assert prefill_powers and max(prefill_powers) == pytest.approx(350.0)


def test_client_disconnect_mid_stream_frees_slot() -> None:
    async def body(server: SimServer) -> None:
        engine = server.engine
        async with aiohttp.ClientSession() as s:
            r = await s.post(
                server.url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "z" * 400}],
                    "max_tokens": 5000,
                    "stream": True,
                },
            )
            for _ in range(4):
                await r.content.readline()
            assert engine.num_running == 1 and engine.kv_tokens > 0
            r.close()  # hang up
        await async_wait_until(lambda: engine.num_running == 0, 2.0, "the hung-up request aborted")
        assert engine.kv_tokens == 0
        assert engine.requests_aborted == 1

    with_server(body)


def test_client_disconnect_non_stream_frees_slot() -> None:
    async def body(server: SimServer) -> None:
        engine = server.engine
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(
                s.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 5000})
            )
            await async_wait_until(lambda: engine.num_running, 2.0, "the request running")
            task.cancel()
        await async_wait_until(
            lambda: engine.num_running == 0, 2.0, "the cancelled request aborted"
        )
        assert engine.kv_tokens == 0

    with_server(body)


def test_dump_trace_csv(tmp_path: Path) -> None:
    async def body(server: SimServer) -> int:
        async with client(server) as c:
            await c.completions.create(model="sim-llama", prompt="q" * 100, max_tokens=10)
        return dump_trace_csv(server.engine, tmp_path / "trace.csv")

    count = with_server(body)
    rows = list(read_trace(tmp_path / "trace.csv"))
    assert len(rows) == count and count >= 10
    decode = [r for r in rows if r.decode_tok_s]
    assert len(decode) == 9  # the first token comes from the prefill step
    assert all(r.energy_j is not None for r in rows)
    assert all(
        b.t_s >= a.t_s and (b.energy_j or 0) >= (a.energy_j or 0)
        for a, b in itertools.pairwise(rows)
    )
    assert not any(math.isnan(r.power_w) for r in rows)
