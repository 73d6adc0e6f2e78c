"""`powerbatch load` against a running simulator: bounded, summarised, keyed."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from aiohttp import web
from conftest import run, serve

from powerbatch.cli.load import plan_for
from powerbatch.load import PROFILES
from powerbatch.sim import SimEngine
from powerbatch.sim.server import create_sim_app


async def _load(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "powerbatch",
        "load",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


def test_load_drives_a_bounded_run_and_writes_a_summary(tmp_path: Path) -> None:
    """8 requests at most, 6 s of schedule at most: every one answered, with a key sent."""
    auth: list[str | None] = []

    @web.middleware
    async def record_auth(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        auth.append(request.headers.get("Authorization"))
        return await handler(request)

    async def main() -> tuple[int, str]:
        app = create_sim_app(SimEngine(seed=1), stream_interval_tokens=8)
        app.middlewares.append(record_auth)
        runner, url = await serve(app)
        try:
            return await _load(
                "--target",
                url,
                "--profile",
                "steady",
                "--requests",
                "8",
                "--duration-s",
                "6",
                "--concurrency",
                "4",
                "--api-key",
                "sk-test",
                "--out",
                str(tmp_path / "summary.json"),
            )
        finally:
            await runner.cleanup()

    rc, out = run(main())
    assert rc == 0, out
    s = json.loads((tmp_path / "summary.json").read_text())
    want = len(plan_for(PROFILES["steady"](), 1, 6.0, 8))
    assert want == 8
    assert s["requests"] == s["ok"] == want and s["errors"] == 0 and s["http_429"] == 0
    assert s["output_tok_s"] > 0 and s["model"] == "sim-llama"
    assert all(c["ttft_p95_s"] is not None for c in s["by_class"].values())
    assert "ok 8" in out and "TTFT p95" in out
    assert auth and set(auth) == {"Bearer sk-test"}


def test_plan_is_cut_at_the_request_count_and_keeps_the_seeded_prefix() -> None:
    profile = PROFILES["bursty"]()
    long = plan_for(profile, 3, None, 500)
    assert len(long) == 500
    assert plan_for(profile, 3, 20.0, None) == long[: len(plan_for(profile, 3, 20.0, None))]
    assert all(r.t_s < 5.0 for r in plan_for(profile, 3, 5.0, 10_000))


def test_a_plan_moves_past_a_phase_boundary_that_rounding_puts_before_itself() -> None:
    from powerbatch.load.profile import LoadProfile, Phase

    # Drawn durations whose cycle boundaries land a hair before themselves in binary: the
    # plan used to spin there forever.
    durations = (4.640250967589453, 2.253613639465157, 0.7663279055852654)
    rates = (5.0, 0.5, 2.0)
    phases = tuple(Phase(d, r) for d, r in zip(durations, rates, strict=True))
    profile = LoadProfile("drawn", phases)
    plan = profile.plan(20.0, seed=0)
    assert plan and all(0.0 <= r.t_s < 20.0 for r in plan)
