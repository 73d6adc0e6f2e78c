"""One-shot check on a lent GPU: NVML through powerbatch, then power against decode batch.

Device time is scarce (one run, minutes), so this script does everything in one go, stops on
its own time budget, and writes what it has after every row, so a crash or a kill still leaves
results. See docs/gpu-check.md for the command, the expected run time and what to look at.

1. NVML, for real, through powerbatch.telemetry.nvml only (this script never imports pynvml):
   instant and averaged power, the energy counter against mean power x time, the power-limit
   constraints, and read latency. -> gpu_check.json
2. A randomly initialised Llama-3.1-8B-shaped model (transformers, bf16; no weights downloaded:
   random weights cost the same FLOPs and bytes). Per batch: prefill --context tokens per
   sequence once, then decode one token per sequence per step while a thread samples power
   every 50 ms. Rows run eager first, then with the decode step captured in a CUDA graph
   (eager Hugging Face decode is CPU-launch-bound at small batch, vLLM's is not), plus one
   prefill row and idle rows. -> power_vs_batch.json / .md, power_samples.csv, and the
   comparison with powerbatch.sim.gpu_model and the published figures.

Smoke mode, no GPU: ``--device cpu --tiny --no-nvml`` (tests/vllm/test_gpu_check_smoke.py).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import gc
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from powerbatch.cli.stats import pct
from powerbatch.errors import PowerbatchError
from powerbatch.sim.gpu_model import (
    PROFILES,
    decode_power_w,
    idle_power_w,
    prefill_power_w,
)
from powerbatch.telemetry.base import PowerSample
from powerbatch.telemetry.clock import NvmlClock, snap_lock
from powerbatch.telemetry.nvml import NvmlPowerLimiter, NvmlPowerSource, nvml_available

SOURCES = "the published figures below (PUBLISHED)"
COMPARE_PROFILES = ("h200-decode-light", "h100-llama8b")

# Llama-3.1-8B on one H100 under vLLM, evaluated from the GPU-to-Grid fits (arXiv 2602.05116,
# gpu2grid/openg2g logistic_fits.csv, on ML.ENERGY leaderboard v3 data):
# batch -> (W, ITL ms, output tok/s, J/token). Not measured here; printed next to what is.
PUBLISHED_H100_8B: dict[int, tuple[float, float, float, float]] = {
    8: (489, 8.6, 1253, 0.391),
    16: (509, 8.9, 1898, 0.268),
    32: (556, 9.5, 3173, 0.175),
    64: (620, 11.3, 5130, 0.121),
    128: (665, 16.3, 7211, 0.092),
    256: (683, 28.0, 8715, 0.078),
    512: (689, 48.6, 9525, 0.072),
}
PUBLISHED = (
    "'Illusion of Power Capping in LLM Decode' (arXiv 2605.11999): "
    "on H200, decode alone draws 137-300 W of a 700 W budget; a power cap never engages during "
    "decode, which is memory-bound. -> the decode rows, graph mode first.",
    "GPU-to-Grid (arXiv 2602.05116) fits of the ML.ENERGY leaderboard's v3 data: Llama-3.1-8B "
    "on one H100 under vLLM (chat, chunked prefill mixed "
    "in): 489 W at batch 8 to 683 W at batch 256, J/token 0.391 -> 0.078 -> columns 'pub H100 "
    "W', 'pub tok/s', 'pub J/tok'. The h100-llama8b profile is that fit.",
    "NVIDIA Dynamo power-planner notes (ai-dynamo/dynamo, docs/design-docs/power-planner.md): "
    "prefill is compute-bound and runs near the power limit -> the prefill row.",
    "Vendor and benchmark pages: idle H200 about 75-80 W (low confidence); NVIDIA datasheet: "
    "TDP H200 SXM 700 W -> the idle rows.",
    "gpu2grid/openg2g data: a 100 ms trace at batch 128 on one H100: mean ~665 W, typically "
    "+-40 W, single instant readings up to ~850 W -> p5/p95 of the instant readings.",
    "NVML API reference: nvmlDeviceGetPowerUsage is a 1-second average on Hopper, field 186 is "
    "instant; the energy counter updates every 20-100 ms -> gpu_check.json.",
)
# What powerbatch/telemetry/nvml.py does not offer, so this script cannot record it.
NVML_GAPS = (
    "device name, UUID, driver and NVML version",
    "clocks and clock-event (throttle) reasons, to see whether a cap or a thermal limit engaged",
    "GPU utilisation, temperature, memory used",
    "both power readings from one source (field 186 and the 1-s average side by side); two "
    "NvmlPowerSource objects (prefer_instant True/False) are used instead",
)

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=500,
    max_position_embeddings=1024,
)

# (full run, --tiny) defaults for the options whose default depends on the mode.
MODE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "batches": ("1,8,16,32,64,128,256", "1,4"),
    "context": (512, 32),
    "seconds_per_batch": (8.0, 1.0),
    "warmup_s": (2.0, 0.3),
    "prefill_batch": (8, 2),
    "prefill_context": (2048, 64),
    "prefill_seconds": (5.0, 0.5),
    "idle_seconds": (5.0, 0.5),
    "nvml_reads": (200, 20),
}
RESERVE_S = 6.0
"""Kept back from --total-budget-s for writing results and freeing memory."""

_log_file: Any = None


def log(message: str) -> None:
    """Print with flush (PYTHONUNBUFFERED may be unset) and keep a copy in gpu_check.log."""
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    if _log_file is not None:
        _log_file.write(line + "\n")
        _log_file.flush()


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _r(value: float | None, digits: int = 3) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# --------------------------------------------------------------------------- power measurement


@dataclass(frozen=True, slots=True)
class Reading:
    t_s: float  # time.monotonic(), as PowerSample
    tag: str
    instant_w: float
    averaged_w: float | None
    energy_j: float | None


class Meter:
    """powerbatch's NVML sources: sampled on a thread every `interval_s`, read at window edges.

    Two sources because NvmlPowerSource reads one kind of power: field 186 (instant) when it
    works, else nvmlDeviceGetPowerUsage (a 1-s average on Hopper); prefer_instant=False forces
    the average. A third source serves the main thread's window edges, so once the sampler runs
    no source is read from two threads at once.
    """

    def __init__(self, gpu: int, interval_s: float, nvml: ModuleType | None = None) -> None:
        self.instant = NvmlPowerSource((gpu,), prefer_instant=True, nvml=nvml)
        self.averaged = NvmlPowerSource((gpu,), prefer_instant=False, nvml=nvml)
        self.edge = NvmlPowerSource((gpu,), prefer_instant=True, nvml=nvml)
        self.interval_s = interval_s
        self.tag = ""
        self.readings: list[Reading] = []
        self.errors: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self, source: NvmlPowerSource) -> PowerSample:
        """One reading on the main thread."""
        return self._loop.run_until_complete(source.read())

    def read_edge(self) -> PowerSample | None:
        """A window edge; a failed read is recorded and leaves that window without energy."""
        try:
            return self.read(self.edge)
        except PowerbatchError as exc:
            self.errors.append(f"edge read: {_first_line(exc)}")
            return None

    def time_reads(self, source: NvmlPowerSource, n: int) -> list[float]:
        """Seconds per `await source.read()`: what the controller pays per reading."""

        async def run() -> list[float]:
            times: list[float] = []
            for _ in range(n):
                t0 = time.perf_counter()
                await source.read()
                times.append(time.perf_counter() - t0)
            return times

        return self._loop.run_until_complete(run())

    def _sample(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            next_t = time.monotonic()
            while not self._stop.is_set():
                try:
                    inst = loop.run_until_complete(self.instant.read())
                    avg = loop.run_until_complete(self.averaged.read())
                    self.readings.append(
                        Reading(inst.t_s, self.tag, inst.power_w, avg.power_w, inst.energy_j)
                    )
                except Exception as exc:  # keep sampling; the count tells
                    if len(self.errors) < 20:
                        self.errors.append(_first_line(exc))
                next_t += self.interval_s
                self._stop.wait(max(0.0, next_t - time.monotonic()))
        finally:
            loop.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._sample, name="gpu-check-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for source in (self.instant, self.averaged, self.edge):
            try:
                self._loop.run_until_complete(source.close())
            except PowerbatchError as exc:
                self.errors.append(_first_line(exc))
        self._loop.close()


class Window:
    """One measured interval: energy-counter reads at both edges, samples in between."""

    STATS = (
        "power_w_mean",
        "power_w_p5",
        "power_w_p95",
        "power_w_max",
        "power_avg_api_w_mean",
        "n_samples",
        "energy_j",
        "energy_power_w",
        "energy_to_power_x_time",
    )

    def __init__(self, meter: Meter | None, tag: str) -> None:
        self.meter = meter
        self.tag = tag
        self.start: PowerSample | None = None
        self.end: PowerSample | None = None

    def __enter__(self) -> Window:
        if self.meter is not None:
            self.meter.tag = self.tag
            self.start = self.meter.read_edge()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.meter is not None:
            self.end = self.meter.read_edge()
            self.meter.tag = ""

    def stats(self) -> dict[str, Any]:
        """Instant-power spread, the averaged API's mean, and energy counter vs power x time."""
        out: dict[str, Any] = dict.fromkeys(self.STATS)
        if self.meter is None or self.start is None or self.end is None:
            return out
        t0, t1 = self.start.t_s, self.end.t_s
        inside = [r for r in list(self.meter.readings) if t0 <= r.t_s <= t1]
        inst = [r.instant_w for r in inside]
        avg = [r.averaged_w for r in inside if r.averaged_w is not None]
        out.update(
            power_w_mean=_r(_mean(inst), 1),
            power_w_p5=_r(pct(inst, 5), 1),
            power_w_p95=_r(pct(inst, 95), 1),
            power_w_max=_r(max(inst), 1) if inst else None,
            power_avg_api_w_mean=_r(_mean(avg), 1),
            n_samples=len(inst),
        )
        if self.start.energy_j is not None and self.end.energy_j is not None and t1 > t0:
            energy = self.end.energy_j - self.start.energy_j
            out["energy_j"] = _r(energy, 2)
            out["energy_power_w"] = _r(energy / (t1 - t0), 1)
            mean_w = _mean(inst)
            if mean_w:
                out["energy_to_power_x_time"] = _r(energy / (mean_w * (t1 - t0)), 4)
        return out


