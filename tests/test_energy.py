"""Energy accounting: the attribution rule, the meter, and the proxy's figures against the
simulator's energy counter, read by the official openai client."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import defaultdict
from typing import Any

import aiohttp
import openai
import pytest
from conftest import run, serve
from helpers import async_wait_until
from test_proxy import options

from powerbatch.cli.serve import build
from powerbatch.energy import EnergyLedger, EnergyMeter, split_energy
from powerbatch.energy.attribution import learned_prefill_weight
from powerbatch.energy.labels import OTHER, Bounded
from powerbatch.energy.usage import (
    events_with_energy,
    json_usage,
    split_events,
    usage_event_at,
    with_energy,
)
from powerbatch.proxy.auth import ApiKeys, split_name
from powerbatch.sim import SimEngine
from powerbatch.sim.server import start_sim_server

# ---- the rule ------------------------------------------------------------------------------


def test_every_interval_conserves_metered_energy_and_never_charges_idle() -> None:
    rng = random.Random(7)
    ledger = EnergyLedger(prefill_weight=0.3)
    for step in range(500):
        if rng.random() < 0.4:
            labels = (rng.choice(["normal", "high"]), "t", "m")
            ledger.begin(labels, observed=rng.random() < 0.7)
        for rec in ledger.live:
            rec.add(prefill_tokens=rng.choice([0, 0, 0, 300]), decode_tokens=rng.randint(0, 6))
            if rng.random() < 0.1:
                rec.finished = True
        dt_s = rng.uniform(0.0, 0.4)
        delta_j = rng.uniform(0.0, 400.0) * dt_s
        idle_w = rng.uniform(0.0, 600.0)
        split = ledger.settle(delta_j, dt_s, idle_w)
        assert split.idle_j + split.attributed_j == pytest.approx(delta_j, rel=1e-12, abs=1e-12)
        assert split.idle_j == pytest.approx(
            min(delta_j, idle_w * dt_s) if split.attributed_j > 0 else delta_j, abs=1e-12
        ), step
        assert all(j >= 0 for j in split.by_labels_j.values())
    assert ledger.idle_j + sum(ledger.totals_j.values()) == pytest.approx(ledger.metered_j)


class _EveryRequestLedger:
    """The rule as the module's docstring states it, visiting every request in flight at every
    settle (the ledger's code before it kept the estimated share as one running sum)."""

    def __init__(self, prefill_weight: float) -> None:
        self.w = prefill_weight
        self.live: list[list[Any]] = []  # [observed, prefill, decode, energy_j, finished]

    def begin(self, observed: bool, prefill: float) -> list[Any]:
        rec = [observed, prefill, 0.0, 0.0, False]
        self.live.append(rec)
        return rec

    def settle(self, delta_j: float, dt_s: float, idle_w: float) -> None:
        seen = [r[2] for r in self.live if r[0] and r[2] > 0]
        estimate = sum(seen) / len(seen) if seen else 1.0
        units = [self.w * r[1] + (r[2] if r[0] else estimate) for r in self.live]
        _, charges = split_energy(delta_j, dt_s, idle_w, units)
        for r, j in zip(self.live, charges, strict=True):
            r[3] += j
            r[1] = r[2] = 0.0
        self.live = [r for r in self.live if not r[4]]


def test_the_ledger_charges_each_request_what_the_rule_says() -> None:
    """Seen and estimated requests, prefill, ends mid-interval, settles with nothing to do:
    every request's joules are those of the rule applied to every request at every settle."""
    rng = random.Random(11)
    ledger, rule = EnergyLedger(prefill_weight=0.25), _EveryRequestLedger(0.25)
    pairs: list[tuple[Any, list[Any]]] = []
    for _ in range(3_000):
        if rng.random() < 0.5:
            observed, prefill = rng.random() < 0.3, rng.choice([0.0, 0.0, 40.0, 2_000.0])
            labels = (rng.choice(["high", "normal"]), "t", "m")
            rec = ledger.begin(labels, observed=observed, prefill_tokens=prefill)
            pairs.append((rec, rule.begin(observed, prefill)))
        for rec, ref in pairs:
            if ref[4]:
                continue
            if ref[0] and rng.random() < 0.5:
                n = rng.randint(0, 4)
                rec.add(decode_tokens=n)
                ref[2] += n
            if rng.random() < 0.08:
                rec.finished = ref[4] = True
        dt_s = rng.uniform(0.0, 0.05)
        delta_j, idle_w = rng.uniform(0.0, 700.0) * dt_s, rng.choice([0.0, 100.0, 300.0])
        ledger.settle(delta_j, dt_s, idle_w)
        rule.settle(delta_j, dt_s, idle_w)
        assert ledger.in_flight == len(rule.live)
    assert len(pairs) > 1_000
    for rec, ref in pairs:
        assert rec.energy_j == pytest.approx(ref[3], rel=1e-9, abs=1e-9)
    by_labels: dict[Any, float] = defaultdict(float)
    for rec, ref in pairs:
        by_labels[rec.labels] += ref[3]
    assert ledger.totals_j == pytest.approx(dict(by_labels), rel=1e-9)


def test_the_split_follows_work_weighted_by_phase() -> None:
    idle_j, shares = split_energy(100.0, 0.2, 100.0, [1.0, 3.0])
    assert idle_j == pytest.approx(20.0)
    assert shares == pytest.approx([20.0, 60.0])
    ledger = EnergyLedger(prefill_weight=0.25)
    a = ledger.begin(("high", "t", "m"), prefill_tokens=400)  # 100 units of prefill
    b = ledger.begin(("low", "t", "m"))
    b.add(decode_tokens=100)
    ledger.settle(120.0, 0.2, 100.0)  # 20 J idle, 100 J shared evenly
    assert a.energy_j == pytest.approx(50.0) and b.energy_j == pytest.approx(50.0)
    # Below idle power everything is idle: a quiet server charges no request.
    ledger.settle(10.0, 0.2, 100.0)
    assert a.energy_j == pytest.approx(50.0)


def test_unseen_decoding_is_estimated_from_the_requests_seen() -> None:
    ledger = EnergyLedger(prefill_weight=0.25)
    seen = [ledger.begin(("normal", "t", "m")) for _ in range(2)]
    whole = ledger.begin(("normal", "t", "m"), observed=False)
    seen[0].add(decode_tokens=4)
    seen[1].add(decode_tokens=8)
    ledger.settle(18.0, 0.1, 0.0)  # 4 + 8 units seen, 6 estimated for the whole answer
    assert [r.energy_j for r in (*seen, whole)] == pytest.approx([4.0, 8.0, 6.0])
    # With nothing seen, each running request counts one token: an even split.
    alone = EnergyLedger()
    recs = [alone.begin(("n", "t", "m"), observed=False) for _ in range(4)]
    alone.settle(50.0, 0.1, 0.0)
    assert [r.energy_j for r in recs] == pytest.approx([12.5] * 4)
    assert whole.energy_j == pytest.approx(6.0)  # another ledger's settle charges it nothing


def test_learned_weight_rejects_noise() -> None:
    # 0.02 J per prompt token; 400 W over 4,000 tokens/s is 0.1 J per generated token.
    assert learned_prefill_weight(0.02, 400.0, 4_000.0) == pytest.approx(0.2)
    assert learned_prefill_weight(-0.01, 400.0, 4_000.0) is None
    assert learned_prefill_weight(0.02, 400.0, 0.0) is None
    assert learned_prefill_weight(50.0, 400.0, 4_000.0) is None


def test_meter_follows_the_counter_and_falls_back_to_power() -> None:
    meter = EnergyMeter()
    assert meter.advance(0.0, 100.0, 1_000.0) == (0.0, 0.0)
    total = 0.0
    # The counter is read at 10 Hz, intervals end between reads: the sum follows the counter.
    counter = 1_000.0
    for i in range(1, 101):
        t = i * 0.07
        if i % 3 == 0:
            counter = 1_000.0 + 200.0 * t
        age = t - (counter - 1_000.0) / 200.0
        delta, _ = meter.advance(t, 200.0, counter, age)
        assert delta >= 0
        total += delta
    assert total == pytest.approx(200.0 * 7.0, rel=1e-9)
    # A gap in the readings: the counter's increase across it comes with the next reading.
    assert meter.advance(7.2, None) == (0.0, pytest.approx(0.2))
    assert meter.advance(7.4, 200.0, 1_000.0 + 200.0 * 7.4)[0] == pytest.approx(80.0)
    assert meter.unmetered_s == 0.0
    # No counter: power x dt. No trusted reading: unmetered.
    assert meter.advance(7.5, 100.0)[0] == pytest.approx(10.0)
    assert meter.advance(8.0, None) == (0.0, 0.5)
    assert meter.unmetered_s == 0.5
    # A counter that goes back (a reset) starts over instead of charging a negative interval.
    meter.advance(8.1, 100.0, 5_000.0)
    assert meter.advance(8.2, 100.0, 10.0)[0] == pytest.approx(10.0)


# ---- labels, keys, usage -------------------------------------------------------------------


def test_key_names_and_bounded_labels() -> None:
    assert split_name("team-a:sk-123") == ("team-a", "sk-123")
    assert split_name("sk-123") == ("default", "sk-123")
    keys = ApiKeys(["a:k1-aaaa", "k2-bbbb"])
    assert keys.identify("k1-aaaa") == "a" and keys.identify("k2-bbbb") == "default"
    assert keys.identify("a:k1-aaaa") is None  # the name is not part of the key
    assert keys.names() == ["a", "default"]
    models = Bounded((), max_seen=2)
    assert [models(m) for m in ("x", "y", "z", "x")] == ["x", "y", OTHER, "x"]
    fixed = Bounded(["a"])
    assert fixed("a") == "a" and fixed("b") == OTHER


def test_usage_chunk_gets_the_energy_field() -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
        b"data: [DONE]\n\n"
    )
    events = split_events(stream)
    assert usage_event_at(events) == 1
    out, prompt = events_with_energy(b"".join(events[1:]), 1.5)
    assert prompt == 5 and b'"energy_j":1.5' in out and out.endswith(b"data: [DONE]\n\n")


