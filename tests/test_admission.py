"""The admission queue: limits hold, order is by priority then arrival, nothing is lost."""

from __future__ import annotations

import asyncio

import pytest
from conftest import run
from helpers import run_virtual

from powerbatch.admission import AdmissionQueue, Rejected, Slot, parse_priority
from powerbatch.control import AdmissionLimits


def test_parse_priority_accepts_aliases_and_rejects_the_rest() -> None:
    assert parse_priority(None) == "normal"
    assert parse_priority("Interactive") == "high"
    assert parse_priority("batch") == "low"
    assert parse_priority("0") == "high"
    with pytest.raises(ValueError, match="accepted"):
        parse_priority("urgent!!")


def test_never_more_in_flight_than_the_limit_and_every_slot_released_once() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(3, 10**9))
        peak = 0

        async def one(i: int) -> None:
            nonlocal peak
            slot = await q.admit("normal", 10, 10)
            peak = max(peak, q.in_flight)
            await asyncio.sleep(0.001 * (i % 5))
            slot.release()
            slot.release()  # idempotent: the second call must not free another place

        await asyncio.gather(*(one(i) for i in range(60)))
        assert peak == 3
        assert q.in_flight == 0 and q.kv_in_flight == 0 and q.queued == 0
        assert q.stats.admitted_total["normal"] == 60

    run(main())


def test_priority_first_then_fifo_within_a_class() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9))
        blocker = await q.admit("normal", 1, 1)
        order: list[str] = []

        async def one(name: str, prio: str) -> None:
            slot = await q.admit(prio, 1, 1)
            order.append(name)
            slot.release()

        tasks = []
        for name, prio in [
            ("n1", "normal"),
            ("l1", "low"),
            ("h1", "high"),
            ("n2", "normal"),
            ("h2", "high"),
        ]:
            tasks.append(asyncio.create_task(one(name, prio)))
            await asyncio.sleep(0)  # enqueue in this order
        blocker.release()
        await asyncio.gather(*tasks)
        assert order == ["h1", "h2", "n1", "n2", "l1"]

    run(main())


def test_kv_limit_holds_but_one_request_always_fits_an_empty_upstream() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(100, 1_000))
        big = await q.admit("normal", 5_000, 10)  # larger than the cap: admitted alone
        waiting = asyncio.create_task(q.admit("normal", 600, 10))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        big.release()
        small = await asyncio.wait_for(waiting, 1)
        other = await q.admit("normal", 300, 10)
        assert q.kv_in_flight == 900
        third = asyncio.create_task(q.admit("normal", 200, 10))
        await asyncio.sleep(0.01)
        assert not third.done()  # 900 + 200 > 1000
        small.release()
        (await asyncio.wait_for(third, 1)).release()
        other.release()

    run(main())


def test_wait_limit_answers_429_with_retry_after() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9), max_wait_s={"normal": 0.05})
        held = await q.admit("normal", 1, 1)
        with pytest.raises(Rejected) as info:
            await q.admit("normal", 1, 1)
        assert info.value.status == 429 and info.value.reason == "queue_timeout"
        assert info.value.retry_after_s is not None and info.value.retry_after_s >= 1
        assert q.queued == 0
        held.release()

    run(main())


def test_full_queue_sheds_lowest_priority_for_higher_and_refuses_equal() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9), max_queue_len=2)
        held = await q.admit("high", 1, 1)
        low = asyncio.create_task(q.admit("low", 1, 1))
        normal = asyncio.create_task(q.admit("normal", 1, 1))
        await asyncio.sleep(0.01)
        high = asyncio.create_task(q.admit("high", 1, 1))  # full: the low waiter makes room
        await asyncio.sleep(0.01)
        with pytest.raises(Rejected) as shed:
            await low
        assert shed.value.reason == "shed" and shed.value.status == 429
        with pytest.raises(Rejected) as full:
            await q.admit("low", 1, 1)  # nothing lower to shed
        assert full.value.reason == "queue_full"
        held.release()
        for task in (high, normal):
            slot: Slot = await asyncio.wait_for(task, 1)
            slot.release()
        assert q.in_flight == 0 and q.queued == 0

    run(main())


def test_cancelled_waiter_leaves_the_queue_and_takes_no_slot() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9))
        held = await q.admit("normal", 1, 1)
        waiter = asyncio.create_task(q.admit("normal", 1, 1))
        await asyncio.sleep(0.01)
        assert q.queued == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert q.queued == 0
        held.release()
        assert q.in_flight == 0

    run(main())


