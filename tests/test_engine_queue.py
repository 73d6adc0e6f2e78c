"""The engine's own queue and start rate, from its scraped counts and the proxy's."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from conftest import run, serve

from powerbatch.cli.serve import build
from powerbatch.cli.settings import SERVE
from powerbatch.control.engine_queue import GENERATED_KEPT_S, MISSES_KEPT, EngineQueue
from powerbatch.settings import load
from powerbatch.sim import SimEngine
from powerbatch.sim.server import start_sim_server
from powerbatch.telemetry import UpstreamSignals
from powerbatch.telemetry.prometheus import UpstreamMetricsScraper


def signals(t_s: float, running: float, waiting: float, started: float | None) -> UpstreamSignals:
    return UpstreamSignals(running, waiting, 0.5, t_s, requests_started_total=started)


def test_the_start_rate_is_the_engines_own_count_wherever_it_begins() -> None:
    q = EngineQueue()
    # The engine has started 1,000 requests before this proxy: only differences count.
    q.update(signals(0.0, 10, 2, 1000.0), admitted=12, in_flight=12)
    assert q.load is None  # one scrape measures no rate: nothing to size a buffer by
    q.update(signals(2.0, 25, 3, 1008.0), admitted=40, in_flight=28)
    assert q.load is not None and q.load.queued == 3  # what the next step will not start
    assert q.load.start_rate == pytest.approx(4.0)  # 8 in 2 s: the first rate, unsmoothed
    assert q.load.in_flight == 28
    q.update(signals(3.0, 25, 3, 1018.0), admitted=50, in_flight=28)
    assert q.load is not None and q.load.start_rate == pytest.approx(4.0 + 0.3 * 6.0)


def test_an_engine_without_a_ttft_histogram_is_timed_by_what_it_was_sent() -> None:
    q = EngineQueue()
    q.update(signals(0.0, 10, 0, None), admitted=10, in_flight=10)
    q.update(signals(1.0, 16, 4, None), admitted=20, in_flight=20)
    assert q.load is not None and q.load.queued == 4
    assert q.load.start_rate == pytest.approx(10.0)
    kept = q.load
    for _ in range(MISSES_KEPT):  # a scrape or two lost: the last load holds, as it was
        q.update(None, admitted=20, in_flight=20)
        assert q.load is kept
    q.update(None, admitted=20, in_flight=20)  # one more: an engine without metrics, no load
    assert q.load is None
    q.update(signals(3.0, 16, 0, None), admitted=30, in_flight=16)
    assert q.load is None  # measured anew from here
    q.update(signals(4.0, 16, 0, None), admitted=36, in_flight=16)
    assert q.load is not None and q.load.start_rate == pytest.approx(6.0)


def test_a_lost_scrape_neither_drops_the_load_nor_skews_the_rate() -> None:
    q = EngineQueue()
    q.update(signals(0.0, 4, 0, 100.0), admitted=4, in_flight=4)
    q.update(signals(1.0, 4, 6, 104.0), admitted=10, in_flight=10)
    q.update(None, admitted=12, in_flight=12)  # the scrape at 2 s timed out
    assert q.load is not None and q.load.t_s == 1.0  # the law sees no new scrape to act on
    q.update(signals(3.0, 4, 6, 112.0), admitted=14, in_flight=10)
    assert q.load is not None and q.load.start_rate == pytest.approx(4.0)  # 8 over 2 s


def test_the_time_per_token_is_the_inter_token_latency_over_a_requests_decode_time() -> None:
    q = EngineQueue()

    def at(t_s: float, itl_sum_s: float, itl_count: float, finished: float) -> UpstreamSignals:
        return UpstreamSignals(
            50,
            0,
            0.5,
            t_s,
            requests_started_total=t_s,
            itl_sum_s=itl_sum_s,
            itl_count=itl_count,
            decode_sum_s=10.0 * finished,  # every request decodes for 10 s
            decode_count=finished,
        )

    q.update(at(0.0, 300.0, 5_000.0, 7), admitted=40, in_flight=40)
    q.update(at(0.5, 325.0, 5_250.0, 7), admitted=40, in_flight=40)
    # No request has finished since the proxy began: no decode time to average over.
    assert q.load is not None and q.load.token_s is None and q.load.step_s == pytest.approx(0.1)
    # 25 request-seconds waited for tokens in 0.5 s: 50 requests decoding, the step's batch.
    assert q.load.step_batch == pytest.approx(50.0)
    q.update(at(1.0, 350.0, 5_500.0, 9), admitted=60, in_flight=60)
    # 250 tokens after a first in 0.5 s, 25 s waited for them: 0.1 s a token.
    assert q.load is not None and q.load.token_s == pytest.approx(0.1)
    assert q.load.step_s == pytest.approx(0.1)
    # One slow second (0.5 s a token, a prefill burst): the step now says so at once, the
    # average over a request's tokens (425 / 2 then 397.5 / 1.4 of them) a little.
    q.update(at(2.0, 400.0, 5_600.0, 9), admitted=60, in_flight=60)
    assert q.load is not None and q.load.step_s == pytest.approx(0.1 + 0.3 * 0.4)
    assert q.load.step_batch == pytest.approx(50.0)  # 50 request-seconds in 1 s: still 50

    def decay(steps: float, tokens: float) -> tuple[float, float]:
        x = steps / tokens
        return math.exp(-x), (1.0 - math.exp(-x)) / x

    (k1, o1), (k2, o2) = decay(5.0, 425.0 / 2.0), decay(2.0, 397.5 / 1.4)
    total = k2 * (k1 * 25.0 + o1 * 25.0) + o2 * 50.0
    count = k2 * (k1 * 250.0 + o1 * 250.0) + o2 * 100.0
    assert q.load.token_s == pytest.approx(total / count)
    assert q.load.token_s < q.load.step_s  # the slow steps are 2 of the 12 it knows
    q.update(at(3.0, 1.0, 10.0, 0), admitted=60, in_flight=5)  # the engine restarted
    assert q.load is not None and q.load.token_s is None and q.load.step_s is None
    assert q.load.step_batch is None
    q.update(UpstreamSignals(5, 0, 0.5, 4.0, 4.0), admitted=60, in_flight=5)
    assert q.load is not None and q.load.token_s is None  # an engine without the histogram


@pytest.mark.parametrize("law", [True, False])
def test_work_the_engine_cannot_start_waits_in_the_proxy_where_a_stream_goes_first(
    law: bool,
) -> None:
    """An engine that runs two requests at a time, a backlog of batch-class work, then a few
    interactive streams: the streams' first tokens come after a buffer's worth of the backlog,
    not after all of it (the engine's own queue is first come, first served).

    The buffer follows the start rate the proxy measures, which a busy machine's late scrapes
    can inflate; so the check is on what was held when the streams came: they go ahead of all
    of it, and it is a good part of the backlog."""

    async def main() -> tuple[list[int], int, int, int]:
        sim = await start_sim_server(SimEngine(seed=5, max_num_seqs=2), stream_interval_tokens=1)
        settings = load(
            SERVE,
            overrides={
                "upstream": sim.url,
                "ceiling_w": 5000.0,  # power never binds: only the engine's queue holds work
                "warmup_s": 0.5,
                "initial_batch": 64,  # nothing else holds the backlog back
                "power_source": "dcgm",
                "dcgm_url": sim.url + "/metrics",
            }
            | ({} if law else {"engine_min_buffer": 10_000}),  # a buffer that never fills
        )
        app, gov = build(settings)
        runner, url = await serve(app)
        done = 0
        try:
            async with aiohttp.ClientSession() as s:

                async def low() -> None:
                    nonlocal done
                    body = {"messages": [{"role": "user", "content": "x " * 20}], "max_tokens": 60}
                    async with s.post(
                        url + "/v1/chat/completions", json=body, headers={"x-priority": "low"}
                    ) as r:
                        await r.read()
                        assert r.status == 200
                    done += 1

                async def high() -> int:
                    body = {
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4,
                        "stream": True,
                    }
                    async with s.post(
                        url + "/v1/chat/completions", json=body, headers={"x-priority": "high"}
                    ) as r:
                        assert r.status == 200
                        await r.content.readline()  # the first token's event
                        before = done
                        await r.read()
                        return before

                lows = []
                # A backlog that builds for 3.2 s, seen by three scrapes; with the law, on for
                # up to as long again until it holds some (a busy machine's scrapes come late,
                # and what the engine was sent before the law measured it stays there).
                while len(lows) < LOWS or (law and gov.queue.queued < 5 and len(lows) < 2 * LOWS):
                    lows.append(asyncio.create_task(low()))
                    await asyncio.sleep(0.08)
                held = gov.queue.queued  # what waits in the proxy as the streams come
                before = await asyncio.gather(*(high() for _ in range(3)))
                await asyncio.gather(*lows)
            return before, held, len(lows), gov.queue.in_flight
        finally:
            await runner.cleanup()
            await gov.monitor.source.close()  # `powerbatch serve` closes these on exit
            if gov.scraper is not None:
                await gov.scraper.close()
            await sim.close()

    before, held, sent, in_flight = run(main())
    assert in_flight == 0
    if law:  # a good part of the backlog waited here, and the streams went ahead of all of it
        assert held >= 5, (held, sent)
        # (+2: a low or two that finish between the count and the streams' arrival)
        assert max(before) <= sent - held + 2, (before, held, sent)
    else:  # the engine's own queue: all but the last of the backlog finish first
        assert held == 0 and sent == LOWS
        assert min(before) >= LOWS - 3, before


LOWS = 40


def test_the_engines_time_per_token_reaches_status_from_its_scraped_histogram() -> None:
    """The wiring: the sim's `vllm:inter_token_latency_seconds`, scraped by the proxy, averaged
    over the answers' decode time, is what `/status` shows and the latency law reads."""

    async def main() -> tuple[float | None, float]:
        engine = SimEngine(seed=3)
        sim = await start_sim_server(engine, stream_interval_tokens=1)
        settings = load(
            SERVE,
            overrides={
                "upstream": sim.url,
                "ceiling_w": 5000.0,
                "warmup_s": 0.2,
                "power_source": "dcgm",
                "dcgm_url": sim.url + "/metrics",
            },
        )
        app, gov = build(settings)
        runner, url = await serve(app)
        try:
            async with aiohttp.ClientSession() as s:

                async def one() -> None:
                    body = {"messages": [{"role": "user", "content": "x " * 30}], "max_tokens": 120}
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        await r.read()

                for _ in range(3):  # answers keep coming through three scrapes or more
                    await asyncio.gather(*(one() for _ in range(8)))
                async with s.get(url + "/status") as r:
                    status = await r.json()
            return status["upstream"]["token_s"], engine.itl_total_s / engine.itl_count
        finally:
            await runner.cleanup()
            await gov.monitor.source.close()
            if gov.scraper is not None:
                await gov.scraper.close()
            await sim.close()

    token_s, engine_mean_s = run(main())
    assert token_s is not None
    assert token_s == pytest.approx(engine_mean_s, rel=0.5)


def test_the_engines_generated_tokens_are_kept_a_few_seconds_and_begin_again_on_a_restart() -> None:
    q = EngineQueue()

    def scrape(t_s: float, generated: float | None) -> None:
        up = UpstreamSignals(
            4, 0, 0.5, t_s, requests_started_total=t_s, generation_tokens_total=generated
        )
        q.update(up, admitted=4, in_flight=4)

    for t in range(15):
        scrape(float(t), 1000.0 + 300.0 * t)
    assert q.load is not None
    assert q.load.generated[0] == (
        float(14 - GENERATED_KEPT_S),
        1000.0 + 300.0 * (14 - GENERATED_KEPT_S),
    )
    assert q.load.generated[-1] == (14.0, 1000.0 + 300.0 * 14)
    scrape(15.0, 20.0)  # the engine restarted: its counter begins again
    assert q.load is not None and q.load.generated == ((15.0, 20.0),)
    scrape(16.0, None)  # an engine that does not export it
    assert q.load is not None and q.load.generated == ()


def test_the_sims_generated_tokens_reach_the_proxy_through_a_scrape() -> None:
    async def main() -> tuple[float, ...]:
        engine = SimEngine(seed=3)
        sim = await start_sim_server(engine)
        scraper = UpstreamMetricsScraper(sim.url + "/metrics")
        try:
            before = (await scraper.scrape()).generation_tokens_total
            engine.add_request(50, 40)
            while engine.step() is not None:
                pass
            after = (await scraper.scrape()).generation_tokens_total
            assert before is not None and after is not None
            return before, after, float(engine.generation_tokens_total)
        finally:
            await scraper.close()
            await sim.close()

    before, after, total = run(main())
    assert after - before == 40 and after == total


def test_a_prefill_burst_reads_as_what_a_request_spanning_it_shows_not_as_the_burst() -> None:
    """Answers of 16 tokens decode in 0.32 s at 0.02 s a step; one second of 0.28-s steps (a
    burst's prompts prefilled under a cap) slows each request decoding through it by 3.6
    steps: its TPOT is (3.6 × 0.28 + 12.4 × 0.02) / 16 = 0.078 s, under a 0.1-s SLO. Averaged
    over a decode *time* of 0.32 s, the engine's time per token read 0.18 s, and the latency
    law held a fleet member's batch while its queue grew (docs/fleet.md, stop 50)."""
    q = EngineQueue()
    batch, t, itl_s, itl_n, finished = 50, 0.0, 0.0, 0.0, 0.0

    def scrape(step_s: float) -> None:
        nonlocal t, itl_s, itl_n, finished
        t += 1.0
        steps = 1.0 / step_s
        itl_s, itl_n = itl_s + batch * 1.0, itl_n + batch * steps
        finished += batch * steps / 16.0
        up = UpstreamSignals(
            batch, 0, 0.5, t, requests_started_total=finished, itl_sum_s=itl_s,
            itl_count=itl_n, decode_sum_s=0.32 * finished, decode_count=finished,
        )  # fmt: skip
        q.update(up, admitted=int(finished) + batch, in_flight=batch)

    for _ in range(10):
        scrape(0.02)
    assert q.load is not None and q.load.token_s == pytest.approx(0.02)
    scrape(0.28)
    spanning = (3.6 * 0.28 + 12.4 * 0.02) / 16.0
    assert q.load is not None and q.load.step_s is not None and q.load.step_s > 0.09
    assert q.load.token_s is not None and 0.8 * spanning < q.load.token_s < 0.1


def test_the_first_finished_request_averages_every_step_since_decoding_began() -> None:
    """Before any request has finished, the average must keep what it has seen: the requests
    running have decoded through all of it. Forgetting each interval made the first reading,
    at the first finished request, one interval alone: a fleet member's first reading was a
    prefill burst's 0.16-s step, the latency law cut its batch from 82 to 61 on it, and 98 of
    its 237 requests then missed their first token (the hardware split's: 21;
    docs/fleet.md, stop 54)."""
    q = EngineQueue()
    batch, t, itl_s, itl_n = 50, 0.0, 0.0, 0.0

    def scrape(step_s: float, finished: float) -> None:
        nonlocal t, itl_s, itl_n
        t += 1.0
        itl_s, itl_n = itl_s + batch * 1.0, itl_n + batch / step_s
        up = UpstreamSignals(
            batch, 0, 0.5, t, requests_started_total=batch, itl_sum_s=itl_s,
            itl_count=itl_n, decode_sum_s=5.0 * finished, decode_count=finished,
        )  # fmt: skip
        q.update(up, admitted=batch, in_flight=batch)

    for _ in range(5):
        scrape(0.02, 0.0)
    assert q.load is not None and q.load.token_s is None  # nothing finished: no horizon yet
    scrape(0.2, 1.0)  # a burst's slow second, and the first request ends (250 tokens)
    # Every step so far: 5 s at 50 tokens a second, 1 s at 5, per request.
    mean = 6.0 / (5 * 50.0 + 5.0)
    assert q.load is not None and q.load.token_s is not None
    assert q.load.token_s == pytest.approx(mean, rel=0.1)
    assert q.load.token_s < 0.05 < q.load.step_s