def nvml_checks(
    meter: Meter, *, reads: int, idle_s: float, gpu: int, nvml: ModuleType | None
) -> dict[str, Any]:
    """Field 186 or not, read latency, idle energy vs power x time, and the limits in force."""
    result: dict[str, Any] = {"available": True, "gpu_index": gpu, "source": meter.instant.name}
    first_inst = meter.read(meter.instant)
    first_avg = meter.read(meter.averaged)
    result["first_reading"] = {
        "instant_w": _r(first_inst.power_w, 1),
        "averaged_w": _r(first_avg.power_w, 1),
        "energy_counter_j": _r(first_inst.energy_j, 1),
    }
    latency: dict[str, Any] = {"note": "one read() = one power call + one energy-counter call"}
    for name, source in (("instant", meter.instant), ("averaged", meter.averaged)):
        times = meter.time_reads(source, reads)
        latency[name] = {
            "n": len(times),
            "p50_us": _r(pct(times, 50, 1e6), 1),
            "p99_us": _r(pct(times, 99, 1e6), 1),
            "max_us": _r(pct(times, 100, 1e6), 1),
        }
    result["read_latency"] = latency
    result["instant_field_186_in_use"] = meter.instant.instant_power[0]
    result["averaged_source_uses_field_186"] = meter.averaged.instant_power[0]

    meter.start()
    with Window(meter, "idle-nvml") as window:
        time.sleep(idle_s)
    stats = window.stats()
    seconds = window.end.t_s - window.start.t_s if window.end and window.start else None
    mean_avg = stats["power_avg_api_w_mean"]
    result["idle_energy_check"] = {
        "seconds": _r(seconds, 3),
        "note": "GPU idle, before this process starts CUDA",
        **stats,
        "energy_to_averaged_x_time": _r(
            stats["energy_j"] / (mean_avg * seconds)
            if stats["energy_j"] is not None and mean_avg and seconds
            else None,
            4,
        ),
    }
    try:
        limiter = NvmlPowerLimiter((gpu,), nvml=nvml)
        try:
            (lo, hi), *_ = limiter.constraints_w()
            result["limits_w"] = {
                "constraints_min": lo,
                "constraints_max": hi,
                "default": limiter.default_limits_w()[0],
                "enforced": limiter.enforced_limits_w()[0],
                "note": "read only; this script never sets a limit",
            }
        finally:
            limiter.close()
    except PowerbatchError as exc:
        result["limits_w"] = {"error": _first_line(exc)}
    return result