def test_prefill_pace_spreads_admissions() -> None:
    async def main() -> None:
        # 1000 prompt tokens a second, 100 per request: 10 admissions a second. The first is
        # granted at once into an empty upstream (the bucket, empty, goes to -100 tokens); the
        # next waits for 200 tokens (0.2 s), each after it for 100 (0.1 s): 0.8 s for 8.
        loop = asyncio.get_running_loop()
        q = AdmissionQueue(
            AdmissionLimits(100, 10**9, prefill_tok_s=1_000.0), prefill_burst_s=0.1, clock=loop.time
        )
        t0 = loop.time()
        granted, slots = [], []
        for _ in range(8):
            slots.append(await q.admit("normal", 100, 100))
            granted.append(round(loop.time() - t0, 2))
        assert granted == [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
        assert q.stats.prefill_tokens_admitted_total == 800
        for s in slots:
            s.release()
        assert q.in_flight == 0

    run_virtual(main())


def test_the_most_urgent_class_waits_for_the_pace_but_goes_first() -> None:
    async def main() -> None:
        # As above, 1000 prompt tokens a second. Behind an empty-upstream grant (bucket at -100)
        # a normal prompt queues first, then a high one: the high one is granted first, once the
        # bucket holds its 100 tokens (0.2 s), and the normal one 0.1 s after it.
        loop = asyncio.get_running_loop()
        q = AdmissionQueue(
            AdmissionLimits(100, 10**9, prefill_tok_s=1_000.0), prefill_burst_s=0.1, clock=loop.time
        )
        t0 = loop.time()
        first = await q.admit("normal", 100, 100)
        normal = asyncio.create_task(q.admit("normal", 100, 100))
        await asyncio.sleep(0)
        high = asyncio.create_task(q.admit("high", 100, 100))
        done_at: dict[str, float] = {}
        for name, task in (("high", high), ("normal", normal)):
            task.add_done_callback(lambda _t, n=name: done_at.setdefault(n, loop.time() - t0))
        slots = [first, await high, await normal]
        assert round(done_at["high"], 2) == 0.2
        assert round(done_at["normal"], 2) == 0.3
        for s in slots:
            s.release()

    run_virtual(main())


def test_an_empty_upstream_waits_for_the_prompts_debt() -> None:
    async def main() -> None:
        # A 1,000-token prompt at 1,000 tokens/s borrows a second ahead. When it is done, the
        # next request into the empty upstream still waits for that second: one long prompt
        # after another is prefill at full power all the same.
        loop = asyncio.get_running_loop()
        q = AdmissionQueue(
            AdmissionLimits(1, 10**9, prefill_tok_s=1_000.0), prefill_burst_s=0.1, clock=loop.time
        )
        t0 = loop.time()
        first = await q.admit("high", 100, 1_000)
        assert round(loop.time() - t0, 2) == 0.0
        first.release()
        second = await q.admit("high", 100, 1_000)
        assert round(loop.time() - t0, 2) == 1.0
        second.release()

    run_virtual(main())


def test_streams_go_first_within_a_class_and_classes_stay_strict() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9))
        held = await q.admit("normal", 1, 1)
        order: list[str] = []

        async def wait(name: str, priority: str, stream: bool) -> None:
            slot = await q.admit(priority, 1, 1, stream=stream)
            order.append(name)
            slot.release()

        tasks = []
        for name, priority, stream in (
            ("normal-whole", "normal", False),
            ("low-stream", "low", True),
            ("normal-stream", "normal", True),
            ("high-whole", "high", False),
            ("high-stream", "high", True),
        ):
            tasks.append(asyncio.create_task(wait(name, priority, stream)))
            await asyncio.sleep(0)
        held.release()
        await asyncio.gather(*tasks)
        assert order == ["high-stream", "high-whole", "normal-stream", "normal-whole", "low-stream"]

    run(main())


def test_valley_fill_keeps_a_reserve_from_deferrable_work() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(10, 10**9), valley_fill=True, fill_reserve_frac=0.2)
        lows = [await q.admit("low", 1, 1) for _ in range(8)]
        blocked = asyncio.create_task(q.admit("low", 1, 1))
        await asyncio.sleep(0.01)
        assert not blocked.done()  # 2 of 10 kept for interactive arrivals
        high = await asyncio.wait_for(q.admit("high", 1, 1), 1)
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)
        for s in [*lows, high]:
            s.release()

    run(main())


def test_drain_answers_queued_with_503_and_refuses_new() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9))
        held = await q.admit("normal", 1, 1)
        waiting = asyncio.create_task(q.admit("normal", 1, 1))
        await asyncio.sleep(0.01)
        q.drain()
        with pytest.raises(Rejected) as queued:
            await waiting
        assert queued.value.status == 503
        with pytest.raises(Rejected):
            await q.admit("high", 1, 1)
        idle = asyncio.create_task(q.wait_idle())
        await asyncio.sleep(0.01)
        assert not idle.done()
        held.release()
        await asyncio.wait_for(idle, 1)

    run(main())