# ---- the proxy against the simulator's meter -----------------------------------------------

KEYS = ("alpha:key-alpha-1", "beta:key-beta-2", "key-plain-3")


async def _tenant_load(url: str) -> dict[str, Any]:
    """Three tenants, two classes, streamed and whole answers of different lengths."""
    results: list[tuple[str, str, float, int]] = []

    async def one(key: str, tenant: str, priority: str, max_tokens: int, stream: bool) -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": "word " * 200}]
        headers = {"x-priority": priority}
        if stream:
            s = await client.chat.completions.create(
                model="sim-llama",
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
            usage = None
            async for chunk in s:
                if chunk.usage:
                    usage = chunk.usage
        else:
            done = await client.chat.completions.create(
                model="sim-llama",
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                extra_headers=headers,
            )
            usage = done.usage
        await client.close()
        assert usage is not None and usage.model_extra is not None
        results.append((tenant, priority, float(usage.model_extra["energy_j"]), max_tokens))

    jobs = []
    for i in range(18):
        key = split_name(KEYS[i % 3])[1]
        tenant = ("alpha", "beta", "default")[i % 3]
        long = tenant == "alpha"  # alpha asks for 8x the tokens: it must pay more per request
        jobs.append(one(key, tenant, ("high", "low")[i % 2], 96 if long else 12, i % 4 != 0))
    await asyncio.gather(*jobs)
    return {"results": results}


def test_per_request_class_and_tenant_sums_match_the_meter() -> None:
    async def main() -> None:
        engine = SimEngine(seed=5)
        sim = await start_sim_server(engine, stream_interval_tokens=1)
        app, gov = build(options(sim.url, api_keys=KEYS, energy_header=True, max_models=1))
        runner, url = await serve(app)
        acc = gov.energy
        try:

            async def metered() -> bool:
                return acc.meter._metered_to_j is not None

            await async_wait_until(metered, 10.0, "the energy counter")
            acc.settle()
            e0_sim, m0, i0 = engine.energy_j(), acc.ledger.metered_j, acc.ledger.idle_j
            a0 = sum(acc.ledger.totals_j.values())
            out = await _tenant_load(url)
            await asyncio.sleep(1.5)  # idle again: the 1-second mean power has settled
            acc.settle()
            e1_sim = engine.energy_j()
        finally:
            await runner.cleanup()
            await sim.close()
        results = out["results"]
        metered_j = acc.ledger.metered_j - m0
        idle_j = acc.ledger.idle_j - i0
        attributed_j = sum(acc.ledger.totals_j.values()) - a0
        per_request_j = sum(r[2] for r in results)
        true_j = e1_sim - e0_sim
        assert metered_j == pytest.approx(true_j, rel=0.01)
        assert attributed_j + idle_j == pytest.approx(metered_j, rel=1e-9)
        assert per_request_j == pytest.approx(attributed_j, rel=0.01)
        assert 0 < idle_j < metered_j
        # Per class and per tenant: the answers' joules against the exported counters.
        reg = gov.metrics.registry
        for key_index, label in ((0, "tenant"), (1, "priority")):
            sums: dict[str, float] = defaultdict(float)
            for r in results:
                sums[r[key_index]] += r[2]
            for name, j in sums.items():
                exported = sum(
                    s.value
                    for fam in reg.collect()
                    if fam.name == "powerbatch_request_energy_joules"
                    for s in fam.samples
                    if s.name.endswith("_total") and s.labels[label] == name
                )
                assert exported == pytest.approx(j, rel=0.01), (label, name)
        per = defaultdict(list)
        for tenant, _, j, _ in results:
            per[tenant].append(j)
        mean = {t: sum(v) / len(v) for t, v in per.items()}
        assert mean["alpha"] > 2 * mean["beta"], mean
        tokens = reg.get_sample_value(
            "powerbatch_request_tokens_total",
            {"kind": "completion", "priority": "high", "tenant": "alpha", "model": "sim-llama"},
        )
        assert tokens == 96 * 3
        status = gov.status()["energy"]
        assert set(status["by_tenant_j"]) == {"alpha", "beta", "default"}
        assert status["idle_j"] > 0

    run(main())


def test_header_and_access_log(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        sim = await start_sim_server(SimEngine(seed=2), stream_interval_tokens=1)
        app, gov = build(options(sim.url, energy_header=True, access_log=True, models=("m1",)))
        runner, url = await serve(app)
        try:
            body = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}]}
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/chat/completions", json=body) as r,
            ):
                doc = await r.json()
                header = r.headers.get("x-powerbatch-energy-j")
        finally:
            await runner.cleanup()
            await sim.close()
        assert header is not None and float(header) == pytest.approx(doc["usage"]["energy_j"])
        # Series at zero for the configured models; a model outside them counts as `other`.
        reg = gov.metrics.registry
        lab = {"priority": "low", "tenant": "anonymous", "model": "m1"}
        assert reg.get_sample_value("powerbatch_request_energy_joules_total", lab) == 0.0
        lab = {"priority": "normal", "tenant": "anonymous", "model": "other"}
        assert reg.get_sample_value("powerbatch_request_energy_joules_total", lab) is not None

    with caplog.at_level(logging.INFO, logger="powerbatch.access"):
        run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "powerbatch.access"]
    assert len(lines) == 1 and "tenant=anonymous" in lines[0] and "energy_j=" in lines[0]


