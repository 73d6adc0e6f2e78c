"""`powerbatch load`: the seeded load profiles against a running stack, and what users saw.

`bench` and `demo` start their own simulator; an operator with a stack already up (the compose
stack, a proxy in front of vLLM, or vLLM alone) needs the same load pointed at a URL. The run is
bounded by `--duration-s` and/or `--requests`, so it always ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from powerbatch.cli.stats import pct
from powerbatch.load import PROFILES, LoadProfile, PlannedRequest, RequestResult, run_load

DEFAULT_DURATION_S = 60.0
_MAX_HORIZON_S = 7 * 24 * 3600.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "load", help="drive a seeded load profile at a running OpenAI-compatible URL"
    )
    p.add_argument("--target", required=True, help="base URL of the proxy or of vLLM (without /v1)")
    p.add_argument("--profile", default="bursty", choices=sorted(PROFILES), help="load profile")
    p.add_argument("--seed", type=int, default=1, help="same seed, same requests at same times")
    p.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help=f"length of the schedule (default {DEFAULT_DURATION_S:g} s, or as --requests needs)",
    )
    p.add_argument("--requests", type=int, default=None, help="send at most this many requests")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="most requests outstanding (default: no cap)",
    )
    p.add_argument(
        "--api-key", default=None, help="Bearer key to send (default: $OPENAI_API_KEY if set)"
    )
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=120.0,
        help="after the schedule, longest wait for answers still in flight",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the summary here as JSON")
    p.set_defaults(func=main)


def plan_for(
    profile: LoadProfile, seed: int, duration_s: float | None, requests: int | None
) -> list[PlannedRequest]:
    """The profile's seeded schedule, cut at `duration_s` and at `requests`, whichever first."""
    if duration_s is not None:
        plan = profile.plan(duration_s, seed)
    elif requests is None:
        plan = profile.plan(DEFAULT_DURATION_S, seed)
    else:  # as long as it takes to draw that many; the same seed gives the same prefix
        horizon = DEFAULT_DURATION_S
        plan = profile.plan(horizon, seed)
        while len(plan) < requests and horizon < _MAX_HORIZON_S:
            horizon *= 2
            plan = profile.plan(horizon, seed)
    return plan if requests is None else plan[:requests]


async def discover_model(target: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.get(target.rstrip("/") + "/v1/models", headers=headers) as r,
    ):
        if r.status == 401:
            raise ValueError("it answered 401: pass --api-key")
        r.raise_for_status()
        return str((await r.json())["data"][0]["id"])


def summarize(results: list[RequestResult], wall_s: float, planned: int) -> dict[str, Any]:
    """What users saw: answers by kind, TTFT by class, output tokens per second.

    `unanswered` counts requests still in flight when the drain timeout ended the run.
    """
    status = Counter(r.status for r in results)
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    by_class: dict[str, Any] = {}
    for prio in sorted({r.priority for r in results}):
        ttft = [r.ttft_s for r in ok if r.priority == prio and r.ttft_s is not None]
        by_class[prio] = {
            "requests": sum(r.priority == prio for r in results),
            "ok": sum(r.priority == prio for r in ok),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p95_s": pct(ttft, 95),
        }
    return {
        "requests": len(results),
        "unanswered": planned - len(results),
        "ok": len(ok),
        "http_429": status.get(429, 0),
        "errors": len(results) - len(ok) - status.get(429, 0),
        "errors_by_status": {str(k): v for k, v in sorted(status.items()) if k not in (200, 429)},
        "output_tokens": tokens,
        "seconds": round(wall_s, 3),
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "by_class": by_class,
    }


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def render(s: dict[str, Any], target: str, profile: str) -> str:
    lines = [
        f"{profile} load on {target}: {s['requests']} requests in {s['seconds']:.1f} s",
        f"  ok {s['ok']}   429 {s['http_429']}   errors {s['errors']}"
        + (f" {s['errors_by_status']}" if s["errors_by_status"] else "")
        + (f"   unanswered {s['unanswered']}" if s["unanswered"] else ""),
        f"  output tokens/s {s['output_tok_s']:.1f}",
        "  class    requests  ok     TTFT p50 s  TTFT p95 s",
    ]
    for prio, c in s["by_class"].items():
        lines.append(
            f"  {prio:<8} {c['requests']:>8}  {c['ok']:<6} "
            f"{_fmt(c['ttft_p50_s']):>10}  {_fmt(c['ttft_p95_s']):>10}"
        )
    return "\n".join(lines)


async def _load(a: argparse.Namespace) -> int:
    for name in ("requests", "concurrency"):
        value = getattr(a, name)
        if value is not None and value < 1:
            print(f"powerbatch load: --{name} must be at least 1", file=sys.stderr)
            return 2
    if a.duration_s is not None and not a.duration_s > 0:
        print("powerbatch load: --duration-s must be positive", file=sys.stderr)
        return 2
    api_key = a.api_key or os.environ.get("OPENAI_API_KEY") or None
    try:
        model = a.model or await discover_model(a.target, api_key)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as exc:
        print(
            f"powerbatch load: cannot read {a.target}/v1/models ({exc}); or pass --model",
            file=sys.stderr,
        )
        return 2
    plan = plan_for(PROFILES[a.profile](), a.seed, a.duration_s, a.requests)
    t0 = time.monotonic()
    results = await run_load(
        a.target,
        plan,
        model=model,
        drain_timeout_s=a.drain_timeout_s,
        api_key=api_key,
        concurrency=a.concurrency,
    )
    summary = summarize(results, time.monotonic() - t0, len(plan))
    summary.update(target=a.target, profile=a.profile, seed=a.seed, model=model)
    print(render(summary, a.target, a.profile))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(summary, indent=2))
        print(f"wrote {a.out}")
    return 0


def main(a: argparse.Namespace) -> int:
    return asyncio.run(_load(a))
