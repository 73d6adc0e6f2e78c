"""The controller in closed loop with plants it was not written for, and its failure modes."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np

from powerbatch.control import ControlConfig, EngineLoad, LatencySnapshot, Observation
from powerbatch.control.controller import Controller
from powerbatch.control.laws.engine import EngineLaw
from powerbatch.estimate import Features

Plant = Callable[[float], float]  # mean 1-second power at a batch


def linear(n: float) -> float:
    return 150.0 + 4.0 * n


def saturating(n: float) -> float:
    return 250.0 + 450.0 * (1.0 - math.exp(-n / 60.0))


def concave_log(n: float) -> float:
    return 420.0 + 45.0 * math.log2(1.0 + n)


def run_loop(
    plant: Plant,
    ceiling_w: float,
    *,
    seconds: float = 90.0,
    demand: Callable[[float], int] = lambda t: 10_000,
    noise_w: float = 8.0,
    sensor_ok: Callable[[float], bool] = lambda t: True,
    latency: Callable[[float, int], LatencySnapshot | None] = lambda t, n: None,
    config: dict[str, object] | None = None,
    seed: int = 0,
) -> list[tuple[float, float, int, str, str]]:
    """Tick at 5 Hz; the plant's power follows the admitted batch. Returns (t, W, limit, ...)."""
    rng = np.random.default_rng(seed)
    cfg = ControlConfig(ceiling_w=ceiling_w, max_batch=256, **config or {})  # type: ignore[arg-type]
    ctl = Controller(cfg)
    limit = cfg.initial_batch
    out = []
    for i in range(int(seconds * cfg.tick_hz)):
        t = i / cfg.tick_hz
        batch = min(limit, demand(t))
        power = plant(batch) + rng.normal(0, noise_w)
        feats = Features(batch, 900.0 * batch, 40.0 * batch, 30.0 * batch)
        ok = sensor_ok(t)
        obs = Observation(
            t_s=t,
            power_w=power if ok else None,
            sensor_ok=ok,
            sensor_error=None if ok else "scripted failure",
            features=feats,
            in_flight=batch,
            queued=max(demand(t) - batch, 0),
            latency=latency(t, batch),
        )
        d = ctl.tick(obs)
        limit = d.enforced.max_requests
        out.append((t, power, limit, d.binding, d.state))
    return out


def feasible_batch(plant: Plant, ceiling_w: float) -> int:
    return max(n for n in range(1, 257) if plant(n) <= ceiling_w)


def test_learns_each_plant_and_holds_the_ceiling() -> None:
    for plant, ceiling in ((linear, 500.0), (saturating, 600.0), (concave_log, 700.0)):
        trace = run_loop(plant, ceiling)
        settled = [r for r in trace if r[0] >= 30]
        above = np.mean([p > ceiling for _, p, *_ in settled])
        limits = [lim for _, _, lim, *_ in settled]
        assert above <= 0.01, (plant.__name__, above)
        # It uses most of the budget (margin, dead band and noise take the rest), without a
        # model of the plant, and never holds a batch far past what fits.
        median_w = float(np.median([p for _, p, *_ in settled]))
        assert median_w >= 0.9 * ceiling, (plant.__name__, median_w)
        assert max(limits) <= feasible_batch(plant, ceiling + 30), plant.__name__
        bindings = {b for *_, b, _ in settled}
        assert "power" in bindings


def test_low_demand_binds_nothing_and_power_follows_demand() -> None:
    trace = run_loop(linear, 500.0, demand=lambda t: 20)
    late = trace[-50:]
    assert {b for *_, b, _ in late} <= {"none", "demand"}
    assert all(p < 500 for _, p, *_ in late)


def test_step_in_plant_power_is_cut_at_once() -> None:
    shift = {"w": 0.0}

    def plant(n: float) -> float:
        return linear(n) + shift["w"]

    cfg = ControlConfig(ceiling_w=500.0, max_batch=256)
    ctl = Controller(cfg)
    limit = cfg.initial_batch
    for i in range(400):
        t = i / 5
        if t >= 60:
            shift["w"] = 120.0  # e.g. a model swap makes every request dearer
        batch = limit
        power = plant(batch)
        obs = Observation(
            t, power, True, Features(batch, 900 * batch, 40 * batch, 30 * batch), batch, 1000
        )
        d = ctl.tick(obs)
        if t == 60.0:
            assert d.emergency, "a measured breach must cut without waiting for the model"
            assert d.enforced.max_requests < limit
        limit = d.enforced.max_requests
    assert plant(limit) <= 500.0 + 10  # settled under the ceiling on the new plant