# --------------------------------------------------------------------------- model


def build_model(tiny: bool, device: str, dtype: Any) -> Any:
    """Random init directly on the device in the target dtype: no download, no fp32 copy."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(LLAMA_TINY if tiny else LLAMA_8B), attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype)
    return model.eval()


def fixed_context_cache(num_layers: int) -> Any:
    """A DynamicCache whose layers keep the prompt and one slot for the newest token.

    The stock DynamicLayer torch.cats the whole layer cache on every step (three times the KV
    traffic that vLLM's paged attention has, and new addresses each step). Here each decode step
    writes its K/V into the slot after the prompt and attends over exactly prompt + 1 tokens:
    the work of one decode step at that context, with fixed shapes and addresses, so the step
    can also be captured in a CUDA graph. Numerics after the first step do not matter here.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class FixedContextLayer(DynamicLayer):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.is_initialized = False
            self.prompt_len = 0

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            q = int(key_states.shape[-2])
            if not self.is_initialized:
                b, h, _, dk = key_states.shape
                self.dtype, self.device = key_states.dtype, key_states.device
                self.keys = key_states.new_zeros((b, h, q + 1, dk))
                self.values = value_states.new_zeros((b, h, q + 1, value_states.shape[-1]))
                self.keys[:, :, :q].copy_(key_states)
                self.values[:, :, :q].copy_(value_states)
                self.prompt_len = q
                self.is_initialized = True
                return self.keys[:, :, :q], self.values[:, :, :q]
            if q != 1:
                raise ValueError("after the prompt, one token per sequence per step")
            self.keys[:, :, self.prompt_len :].copy_(key_states)
            self.values[:, :, self.prompt_len :].copy_(value_states)
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return self.prompt_len

        def get_mask_sizes(self, query: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
            # transformers 5.x passes the query length; earlier 5.x passed cache_position.
            q = int(query.shape[0]) if hasattr(query, "shape") else int(query)
            return self.prompt_len + q, 0

    cache = DynamicCache()
    cache.layers = [FixedContextLayer() for _ in range(num_layers)]
    return cache


def check_fixed_cache(model: Any, *, context: int, device: str, tol: float) -> dict[str, Any]:
    """First decode step through the fixed-context cache vs the stock cache: same logits?"""
    import torch

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, context), device=device)
    nxt = torch.randint(0, vocab, (2, 1), device=device)
    out = model(input_ids=ids, use_cache=True)
    ref = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    ref_logits = ref.logits[:, -1].float()
    cache = fixed_context_cache(model.config.num_hidden_layers)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    got1 = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].float()
    got2 = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].float()
    scale = float(ref_logits.abs().max()) or 1.0
    diff = float((ref_logits - got1).abs().max()) / scale
    repeat = float((got1 - got2).abs().max()) / scale
    return {
        "rel_diff_vs_stock_cache": _r(diff, 6),
        "rel_diff_repeat_step": _r(repeat, 6),
        "tolerance": tol,
        "ok": diff <= tol and repeat <= tol,
    }


