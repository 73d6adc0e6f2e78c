"""Randomized plants for the scenario bench: a GPU set, its ceiling and its meter, from a seed.

A plant is a `GpuProfile` drawn from wide ranges (`RANGES`, docs/scenarios.md), so that no law
can be tuned to one calibrated profile. Where gpu_model.py cites a figure, the range brackets it:
the named profiles ([G2G] fits for Llama-3.1-8B on one H100 and Llama-70B on four, the [IPC]
decode-light H200) fall inside or at the edges (docs/scenarios.md). The ceiling is drawn with
the plant so that power binds part of the time: between 29 % and 91 % of the way from the base
to the top decode draw, at a batch of 8 to 128.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from powerbatch.sim.gpu_model import GpuProfile, decode_power_w, decode_step_s, prefill_power_w

__all__ = ["CLOCK_RANGES", "METERS", "RANGES", "Plant", "draw_plant", "with_clock_physics"]

METERS: dict[str, tuple[float, float]] = {
    "instant": (0.0, 0.0),
    "mean-1s": (1.0, 0.0),
    "lag-2s": (1.0, 2.0),
}
"""Meter -> (dcgm-exporter collect interval s, lag s): the instant field at every poll
(NVML_FI_DEV_POWER_INSTANT), the exporter's 1-s mean refreshed once a second
(nvmlDeviceGetPowerUsage on Hopper is a 1-s mean, NVML API reference), or that mean 2 s late."""

RANGES: dict[str, Any] = {
    "num_gpus": (1, 2, 4, 8),
    "base_frac": (0.10, 0.85),  # decode power at batch 1, share of the ceiling
    "idle_over_base": (0.5, 1.0),  # idle power over base power (idle >= 10 % of the ceiling)
    "top_over_headroom": (1.1, 3.5),  # (top - base) / (ceiling - base): 1 / the cap's place
    "tdp_use": (0.4, 1.0),  # top decode power over the set's TDP ([IPC]: 300 of 700 W)
    "bind_log2_batch": (3.0, 7.0),  # the ceiling binds at a batch of 8..128
    "dec_k": (0.3, 2.5),  # logistic slope in log2(batch): near linear .. sharp (log-uniform)
    "prefill_power_frac": (0.5, 1.0),  # prefill power over TDP (at least the top decode power)
    "prefill_tok_s_per_gpu": (2_500.0, 25_000.0),  # log-uniform: heavy .. light J/prompt token
    "itl_base_s": (0.006, 0.03),  # log-uniform
    "itl_span_s": (0.02, 0.35),  # log-uniform
    "itl_k": (0.6, 1.2),
    "itl_x0": (8.0, 11.5),
    "decode_cap_exponent": (0.05, 1.0),  # cheap (memory-bound) .. proportional
    "noise_sigma_w_per_gpu": (0.0, 40.0),
    "noise_tau_s": (0.1, 5.0),  # log-uniform; half the plants draw white noise (tau 0)
    "imbalance": (0.0, 0.3),  # each GPU's weight 1 +- this, then normalised
    "kv_binds": (True, False),
    "kv_bind_factor": (0.5, 1.2),  # binding KV: this x the batch where power binds x 1,000 tokens
    "meter": tuple(METERS),
}
TDP_W_PER_GPU = 700.0  # H100/H200 SXM board limit; NVML's constraints 200-700 W (gpu_model.py)
MIN_LIMIT_W_PER_GPU = 200.0
MIN_CEILING_OVER_LIMIT = 1.1  # the ceiling per GPU stays 10 % above the lowest settable limit
KV_TOKENS_PER_REQUEST = 1_000  # the sizing guess for a binding KV cache (chat-like requests)
KV_FREE_TOKENS_PER_GPU = 400_000  # gpu_model.DEFAULT_KV_CAPACITY_TOKENS: does not bind


@dataclass(frozen=True)
class Plant:
    """A drawn GPU set, its ceiling, KV capacity and meter, with the draw behind them."""

    profile: GpuProfile
    ceiling_w: float
    kv_capacity_tokens: int
    meter: str
    draw: dict[str, Any]
    """The drawn dimensions (fractions, labels), for the report and the docs."""

    @property
    def dcgm_interval_s(self) -> float:
        return METERS[self.meter][0]

    @property
    def dcgm_lag_s(self) -> float:
        return METERS[self.meter][1]

    def sustain_rps(self, prompt_mean: float, output_mean: float) -> float:
        """About how many requests a second the plant serves at the ceiling: the batch where
        decode power meets the ceiling (or the KV cache's, if smaller) decoding back to back,
        with each request's prefill taking its share of the time. Prefill drawing more than
        the ceiling runs at ceiling / prefill power of its speed (under a cap it is slowed; under
        admission alone it may run only that share of the time). A sizing guess for the load,
        not a figure the bench reports."""
        p = self.profile
        s = (self.ceiling_w - p.dec_base_w) / p.dec_span_w
        x = p.dec_x0 + math.log(s / (1.0 - s)) / p.dec_k if 0.0 < s < 1.0 else 8.0
        batch = min(2.0**x, self.kv_capacity_tokens / (prompt_mean + output_mean / 2), 256.0)
        batch = max(batch, 1.0)
        step_s = decode_step_s(p, round(batch))
        prefill_tok_s = p.prefill_tok_s * min(1.0, self.ceiling_w / prefill_power_w(p))
        return float(batch / (step_s * output_mean + batch * prompt_mean / prefill_tok_s))

    def one_request_over(self, prompt_mean: float) -> bool:
        """Whether one request alone puts a second over the ceiling: its prompt's prefill at
        full power, the rest of that second decoding it at batch 1. On such a plant no admission
        law holds every second without leaving the GPU idle around each prompt; the cap slows
        the prefill instead. The bench reports admission alone with and without these plants."""
        p = self.profile
        d = min(prompt_mean / p.prefill_tok_s, 1.0)
        return d * prefill_power_w(p) + (1.0 - d) * decode_power_w(p, 1) > self.ceiling_w

    def admission_bound_tok_s(self, prompt_mean: float, output_mean: float) -> float:
        """The most output tokens/s any admission law sustains under the ceiling on this plant:
        a fluid bound over batches b (to the KV cache's limit, at most 256), decoding at b
        with prefill taking the share of the time its prompts need, or the share whose watts
        fit (f P_prefill + (1 - f) P_decode(b) at the ceiling) where that is less. A steady
        state that knows the plant exactly; the bench compares admission alone with it, since
        the cap's advantage (decode slowed, not stopped) is out of admission's reach."""
        p = self.profile
        pre_w, pre_tok_s = prefill_power_w(p), p.prefill_tok_s
        kv_batch = self.kv_capacity_tokens / (prompt_mean + output_mean / 2.0)
        best = 0.0
        for b in range(1, int(min(256.0, max(kv_batch, 1.0))) + 1):
            dec_w = decode_power_w(p, b)
            if dec_w > self.ceiling_w:
                break
            t_s = decode_step_s(p, b)
            rps = (b / (t_s * output_mean)) / (
                1.0 + b * prompt_mean / (t_s * output_mean * pre_tok_s)
            )
            f = rps * prompt_mean / pre_tok_s  # the share of time in prefill it needs
            f_max = (self.ceiling_w - dec_w) / (pre_w - dec_w) if pre_w > dec_w else 1.0
            if f > f_max:
                rps = f_max * pre_tok_s / prompt_mean
            best = max(best, rps * output_mean)
        return best

    def to_json(self) -> dict[str, Any]:
        return {
            "profile": asdict(self.profile),
            "ceiling_w": self.ceiling_w,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "meter": self.meter,
            "draw": self.draw,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plant:
        prof = dict(d["profile"])
        prof["gpu_power_shares"] = tuple(prof.get("gpu_power_shares", ()))
        return cls(
            GpuProfile(**prof),
            float(d["ceiling_w"]),
            int(d["kv_capacity_tokens"]),
            str(d["meter"]),
            dict(d.get("draw", {})),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _u(rng: np.random.Generator, key: str) -> float:
    lo, hi = RANGES[key]
    return float(rng.uniform(lo, hi))


def _log_u(rng: np.random.Generator, key: str) -> float:
    lo, hi = RANGES[key]
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _curve_shape(x0: float, k: float, span_over_ceiling: float) -> str:
    """A label for the docs and the tables, from the drawn curve (not used by any run)."""
    if span_over_ceiling < 0.35:
        return "flat"
    if k < 0.6:
        return "near-linear"
    return "saturates-early" if x0 < 4.0 else "saturates-late"


def draw_plant(rng: np.random.Generator, name: str = "drawn") -> Plant:
    """One plant from `RANGES`. The order of the draws is fixed: the same generator state gives
    the same plant."""
    n = int(rng.choice(RANGES["num_gpus"]))
    tdp = TDP_W_PER_GPU * n
    base_frac = _u(rng, "base_frac")
    idle_frac = max(base_frac * _u(rng, "idle_over_base"), RANGES["base_frac"][0])
    g = _u(rng, "top_over_headroom")
    top_over_ceiling = base_frac + (1.0 - base_frac) * g
    tdp_use = _u(rng, "tdp_use")
    ceiling = tdp * tdp_use / top_over_ceiling
    if ceiling < MIN_CEILING_OVER_LIMIT * MIN_LIMIT_W_PER_GPU * n:  # a limiter must reach it
        ceiling = MIN_CEILING_OVER_LIMIT * MIN_LIMIT_W_PER_GPU * n
        g = (tdp * tdp_use / ceiling - base_frac) / (1.0 - base_frac)
        top_over_ceiling = base_frac + (1.0 - base_frac) * g
    base = base_frac * ceiling
    span = (1.0 - base_frac) * g * ceiling
    x_bind = _u(rng, "bind_log2_batch")
    k = _log_u(rng, "dec_k")
    s_bind = 1.0 / g  # where on the logistic the ceiling sits
    x0 = x_bind - math.log(s_bind / (1.0 - s_bind)) / k
    top = base + span
    prefill_frac = max(_u(rng, "prefill_power_frac"), min(top / tdp, 1.0))
    prefill_tok_s = _log_u(rng, "prefill_tok_s_per_gpu") * n
    itl_base = _log_u(rng, "itl_base_s")
    itl_span = _log_u(rng, "itl_span_s")
    itl_k = _u(rng, "itl_k")
    itl_x0 = _u(rng, "itl_x0")
    cap_exp = _u(rng, "decode_cap_exponent")
    sigma = _u(rng, "noise_sigma_w_per_gpu")
    tau = _log_u(rng, "noise_tau_s") if rng.random() < 0.5 else 0.0
    shares: tuple[float, ...] = ()
    imbalance = 0.0
    if n > 1:
        imbalance = _u(rng, "imbalance")
        w = 1.0 + rng.uniform(-imbalance, imbalance, n)
        shares = tuple(float(x) for x in w / w.sum())
    kv_binds = bool(rng.random() < 0.5)
    if kv_binds:
        kv = int(_u(rng, "kv_bind_factor") * 2.0**x_bind * KV_TOKENS_PER_REQUEST)
        kv = max(kv, 16_000)  # a whole request (up to 7,024 tokens) must still fit
    else:
        kv = KV_FREE_TOKENS_PER_GPU * n
    meter = str(rng.choice(RANGES["meter"]))
    base_profile = GpuProfile(
        name=name,
        num_gpus=n,
        gpu_model_name="NVIDIA H100 80GB HBM3",
        tdp_w_per_gpu=TDP_W_PER_GPU,
        dec_base_w=base,
        dec_span_w=span,
        dec_k=k,
        dec_x0=x0,
        itl_base_s=itl_base,
        itl_span_s=itl_span,
        itl_k=itl_k,
        itl_x0=itl_x0,
        prefill_tok_s=prefill_tok_s,
    )
    profile = replace(
        base_profile,
        idle_w_per_gpu=idle_frac * ceiling / n,
        min_limit_w_per_gpu=MIN_LIMIT_W_PER_GPU,
        prefill_power_frac=prefill_frac,
        noise_sigma_w_per_gpu=sigma,
        noise_tau_s=tau,
        decode_cap_exponent=cap_exp,
        gpu_power_shares=shares,
    )
    draw = {
        "num_gpus": n,
        "base_frac": base_frac,
        "idle_frac": idle_frac,
        "top_over_headroom": g,
        "top_over_ceiling": top_over_ceiling,
        "bind_batch": 2.0**x_bind,
        "curve": _curve_shape(x0, k, span / ceiling),
        "prefill_j_per_token": prefill_frac * tdp / prefill_tok_s,
        "prefill_over_ceiling": prefill_frac * tdp / ceiling,
        "decode_cap_exponent": cap_exp,
        "noise_sigma_w_per_gpu": sigma,
        "noise_tau_s": tau,
        "imbalance": imbalance,
        "kv_binds": kv_binds,
        "meter": meter,
    }
    return Plant(profile, ceiling, kv, meter, draw)


CLOCK_RANGES: dict[str, tuple[float, float]] = {
    "voltage_knee_frac": (0.4, 0.8),
    "voltage_floor_frac": (0.55, 0.95),
    "clock_power_frac": (0.0, 0.8),
    "mem_issue_clock_frac": (0.0, 0.9),
    "roofline_p": (1.0, 4.0),
}
"""The clock model's constants drawn for the clock benches (docs/clock.md): no source publishes
Hopper's V/f table, and the sources disagree on where decode stops being flat (VoltanaLLM, arXiv
2509.04827: a U with a sweet spot; arXiv 2501.08219: flat down to the lowest clock), so both are
drawn. Uniform, in this order (the draws of benchmarks/clock_plants.py)."""


def with_clock_physics(profile: GpuProfile, rng: np.random.Generator) -> GpuProfile:
    """`profile` with its clock physics drawn (`CLOCK_RANGES`) and a limit met by the clock."""
    drawn: dict[str, Any] = {k: float(rng.uniform(lo, hi)) for k, (lo, hi) in CLOCK_RANGES.items()}
    return replace(profile, cap_by_clock=True, **drawn)