def test_sensor_failure_fails_closed_then_recovers() -> None:
    trace = run_loop(linear, 500.0, sensor_ok=lambda t: not 40 <= t < 50)
    during = [r for r in trace if 41 <= r[0] < 50]
    assert all(lim <= 2 for _, _, lim, *_ in during)
    assert all(state == "fail_closed" and b == "sensor" for *_, b, state in during)
    after = [r for r in trace if r[0] >= 80]
    assert np.median([lim for _, _, lim, *_ in after]) > 20
    assert all(state == "enforce" for *_, state in after)


def test_warmup_holds_initial_batch_and_observe_mode_enforces_nothing() -> None:
    trace = run_loop(linear, 500.0, seconds=10, config={"warmup_s": 5.0, "initial_batch": 6})
    assert all(lim == 6 and state == "warmup" for t, _, lim, _, state in trace if t < 5)
    observe = run_loop(linear, 500.0, seconds=30, config={"mode": "observe"})
    assert all(lim == 256 for _, _, lim, *_ in observe)  # admission sees the configured max


def test_latency_violation_shrinks_the_batch_within_the_power_limit() -> None:
    def slow_tokens(t: float, n: int) -> LatencySnapshot:
        # time per output token grows with batch; the SLO (0.1 s) holds up to batch 40
        return LatencySnapshot(0.5, 0.0025 * n, {"high": 0.5}, 100)

    trace = run_loop(linear, 2000.0, latency=slow_tokens, seconds=120)
    late = trace[-100:]
    assert np.median([lim for _, _, lim, *_ in late]) <= 48
    assert "latency" in {b for *_, b, _ in late}