# --------------------------------------------------------------------------- rows


@dataclass
class Ctx:
    """What every row needs."""

    args: argparse.Namespace
    model: Any
    meter: Meter | None
    deadline: float
    cache_mode: str  # "fixed" or "stock"
    prefill_tok_s: float = 20_000.0  # first guess; replaced by what prefill rows measure

    @property
    def cuda(self) -> bool:
        return bool(self.args.device.startswith("cuda"))

    def left_s(self) -> float:
        return self.deadline - RESERVE_S - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


def _row(name: str, kind: str, mode: str | None, batch: int, context: int) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "mode": mode,
        "batch": batch,
        "context": context,
        "status": "pending",
        "note": None,
        "seconds": None,
        "steps": None,
        "steps_per_s": None,
        "step_ms_p50": None,
        "step_ms_p95": None,
        "issue_ms_p50": None,
        "tok_s": None,
        "j_per_token": None,
        "prefill_s": None,
        "mem_alloc_gib": None,
        "mem_peak_gib": None,
        "mem_device_used_gib": None,
    }


def _memory(ctx: Ctx) -> dict[str, float | None]:
    if not ctx.cuda:
        return {}
    import torch

    free, total = torch.cuda.mem_get_info()
    gib = float(2**30)
    return {
        "mem_alloc_gib": _r(torch.cuda.memory_allocated() / gib, 2),
        "mem_peak_gib": _r(torch.cuda.max_memory_allocated() / gib, 2),
        "mem_device_used_gib": _r((total - free) / gib, 2),
    }


