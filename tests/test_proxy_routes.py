"""The proxy's routes and outcome accounting, as an operator meets them on the first day."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from conftest import run, serve
from faults import Behaviour, chat_body, running_proxy, upstream
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import options

from powerbatch.admission import PRIORITIES, REJECTION_REASONS
from powerbatch.cli.serve import build
from powerbatch.proxy import Governor
from powerbatch.sim import SimEngine
from powerbatch.sim.server import SimServer, start_sim_server


async def _stack(
    body: Callable[[SimServer, str, Governor], Awaitable[Any]], **overrides: Any
) -> Any:
    sim = await start_sim_server(SimEngine(seed=3), stream_interval_tokens=4)
    app, gov = build(options(sim.url, **overrides))
    runner, url = await serve(app)
    try:
        return await body(sim, url, gov)
    finally:
        await runner.cleanup()
        await sim.close()


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_a_fresh_proxy_exports_every_rejection_series_at_zero() -> None:
    """rate() needs a sample before the first rejection, or it never sees the first burst."""

    async def body(sim: SimServer, url: str, gov: Governor) -> None:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        got = _samples(text, "powerbatch_rejections_total")
        want = {
            (("priority", p), ("reason", reason)): 0.0
            for p in PRIORITIES
            for reason in REJECTION_REASONS
        }
        assert got == want

    run(_stack(body))


def _outcome(gov: Governor, outcome: str) -> float | None:
    return gov.metrics.registry.get_sample_value(
        "powerbatch_requests_total", {"priority": "normal", "outcome": outcome}
    )


def test_an_upstream_4xx_is_a_client_error_not_an_upstream_failure() -> None:
    """The simulator refuses an unknown model (404) and n=2 (400) as vLLM does; a 503 from a
    stub is a real upstream failure. Only the 503 may count as upstream_error."""

    async def main() -> None:
        sim = await start_sim_server(SimEngine(seed=1))
        try:
            async with running_proxy(sim.url) as p, aiohttp.ClientSession() as s:
                msgs = [{"role": "user", "content": "hi"}]
                for extra, status in (({"model": "no-such-model"}, 404), ({"n": 2}, 400)):
                    body = {"model": "sim-llama", "messages": msgs, "max_tokens": 2, **extra}
                    async with s.post(p.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == status, await r.text()
                assert _outcome(p.gov, "upstream_client_error") == 2
                assert _outcome(p.gov, "upstream_error") == 0
        finally:
            await sim.close()
        async with (
            upstream(Behaviour(status=503)) as up,
            running_proxy(up.url) as p,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(p.url + "/v1/chat/completions", json=chat_body()) as r:
                assert r.status == 503
            assert _outcome(p.gov, "upstream_error") == 1
            assert _outcome(p.gov, "upstream_client_error") == 0

    run(main())
