"""How well the latency law's measure forecasts the TPOT the running requests end with.

The latency law cuts the batch while the engine's time per token (`EngineQueue.token_s`, "what
the requests running now will show at their end") and its step now are over the TPOT SLO. This
replays one fleet-matrix member's plan through `SimEngine` in virtual time under a device limit,
everything admitted at once (as behind a hardware cap), feeds the engine's counters to
`EngineQueue` once a simulated second as the proxy's scrape does, and prints each second:
`token_s`, the step now, the requests finished so far, and the TPOT the requests running then
actually end with (mean and p95: the truth the measure stands for). The summary is the measure
over the truth's p95, median and worst, over the seconds that have both.

    python benchmarks/tpot_forecast.py --case diurnal-4mixed-65% --member 2 --seed 2 --limit-w 354

`--all` replays every member of every reduced case (seeds 1-2, each at its split limit) and
counts the seconds the law's engine condition (`token_s` and the step now both over the SLO)
disagrees with the truth (the running requests' eventual p95 over it): cuts it would make
where the requests end inside the SLO, and breaches it would let run.

No sleeping and no network: a 20-s plan takes about a second of CPU (`--all`: sizing the
reduced cases' loads, about three minutes).
"""

from __future__ import annotations

import argparse
import statistics

from powerbatch.cli import fleet_matrix
from powerbatch.control.engine_queue import EngineQueue
from powerbatch.sim.capacity import replay
from powerbatch.sim.engine import SimEngine, SimRequest
from powerbatch.telemetry import UpstreamSignals

Row = tuple[float, float | None, float | None, int, float | None, float | None]
"""(t s, token_s, step now, requests finished, the running requests' eventual mean and p95)"""


def replay_member(
    case: fleet_matrix.Case, scale: fleet_matrix.LoadScale, member: int, seed: int,
    limit_w: float, duration_s: float,
) -> list[Row]:  # fmt: skip
    plan = fleet_matrix.member_plan(
        case, member, scale.hot_rps[member], scale.out_median, seed, duration_s
    )
    queue = EngineQueue()
    seen: list[tuple[float, float | None, float | None, int]] = []

    def scrape(t_s: float, eng: SimEngine, sent: list[SimRequest]) -> None:
        up = UpstreamSignals(
            eng.num_running, eng.num_waiting, eng.kv_usage, t_s,
            requests_started_total=eng.requests_started_total, itl_sum_s=eng.itl_total_s,
            itl_count=eng.itl_count, decode_sum_s=eng.decode_total_s,
            decode_count=eng.decode_count, generation_tokens_total=eng.generation_tokens_total,
        )  # fmt: skip
        queue.update(up, len(sent), eng.num_running + eng.num_waiting)
        step = queue.load.step_s if queue.load is not None else None
        seen.append((t_s, queue.token_s, step, eng.requests_finished))

    sent = replay(case.plants()[member], limit_w, plan, each=scrape)
    rows: list[Row] = []
    for t, token_s, step, finished in seen:
        if t > duration_s:
            break
        ends = [x for r in sent if r.first_token_s is not None and r.first_token_s <= t
                < r.last_token_s and (x := r.tpot_s) is not None]  # fmt: skip
        p95 = statistics.quantiles(ends, n=20)[-1] if len(ends) >= 5 else None
        mean = statistics.mean(ends) if ends else None
        rows.append((t, token_s, step, finished, mean, p95))
    return rows


def confusion(duration_s: float) -> None:
    slo_s = fleet_matrix.TPOT_SLO_S
    total = [0, 0, 0, 0]  # seconds, truth over, false cuts, breaches let run
    for case in fleet_matrix.reduced_cases():
        scale = fleet_matrix.load_scale(case, duration_s)
        for seed in (1, 2):
            n = [0, 0, 0, 0]
            for m, plant in enumerate(case.plants()):
                for _, token_s, step, _, _, p95 in replay_member(
                    case, scale, m, seed, plant.ceiling_w, duration_s
                ):
                    if p95 is None:
                        continue
                    cut = token_s is not None and step is not None and min(token_s, step) > slo_s
                    n[0] += 1
                    n[1] += p95 > slo_s
                    n[2] += cut and p95 <= slo_s
                    n[3] += not cut and p95 > slo_s
            print(f"{case.name} seed {seed}: {n[0]} s read, truth over in {n[1]}, "
                  f"false cuts {n[2]}, breaches let run {n[3]}", flush=True)  # fmt: skip
            total = [a + b for a, b in zip(total, n, strict=True)]
    print(f"all: {total[0]} s read, truth over in {total[1]}, false cuts {total[2]}, "
          f"breaches let run {total[3]}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="diurnal-4mixed-65%")
    p.add_argument("--member", type=int, default=2)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--limit-w", type=float, default=354.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--all", action="store_true", help="count disagreements over every member")
    a = p.parse_args()
    if a.all:
        confusion(a.duration_s)
        return
    case = next(c for c in fleet_matrix.reduced_cases() + fleet_matrix.full_cases()
                if c.name == a.case)  # fmt: skip
    scale = fleet_matrix.load_scale(case, a.duration_s)
    plant = case.plants()[a.member]
    rows = replay_member(case, scale, a.member, a.seed, a.limit_w, a.duration_s)
    slo_s = fleet_matrix.TPOT_SLO_S
    print(f"{case.name}, member {a.member} ({plant.profile.name}), seed {a.seed}, "
          f"{a.limit_w:.0f} W, TPOT SLO {slo_s * 1000:.0f} ms")  # fmt: skip

    def ms(x: float | None) -> str:
        return f"{1000 * x:6.0f}" if x is not None else "     -"

    print("   t s  token_s ms  step ms  finished | running then end at: mean ms  p95 ms")
    ratios = []
    for t, token_s, step, finished, mean, p95 in rows:
        print(
            f"{t:6.1f}  {ms(token_s)}      {ms(step)}   {finished:6d}  |"
            f"                  {ms(mean)}  {ms(p95)}"
        )
        if token_s is not None and p95:
            ratios.append(token_s / p95)
    if ratios:
        median = statistics.median(ratios)
        print(f"token_s / the running requests' eventual p95: median {median:.2f}, "
              f"low {min(ratios):.2f}, high {max(ratios):.2f}, over {len(ratios)} s")  # fmt: skip


if __name__ == "__main__":
    main()