def _free(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed_steps(
    ctx: Ctx, step: Callable[[], None], seconds: float, tag: str
) -> tuple[list[float], list[float], Window, float]:
    """Run `step` for `seconds` (or until the budget ends) inside a power window."""
    steps_s: list[float] = []
    issue_s: list[float] = []
    with Window(ctx.meter, tag) as window:
        t_start = time.perf_counter()
        stop_at = t_start + max(0.0, min(seconds, ctx.left_s()))
        while True:
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            ctx.sync()
            t2 = time.perf_counter()
            steps_s.append(t2 - t0)
            issue_s.append(t1 - t0)
            if t2 >= stop_at:
                break
        elapsed = time.perf_counter() - t_start
    return steps_s, issue_s, window, elapsed


def _finish(
    row: dict[str, Any],
    ctx: Ctx,
    run: tuple[list[float], list[float], Window, float],
    tokens: int,
    asked_s: float,
) -> None:
    """Fill a row from one measured window; `tokens` per step."""
    steps_s, issue_s, window, elapsed = run
    row.update(
        status="ok",
        seconds=_r(elapsed, 3),
        steps=len(steps_s),
        steps_per_s=_r(len(steps_s) / elapsed, 3),
        step_ms_p50=_r(pct(steps_s, 50, 1e3), 3),
        step_ms_p95=_r(pct(steps_s, 95, 1e3), 3),
        issue_ms_p50=_r(pct(issue_s, 50, 1e3), 3),
        tok_s=_r(tokens * len(steps_s) / elapsed, 1),
        **window.stats(),
        **_memory(ctx),
    )
    if elapsed < asked_s - 0.5:
        row["note"] = f"window cut to {elapsed:.1f} s by the budget"
    joules = row.get("energy_j")
    if joules is None and row.get("power_w_mean") is not None:
        joules = row["power_w_mean"] * elapsed  # no energy counter: mean power x time
    if joules is not None and steps_s:
        row["j_per_token"] = _r(joules / (tokens * len(steps_s)), 5)


def decode_row(ctx: Ctx, batch: int, mode: str) -> dict[str, Any]:
    """Prefill once (untimed), warm up, then time decode steps at `batch` sequences."""
    import torch

    args, model = ctx.args, ctx.model
    row = _row(f"decode-b{batch}-{mode}", "decode", mode, batch, args.context)
    need = batch * args.context / ctx.prefill_tok_s + args.warmup_s + args.seconds_per_batch + 2
    if mode == "graph":
        need += 3.0
    if need > ctx.left_s():
        row.update(status="skipped", note=f"budget: needs ~{need:.0f} s, {ctx.left_s():.0f} s left")
        return row
    log(f"{row['name']}: prefill {batch} x {args.context} tokens")

    def run() -> None:
        tag = row["name"]
        if ctx.meter is not None:
            ctx.meter.tag = f"{tag}:prefill"
        ids = torch.randint(0, model.config.vocab_size, (batch, args.context), device=args.device)
        cache = None  # stock: the model makes a DynamicCache
        if ctx.cache_mode == "fixed":
            cache = fixed_context_cache(model.config.num_hidden_layers)
        t0 = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        next_ids = out.logits[:, -1:].argmax(-1)
        ctx.sync()
        row["prefill_s"] = _r(time.perf_counter() - t0, 3)
        ctx.prefill_tok_s = max(1_000.0, batch * args.context / max(row["prefill_s"], 1e-3))
        del out, ids

        def eager_step() -> None:
            logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
            next_ids.copy_(logits[:, -1:].argmax(-1))

        step = eager_step
        if mode == "graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    eager_step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                eager_step()
            step = graph.replay
        _timed_steps(ctx, step, args.warmup_s, f"{tag}:warmup")
        measured = _timed_steps(ctx, step, args.seconds_per_batch, f"{tag}:measure")
        _finish(row, ctx, measured, batch, args.seconds_per_batch)

    return _guarded(ctx, row, run)


def prefill_row(ctx: Ctx) -> dict[str, Any]:
    """Repeated prefill without a cache: the compute-bound power (tok/s = prompt tokens/s)."""
    import torch

    args, model = ctx.args, ctx.model
    batch, context = args.prefill_batch, args.prefill_context
    row = _row(f"prefill-b{batch}x{context}", "prefill", "eager", batch, context)
    need = 2 * batch * context / ctx.prefill_tok_s + args.warmup_s + args.prefill_seconds + 2
    if need > ctx.left_s():
        row.update(status="skipped", note=f"budget: needs ~{need:.0f} s, {ctx.left_s():.0f} s left")
        return row
    log(f"{row['name']}: repeated prefill for {args.prefill_seconds:g} s")

    def run() -> None:
        ids = torch.randint(0, model.config.vocab_size, (batch, context), device=args.device)

        def step() -> None:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

        t0 = time.perf_counter()
        step()
        ctx.sync()
        row["prefill_s"] = _r(time.perf_counter() - t0, 3)
        _timed_steps(ctx, step, args.warmup_s, f"{row['name']}:warmup")
        measured = _timed_steps(ctx, step, args.prefill_seconds, f"{row['name']}:measure")
        _finish(row, ctx, measured, batch * context, args.prefill_seconds)
        if row["tok_s"]:
            ctx.prefill_tok_s = float(row["tok_s"])

    return _guarded(ctx, row, run)


def idle_row(ctx: Ctx, name: str, seconds: float) -> dict[str, Any]:
    row = _row(name, "idle", None, 0, 0)
    if ctx.meter is None:
        row.update(status="skipped", note="no NVML")
        return row
    with Window(ctx.meter, name) as window:
        time.sleep(max(0.0, min(seconds, ctx.left_s())))
    elapsed = window.end.t_s - window.start.t_s if window.end and window.start else None
    row.update(status="ok", seconds=_r(elapsed, 3), **window.stats(), **_memory(ctx))
    return row


def _guarded(ctx: Ctx, row: dict[str, Any], run: Callable[[], None]) -> dict[str, Any]:
    """Out of memory or any other failure is recorded on the row; the sweep goes on."""
    import torch

    try:
        run()
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="oom", note=_first_line(exc))
    except Exception as exc:
        row.update(status="error", note=_first_line(exc))
    finally:
        if ctx.meter is not None:
            ctx.meter.tag = ""
    _free(ctx)
    log(_row_line(row))
    return row


def graph_probe(ctx: Ctx) -> str | None:
    """None if one eager decode step makes no host-device sync (so capture can work), else why.

    A failed capture can leave the CUDA context unusable, so check first with PyTorch's sync
    debug mode, which raises on any synchronising call without capturing anything.
    """
    import torch

    model = ctx.model
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, 16), device=ctx.args.device)
        cache = fixed_context_cache(model.config.num_hidden_layers)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        next_ids = out.logits[:, -1:].argmax(-1)
        ctx.sync()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
            next_ids.copy_(logits[:, -1:].argmax(-1))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ctx.sync()
        return None
    except Exception as exc:
        return f"decode step synchronises, not capturable: {_first_line(exc)}"
    finally:
        _free(ctx)


