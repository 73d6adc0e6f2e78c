"""Helpers for the `-m vllm` tests: real vLLM (the CPU build in .venv-vllm), the proxy, scraping.

Run through `.venv-vllm/bin/pytest -m vllm tests/vllm` after `scripts/setup_vllm_cpu.sh`; in any
other environment these tests skip. Every server binds 127.0.0.1 on a free port, is bounded in
time, and is killed with its whole process group (API server, EngineCore) in teardown.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from powerbatch.cli.process import Child, free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
MODEL = VENV / "tiny-llama"
OUT = ROOT / "out" / "vllm-plugin"
SCHEDULER = "powerbatch_vllm.scheduler.PowerbatchScheduler"
ASYNC_SCHEDULER = "powerbatch_vllm.scheduler.PowerbatchAsyncScheduler"
MAX_NUM_SEQS = 64
KV_BLOCKS = 512  # enough for the load below, small enough for usage to move
# Tokens per streamed chunk. At vLLM's default (1), parsing a chunk per token in the clients and
# the API server costs more CPU than the tiny model's step: with everything on 2 cores the load
# generator, not the engine, became the bottleneck of a decode-heavy load, and the engine sat
# idle with every client waiting on the front end. Batching 8 tokens a chunk keeps it engine-bound.
STREAM_INTERVAL = 8
START_TIMEOUT_S = 180.0


@dataclass
class VllmServer:
    url: str
    plugin_url: str
    child: Child
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.child.pid

    def log_tail(self, chars: int = 6000) -> str:
        return self.child.log_tail(chars)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("needs vLLM: run scripts/setup_vllm_cpu.sh, then .venv-vllm/bin/pytest -m vllm")
    if not (MODEL / "model.safetensors").exists():
        pytest.skip(f"no tiny model at {MODEL}: run scripts/setup_vllm_cpu.sh")


def pin_engine(server: VllmServer) -> set[int] | None:
    """Keep the EngineCore on the cores vLLM bound its worker's OpenMP threads to.

    vLLM's CPU build binds the worker to some cores and reserves the rest for the front end
    (on 2 cores: compute on one, one reserved). The EngineCore process is left floating, and
    between steps it spins on the shared-memory queue (`sched_yield`, up to 1 s after each
    read), so on 2 cores it takes most of the reserved core from the API server and this
    test's clients: a decode-heavy load then starves in the front end while the engine idles.
    Sharing the worker's core costs the engine little (it waits for the worker each step
    anyway). Returns the cores used, or None when there was nothing to pin.
    """
    import psutil

    procs = psutil.Process(server.pid).children(recursive=True)
    names = {p: p.name() for p in procs}
    workers = [p for p, n in names.items() if "Worker" in n]
    engines = [p for p, n in names.items() if "EngineCore" in n]
    if not workers or not engines:
        return None
    cores = set(os.sched_getaffinity(workers[0].pid))
    if len(cores) >= len(os.sched_getaffinity(0)):
        return None  # the worker is not bound: leave the OS to place things
    for engine in engines:
        for thread in engine.threads():  # affinity is per thread on Linux
            with contextlib.suppress(OSError):
                os.sched_setaffinity(thread.id, cores)
    return cores


@contextlib.contextmanager
def vllm_server(
    name: str,
    plugin_env: dict[str, str],
    scheduler: str = SCHEDULER,
    extra_args: tuple[str, ...] = (),
) -> Iterator[VllmServer]:
    """`vllm serve` of the tiny model with a powerbatch `scheduler` class and `plugin_env`
    (and `extra_args` for `vllm serve`)."""
    _require_vllm()
    OUT.mkdir(parents=True, exist_ok=True)
    port, plugin_port = free_port(), free_port()
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("POWERBATCH_VLLM_")}
        | {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_CI_ENV": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "POWERBATCH_VLLM_METRICS_PORT": str(plugin_port),
            "POWERBATCH_VLLM_RECORD_TRACE": str(OUT / f"{name}-engine-trace.csv"),
        }
        | plugin_env
    )
    args = [
        "serve",
        str(MODEL),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--num-gpu-blocks-override",
        str(KV_BLOCKS),
        "--stream-interval",
        str(STREAM_INTERVAL),
        "--scheduler-cls",
        scheduler,
        *extra_args,
    ]
    child = Child(
        f"{name}-vllm", args, OUT, command=[str(VENV / "bin" / "vllm")], env=env, new_session=True
    )
    server = VllmServer(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{plugin_port}", child, env)
    try:
        t0 = time.monotonic()
        child.launch()
        child.wait_ready(server.url + "/health", START_TIMEOUT_S, interval_s=1.0)
        print(f"\n[{name}] vllm serve healthy in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        print(f"[{name}] EngineCore pinned to cores {pin_engine(server)}", file=sys.stderr)
        yield server
    finally:
        child.terminate(timeout_s=20)


@contextlib.contextmanager
def sim_server(name: str, *args: str) -> Iterator[str]:
    """`powerbatch sim` on loopback (a vLLM-like server, and zeusd's routes), with `args`."""
    port = free_port()
    with _serving(Child(name, ["sim", "--port", str(port), *args], OUT, new_session=True), port):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def _serving(child: Child, port: int) -> Iterator[None]:
    """`child` started and healthy on `port` (30 s at most), terminated after."""
    try:
        child.launch()
        child.wait_ready(f"http://127.0.0.1:{port}/health", 30, interval_s=0.5)
        yield
    finally:
        child.terminate(timeout_s=20)


@contextlib.contextmanager
def proxy_server(upstream: str, power_url: str, ceiling_w: float) -> Iterator[str]:
    """`powerbatch serve` in front of `upstream`, reading watts from a dcgm-format `power_url`."""
    port = free_port()
    args = [
        "serve",
        "--upstream",
        upstream,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ceiling-w",
        str(ceiling_w),
        "--power-source",
        "dcgm",
        "--dcgm-url",
        power_url,
        "--max-batch",
        str(MAX_NUM_SEQS),
        "--record-trace",
        str(OUT / "proxy-control-trace.csv"),
    ]
    with _serving(Child("proxy", args, OUT, new_session=True), port):
        yield f"http://127.0.0.1:{port}"


# -- scraping -------------------------------------------------------------------------------


_UNREAD = ("_bucket", "_created")  # histogram buckets and creation times: never read here


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name. Buckets are dropped: they are most of vLLM's /metrics, and keeping every
    scrape's worth grew the load generator's heap until its garbage collections stalled the
    clients for a second at a time (the engine then idled for want of requests)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith(_UNREAD):
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def value(
    m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float | None:
    for lab, v in m.get(name, []):
        if all(lab.get(k) == w for k, w in labels.items()):
            return v
    return None


def one_hot(m: dict[str, list[tuple[dict[str, str], float]]], name: str, label: str) -> str | None:
    for lab, v in m.get(name, []):
        if v == 1.0:
            return lab.get(label)
    return None


class Sampler:
    """Scrapes endpoints every `interval_s` into rows: the traces the test asserts on.

    A thread of its own, with blocking reads: the load's event loop keeps the CPU busy, and the
    samples must not wait on it.
    """

    def __init__(self, endpoints: dict[str, str], interval_s: float = 0.5) -> None:
        self.endpoints = endpoints
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self.phase = "idle"
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _run(self) -> None:
        import urllib.request

        while not self._stop.is_set():
            t = time.monotonic()
            row: dict[str, Any] = {"t_s": round(self.now(), 2), "phase": self.phase}
            for name, url in self.endpoints.items():
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        row[name] = parse_metrics(r.read().decode())
                except (OSError, ValueError):
                    row[name] = {}
            self.rows.append(row)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def summarize(values: list[float]) -> dict[str, float]:
    vs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vs:
        return {"n": 0}
    return {
        "n": len(vs),
        "min": vs[0],
        "median": statistics.median(vs),
        "p95": vs[min(len(vs) - 1, math.ceil(0.95 * len(vs)) - 1)],
        "max": vs[-1],
        "mean": sum(vs) / len(vs),
    }
