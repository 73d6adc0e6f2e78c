"""The load client's drain: it waits for every answer that can still count, and no longer."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from aiohttp import web
from conftest import run, serve

from powerbatch.load import PlannedRequest, RequestResult, run_load
from powerbatch.load.client import InFlight

TTFT_SLO_S, TPOT_SLO_S = 0.5, 0.1


def test_the_drain_never_gives_up_on_an_answer_that_would_count() -> None:
    """Drawn answers: one that ends within both SLOs was `may_meet` at every moment before its
    end, so stopping the wait where `may_meet` fails everywhere loses no goodput."""
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(5000):
        max_tokens = int(rng.integers(2, 300))
        tokens = int(rng.integers(2, max_tokens + 1))
        ttft_s = float(rng.uniform(0, 2 * TTFT_SLO_S))
        e2e_s = ttft_s + float(rng.uniform(0, 2 * TPOT_SLO_S)) * (tokens - 1)
        r = RequestResult(0.0, "high", 0, 200, ttft_s, e2e_s, 8, tokens)
        seen = InFlight(max_tokens, sent_s=100.0)
        if not r.within_slo(TTFT_SLO_S, TPOT_SLO_S):
            continue
        checked += 1
        for now_s in np.linspace(100.0, 100.0 + e2e_s, 20):
            seen.first_token_s = 100.0 + ttft_s if now_s >= 100.0 + ttft_s else None
            assert seen.may_meet(now_s, TTFT_SLO_S, TPOT_SLO_S), (r, now_s)
    assert checked > 1000


def test_a_request_not_yet_sent_may_still_meet_and_a_late_one_may_not() -> None:
    assert InFlight(10).may_meet(1e9, TTFT_SLO_S, TPOT_SLO_S)
    late = InFlight(10, sent_s=0.0)
    assert late.may_meet(TTFT_SLO_S, TTFT_SLO_S, TPOT_SLO_S)
    assert not late.may_meet(TTFT_SLO_S + 0.01, TTFT_SLO_S, TPOT_SLO_S)
    late.first_token_s = 0.1
    assert late.may_meet(0.1 + 9 * TPOT_SLO_S, TTFT_SLO_S, TPOT_SLO_S)
    assert not late.may_meet(0.1 + 9 * TPOT_SLO_S + 0.01, TTFT_SLO_S, TPOT_SLO_S)


def _app() -> web.Application:
    """Streams: `x-priority: slow` sends one token and stalls (it can no longer count after
    (max_tokens - 1) x TPOT SLO), `x-priority: late` stalls 1 s there; any other sends its
    tokens at 20 ms each and ends."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            chunk = '{"choices":[{"delta":{"content":"t"}}]}'
            await resp.write(f"data: {chunk}\n\n".encode())
            if i == 0:
                await asyncio.sleep(
                    {"slow": 3600.0, "late": 1.0}.get(request.headers["x-priority"], 0.0)
                )
            await asyncio.sleep(0.02)
        usage = f'{{"choices":[],"usage":{{"completion_tokens":{n}}}}}'
        await resp.write(f"data: {usage}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _load_against_app(
    max_tokens: dict[str, int], finish_s: float | None = None
) -> tuple[list[RequestResult], float]:
    """One stream per `x-priority` at once against `_app`, the SLOs above, a 60-s drain cap:
    what came back, and the wall time `run_load` took."""

    async def go() -> tuple[list[RequestResult], float]:
        runner, url = await serve(_app())
        try:
            plan = [PlannedRequest(0.0, p, 32, n, True, 0) for p, n in max_tokens.items()]
            t0 = time.monotonic()
            results = await run_load(
                url,
                plan,
                drain_timeout_s=60.0,
                slo_s=(TTFT_SLO_S, TPOT_SLO_S),
                finish_s=finish_s,
            )
            return results, time.monotonic() - t0
        finally:
            await runner.cleanup()

    out: tuple[list[RequestResult], float] = run(go())
    return out


def test_run_load_waits_for_answers_that_may_count_then_stops() -> None:
    """A stalled answer ends the wait once it cannot count (0.4 s after its first token), not
    at the 60-s timeout; a 1.5-s answer that counts is waited for and recorded."""

    results, wall_s = _load_against_app({"slow": 5, "high": 75})
    assert [r.priority for r in results] == ["high"]
    assert results[0].within_slo(TTFT_SLO_S, TPOT_SLO_S) and results[0].output_tokens == 75
    assert 1.4 < wall_s < 10.0


def test_the_finish_records_the_answers_that_cannot_count_as_late() -> None:
    """With `finish_s`, the wait goes on past the last answer that could count: the 1-s stall
    ends late and is recorded so (tokens and joules need it); the endless one is still cut off
    when the finish runs out, and the answer that counts is not marked."""

    results, wall_s = _load_against_app({"slow": 5, "late": 5, "high": 5}, finish_s=2.0)
    by = {r.priority: r for r in results}
    assert sorted(by) == ["high", "late"]
    assert not by["high"].late and by["high"].within_slo(TTFT_SLO_S, TPOT_SLO_S)
    assert by["late"].late and by["late"].output_tokens == 5
    assert 2.3 < wall_s < 10.0  # the 0.4 s the stalls could still count, then the whole finish
