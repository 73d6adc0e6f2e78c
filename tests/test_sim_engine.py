"""SimEngine: continuous batching, KV accounting, preemption, energy bookkeeping."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerbatch.errors import ConfigError, PowerLimitError, SensorUnavailable
from powerbatch.sim import PROFILES, ModelPowerSource, SimEngine, SimPowerSource
from powerbatch.sim.engine import QueueFull, RequestTooLarge, SimRequest, StepRecord
from powerbatch.sim.gpu_model import decode_step_s, steady_state, step_at_clock
from powerbatch.telemetry.base import PowerSource

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def drain(engine: SimEngine, max_steps: int = 100_000) -> list[StepRecord]:
    records: list[StepRecord] = []
    for _ in range(max_steps):
        rec = engine.step()
        if rec is None:
            return records
        records.append(rec)
    raise AssertionError("engine did not drain")


def trace_energy_j(engine: SimEngine) -> float:
    return math.fsum(r.power_w * r.step_s for r in engine.trace)


def test_max_num_seqs_is_respected_and_all_finish() -> None:
    engine = SimEngine(max_num_seqs=4)
    reqs = [engine.add_request(20, 10) for _ in range(10)]
    records = drain(engine)
    assert max(r.running for r in records) == 4
    assert all(r.num_output == 10 and r.finish_reason == "length" for r in reqs)
    assert engine.generation_tokens_total == 100
    assert engine.prompt_tokens_total == 200
    # vLLM's inter-token latency: every output after a request's first, the time since its last
    assert engine.itl_count == 10 * 9
    spans = [r.last_token_s - r.first_token_s for r in reqs if r.first_token_s is not None]
    assert engine.itl_total_s == pytest.approx(math.fsum(spans))
    assert engine.decode_count == 10 and engine.decode_total_s == pytest.approx(math.fsum(spans))
    assert engine.kv_tokens == 0 and engine.num_running == 0


def test_fifo_admission() -> None:
    engine = SimEngine(max_num_seqs=2)
    reqs = [engine.add_request(10, 5) for _ in range(6)]
    drain(engine)
    firsts = [r.first_token_s for r in reqs]
    assert all(f is not None for f in firsts)
    assert firsts == sorted(firsts)  # type: ignore[type-var]


def test_token_budget_chunks_prefill() -> None:
    engine = SimEngine(max_num_batched_tokens=100)
    req = engine.add_request(350, 3)
    other = engine.add_request(50, 3)
    records = drain(engine)
    assert all(r.prefill_tokens + r.decode_tokens <= 100 for r in records)
    # 350 prompt tokens need four 100-token steps; the second request waits for budget.
    assert [r.prefill_tokens for r in records[:4]] == [100, 100, 100, 100]
    assert req.num_output == 3 and other.num_output == 3
    assert req.first_token_s is not None and other.first_token_s is not None
    assert req.first_token_s <= other.first_token_s


def test_prefill_pending_says_which_steps_carry_prompt_tokens() -> None:
    # Chunked prompts, a full batch with requests waiting, and decode-only spells between.
    engine = SimEngine(max_num_seqs=3, max_num_batched_tokens=64)
    carried = []
    for k in range(40):
        if k % 7 == 0:
            for n in (1, 150, 30):
                engine.add_request(n, 9)
        pending = engine.prefill_pending
        rec = engine.step()
        assert rec is not None
        carried.append(rec.prefill_tokens > 0)
        assert pending == (rec.prefill_tokens > 0), k
    assert any(carried) and not all(carried)
    # A prompt chunked to one token short: its last prompt token is still prefill.
    engine = SimEngine(max_num_batched_tokens=64)
    engine.add_request(65, 3)
    assert engine.step() is not None and engine.prefill_pending
    rec = engine.step()
    assert rec is not None and rec.prefill_tokens == 1 and not engine.prefill_pending


def test_kv_capacity_forces_preemption_and_requests_still_finish() -> None:
    engine = SimEngine(kv_capacity_tokens=256, block_size=16)
    reqs = [engine.add_request(40, 60) for _ in range(5)]
    records = drain(engine)
    assert engine.preemptions_total > 0
    assert sum(r.preemptions for r in reqs) == engine.preemptions_total
    assert all(r.kv_tokens <= 256 for r in records)
    assert all(r.num_output == 60 for r in reqs)
    # Generated tokens are counted once even when recomputed.
    assert engine.generation_tokens_total == 300
    assert engine.kv_tokens == 0


def test_no_preemption_with_ample_kv() -> None:
    engine = SimEngine()
    for _ in range(5):
        engine.add_request(40, 60)
    drain(engine)
    assert engine.preemptions_total == 0


def test_kv_is_counted_in_blocks() -> None:
    engine = SimEngine(block_size=16)
    engine.add_request(17, 50)
    engine.step()  # prefill 17 tokens -> 2 blocks
    assert engine.kv_tokens == 32
    assert engine.kv_usage == pytest.approx(2 / engine.num_blocks)


def test_abort_frees_kv() -> None:
    engine = SimEngine()
    running = engine.add_request(100, 50)
    waiting_engine = SimEngine(max_num_seqs=1)
    for _ in range(3):
        engine.step()
    assert engine.kv_tokens > 0
    assert engine.abort(running)
    assert engine.kv_tokens == 0 and engine.num_running == 0
    assert running.finish_reason == "abort"
    assert not engine.abort(running)
    assert engine.step() is None
    # A waiting request is dropped from the queue.
    a = waiting_engine.add_request(10, 5)
    b = waiting_engine.add_request(10, 5)
    waiting_engine.step()
    assert waiting_engine.abort(b.request_id)
    assert waiting_engine.num_waiting == 0
    drain(waiting_engine)
    assert a.num_output == 5 and b.num_output == 0


def test_rejections() -> None:
    engine = SimEngine(max_num_queued_reqs=2, kv_capacity_tokens=1024)
    engine.add_request(10, 10)
    engine.add_request(10, 10)
    with pytest.raises(QueueFull):
        engine.add_request(10, 10)
    with pytest.raises(RequestTooLarge):
        SimEngine(kv_capacity_tokens=1024).add_request(1000, 100)
    with pytest.raises(ConfigError):
        SimEngine(max_num_seqs=0)
    with pytest.raises(ConfigError):
        SimEngine("no-such-gpu")


def test_power_limit_validation() -> None:
    engine = SimEngine()
    engine.power_limit_w = 350.0
    assert engine.power_limit_w == 350.0
    for bad in (0.0, -5.0, math.nan, 701.0):
        with pytest.raises(PowerLimitError):
            engine.power_limit_w = bad


def test_power_limit_caps_trace_power() -> None:
    engine = SimEngine(power_limit_w=400.0)
    for _ in range(32):
        engine.add_request(500, 20)
    records = drain(engine)
    assert max(r.power_w for r in records) == pytest.approx(400.0)
    free = SimEngine()
    for _ in range(32):
        free.add_request(500, 20)
    free_records = drain(free)
    assert max(r.power_w for r in free_records) > 600.0
    assert sum(r.step_s for r in records) > sum(r.step_s for r in free_records)


def test_energy_counter_equals_trace_integral_sync() -> None:
    engine = SimEngine()
    for _ in range(20):
        engine.add_request(300, 30)
    drain(engine)
    end_s = engine.trace[-1].t_s + engine.trace[-1].step_s
    assert engine.energy_j(end_s) == pytest.approx(trace_energy_j(engine), rel=1e-9)
    assert engine.trace[-1].energy_j == pytest.approx(trace_energy_j(engine), rel=1e-9)


def test_steady_decode_step_matches_model() -> None:
    engine = SimEngine()
    for _ in range(64):
        engine.add_request(16, 40)
    records = drain(engine)
    decode_steps = [r for r in records if r.decode_tokens == 64 and r.prefill_tokens == 0]
    assert decode_steps
    expected = steady_state(engine.profile, 64, kv_tokens=decode_steps[5].kv_tokens)
    assert decode_steps[5].step_s == pytest.approx(decode_step_s(engine.profile, 64))
    assert decode_steps[5].power_w == pytest.approx(expected.power_w)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=25),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 256),
    kv_blocks=st.integers(22, 64),
)
def test_invariants_under_random_load(
    reqs: list[tuple[int, int]], max_num_seqs: int, budget: int, kv_blocks: int
) -> None:
    engine = SimEngine(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        kv_capacity_tokens=kv_blocks * 16,
    )
    handles = [engine.add_request(p, m) for p, m in reqs]
    records = drain(engine)
    for r in records:
        assert r.running <= max_num_seqs
        assert r.prefill_tokens + r.decode_tokens <= budget
        assert r.kv_tokens <= engine.kv_capacity_tokens
    assert all(h.num_output == h.max_tokens for h in handles)
    assert engine.kv_tokens == 0
    assert engine.generation_tokens_total == sum(m for _, m in reqs)


# ---- the asyncio loop ---------------------------------------------------------------------


def test_async_requests_finish_on_model_time() -> None:
    async def main() -> tuple[list[SimRequest], float, SimEngine]:
        engine = SimEngine()
        await engine.start()
        t0 = time.monotonic()
        reqs = [engine.add_request(64, 30) for _ in range(8)]
        counts = await asyncio.gather(*(r.wait_tokens(r.max_tokens) for r in reqs))
        elapsed = time.monotonic() - t0
        assert counts == [30] * 8
        await engine.stop()
        return reqs, elapsed, engine

    reqs, elapsed, engine = run(main())
    modelled = 8 * 64 / engine.profile.prefill_tok_s + 29 * decode_step_s(engine.profile, 8)
    assert modelled * 0.9 < elapsed < modelled * 2 + 0.1
    assert all(r.finish_reason == "length" for r in reqs)


def test_wait_tokens_wakes_at_threshold() -> None:
    async def main() -> list[int]:
        engine = SimEngine()
        await engine.start()
        req = engine.add_request(8, 20)
        seen = []
        got = 0
        while got < 20:
            got = await req.wait_tokens(got + 6)
            seen.append(got)
        await engine.stop()
        return seen

    seen = run(main())
    # One token per step, so the consumer wakes exactly at each threshold and at the end.
    assert seen == [6, 12, 18, 20]


def test_idle_power_accounted_while_idle() -> None:
    async def main() -> tuple[float, float, float]:
        engine = SimEngine()
        await engine.start()
        t0 = time.monotonic()
        e0 = engine.energy_j(t0)
        await asyncio.sleep(0.3)
        t1 = time.monotonic()
        energy = engine.energy_j(t1) - e0
        avg = engine.average_power_w()
        await engine.stop()
        return energy, t1 - t0, avg

    energy, dt, avg = run(main())
    assert energy == pytest.approx(78.0 * dt, rel=1e-6)
    assert avg == pytest.approx(78.0, rel=1e-6)


def test_async_energy_equals_trace_integral_with_idle_gaps() -> None:
    async def main() -> SimEngine:
        engine = SimEngine()
        await engine.start()
        for _ in range(2):
            reqs = [engine.add_request(200, 15) for _ in range(4)]
            await asyncio.gather(*(r.wait_tokens(15) for r in reqs))
            await asyncio.sleep(0.1)
        reqs = [engine.add_request(200, 5)]
        await reqs[0].wait_tokens(5)
        await engine.stop()
        return engine

    engine = run(main())
    idle = [r for r in engine.trace if r.prefill_tokens == 0 and r.decode_tokens == 0]
    assert sum(r.step_s for r in idle) > 0.15  # the two sleeps are in the trace
    last = engine.trace[-1]
    assert engine.energy_j(last.t_s + last.step_s) == pytest.approx(trace_energy_j(engine))
    # Contiguous timeline: each entry starts where the previous ended.
    entries = list(engine.trace)
    for a, b in itertools.pairwise(entries):
        assert b.t_s == pytest.approx(a.t_s + a.step_s, abs=1e-9)


def test_average_power_tracks_busy_load() -> None:
    async def main() -> tuple[float, float]:
        engine = SimEngine(max_num_batched_tokens=512)
        await engine.start()
        reqs = [engine.add_request(4, 2000) for _ in range(64)]
        await asyncio.sleep(1.3)
        avg = engine.average_power_w()
        instant = [engine.instant_power_w() for _ in range(200)]
        for r in reqs:
            engine.abort(r)
        await engine.stop()
        return avg, sorted(instant)[100]

    avg, median_instant = run(main())
    # Batch 64 decode with little KV: ~620 W (the GPU-to-Grid fit, arXiv 2602.05116), a 1-s
    # window well after start-up.
    assert avg == pytest.approx(620.0, rel=0.05)
    assert median_instant == pytest.approx(620.0, rel=0.05)


def test_sim_power_source_reads_engine() -> None:
    async def main() -> None:
        engine = SimEngine("h100x4-llama70b")
        source = SimPowerSource(engine)
        assert isinstance(source, PowerSource)
        with pytest.raises(SensorUnavailable):
            await source.read()
        await engine.start()
        await asyncio.sleep(0.05)
        sample = await source.read()
        assert sample.power_w == pytest.approx(4 * 78.0)
        assert sample.energy_j is not None and sample.energy_j > 0
        instant = await SimPowerSource(engine, kind="instant").read()
        assert 0 < instant.power_w < 4 * 78.0 + 4 * 300
        await source.close()
        with pytest.raises(SensorUnavailable):
            await source.read()
        await engine.stop()

    run(main())


def test_model_power_source() -> None:
    features = [(64, 0.0, 0), (0, 0.0, 0), (8, 4096.0, 1000)]

    async def main() -> list[float]:
        state = iter(features)
        source = ModelPowerSource(lambda: next(state), "h100-llama8b")
        assert isinstance(source, PowerSource)
        return [(await source.read()).power_w for _ in features]

    busy, idle, prefill = run(main())
    assert busy == pytest.approx(620.0, rel=0.02)
    assert idle == PROFILES["h100-llama8b"].idle_w
    assert prefill > busy


def _prefill_under_a_limit_set_mid_step(start_w: float, then_w: float) -> tuple[float, SimEngine]:
    """One 8192-token prefill step started at `start_w`; the limit moves to `then_w` 0.15 s in."""

    async def main() -> tuple[float, SimEngine]:
        engine = SimEngine("h100-llama8b", power_limit_w=start_w)
        await engine.start()
        t0 = time.monotonic()
        req = engine.add_request(8192, 1)
        await asyncio.sleep(0.15)
        engine.power_limit_w = then_w
        assert engine.power_w() <= then_w + 1e-9  # the new limit holds at once, not next step
        await req.wait_tokens(1)
        elapsed = time.monotonic() - t0
        await engine.stop()
        return elapsed, engine

    return run(main())


def test_a_limit_raised_mid_step_speeds_the_rest_of_the_step() -> None:
    elapsed, engine = _prefill_under_a_limit_set_mid_step(200.0, 700.0)
    p = engine.profile
    slow = step_at_clock(p, 0, 8192, 8192, 200.0).step_s  # about 1.1 s all at 200 W
    fast = step_at_clock(p, 0, 8192, 8192, 700.0).step_s
    expected = 0.15 + (1 - 0.15 / slow) * fast
    assert elapsed < (expected + slow) / 2  # nearer the re-timed end than the old one
    step = next(r for r in engine.trace if r.prefill_tokens)
    assert step.step_s == pytest.approx(expected, abs=0.05)
    assert 200.0 < step.power_w < step_at_clock(p, 0, 8192, 8192, 700.0).power_w
    assert step.power_limit_w == 700.0
    assert engine.energy_j(step.t_s + step.step_s) == pytest.approx(step.energy_j)


def test_a_limit_lowered_mid_step_slows_it_and_the_energy_timeline_stays_whole() -> None:
    elapsed, engine = _prefill_under_a_limit_set_mid_step(700.0, 200.0)
    p = engine.profile
    fast = step_at_clock(p, 0, 8192, 8192, 700.0).step_s  # about 0.33 s at 700 W
    slow = step_at_clock(p, 0, 8192, 8192, 200.0).step_s
    assert elapsed > (fast + 0.15 + (1 - 0.15 / fast) * slow) / 2
    last = engine.trace[-1]
    assert engine.energy_j(last.t_s + last.step_s) == pytest.approx(trace_energy_j(engine))
    for a, b in itertools.pairwise(engine.trace):
        assert b.t_s == pytest.approx(a.t_s + a.step_s, abs=1e-9)