def _closed_loop(
    mode: str, demand: int = 40, seconds: float = 90.0
) -> list[tuple[float, int, float]]:
    """The same load in either mode; observing, the plant runs whatever the load brings."""
    rng = np.random.default_rng(1)
    ctl = Controller(ControlConfig(ceiling_w=600.0, mode=mode))  # type: ignore[arg-type]
    limit = ctl.config.initial_batch
    out = []
    for i in range(int(seconds * 5)):
        t = i / 5
        demand = (16, 40, 28)[int(t // 7) % 3]  # a load that varies, as a day's does
        batch = demand if mode == "observe" else min(limit, demand)
        power = concave_log(batch) + rng.normal(0, 8.0)
        feats = Features(batch, 900.0 * batch, 40.0 * batch, 30.0 * batch)
        d = ctl.tick(Observation(t, power, True, feats, batch, demand - batch))
        limit = d.enforced.max_requests
        out.append((t, d.proposed.max_requests, d.multipliers["power"]))
    return out


def test_observe_mode_proposes_what_enforce_mode_settles_at() -> None:
    enforce, observe = _closed_loop("enforce"), _closed_loop("observe")
    settled_e = float(np.median([n for t, n, _ in enforce if t >= 40]))
    settled_o = float(np.median([n for t, n, _ in observe if t >= 40]))
    # Observing, the meter shows 40 running (~660 W, over the 600 W ceiling) the whole time;
    # judged on that, the multiplier winds up to its cap and the proposal sinks to 1.
    assert abs(settled_o - settled_e) <= max(2.0, 0.25 * settled_e), (settled_o, settled_e)
    assert max(lam for t, _, lam in observe if t >= 20) < 0.25 * 600.0
    assert feasible_batch(concave_log, 600.0) >= settled_o >= 0.5 * settled_e


def test_a_binding_kv_cap_is_reported() -> None:
    ctl = Controller(ControlConfig(ceiling_w=2000.0, warmup_s=0.0))
    d = None
    for i in range(60):
        # Plenty of watts; the upstream's KV cache is over its target, and work waits while
        # the batch has room: the KV cap is what holds it back.
        feats = Features(4, 4 * 900.0, 160.0, 120.0)
        obs = Observation(i / 5, 400.0, True, feats, 4, 30, kv_cache_usage=0.97)
        d = ctl.tick(obs)
    assert d is not None and d.binding == "kv", d
    assert d.multipliers["kv"] > 0


def test_a_plant_whose_token_rate_saturates_is_filled_to_the_ceiling() -> None:
    """Power follows tokens per second, and an engine at its compute or token budget serves
    about the same tokens per second at any batch, so one more request adds little power. A
    controller that assumes the rate grows in proportion to the batch sees a steep curve and
    stops far short of the ceiling (seen in a real vLLM on CPU: 7 running of 18 at 488 W under a
    549 W target). It must learn how the rate scales with the batch on the plant it runs on.
    First tokens are late (the queue is long), so the growth step is boosted as well."""

    def tok_s(n: float) -> float:
        return 3000.0 * n / (n + 4.0)

    def plant(n: float) -> float:
        return 80.0 + 0.15 * tok_s(n) + 1.5 * n

    rng = np.random.default_rng(5)
    cfg = ControlConfig(ceiling_w=560.0, max_batch=64)
    ctl = Controller(cfg)
    late = LatencySnapshot(6.0, 0.03, {"high": 6.0}, 100)
    limit, limits, powers = cfg.initial_batch, [], []
    for i in range(120 * 5):
        t = i / 5
        batch = limit
        power = plant(batch) + rng.normal(0, 2.0)
        rate = tok_s(batch)
        feats = Features(batch, 300.0 * batch, 0.2 * rate, 0.8 * rate)
        d = ctl.tick(Observation(t, power, True, feats, batch, 60, latency=late))
        limit = d.enforced.max_requests
        if t >= 60:
            limits.append(limit)
            powers.append(power)
    # The target (the ceiling less its 2 % margin) less the 1 % dead band.
    feasible = max(n for n in range(1, 65) if plant(n) <= 560.0 * 0.97)
    assert np.median(limits) >= feasible - 3, (feasible, limits[-20:])
    assert max(powers) <= 560.0


def test_a_stale_latency_window_does_not_collapse_the_batch() -> None:
    """p95 time per output token comes from a sliding window (30 s by default) that still holds
    the slow tokens of a batch long after the batch was shrunk. Shrinking again on every tick
    while that window is stale winds the batch down to 1 (seen in front of a real vLLM: held at
    1 for 45 s). The law must wait for its last shrink to show before shrinking again."""
    from powerbatch.control.latency import LatencyWindow

    window = LatencyWindow(window_s=30.0)
    cfg = ControlConfig(ceiling_w=2000.0, max_batch=256)
    ctl = Controller(cfg)
    limit, limits = cfg.initial_batch, []
    for i in range(150 * 5):
        t = i / 5
        batch = limit
        window.record(t, "normal", 0.5, 0.0025 * batch)  # the SLO (0.1 s) holds up to 40
        feats = Features(batch, 900.0 * batch, 40.0 * batch, 30.0 * batch)
        obs = Observation(t, linear(batch), True, feats, batch, 1000, latency=window.snapshot(t))
        limit = ctl.tick(obs).enforced.max_requests
        limits.append(limit)
    late = limits[-150:]
    assert min(limits[len(limits) // 3 :]) >= 20, min(limits[len(limits) // 3 :])
    assert np.median(late) <= 48, np.median(late)


def test_the_prefill_pace_leaves_room_for_the_batch() -> None:
    """Prompts are compute: a burst of them is a burst of watts that the batch limit does not
    see (a request replacing one that finished keeps the batch the same size). The pace must
    let through only the prompt tokens whose watts fit under the target, learnt from the plant,
    and not a fixed multiple of the usual prompt flow: on a plant where 1,000 prompt tokens a
    second draw 12 W, a batch that already draws 470 W leaves room for about 7,000."""
    per_tok_w = 0.012

    def plant(batch: float, prefill_tok_s: float) -> float:
        return 380.0 + 3.0 * batch + per_tok_w * prefill_tok_s

    rng = np.random.default_rng(3)
    ctl = Controller(ControlConfig(ceiling_w=600.0, max_batch=256))
    for i in range(90 * 5):  # mixed operating points, a queue throughout
        batch = 15 + i % 16
        prefill = float(rng.uniform(0.0, 14_000.0))
        power = plant(batch, prefill) + rng.normal(0.0, 3.0)
        feats = Features(batch, 900.0 * batch, prefill, 30.0 * batch)
        ctl.tick(Observation(i / 5, power, True, feats, batch, 50))
    batch, prefill = 30, 1_000.0
    feats = Features(batch, 900.0 * batch, prefill, 30.0 * batch)
    d = ctl.tick(Observation(90.0, plant(batch, prefill), True, feats, batch, 50))
    pace = d.enforced.prefill_tok_s
    assert pace is not None
    room_tok_s = (d.target_w - plant(batch, 0.0)) / per_tok_w
    assert 0.6 * room_tok_s <= pace <= 1.1 * room_tok_s, (pace, room_tok_s, d.target_w)

    # A meter a second behind: it measured 10 requests, 30 run now. The pace is priced at the
    # 30 running, or the 20 the batch law let in since the reading get their watts twice.
    seen = Features(10, 900.0 * 10, prefill, 30.0 * 10)
    late = copy.deepcopy(ctl).tick(
        Observation(90.2, plant(10, prefill), True, feats, batch, 50, reading_features=seen)
    )
    pace = late.enforced.prefill_tok_s
    assert pace is not None and late.enforced.max_requests >= batch
    room_tok_s = (late.target_w - plant(batch, 0.0)) / per_tok_w
    assert 0.6 * room_tok_s <= pace <= 1.1 * room_tok_s, (pace, room_tok_s, late.target_w)


def test_a_queue_one_scrape_saw_holds_nothing_and_a_standing_one_does() -> None:
    """A burst's prompts wait a step or two for the engine's token budget; a scrape may see
    them all waiting. Only a queue over the buffer at two scrapes in a row holds work here."""
    law = EngineLaw(ControlConfig(ceiling_w=5000.0, max_batch=256))
    law.update(EngineLoad(13, 13, 1.0, 1.0), in_flight=13)  # the load's first scrape
    assert law.cap is None
    law.update(EngineLoad(0, 20, 8.0, 2.0), in_flight=20)  # started within the second
    assert law.cap is None
    law.update(EngineLoad(30, 60, 4.0, 3.0), in_flight=60)
    assert law.cap is None  # one scrape's queue, again
    law.update(EngineLoad(30, 60, 4.0, 4.0), in_flight=60)  # it stands: 30 run, 8 buffered
    assert law.cap == 30 + law.buffer(4.0)


def test_work_the_engine_would_queue_waits_here_and_the_engine_stays_fed() -> None:
    """An engine that runs at most `capacity` requests queues the rest first come first served;
    the controller holds that surplus in admission's queue (by class) instead, and follows the
    engine's capacity up when it grows, seen only through its scraped counts."""
    cfg = ControlConfig(ceiling_w=5000.0, max_batch=256, warmup_s=0.0)
    ctl = Controller(cfg)
    start_rate = 4.0  # requests the engine starts per second (it finishes as many)
    limit, scraped, trace = cfg.initial_batch, None, []
    for i in range(int(60 * cfg.tick_hz)):
        t = i / cfg.tick_hz
        capacity = 24 if t < 30 else 60
        in_flight = limit  # demand without end: admission fills every slot
        if scraped is None or t - scraped.t_s >= 1.0:  # the upstream's metrics, once a second
            queued = max(0, in_flight - capacity)
            scraped = EngineLoad(queued, in_flight, start_rate, t)
        feats = Features(in_flight, 900.0 * in_flight, 40.0 * in_flight, 30.0 * in_flight)
        d = ctl.tick(Observation(t, 300.0 + in_flight, True, feats, in_flight, 500, engine=scraped))
        limit = d.enforced.max_requests
        trace.append((t, limit, d.binding))
    buffer = ctl.engine.buffer(start_rate)
    settled = [(lim, b) for t, lim, b in trace if 15 <= t < 30]
    assert all(24 <= lim <= 24 + buffer for lim, _ in settled), settled
    assert all(b == "engine" for _, b in settled), settled
    grown = [lim for t, lim, _ in trace if 40 <= t < 60]
    assert all(60 <= lim <= 60 + buffer for lim in grown), grown
    # No scraped counts (a server without them): the law lets go.
    d = ctl.tick(Observation(61.0, 360.0, True, Features(60, 5.4e4, 2400, 1800), 60, 500))
    assert d.binding != "engine"
