"""The proxy's routes and outcome accounting, as an operator meets them on the first day."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from conftest import run, serve
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
