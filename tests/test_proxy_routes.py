"""The proxy's routes and outcome accounting, as an operator meets them on the first day."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from conftest import run, serve
from faults import Behaviour, chat_body, running_proxy, upstream
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import _with_stack

from powerbatch.admission import PRIORITIES, REJECTION_REASONS
from powerbatch.proxy import Governor
from powerbatch.proxy.app import POOLING_PATHS
from powerbatch.proxy.parse import parse_pooling_request
from powerbatch.sim import SimEngine
from powerbatch.sim.server import EMBEDDING_DIM, SimServer, start_sim_server


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

    run(_with_stack(body, stream_interval_tokens=4))


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


class _CountingUpstream:
    """Answers any POST after a pause and records the most requests it held at once."""

    def __init__(self) -> None:
        self.active = 0
        self.max_active = 0
        self.paths: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(0.05)
        finally:
            self.active -= 1
        return web.json_response({"object": "list", "data": [], "usage": {"prompt_tokens": 1}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


def test_embeddings_and_every_pooling_route_go_through_admission() -> None:
    """Batch limit 2: 20 concurrent embeddings never put more than 2 upstream, and all answer.
    Every other pooling route is admitted too; metadata routes are not."""

    async def main() -> None:
        stub = _CountingUpstream()
        stub_runner, stub_url = await serve(stub.app())
        try:
            async with running_proxy(stub_url, batch=2) as p, aiohttp.ClientSession() as s:

                async def embed(i: int) -> int:
                    body = {"model": "m", "input": f"text number {i} " * 20}
                    async with s.post(p.url + "/v1/embeddings", json=body) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*(embed(i) for i in range(20)))
                assert statuses == [200] * 20
                assert stub.max_active <= 2, stub.max_active
                admitted = p.gov.queue.stats.admitted_total
                assert sum(admitted.values()) == 20
                for path in POOLING_PATHS:
                    body = {"model": "m", "query": "q", "documents": ["a", "b"]}
                    async with s.post(p.url + path, json=body) as r:
                        assert r.status == 200, (path, await r.text())
                assert sum(admitted.values()) == 20 + len(POOLING_PATHS)
                for path in ("/version", "/tokenize", "/detokenize", "/v1/models"):
                    method = "GET" if path in ("/version", "/v1/models") else "POST"
                    async with s.request(method, p.url + path, json={"prompt": "x"}) as r:
                        assert r.status == 200, (path, await r.text())
                assert sum(admitted.values()) == 20 + len(POOLING_PATHS)
                assert stub.paths[-4:] == ["/version", "/tokenize", "/detokenize", "/v1/models"]
                assert p.gov.queue.in_flight == 0
        finally:
            await stub_runner.cleanup()

    run(main())


def test_pooling_estimate_is_prefill_only_and_counts_each_pair() -> None:
    one = parse_pooling_request(json.dumps({"input": "x" * 400}).encode())
    assert (one.prompt_tokens, one.max_tokens, one.kv_tokens, one.stream) == (100, 0, 100, False)
    many = parse_pooling_request(json.dumps({"input": ["x" * 40] * 5}).encode())
    assert many.prompt_tokens == 50
    ids = parse_pooling_request(json.dumps({"input": [[1, 2, 3], [4, 5]]}).encode())
    assert ids.prompt_tokens == 5
    # A reranker runs the query with each document: 3 pairs of (40 + 20) characters.
    rerank = parse_pooling_request(
        json.dumps({"query": "q" * 40, "documents": ["d" * 20] * 3}).encode()
    )
    assert rerank.prompt_tokens == (3 * 40 + 3 * 20) // 4


def test_the_simulator_serves_embeddings_as_prefill_only_jobs() -> None:
    """The job holds the engine (in flight, prefill power) and decodes nothing."""

    async def main() -> None:
        sim = await start_sim_server(SimEngine(seed=2))
        eng = sim.engine
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "sim-llama", "input": ["word " * 800, "word " * 400]}
                task = asyncio.ensure_future(s.post(sim.url + "/v1/embeddings", json=body))
                seen_running, seen_power = 0, 0.0
                while not task.done():
                    seen_running = max(seen_running, eng.num_running + eng.num_waiting)
                    seen_power = max(seen_power, eng.power_w())
                    await asyncio.sleep(0)
                async with task.result() as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
                assert out["usage"] == {"prompt_tokens": 1500, "total_tokens": 1500}
                assert [d["index"] for d in out["data"]] == [0, 1]
                assert all(len(d["embedding"]) == EMBEDDING_DIM for d in out["data"])
                assert seen_running == 2 and seen_power > eng.profile.idle_w
                assert eng.prompt_tokens_total == 1500 and eng.generation_tokens_total == 0
                assert eng.num_running == 0 and eng.kv_tokens == 0
                bad = {"model": "other", "input": "x"}
                async with s.post(sim.url + "/v1/embeddings", json=bad) as r:
                    assert r.status == 404
        finally:
            await sim.close()

    run(main())


def test_a_cookie_one_clients_answer_sets_never_goes_upstream_with_anothers_request() -> None:
    """One upstream session serves every client: it keeps no cookies. A client's own Cookie
    header goes up as it is, and the upstream's Set-Cookie comes back to that client only."""
    seen: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        resp = web.json_response({"object": "list", "data": []})
        resp.set_cookie("session", "client-a", path="/")
        return resp

    async def main() -> None:
        app = web.Application()

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        runner, up_url = await serve(app)
        # A host name, not an address: aiohttp's jar keeps no cookies for an IP address.
        host_url = up_url.replace("127.0.0.1", "localhost")
        try:
            async with running_proxy(host_url) as proxy, aiohttp.ClientSession() as s:
                async with s.get(proxy.url + "/v1/models", headers={"Cookie": "mine=a"}) as r:
                    assert r.status == 200 and "session=client-a" in r.headers["Set-Cookie"]
                # another client, no cookies
                async with (
                    aiohttp.ClientSession() as other,
                    other.get(proxy.url + "/v1/models") as r,
                ):
                    assert r.status == 200
        finally:
            await runner.cleanup()
        assert seen == ["mine=a", None]

    run(main())