def test_bench_reports_attributed_joules_per_token_by_class() -> None:
    from powerbatch.cli.report import energy_by_class
    from powerbatch.load.client import RequestResult

    def r(priority: str, tokens: int, energy_j: float | None) -> RequestResult:
        return RequestResult(0.0, priority, 0, 200, 0.1, 1.0, 10, tokens, energy_j=energy_j)

    out = energy_by_class([r("high", 10, 5.0), r("high", 30, 15.0), r("low", 20, 4.0)], 30.0)
    assert out["j_per_token_by_class"] == {"high": 0.5, "normal": None, "low": 0.2}
    assert out["attributed_j"] == 24.0 and out["attributed_share"] == pytest.approx(0.8)
    assert energy_by_class([r("high", 10, None)], 30.0)["attributed_j"] is None


def _energy_added(body: bytes, energy_j: float) -> bytes:
    doc, usage = json_usage(body)
    assert usage is not None
    return with_energy(body, doc, usage, energy_j)


@pytest.mark.parametrize(
    "doc",
    [
        {"id": "a", "choices": [{"text": "x"}], "usage": {"prompt_tokens": 3}},
        {"usage": {}, "model": "m"},
        # a "usage" key below the top one, after it and before it, and text that looks like one
        {"usage": {"prompt_tokens": 1}, "choices": [{"usage": {"x": 1}}]},
        {"choices": [{"usage": {"x": 1}}], "usage": {"completion_tokens": 2}},
        {"choices": [{"text": '"usage": {"a": [}'}], "usage": {"prompt_tokens": 4}, "z": "}"},
        {"usage": {"prompt_tokens": 1}, "tail": ', "usage": {"prompt_tokens": 9}}'},
        {"usage": {"prompt_tokens": 1, "energy_j": 7.0}},  # the upstream's own: replaced
        {"usage": {"prompt_tokens": 2}, 'say "usage': {"a": 1}},
    ],
)
@pytest.mark.parametrize("indent", [None, 2])
def test_energy_goes_into_the_top_usage_object_whatever_the_bytes(
    doc: dict[str, Any], indent: int | None
) -> None:
    body = json.dumps(doc, indent=indent).encode()
    out = json.loads(_energy_added(body, 1.23456789))
    want = json.loads(body)
    want["usage"]["energy_j"] = 1.234568
    assert out == want


