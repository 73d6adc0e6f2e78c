"""One matrix case's runs, member by member, in bins of the run (docs/fleet.md, stop 36).

For each seed with both a `hwcap` and a `fleet` run under `<out>/logs/<case>/`: requests
answered within SLO over those sent, per member and bin, in each arm (from `request_rows`); the
member's mean 1-s draw in each arm (`member_w`); and the fleet arm's /status rows averaged over
the bin (share, device limit in force, batch, in flight, queued: mean/max, the share of rows it
bid needy, its want and value, what its renewal reported as using).

    python benchmarks/fleet_bins.py results/fleet-matrix/stop36 diurnal-4mixed-65% [--bin 2.5]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _bins(run: dict[str, Any], member: int, width: float) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for m, t, _prio, _status, _ttft, _tpot, ok in run["request_rows"]:
        if m == member:
            out[int(t // width)][1] += 1
            out[int(t // width)][0] += int(ok)
    return out


def report(out: Path, case: str, width: float, detail: bool) -> str:
    lines = []
    base = out / "logs" / case
    seeds = sorted({p.name.rsplit("-", 1)[1] for p in base.iterdir()}, key=int)
    for s in seeds:
        paths = {arm: base / f"{arm}-{s}" / "run.json" for arm in ("hwcap", "fleet")}
        if not all(p.exists() for p in paths.values()):
            continue
        h, f = (json.loads(p.read_text()) for p in paths.values())
        ratio = f["goodput_rps"] / h["goodput_rps"]
        lines.append(
            f"=== seed {s}: goodput hwcap {h['goodput_rps']:.2f} fleet {f['goodput_rps']:.2f}"
            f" ratio {ratio:.3f}"
        )
        for i in range(len(h["member_w"])):
            bh, bf = _bins(h, i, width), _bins(f, i, width)
            sent = sum(v[1] for v in bh.values())
            lines.append(
                f" member {i}: good hwcap {sum(v[0] for v in bh.values())}"
                f" fleet {sum(v[0] for v in bf.values())} of {sent}"
            )
            if not detail:
                continue
            rows = [r for r in f["status_rows"] if r["member"] == i]
            for k in range(math.ceil(f["seconds"] / width) + 3):
                rs = [r for r in rows if k * width <= r["t_s"] < (k + 1) * width]

                def col(key: str, rs: list[dict[str, Any]] = rs) -> list[float]:
                    return [float(r[key]) for r in rs if isinstance(r.get(key), int | float)]

                lo, hi = int(k * width), int((k + 1) * width)
                queued = col("queued")
                lines.append(
                    f"  t{k * width:5.1f} h {bh[k][0]:3d}/{bh[k][1]:3d}"
                    f" f {bf[k][0]:3d}/{bf[k][1]:3d}"
                    f" | drawW h {_mean(h['member_w'][i][lo:hi]):4.0f}"
                    f" f {_mean(f['member_w'][i][lo:hi]):4.0f}"
                    f" | share {_mean(col('share_w')):4.0f} lim {_mean(col('limit_w')):4.0f}"
                    f" batch {_mean(col('batch')):5.1f} infl {_mean(col('in_flight')):4.1f}"
                    f" q {_mean(queued):4.1f}/{max(queued, default=math.nan):3.0f}"
                    f" | needy {_mean(col('bid_needy')):.2f} want {_mean(col('bid_want_w')):4.0f}"
                    f" v {_mean(col('bid_value_per_w')) * 1000:5.2f}m"
                    f" using {_mean(col('bid_using_w')):4.0f}"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("case")
    p.add_argument("--bin", type=float, default=2.5, help="bin width, s")
    p.add_argument("--brief", action="store_true", help="per member totals only")
    a = p.parse_args()
    print(report(a.out, a.case, a.bin, not a.brief))


if __name__ == "__main__":
    main()
