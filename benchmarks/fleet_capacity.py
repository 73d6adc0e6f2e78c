"""What each member of the fleet matrix can serve, from the plants: is there anything to move?

For every reduced-matrix case (`powerbatch.cli.fleet_matrix.reduced_cases`) and kind of member,
the sizing the matrix itself uses (`fleet_matrix.sizing`, capacities from
`powerbatch.sim.capacity`): C(split), what the member serves with its hardware limit at the
static split; w_max, the highest share the hot member can be given (its TDP, or the budget less
the lowest limits that serve the cold members' rates); C(w_max); and the rates the matrix sends
(the peak at `hot_position` inside [C(split), C(w_max)]). A steady-state sizing, not a figure
the bench measures.

    PYTHONPATH=. python benchmarks/fleet_capacity.py \
        > results/fleet-matrix/stop31-capacity/capacity.md
"""

from __future__ import annotations

from powerbatch.cli import fleet_matrix as fm


def main() -> None:
    print(
        "| case | member | answer median, tokens | split | C(split), req/s | w_max | C(w_max) "
        "| room | peak | hot (mean) | cold |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in fm.reduced_cases():
        plants = case.plants()
        out = fm.output_median(case, plants)
        seen: set[tuple[str, float]] = set()
        for pl, m in zip(plants, fm.sizing(case, plants, out), strict=True):
            key = (str(pl.draw["kind"]), pl.ceiling_w)
            if key in seen:
                continue
            seen.add(key)
            print(
                f"| {case.name} | {key[0]} | {out:.0f} | {m.split_w:.0f} W | {m.at_split_rps:.2f} "
                f"| {m.max_share_w:.0f} W | {m.at_max_rps:.2f} | {m.room:.2f}x | {m.peak_rps:.2f} "
                f"| {m.hot_rps:.2f} | {m.cold_rps:.2f} |"
            )


if __name__ == "__main__":
    main()