# --------------------------------------------------------------------------- report


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured power next to powerbatch.sim.gpu_model and the published H100 table."""
    table = []
    for row in rows:
        if row["status"] != "ok" or row["kind"] not in ("decode", "prefill", "idle"):
            continue
        measured = row.get("power_w_mean")
        entry: dict[str, Any] = {
            "name": row["name"],
            "batch": row["batch"],
            "measured_w": measured,
        }
        for key in COMPARE_PROFILES:
            profile = PROFILES[key]
            if row["kind"] == "decode":
                model_w = decode_power_w(profile, row["batch"])
            elif row["kind"] == "prefill":
                model_w = prefill_power_w(profile)
            else:
                model_w = idle_power_w(profile)
            entry[f"{key}_w"] = _r(model_w, 1)
            entry[f"ratio_{key}"] = _r(measured / model_w, 3) if measured else None
        pub = PUBLISHED_H100_8B.get(row["batch"]) if row["kind"] == "decode" else None
        entry["pub_h100_w"] = pub[0] if pub else None
        entry["pub_h100_tok_s"] = pub[2] if pub else None
        entry["pub_h100_j_per_tok"] = pub[3] if pub else None
        entry["measured_tok_s"] = row.get("tok_s")
        entry["measured_j_per_tok"] = row.get("j_per_token")
        table.append(entry)
    return table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def markdown(headers: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(title for title, _ in headers) + " |",
        "|" + "---|" * len(headers),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key)) for _, key in headers) + " |")
    return "\n".join(lines)


ROW_COLUMNS = (
    ("row", "name"),
    ("status", "status"),
    ("batch", "batch"),
    ("ctx", "context"),
    ("steps", "steps"),
    ("steps/s", "steps_per_s"),
    ("step ms p50", "step_ms_p50"),
    ("issue ms p50", "issue_ms_p50"),
    ("tok/s", "tok_s"),
    ("W mean", "power_w_mean"),
    ("W p5", "power_w_p5"),
    ("W p95", "power_w_p95"),
    ("W avg-API", "power_avg_api_w_mean"),
    ("energy J", "energy_j"),
    ("J/tok", "j_per_token"),
    ("E/(P·t)", "energy_to_power_x_time"),
    ("GiB peak", "mem_peak_gib"),
    ("note", "note"),
)
COMPARE_COLUMNS = (
    ("row", "name"),
    ("measured W", "measured_w"),
    ("h200-decode-light W", "h200-decode-light_w"),
    ("ratio", "ratio_h200-decode-light"),
    ("h100-llama8b W", "h100-llama8b_w"),
    ("ratio", "ratio_h100-llama8b"),
    ("pub H100 W", "pub_h100_w"),
    ("tok/s", "measured_tok_s"),
    ("pub tok/s", "pub_h100_tok_s"),
    ("J/tok", "measured_j_per_tok"),
    ("pub J/tok", "pub_h100_j_per_tok"),
)


def write_outputs(out: Path, report: dict[str, Any], meter: Meter | None) -> None:
    """Rewritten after every row, so whatever ran is on disk if the run is cut short."""
    report["comparison"] = compare(report["rows"])
    (out / "power_vs_batch.json").write_text(json.dumps(report, indent=2) + "\n")
    meta = report["meta"]
    md = [
        "# Power against batch (scripts/gpu_check.py)",
        "",
        f"{meta.get('gpu_name') or meta['device']}, {meta['model']}, {meta['dtype']}, "
        f"cache {meta.get('cache_mode')}, started {meta['started_utc']}.",
        "Decode: tok/s = output tokens/s; prefill: prompt tokens/s. 'issue ms' is the CPU time "
        "to launch one step: near 'step ms' means launch-bound. E/(P·t): energy counter over "
        "mean instant power x time.",
        "",
        markdown(ROW_COLUMNS, report["rows"]),
        "",
        "## Against powerbatch.sim.gpu_model and the published figures",
        "",
        markdown(COMPARE_COLUMNS, report["comparison"]),
        "",
        "## Published figures to compare with",
        "",
        *[f"- {line}" for line in PUBLISHED],
        "",
    ]
    (out / "power_vs_batch.md").write_text("\n".join(md))
    if meter is not None:
        with (out / "power_samples.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["t_s", "tag", "instant_w", "averaged_w", "energy_j"])
            t0 = meter.readings[0].t_s if meter.readings else 0.0
            writer.writerows(
                [f"{r.t_s - t0:.3f}", r.tag, f"{r.instant_w:.1f}", _fmt(r.averaged_w), r.energy_j]
                for r in list(meter.readings)
            )


def _row_line(row: dict[str, Any]) -> str:
    parts = [f"{row['name']}: {row['status']}"]
    for label, key in (
        ("steps", "steps"),
        ("tok/s", "tok_s"),
        ("step ms", "step_ms_p50"),
        ("W", "power_w_mean"),
        ("J/tok", "j_per_token"),
        ("GiB", "mem_peak_gib"),
    ):
        if row.get(key) is not None:
            parts.append(f"{label} {_fmt(row[key])}")
    if row.get("note"):
        parts.append(str(row["note"]))
    return ", ".join(parts)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True, help="output folder (the device's $OUT)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for the smoke mode")
    p.add_argument("--tiny", action="store_true", help="tiny Llama and short windows (smoke)")
    p.add_argument("--no-nvml", action="store_true", help="no power readings (columns None)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="skip the graph-mode rows")
    p.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU")
    p.add_argument("--batches", help="comma-separated decode batches")
    p.add_argument("--context", type=int, help="prompt tokens per sequence")
    p.add_argument("--seconds-per-batch", type=float, help="measured decode window")
    p.add_argument("--warmup-s", type=float, help="unmeasured steps before each window")
    p.add_argument("--prefill-batch", type=int)
    p.add_argument("--prefill-context", type=int)
    p.add_argument("--prefill-seconds", type=float)
    p.add_argument("--idle-seconds", type=float, help="idle window for the energy check")
    p.add_argument("--nvml-reads", type=int, help="reads per source for the latency figures")
    p.add_argument("--sample-interval-s", type=float, default=0.05)
    p.add_argument("--total-budget-s", type=float, default=360.0, help="stop the sweep by then")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock-sweep",
        default="",
        help="comma-separated SM clock tops (MHz) to lock, in turn, for decode rows at "
        "--clock-batches and a prefill row (J/token and step time against the clock; needs "
        "NVML and root; docs/clock.md). Reset after each, and at exit",
    )
    p.add_argument("--clock-batches", default="8,64", help="decode batches of the clock sweep")
    args = p.parse_args(argv)
    for name, (full, tiny) in MODE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    args.batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    args.clock_sweep = [int(c) for c in str(args.clock_sweep).split(",") if c.strip()]
    args.clock_batches = [int(b) for b in str(args.clock_batches).split(",") if b.strip()]
    return args


def clock_sweep(ctx: Ctx, rows: list[dict[str, Any]], nvml: ModuleType | None) -> dict[str, Any]:
    """Part 3: lock each top of --clock-sweep through powerbatch's own clock actuator backend
    (powerbatch.telemetry.clock.NvmlClock: snapped to the supported clocks, a state file while
    locked), run decode rows and a prefill row there, and reset. What calibrates the
    simulator's clock model (docs/clock.md)."""
    args = ctx.args
    clock = NvmlClock((args.gpu,), state_dir=args.out / "clock-state", nvml=nvml)
    report: dict[str, Any] = {"tops_mhz": [], "rows": []}
    try:
        asyncio.run(clock.start())
        supported = clock.supported_mhz()
        report["supported_mhz"] = [supported[0], supported[-1], len(supported)]
        for top in args.clock_sweep:
            lo, hi = snap_lock(supported[0], top, supported)
            t0 = time.perf_counter()
            asyncio.run(clock.lock(lo, hi))
            report["tops_mhz"].append({"asked": top, "locked": [lo, hi],
                                       "lock_s": _r(time.perf_counter() - t0, 4)})  # fmt: skip
            log(f"clock sweep: SM clock locked to {lo}-{hi} MHz")
            for batch in args.clock_batches:
                row = decode_row(ctx, batch, "eager")
                row.update(name=f"{row['name']}-clk{hi}", clock_mhz=hi)
                rows.append(row)
            row = prefill_row(ctx)
            row.update(name=f"{row['name']}-clk{hi}", clock_mhz=hi)
            rows.append(row)
            asyncio.run(clock.restore())
            if ctx.left_s() < 10:
                report["note"] = "stopped on the time budget"
                break
    except PowerbatchError as exc:
        report["error"] = _first_line(exc)
    finally:
        try:
            asyncio.run(clock.restore())
        except PowerbatchError as exc:
            report["reset_error"] = _first_line(exc)
        asyncio.run(clock.close())
    return report