def test_the_reserve_comes_with_its_share_of_kv_tokens() -> None:
    """A reserve slot the KV cap still blocks is no reserve: the top class's first tokens
    waited behind batch work that had filled the KV budget (the cap is per batch slot)."""

    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(2, 200, None, reserve_requests=1))
        a = await q.admit("normal", 100, 1)
        b = await q.admit("low", 100, 1)  # the batch and its KV budget are full
        high = await asyncio.wait_for(q.admit("high", 100, 1), 1.0)
        assert q.in_flight == 3 and q.kv_in_flight == 300
        more = asyncio.ensure_future(q.admit("high", 100, 1))
        await asyncio.sleep(0)
        assert not more.done()  # the reserve is bounded, its KV too
        for slot in (a, b, high):
            slot.release()
        (await more).release()

    run(main())


def test_the_top_class_may_take_the_reserve_beyond_the_batch_limit() -> None:
    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(2, 10**9, None, reserve_requests=1))
        a = await q.admit("normal", 1, 1)
        b = await q.admit("low", 1, 1)
        blocked = asyncio.ensure_future(q.admit("normal", 1, 1))
        await asyncio.sleep(0)
        assert not blocked.done()  # the batch limit holds for the other classes
        high = await asyncio.wait_for(q.admit("high", 1, 1), 1.0)  # the reserve is the top's
        assert q.in_flight == 3
        second_high = asyncio.ensure_future(q.admit("high", 1, 1))
        await asyncio.sleep(0)
        assert not second_high.done()  # the reserve is bounded too
        for slot in (a, b, high):
            slot.release()
        for fut in (blocked, second_high):
            (await fut).release()
        assert q.in_flight == 0

    run(main())


def test_a_free_slot_is_granted_without_waiting_and_a_busy_queue_says_so() -> None:
    """`try_admit`: the uncontended path (no coroutine, no loop turn); None sends the caller
    to `admit`, which keeps the order: nobody overtakes a waiter."""

    async def main() -> None:
        q = AdmissionQueue(AdmissionLimits(1, 10**9))
        first = q.try_admit("normal", 1, 1)
        assert isinstance(first, Slot) and q.in_flight == 1
        assert q.try_admit("high", 1, 1) is None  # full: the caller waits in admit
        waiter = asyncio.create_task(q.admit("normal", 1, 1))
        await asyncio.sleep(0)
        first.release()  # the waiter is granted, before anyone who comes now
        assert q.try_admit("high", 1, 1) is None
        second = await waiter
        second.release()
        q.drain()
        assert q.try_admit("normal", 1, 1) is None and q.in_flight == 0

    run(main())


@pytest.mark.parametrize(
    ("lifo_after_s", "free_at_s", "expected"),
    [
        (None, 2.5, ["a", "b", "c"]),  # FIFO: every waiter as late as the queue is long
        (2.0, 2.5, ["c", "b", "a"]),  # the oldest waited past 2 s: newest first
        (2.0, 1.0, ["a", "b", "c"]),  # a queue younger than 2 s stays FIFO
        (2.0, 16.0, ["a", "b", "c"]),  # past half the 30-s wait: the oldest first, no 429
    ],
)
def test_an_overloaded_class_serves_its_newest_first_and_its_late_after(
    lifo_after_s: float | None, free_at_s: float, expected: list[str]
) -> None:
    """Adaptive LIFO, per class: the fresh waiters can still be served in time."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        q = AdmissionQueue(AdmissionLimits(1, 10**9), lifo_after_s=lifo_after_s, clock=loop.time)
        blocker = await q.admit("normal", 1, 1)
        order: list[str] = []

        async def one(name: str) -> None:
            slot = await q.admit("normal", 1, 1)
            order.append(name)
            await asyncio.sleep(0.5)
            slot.release()

        tasks = []
        for name in ("a", "b", "c"):
            tasks.append(asyncio.create_task(one(name)))
            await asyncio.sleep(0)  # enqueue in this order, all at 0 s
        await asyncio.sleep(free_at_s)
        blocker.release()
        await asyncio.gather(*tasks)
        assert order == expected
        assert q.in_flight == 0 and q.queued == 0

    run_virtual(main())


def test_the_counts_say_how_long_the_longest_waiter_has_waited() -> None:
    """The fleet's bid reads TTFT now from the queue: the oldest live waiter's wait (0 with
    nobody waiting), and arrivals as grants, waiters and refusals."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        q = AdmissionQueue(AdmissionLimits(1, 10**9), clock=loop.time)
        assert q.counts().oldest_wait_s == 0.0
        blocker = await q.admit("normal", 1, 1)
        first = asyncio.create_task(q.admit("high", 1, 1))
        await asyncio.sleep(1.0)
        second = asyncio.create_task(q.admit("normal", 1, 1))
        await asyncio.sleep(0.5)
        c = q.counts()
        assert c.oldest_wait_s == pytest.approx(1.5)
        assert sum(c.arrived.values()) == 3 and c.queued == {"high": 1, "normal": 1, "low": 0}
        first.cancel()  # the oldest leaves: the next oldest counts
        await asyncio.sleep(0)
        assert q.counts().oldest_wait_s == pytest.approx(0.5)
        blocker.release()
        (await second).release()
        assert q.counts().oldest_wait_s == 0.0

    run_virtual(main())
