"""What a simulated GPU set serves under a hardware power limit: its capped capacity C(plant, w).

The law (a steady-state sizing from the plant's profile, not a measured figure): under a limit
`w` the simulator slows each decode step (`gpu_model.step_at_clock`: on these profiles the
step by about sqrt(P / w)) and keeps the batch, so a capped set can run up to `max_num_seqs`
requests (or what its KV cache holds at the mean lengths). Over those batches b, a batch counts
while its step keeps the time per output token under the TPOT SLO; it serves

    b / (step_s(b, w) * output_mean + b * prompt_mean / prefill_tok_s(w))

requests a second, prefill at the limit's share of prefill power (`min(1, w / prefill_w)`).
C(plant, w) is the largest of these. It does not fall as `w` rises (a higher limit never slows
a step), so the lowest limit that serves a rate (`need_w`) is found by bisection.

What a plan of requests gets within the SLOs is not C: a queue absorbs a burst shorter than its
TTFT SLO allows, and a member's load swings. `served_in_slo` runs the plan through `SimEngine`
itself in virtual time (no sleeping: a 20-s plan in well under a second of CPU), the engine the
benches' servers run, under a limit; the fleet matrix sizes its loads by it.

`admission`'s sizing (`Plant.sustain_rps`: the batch where *uncapped* decode power meets the
ceiling) is what a member serves when admission holds it under the ceiling; C is what it serves
when the ceiling is a device limit, 1.1-3.3x more on the fleet matrix's members.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Protocol

from powerbatch.sim.engine import DEFAULT_MAX_NUM_SEQS, SimEngine, SimRequest, VirtualClock
from powerbatch.sim.gpu_model import GpuProfile, prefill_power_w, step_at_clock
from powerbatch.sim.plants import Plant

NEED_RESOLUTION_W = 1.0


def capped_rps(
    plant: Plant,
    limit_w: float,
    prompt_mean: float,
    output_mean: float,
    *,
    tpot_slo_s: float,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> float:
    """Requests/s the plant serves with its device limit at `limit_w` (module docstring)."""
    return _capped_rps(plant.profile, plant.kv_capacity_tokens, float(limit_w), prompt_mean,
                       output_mean, tpot_slo_s, max_num_seqs)  # fmt: skip


@lru_cache(maxsize=65_536)
def _capped_rps(
    p: GpuProfile,
    kv_capacity_tokens: int,
    limit_w: float,
    prompt_mean: float,
    output_mean: float,
    tpot_slo_s: float,
    max_num_seqs: int,
) -> float:
    kv_batch = kv_capacity_tokens / (prompt_mean + output_mean / 2.0)
    prefill_tok_s = p.prefill_tok_s * min(1.0, limit_w / prefill_power_w(p))
    best = 0.0
    for b in range(1, int(min(max_num_seqs, kv_batch)) + 1):
        step_s = step_at_clock(p, b, 0, power_limit_w=limit_w).step_s
        if step_s > tpot_slo_s:
            break
        best = max(best, b / (step_s * output_mean + b * prompt_mean / prefill_tok_s))
    return best


def need_w(
    plant: Plant, rps: float, prompt_mean: float, output_mean: float, *, tpot_slo_s: float
) -> float:
    """The lowest limit (to `NEED_RESOLUTION_W`, within the device's range) whose capped
    capacity covers `rps`; the device's TDP where none does."""

    def serves(limit_w: float) -> bool:
        return capped_rps(plant, limit_w, prompt_mean, output_mean, tpot_slo_s=tpot_slo_s) >= rps

    lo, hi = plant.profile.min_limit_w, plant.profile.tdp_w
    if serves(lo):
        return lo
    if not serves(hi):
        return hi
    while hi - lo > NEED_RESOLUTION_W:  # capped_rps(lo) < rps <= capped_rps(hi)
        mid = (lo + hi) / 2.0
        if serves(mid):
            hi = mid
        else:
            lo = mid
    return hi


class Planned(Protocol):
    """A request to send (`powerbatch.load.profile.PlannedRequest` is one)."""

    @property
    def t_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


def served_in_slo(
    plant: Plant,
    limit_w: float,
    requests: Iterable[Planned],
    *,
    ttft_slo_s: float,
    tpot_slo_s: float,
    seed: int = 0,
) -> tuple[int, int]:
    """(answered within both SLOs, sent) when `requests` (sent at their `t_s`) run on the plant
    with its device limit at `limit_w`, in virtual time until the last one ends. An answer's TTFT
    is from its arrival at the engine and its TPOT the mean gap after the first token, as the
    load client counts goodput (`RequestResult.within_slo`); no proxy, network or CPU stands
    between, so a real-time run serves the same or less."""
    sent = replay(plant, limit_w, requests, seed=seed)
    good = sum(_within_slo(r, ttft_slo_s, tpot_slo_s) for r in sent)
    return good, len(sent)


def replay(
    plant: Plant,
    limit_w: float,
    requests: Iterable[Planned],
    *,
    seed: int = 0,
    every_s: float = 1.0,
    each: Callable[[float, SimEngine, list[SimRequest]], None] | None = None,
) -> list[SimRequest]:
    """The requests sent (each at its `t_s`) to a `SimEngine` of the plant under a device limit
    of `limit_w`, stepped in virtual time until the last one ends; `each(t_s, engine, sent)`
    runs once per `every_s` of virtual time (a scrape's view of the engine at `t_s`)."""
    clock = VirtualClock(0.0)
    eng = SimEngine(
        plant.profile,
        kv_capacity_tokens=plant.kv_capacity_tokens,
        power_limit_w=min(max(limit_w, plant.profile.min_limit_w), plant.profile.tdp_w),
        seed=seed,
        clock=clock,
    )
    todo = sorted(requests, key=lambda r: r.t_s)
    sent: list[SimRequest] = []
    i, next_s = 0, 0.0
    while True:
        while i < len(todo) and todo[i].t_s <= clock.t:
            sent.append(eng.add_request(todo[i].prompt_tokens, todo[i].max_tokens))
            i += 1
        if each is not None and clock.t >= next_s:
            each(clock.t, eng, sent)
            next_s += every_s
        if eng.step() is not None:
            clock.t = eng.clock_s
        elif i < len(todo):
            clock.t = todo[i].t_s
        else:
            break
    return sent


def _within_slo(r: SimRequest, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    if r.first_token_s is None or r.first_token_s - r.arrival_s > ttft_slo_s:
        return False
    return r.tpot_s is None or r.tpot_s <= tpot_slo_s
