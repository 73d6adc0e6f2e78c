"""The vLLM plugin against a TPOT SLO in a real vLLM (the CPU build `make test-vllm` installs).

One `vllm serve` of the tiny model with the powerbatch scheduler in enforce mode, a ceiling no
load reaches (2,000 W of the modelled H100), so the TPOT SLO is the only constraint, and 48
closed-loop streaming clients of decode-heavy requests (8-token prompts, 40-88 tokens out) for
60 s. It prints, and writes as JSON, the tokens/s vLLM generated, the plugin's active-request
limit and vLLM's running count every few seconds, the latency section of the plugin's /status
(p95s, cuts undone) and the step the TPOT law read. An SLO under the engine's step at one
request (about 12 ms on a shared 2-core machine) is out of reach; one of 20 ms is met at about
20 requests (docs/vllm-plugin.md).

    .venv-vllm/bin/python benchmarks/vllm_tpot_slo.py --tpot-slo-s 0.02 --out out/tpot-20ms.json

It imports the test harness (tests/vllm/), so it runs from the repository's root; PYTHONPATH
may point at another checkout's powerbatch and plugin to run that code instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from test_vllm_plugin import LoadStats, Phase, run_phase
from vllm_harness import Sampler, value, vllm_server

DECODE = Phase(
    "decode", clients=48, seconds=60.0, prompt_tokens=8, max_tokens=64, settle_s=0.0,
    max_tokens_spread=24,
)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tpot-slo-s", type=float, required=True)
    p.add_argument("--name", default="tpot-slo", help="the server's log and trace names")
    p.add_argument("--out", type=Path, default=None, help="also write the figures here")
    a = p.parse_args()
    env = {
        "POWERBATCH_VLLM_CEILING_W": "2000",
        "POWERBATCH_VLLM_POWER_SOURCE": "model",
        "POWERBATCH_VLLM_MODEL_PROFILE": "h100-llama8b",
        "POWERBATCH_VLLM_MODE": "enforce",
        "POWERBATCH_VLLM_TPOT_SLO_S": str(a.tpot_slo_s),
    }
    with vllm_server(a.name, env) as server:
        sampler = Sampler(
            {"vllm": server.url + "/metrics", "plugin": server.plugin_url + "/metrics"}
        )

        async def drive() -> LoadStats:
            sampler.start()
            await asyncio.sleep(1.0)
            sampler.phase, stats = DECODE.name, LoadStats()
            await run_phase(server.url, DECODE, stats, sampler.t0)
            sampler.stop()
            return stats

        stats = asyncio.run(drive())
        with urllib.request.urlopen(server.plugin_url + "/status") as r:
            status = json.loads(r.read())
    rows = [r for r in sampler.rows if r["phase"] == DECODE.name]
    generated = [value(r["vllm"], "vllm:generation_tokens_total") or 0.0 for r in rows]
    timeline = [
        (
            round(r["t_s"]),
            value(r["plugin"], "powerbatch_engine_limit", knob="active_requests"),
            value(r["vllm"], "vllm:num_requests_running"),
        )
        for r in rows[:: max(1, len(rows) // 12)]
    ]
    out = {
        "tpot_slo_s": a.tpot_slo_s,
        "completed": stats.ok,
        "errors": stats.errors,
        "tokens_per_s": (generated[-1] - generated[0]) / (rows[-1]["t_s"] - rows[0]["t_s"]),
        "limit_timeline": timeline,  # (t_s, the plugin's active-request limit, vLLM running)
        "latency": status.get("latency"),
        "engine_step": {k: status["engine"].get(k) for k in ("token_s", "step_s")},
    }
    print(json.dumps(out))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