def test_an_answer_keeps_its_bytes_but_for_the_energy_field() -> None:
    """The proxy relays the upstream's answer: only `"energy_j":x,` is added, nothing re-encoded."""
    body = json.dumps(
        {"id": "c", "choices": [{"message": {"content": "é \u2028 <"}}], "usage": {"a": 1}}
    ).encode()
    out = _energy_added(body, 2.5)
    assert out == body.replace(b'"usage": {', b'"usage": {"energy_j":2.5,')


def test_a_plain_usage_object_is_read_off_the_bytes_alone() -> None:
    """The usage object last in the answer is parsed alone (the answer's text is not read);
    anywhere else, or below the top level, the whole answer is parsed as before."""
    last = json.dumps({"choices": [{"text": "x" * 1000}], "usage": {"prompt_tokens": 3}})
    doc, usage = json_usage(last.encode())
    assert doc is None and usage == {"prompt_tokens": 3}
    first = json.dumps({"usage": {"prompt_tokens": 3}, "choices": []}).encode()
    nested = json.dumps({"choices": [{"usage": {"prompt_tokens": 9}}]}).encode()
    assert json_usage(first) == (json.loads(first), {"prompt_tokens": 3})
    assert json_usage(nested) == (json.loads(nested), None)
    assert json_usage(b'[{"usage": {"prompt_tokens": 3}}]')[1] is None  # no object: no usage
    assert json_usage(b"not json") == (None, None)
    # energy_j the upstream set itself is replaced (the answer is parsed whole for it)
    body = json.dumps({"usage": {"prompt_tokens": 1, "energy_j": 7.0}}).encode()
    doc, usage = json_usage(body)
    assert usage is not None
    assert json.loads(with_energy(body, doc, usage, 2.0)) == {
        "usage": {"prompt_tokens": 1, "energy_j": 2.0}
    }