def main(argv: Sequence[str] | None = None, *, nvml: ModuleType | None = None) -> int:
    """`nvml` lets a test hand in a fake pynvml, as powerbatch's own NVML tests do."""
    global _log_file
    started = time.monotonic()
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    _log_file = (args.out / "gpu_check.log").open("w")
    try:
        return _run(args, started, nvml)
    finally:
        _log_file.close()
        _log_file = None


def _nvml_phase(
    args: argparse.Namespace, report: dict[str, Any], nvml: ModuleType | None
) -> Meter | None:
    """Part 1, before torch touches the GPU; returns the meter the sweep samples with."""
    if args.no_nvml:
        report["nvml"] = {"available": False, "note": "--no-nvml"}
        return None
    if not nvml_available(nvml):
        report["nvml"] = {"available": False, "note": "nvml_available() is False"}
        return None
    meter: Meter | None = None
    try:
        meter = Meter(args.gpu, args.sample_interval_s, nvml)
        log("NVML: read latency, idle energy check, limits (GPU idle, before CUDA starts)")
        report["nvml"] = nvml_checks(
            meter, reads=args.nvml_reads, idle_s=args.idle_seconds, gpu=args.gpu, nvml=nvml
        )
    except PowerbatchError as exc:
        report["nvml"] = {"available": False, "error": _first_line(exc)}
        if meter is not None:
            meter.close()
        meter = None
    return meter


