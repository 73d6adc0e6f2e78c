"""`powerbatch demo`: the simulator, the proxy and a bursty load, with a live view and a plot."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from powerbatch.cli.bench import add_common, fetch_json, run_arm
from powerbatch.cli.extras import require_cli_extra
from powerbatch.cli.report import plot_runs, summarize
from powerbatch.cli.stack import Stack
from powerbatch.load import PROFILES

if TYPE_CHECKING:
    from rich.table import Table


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="watch powerbatch hold a simulated GPU under a ceiling")
    add_common(p, 60.0)
    p.add_argument("--out", type=Path, default=Path("out/demo"))
    p.add_argument(
        "--limiter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="both actuators: the device power limit (the simulator's zeusd API) and admission",
    )
    p.add_argument(
        "--clock",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a third actuator: the SM clock, locked by the clock law through the simulator's "
        "zeusd API (--clock-objective energy; docs/clock.md)",
    )
    p.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live terminal view (default: when stdout is a terminal)",
    )
    p.set_defaults(func=main)


def _bar(value: float, full: float, width: int = 30) -> str:
    n = max(0, min(width, round(width * value / full))) if full > 0 else 0
    return "█" * n + "·" * (width - n)


def _view(status: dict[str, Any], sim: dict[str, Any], elapsed_s: float, total_s: float) -> Table:
    p = status["power"]
    lim = status["limits"]["enforced"] or {}
    lat = status["latency"]
    q = status["queue"]
    from rich.table import Table

    t = Table(title=f"powerbatch demo — {elapsed_s:4.0f} / {total_s:.0f} s", show_header=False)
    t.add_column(width=26)
    t.add_column()
    ceiling = p["ceiling_w"]
    measured = p["measured_w"] or 0.0
    colour = "red" if measured > ceiling else "green"
    t.add_row("power (measured)", f"[{colour}]{_bar(measured, 1.3 * ceiling)} {measured:6.0f} W")
    t.add_row("ceiling", f"{_bar(ceiling, 1.3 * ceiling)} {ceiling:6.0f} W")
    limit = status.get("power_limit") or {}
    if limit:
        in_force = limit.get("in_force_w")
        text = "degraded: admission alone" if limit.get("degraded") else "—"
        if in_force is not None and not limit.get("degraded"):
            text = f"{_bar(in_force, 1.3 * ceiling)} {in_force:6.0f} W"
        t.add_row("device power limit", text)
    upper = p["predicted_upper_w"]
    t.add_row("predicted upper bound", "—" if upper is None else f"{upper:.0f} W")
    t.add_row("batch limit / in flight", f"{lim.get('max_requests', '—')} / {q['in_flight']}")
    pace = lim.get("prefill_tok_s")
    t.add_row("prefill pace", "off" if pace is None else f"{pace:,.0f} tok/s")
    t.add_row("queued (high/normal/low)", " / ".join(str(v) for v in q["queued"].values()))
    t.add_row("GPU running / waiting", f"{sim.get('running', '—')} / {sim.get('waiting', '—')}")
    clock = status.get("clock") or {}
    locked = clock.get("locked_mhz")
    lock_text = "unlocked" if not locked else f"locked {locked[0]}-{locked[1]} MHz"
    why = (clock.get("law") or {}).get("reason") or ""
    t.add_row("SM clock", f"{sim.get('sm_clock_mhz', 0):.0f} MHz ({lock_text}) {why}".rstrip())

    def s(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f} s"

    t.add_row("p95 TTFT (SLO)", f"{s(lat['ttft_p95_s'])} ({lat['ttft_slo_s']} s)")
    t.add_row("p95 time/token (SLO)", f"{s(lat['tpot_p95_s'])} ({lat['tpot_slo_s']} s)")
    mult = ", ".join(f"{k} {v:.2f}" for k, v in status["multipliers"].items())
    t.add_row("multipliers", mult or "—")
    t.add_row("binding / state", f"[bold]{status['binding']}[/] / {status['state']}")
    t.add_row("why", status["reason"])
    return t


async def _demo(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    console = Console()
    live_on = sys.stdout.isatty() if a.live is None else a.live
    profile = PROFILES[a.profile]()
    console.print(
        f"Starting the simulated GPU ({a.gpu}), powerbatch at a {a.ceiling_w:.0f} W ceiling, "
        f"and {a.duration_s:.0f} s of {profile.name} load…"
    )

    async def watch(stack: Stack, t0: float) -> None:
        async with aiohttp.ClientSession() as session:
            live = Live(console=console, refresh_per_second=4) if live_on else None
            with live or contextlib.nullcontext():
                last_print = 0.0
                while True:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        status = await fetch_json(session, stack.proxy_url + "/status")
                        sim = await fetch_json(session, stack.sim_url + "/sim/state")
                        elapsed = time.monotonic() - t0
                        if live is not None:
                            live.update(_view(status, sim, elapsed, a.duration_s))
                        elif elapsed - last_print >= 5:
                            last_print = elapsed
                            p = status["power"]
                            console.print(
                                f"{elapsed:5.0f} s  power {p['measured_w'] or 0:6.0f} W "
                                f"(ceiling {p['ceiling_w']:.0f})  batch limit "
                                f"{(status['limits']['enforced'] or {}).get('max_requests')}  "
                                f"in flight {status['queue']['in_flight']}  "
                                f"queued {sum(status['queue']['queued'].values())}  "
                                f"binding {status['binding']}  "
                                f"SM clock {sim.get('sm_clock_mhz', 0):.0f} MHz"
                            )
                    await asyncio.sleep(0.25)

    arm = "powerbatch" if a.limiter else "admission"
    if a.clock:
        arm, a.cap_by_clock, a.clock_objective = "powerbatch-clock", True, "energy"
    run = await run_arm(arm, a, profile, a.out / "logs", during=watch)
    s = summarize(run, a.ttft_slo_s, a.tpot_slo_s)
    png = plot_runs(
        [run],
        a.out / "powerbatch-demo.png",
        f"powerbatch demo: {a.gpu}, ceiling {a.ceiling_w:.0f} W, {profile.name} load",
    )
    (a.out / "summary.json").write_text(json.dumps(s, indent=2))
    t = Table(title="summary (1-second power from the simulated GPU's energy counter)")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("time above ceiling", f"{100 * (s['frac_above_ceiling'] or 0):.2f} %")
    t.add_row("largest overshoot", f"{s['max_overshoot_w'] or 0:.1f} W")
    t.add_row("mean / max 1-s power", f"{s['power_mean_w']:.0f} / {s['power_max_w']:.0f} W")
    t.add_row(
        "sd of 1-s power (bursts / run)",
        f"{s['power_std_high_w'] or 0:.1f} / {s['power_std_w'] or 0:.1f} W",
    )
    t.add_row("output tokens/s", f"{s['output_tok_s']:.0f}")
    t.add_row("J per output token", f"{s['j_per_token'] or 0:.3f}")
    t.add_row(
        "requests ok / 429 / 503 / other",
        f"{s['ok']} / {s['http_429']} / {s['http_503']} / {s['other_errors']}",
    )
    for p, lat in s["latency"].items():
        if lat["ttft_p95_s"] is not None:
            t.add_row(f"p95 TTFT {p}", f"{lat['ttft_p95_s']:.2f} s")
    console.print(t)
    console.print(f"plot: {png}\nsummary: {a.out / 'summary.json'}")
    return 0


def main(a: argparse.Namespace) -> int:
    require_cli_extra("powerbatch demo")  # before anything starts: the view and the plot need it
    return asyncio.run(_demo(a))
