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

No sleeping and no network: a 20-s plan takes about a second of CPU.
"""

from __future__ import annotations

import argparse
import statistics

from powerbatch.cli import fleet_matrix
from powerbatch.control.engine_queue import EngineQueue
from powerbatch.sim.capacity import replay
from powerbatch.sim.engine import SimEngine, SimRequest
from powerbatch.telemetry import UpstreamSignals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="diurnal-4mixed-65%")
    p.add_argument("--member", type=int, default=2)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--limit-w", type=float, default=354.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    a = p.parse_args()
    case = next(c for c in fleet_matrix.reduced_cases() + fleet_matrix.full_cases()
                if c.name == a.case)  # fmt: skip
    scale = fleet_matrix.load_scale(case, a.duration_s)
    plan = fleet_matrix.member_plan(
        case, a.member, scale.hot_rps[a.member], scale.out_median, a.seed, a.duration_s
    )
    plant = case.plants()[a.member]
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

    sent = replay(plant, a.limit_w, plan, each=scrape)
    slo_s = fleet_matrix.TPOT_SLO_S
    print(f"{case.name}, member {a.member} ({plant.profile.name}), seed {a.seed}, "
          f"{a.limit_w:.0f} W, {len(sent)} requests, TPOT SLO {slo_s * 1000:.0f} ms")  # fmt: skip

    def ms(x: float | None) -> str:
        return f"{1000 * x:6.0f}" if x is not None else "     -"

    print("   t s  token_s ms  step ms  finished | running then end at: mean ms  p95 ms")
    ratios = []
    for t, token_s, step, finished in seen:
        if t > a.duration_s:
            break
        ends = [x for r in sent if r.first_token_s is not None and r.first_token_s <= t
                < r.last_token_s and (x := r.tpot_s) is not None]  # fmt: skip
        p95 = statistics.quantiles(ends, n=20)[-1] if len(ends) >= 5 else None
        mean = statistics.mean(ends) if ends else None
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
