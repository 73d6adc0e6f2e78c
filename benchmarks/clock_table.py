"""The clock arms' table from `powerbatch bench --cap-by-clock` outputs: each arm's figures as
ratios to the hardware cap's, measured in the same run, per plant, and the worst case over the
plants for each figure.

    python benchmarks/clock_table.py results/clock/h200-decode-light results/clock/... \\
        --out results/clock/table.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARMS = ("hwcap-lock", "powerbatch-clock")


def figures(agg: dict[str, Any]) -> dict[str, float | None]:
    lat = agg.get("latency", {})

    def p95(cls: str, key: str) -> float | None:
        v = lat.get(cls, {}).get(key)
        return float(v) if v is not None else None

    return {
        "j_per_token": agg["j_per_token"]["mean"],
        "goodput_rps": agg["goodput_rps"]["mean"],
        "ttft_high": p95("high", "ttft_p95_s"),
        "ttft_normal": p95("normal", "ttft_p95_s"),
        "tpot_high": p95("high", "tpot_p95_s"),
        "over_pct": 100.0 * (agg["frac_above_ceiling"]["mean"] or 0.0),
    }


def ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None or y == 0 else x / y


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--lock",
        action="append",
        default=[],
        metavar="PLANT=MHZ",
        help="the sweep's pick, for results.json files written before it was recorded",
    )
    a = p.parse_args()
    lines = [
        "| plant | arm | J/token | goodput | p95 TTFT high / normal | p95 TPOT high | "
        "% s over | J/token vs the static lock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    picked = dict(x.split("=") for x in a.lock)
    for d in a.dirs:
        res = json.loads((d / "results.json").read_text())
        agg = res["aggregate"]
        cap = figures(agg["hwcap"])
        static = figures(agg["hwcap-lock"]) if "hwcap-lock" in agg else None
        lock = res.get("static_clock_mhz") or picked.get(d.name) or res["args"]["static_clock_mhz"]
        lines.append(
            f"| {d.name} | hwcap | {cap['j_per_token']:.3f} J | {cap['goodput_rps']:.2f} rps | "
            f"{fmt(cap['ttft_high'], '.2f')} / {fmt(cap['ttft_normal'], '.2f')} s | "
            f"{fmt(cap['tpot_high'])} s | {cap['over_pct']:.1f} | |"
        )
        for arm in ARMS:
            if arm not in agg:
                continue
            f = figures(agg[arm])
            r = {k: ratio(f[k], cap[k]) for k in ("j_per_token", "goodput_rps")}
            vs_static = ratio(f["j_per_token"], static["j_per_token"]) if static else None
            name = arm if arm != "hwcap-lock" else f"hwcap-lock ({lock} MHz sweep)"
            lines.append(
                f"| {d.name} | {name} | {fmt(r['j_per_token'])}x | {fmt(r['goodput_rps'])}x | "
                f"{fmt(ratio(f['ttft_high'], cap['ttft_high']), '.2f')}x / "
                f"{fmt(ratio(f['ttft_normal'], cap['ttft_normal']), '.2f')}x | "
                f"{fmt(f['tpot_high'])} s | {f['over_pct']:.1f} | "
                f"{fmt(vs_static) + 'x' if arm == 'powerbatch-clock' else ''} |"
            )
            row = {"plant": d.name, "arm": arm, **r, "vs_static": vs_static}
            row["ttft_high"] = ratio(f["ttft_high"], cap["ttft_high"])
            row["ttft_normal"] = ratio(f["ttft_normal"], cap["ttft_normal"])
            rows.append(row)
            for key, bad in (("j_per_token", max), ("goodput_rps", min), ("vs_static", max)):
                v = row[key]
                if v is not None and arm == "powerbatch-clock":
                    worst[key] = bad(worst.get(key, v), v)
    text = "\n".join(lines)
    text += (
        "\n\nWorst over the plants, powerbatch-clock: J/token "
        f"{fmt(worst.get('j_per_token'))}x the cap's, goodput {fmt(worst.get('goodput_rps'))}x, "
        f"J/token {fmt(worst.get('vs_static'))}x the best static lock's.\n"
    )
    print(text)
    if a.out:
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