def _run(args: argparse.Namespace, started: float, nvml: ModuleType | None) -> int:
    log(
        f"gpu_check: out={args.out} device={args.device} tiny={args.tiny} "
        f"budget={args.total_budget_s:g} s"
    )
    deadline = started + args.total_budget_s
    nvml_report: dict[str, Any] = {
        "script": "scripts/gpu_check.py",
        "started_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "not_in_powerbatch_nvml": list(NVML_GAPS),
    }
    meter = _nvml_phase(args, nvml_report, nvml)
    (args.out / "gpu_check.json").write_text(json.dumps(nvml_report, indent=2) + "\n")
    log("NVML: " + json.dumps(nvml_report["nvml"])[:1500])

    # No network on the lent machine: never let transformers try the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(1)  # a smoke test on a shared machine, not a benchmark
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    meta: dict[str, Any] = {
        "started_utc": nvml_report["started_utc"],
        "device": args.device,
        "model": "tiny-llama" if args.tiny else "llama-3.1-8b-shaped (random init)",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sources": SOURCES,
        "published": list(PUBLISHED),
    }
    if cuda:
        props = torch.cuda.get_device_properties(torch.device(args.device))
        meta.update(
            gpu_name=props.name,
            gpu_mem_gib=_r(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    report: dict[str, Any] = {"meta": meta, "rows": [], "checks": {}, "comparison": []}
    rows: list[dict[str, Any]] = report["rows"]
    idle = nvml_report["nvml"].get("idle_energy_check")
    if idle is not None:
        row = _row("idle-no-cuda", "idle", None, 0, 0)
        row.update({k: v for k, v in idle.items() if k in row or k in Window.STATS}, status="ok")
        rows.append(row)

    log(f"building {meta['model']} on {args.device} ({meta['dtype']})")
    t0 = time.perf_counter()
    model = build_model(args.tiny, args.device, dtype)
    meta["params_b"] = _r(sum(p.numel() for p in model.parameters()) / 1e9, 3)
    meta["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    meta["build_s"] = _r(time.perf_counter() - t0, 2)
    log(f"model: {meta['params_b']} B params in {meta['build_s']} s")
    ctx = Ctx(args=args, model=model, meter=meter, deadline=deadline, cache_mode="stock")

    with torch.inference_mode():
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
        try:
            check = check_fixed_cache(
                model, context=min(args.context, 64), device=args.device, tol=tol
            )
        except Exception as exc:
            check = {"ok": False, "error": _first_line(exc)}
        _free(ctx)
        report["checks"]["fixed_context_cache"] = check
        ctx.cache_mode = meta["cache_mode"] = "fixed" if check["ok"] else "stock"
        log(f"fixed-context cache check: {check} -> cache {ctx.cache_mode}")

        if meter is not None:
            rows.append(idle_row(ctx, "idle-model-loaded", min(3.0, args.idle_seconds)))
        for batch in args.batches:
            rows.append(decode_row(ctx, batch, "eager"))
            write_outputs(args.out, report, meter)
        rows.append(prefill_row(ctx))
        write_outputs(args.out, report, meter)
        if args.clock_sweep and meter is not None and cuda:
            report["checks"]["clock_sweep"] = clock_sweep(ctx, rows, nvml)
            write_outputs(args.out, report, meter)

        why_not: str | None = None
        if not cuda:
            why_not = "CUDA graphs need CUDA"
        elif args.no_cuda_graphs:
            why_not = "--no-cuda-graphs"
        elif ctx.cache_mode != "fixed":
            why_not = "needs the fixed-context cache (its check failed)"
        else:
            why_not = graph_probe(ctx)
        report["checks"]["cuda_graphs"] = why_not or "ok"
        for batch in args.batches:
            if why_not is not None:
                row = _row(f"decode-b{batch}-graph", "decode", "graph", batch, args.context)
                row.update(status="skipped", note=why_not)
                rows.append(row)
                continue
            rows.append(decode_row(ctx, batch, "graph"))
            write_outputs(args.out, report, meter)
            if rows[-1]["status"] == "error":
                why_not = f"skipped after the error at batch {batch}"

    if meter is not None:
        meter.close()
        report["checks"]["meter_errors"] = meter.errors
        keys = ("name", "seconds", "power_w_mean", "energy_power_w", "energy_to_power_x_time")
        nvml_report["load_energy_check"] = [
            {k: r.get(k) for k in keys}
            for r in rows
            if r["status"] == "ok" and r.get("energy_j") is not None
        ]
        (args.out / "gpu_check.json").write_text(json.dumps(nvml_report, indent=2) + "\n")
    write_outputs(args.out, report, meter)

    print("\n" + markdown(ROW_COLUMNS, rows), flush=True)
    print(f"\nAgainst powerbatch.sim.gpu_model (decode_power_w, kv 0) and {SOURCES}:", flush=True)
    print(markdown(COMPARE_COLUMNS, report["comparison"]), flush=True)
    print("\nCompare with (published figures, with their sources):", flush=True)
    for line in PUBLISHED:
        print(f"- {line}", flush=True)
    skipped = [r["name"] for r in rows if r["status"] == "skipped"]
    failed = [r["name"] for r in rows if r["status"] in ("oom", "error")]
    log(
        f"done in {time.monotonic() - started:.0f} s; skipped {skipped or 'none'}; "
        f"failed {failed or 'none'}; files in {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
