"""N simulated GPU servers in one process, for `powerbatch fleet-bench`.

Why one process: on a small machine, N simulators, N proxies, Redis and the load generator as
separate processes left too little CPU for anyone. The simulators are the part a bench may
share: each engine keeps its own clock and energy counter, and a step that starts late is
counted as idle time (never as extra power), so sharing a process can only cost them pace,
not the truthfulness of the power they report. The proxies, the members under test, stay one
process each so that one can be killed alone.

    python -m powerbatch.cli.fleet_sims --ports 8101,8102 --seeds 1,2 --profile h100-llama8b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from powerbatch.sim.engine import SimEngine
from powerbatch.sim.gpu_model import DEFAULT_KV_CAPACITY_TOKENS, PROFILES, GpuProfile
from powerbatch.sim.plants import Plant
from powerbatch.sim.server import start_sim_server


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def serve(
    ports: Sequence[int],
    seeds: Sequence[int],
    profile: str,
    stream_interval_tokens: int,
    dcgm_interval_s: float = 0.0,
    plants: Sequence[Plant] | None = None,
    power_limits_w: Sequence[float] | None = None,
) -> None:
    """Serve one simulator per port until cancelled: of `profile` with the given meter, or of
    each plant with its own (`plants`, one per port); at a power limit each where given."""
    servers = []
    try:
        for i, (port, seed) in enumerate(zip(ports, seeds, strict=True)):
            limit = power_limits_w[i] if power_limits_w else None
            interval, lag = dcgm_interval_s, 0.0
            prof: GpuProfile | str = profile
            kv = DEFAULT_KV_CAPACITY_TOKENS
            if plants:
                plant = plants[i]
                prof, kv = plant.profile, plant.kv_capacity_tokens
                interval, lag = plant.dcgm_interval_s, plant.dcgm_lag_s
            engine = SimEngine(prof, seed=seed, power_limit_w=limit, kv_capacity_tokens=kv)
            servers.append(
                await start_sim_server(
                    engine,
                    "127.0.0.1",
                    port,
                    stream_interval_tokens=stream_interval_tokens,
                    dcgm_interval_s=interval,
                    dcgm_lag_s=lag,
                )
            )
        logging.getLogger("powerbatch.sim").info("%d simulators listening", len(servers))
        await asyncio.Event().wait()
    finally:
        for s in servers:
            await s.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerbatch.cli.fleet_sims")
    p.add_argument("--ports", type=_ints, required=True)
    p.add_argument("--seeds", type=_ints, required=True)
    p.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES))
    p.add_argument("--stream-interval-tokens", type=int, default=8)
    p.add_argument("--dcgm-interval-s", type=float, default=0.0)
    p.add_argument(
        "--plant-files", default="", help="comma-separated Plant JSON files, one per simulator"
    )
    p.add_argument("--power-limits-w", default="", help="comma-separated limits, one per simulator")
    a = p.parse_args(argv)
    if len(a.ports) != len(a.seeds):
        p.error("--ports and --seeds need one entry per simulator")
    files = [f for f in a.plant_files.split(",") if f]
    plants = [Plant.from_json(json.loads(Path(f).read_text())) for f in files]
    limits = [float(x) for x in a.power_limits_w.split(",") if x]
    for name, xs in (("--plant-files", plants), ("--power-limits-w", limits)):
        if xs and len(xs) != len(a.ports):
            p.error(f"{name} needs one entry per simulator")
    logging.basicConfig(level=logging.INFO)
    asyncio.run(
        serve(
            a.ports,
            a.seeds,
            a.profile,
            a.stream_interval_tokens,
            a.dcgm_interval_s,
            plants or None,
            limits or None,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
