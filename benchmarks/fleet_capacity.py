"""What each member of the fleet matrix can serve, from the plants: is there anything to move?

For every reduced-matrix case (`powerbatch.cli.fleet_matrix.reduced_cases`) and member, beside
the rates the matrix sends it:

    sustain at split   `fleet_matrix.sustain_rps`: the matrix's sizing, admission's view (the
                       batch where *uncapped* decode power meets the split, or less)
    capped at split    what the member serves with its hardware limit at the split (the static
                       split arm): the largest rate over batches up to `max_num_seqs` and the
                       KV cache, each decode step slowed by the cap (`gpu_model.step_at_clock`),
                       whose step keeps the time per token under its SLO, prefill at the cap's
                       speed; a steady-state sizing, not a figure the bench measures
    capped at max      the same at the highest share the hot member can be given: its TDP, or
                       the budget less what the cold members need to serve their cold rate
                       (each the lowest limit whose capped rate covers it)

A hot rate under "capped at split" is served by the static split; one over "capped at max" by
no allocation. Only between the two can a fleet beat the split, and by at most their ratio.

    PYTHONPATH=. python benchmarks/fleet_capacity.py > results/fleet-matrix/stop31/capacity.md
"""

from __future__ import annotations

from powerbatch.cli import fleet_matrix as fm
from powerbatch.sim.gpu_model import prefill_power_w, step_at_clock
from powerbatch.sim.plants import Plant

TPOT_SLO_S = 0.1  # the matrix's goodput SLO (fleet_bench: TTFT 2 s, TPOT 0.1 s)
MAX_NUM_SEQS = 256  # SimEngine's default batch limit
BURST_PEAK = 1.3  # a moving hot spot's first half (fleet_matrix._phases)
LIMIT_STEP_W = 5.0


def capped_rps(plant: Plant, ceiling_w: float, output_median: float) -> float:
    """Requests/s the plant serves with its limit at `ceiling_w` (module docstring)."""
    p = plant.profile
    prompt, output = fm._means(output_median)
    kv_batch = plant.kv_capacity_tokens / (prompt + output / 2.0)
    prefill_tok_s = p.prefill_tok_s * min(1.0, ceiling_w / prefill_power_w(p))
    best = 0.0
    for b in range(1, int(min(MAX_NUM_SEQS, kv_batch)) + 1):
        step_s = step_at_clock(p, b, 0, power_limit_w=ceiling_w).step_s
        if step_s > TPOT_SLO_S:
            break
        best = max(best, b / (step_s * output + b * prompt / prefill_tok_s))
    return best


def need_w(plant: Plant, rps: float, output_median: float) -> float:
    """The lowest limit (in `LIMIT_STEP_W` steps from the device's lowest) serving `rps`."""
    p = plant.profile
    w = p.min_limit_w_per_gpu * p.num_gpus
    while w < p.tdp_w and capped_rps(plant, w, output_median) < rps:
        w += LIMIT_STEP_W
    return min(w, p.tdp_w)


def main() -> None:
    print(
        "| case | member | split | sustain at split (matrix) | hot rate, peak | cold rate "
        "| capped at split | hot member's max share | capped at max | max / split |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in fm.reduced_cases():
        plants = case.plants()
        out = fm.output_median(case, plants)
        budget = case.budget_w()
        seen: set[tuple[str, float]] = set()
        for i, pl in enumerate(plants):
            key = (str(pl.draw["kind"]), pl.ceiling_w)
            if key in seen:
                continue
            seen.add(key)
            sustain = fm.sustain_rps(pl, out)
            hot = case.peak_over_sustain * sustain
            peak = hot * (BURST_PEAK if case.load == "moving" else 1.0)
            cold = hot / case.hot_over_cold
            at_split = capped_rps(pl, pl.ceiling_w, out)
            others = sum(
                need_w(q, case.peak_over_sustain * fm.sustain_rps(q, out) / case.hot_over_cold,
                       out)
                for j, q in enumerate(plants)
                if j != i
            )  # fmt: skip
            most_w = max(min(pl.profile.tdp_w, budget - others), pl.ceiling_w)
            at_most = capped_rps(pl, most_w, out)
            print(
                f"| {case.name} | {key[0]} | {pl.ceiling_w:.0f} W | {sustain:.2f} | {peak:.2f} "
                f"| {cold:.2f} | {at_split:.2f} | {most_w:.0f} W | {at_most:.2f} "
                f"| {at_most / at_split:.2f}x |"
            )


if __name__ == "__main__":
    main()
