"""The `powerbatch` command: sim, serve, demo, replay, bench, load, config-reference."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from powerbatch.cli.settings import SERVE
from powerbatch.errors import PowerbatchError
from powerbatch.settings import add_arguments, load, reference_markdown


def _sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from powerbatch.sim import PROFILES

    p = sub.add_parser("sim", help="run the simulated GPU behind an OpenAI-compatible server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES))
    p.add_argument("--model-name", default="sim-llama")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-capacity-tokens", type=int, default=400_000)
    p.add_argument("--max-num-queued-reqs", type=int, default=None)
    p.add_argument("--power-limit-w", type=float, default=None, help="hardware cap (default TDP)")
    p.add_argument(
        "--lock-clocks-mhz",
        default=None,
        help="MIN,MAX: start with every GPU's SM clock locked to this range (nvidia-smi -lgc)",
    )
    p.add_argument(
        "--cap-by-clock",
        action="store_true",
        help="meet a power limit by lowering the SM clock on the clock model, as locked clocks "
        "are (default: the profile's reduced cap forms; docs/clock.md)",
    )
    p.add_argument("--stream-interval-tokens", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dcgm-interval-s",
        type=float,
        default=0.0,
        help="hold the dcgm-exporter fields this long, as an exporter's --collect-interval does "
        "(0: current at every scrape)",
    )
    p.add_argument(
        "--zeusd-token",
        default=None,
        help="require this bearer token on the simulated zeusd API's /gpu/* routes",
    )


def _sim_profile(name: str, cap_by_clock: bool) -> object:
    from dataclasses import replace

    from powerbatch.sim import PROFILES

    return replace(PROFILES[name], cap_by_clock=True) if cap_by_clock else name


def _run_sim(a: argparse.Namespace) -> None:
    from powerbatch.sim import run_sim_server

    asyncio.run(
        run_sim_server(
            a.host,
            a.port,
            model_name=a.model_name,
            stream_interval_tokens=a.stream_interval_tokens,
            max_model_len=a.max_model_len,
            profile=_sim_profile(a.profile, a.cap_by_clock),
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            kv_capacity_tokens=a.kv_capacity_tokens,
            max_num_queued_reqs=a.max_num_queued_reqs,
            power_limit_w=a.power_limit_w,
            seed=a.seed,
            zeusd_token=a.zeusd_token,
            dcgm_interval_s=a.dcgm_interval_s,
            locked_clocks_mhz=_lock_arg(a.lock_clocks_mhz),
        )
    )


def _lock_arg(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--lock-clocks-mhz wants MIN,MAX in MHz, got {text!r}") from None
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="powerbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _sim_parser(sub)
    serve = sub.add_parser(
        "serve",
        help="run the power-aware proxy in front of an upstream",
        description="Run the power-aware proxy. Every setting is a flag, a POWERBATCH_* variable "
        "and a key of the TOML file named by --config or POWERBATCH_CONFIG; precedence: "
        "default < file < environment < flag.",
    )
    add_arguments(serve, SERVE)

    from powerbatch.cli import bench, demo, fleet_bench, load, replay, scenarios

    demo.add_parser(sub)
    replay.add_parser(sub)
    bench.add_parser(sub)
    scenarios.add_parser(sub)
    fleet_bench.add_parser(sub)
    load.add_parser(sub)
    sub.add_parser("config-reference", help="print every serve setting as a markdown table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sim":
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
            _run_sim(args)
        elif args.command == "serve":
            from powerbatch.cli.serve import serve

            settings = load(SERVE, args=args, environ=os.environ)
            logging.basicConfig(
                level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s"
            )
            config = args.config or os.environ.get(SERVE.config_env)
            if config:
                logging.getLogger("powerbatch").info("settings from %s", config)
            asyncio.run(serve(settings))
        elif args.command == "config-reference":
            sys.stdout.write(reference_markdown(SERVE))
        else:
            return int(args.func(args))
    except PowerbatchError as exc:
        print(f"powerbatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
