"""Print the LLM view of a locust run from its `--csv` output: per class TTFT, TPOT, E2E and
output tokens per second, then request counts, failures and 429/503 rejections.

    python load_tests/summarize.py results/load/steady        # the --csv prefix
    python load_tests/summarize.py results/load/steady --json  # the same, as JSON

Plain Python (no locust import), so tests and notebooks can use `summarize()` directly.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS = {"TTFT": "ms", "TPOT": "ms", "E2E": "ms", "TOK/S": "tok/s"}
_PCTS = ("50%", "90%", "95%", "99%")


def _num(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None  # locust writes "N/A" for empty percentiles


def summarize(prefix: str | Path) -> dict[str, Any]:
    """{"metrics": {kind: {class: {...}}}, "requests": {name: {...}}, "rejected": {...}}."""
    with Path(f"{prefix}_stats.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, Any] = {"metrics": {}, "requests": {}, "rejected": {}}
    for r in rows:
        kind, name = r["Type"], r["Name"]
        count = int(r["Request Count"])
        if kind in METRICS:
            stats = {
                "count": count,
                "mean": _num(r["Average Response Time"]),
                "unit": METRICS[kind],
            }
            stats |= {f"p{p.rstrip('%')}": _num(r[p]) for p in _PCTS}
            if kind == "TOK/S":
                stats["mean_output_tokens"] = _num(r["Average Content Size"])
            out["metrics"].setdefault(kind, {})[name] = stats
        elif kind == "REJECTED":
            out["rejected"][name] = count
        elif name != "Aggregated":
            out["requests"][f"{kind} {name}"] = {
                "count": count,
                "failures": int(r["Failure Count"]),
                "mean_ms": _num(r["Average Response Time"]),
                "rps": _num(r["Requests/s"]),
            }
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def render(s: dict[str, Any]) -> str:
    lines = [
        f"{'metric':<7} {'class':<8} {'n':>6} {'mean':>9} " + " ".join(f"{p:>8}" for p in _PCTS)
    ]
    for kind, by_class in s["metrics"].items():
        for name, st in sorted(by_class.items()):
            pcts = " ".join(f"{_fmt(st['p' + p.rstrip('%')]):>8}" for p in _PCTS)
            lines.append(
                f"{kind:<7} {name:<8} {st['count']:>6} {_fmt(st['mean']):>9} {pcts}  {st['unit']}"
            )
    lines.append("")
    for name, st in s["requests"].items():
        lines.append(
            f"{name:<28} {st['count']:>6} requests  {st['failures']:>5} failed  "
            f"mean {_fmt(st['mean_ms'])} ms"
        )
    for name, n in sorted(s["rejected"].items()):
        lines.append(f"rejected {name:<19} {n:>6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("prefix", help="the --csv prefix locust was given")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    s = summarize(a.prefix)
    sys.stdout.write((json.dumps(s, indent=2) if a.json else render(s)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
