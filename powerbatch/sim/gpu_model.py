"""Power and step-time model of a GPU set serving an LLM; pure functions, no I/O.

Every number here is calibrated to published figures, cited where used:

* [G2G] the GPU-to-Grid paper (arXiv 2602.05116) and its repository gpu2grid/openg2g: the fits in
  logistic_fits.csv, made from the ML.ENERGY leaderboard's v3 data (vLLM 0.11.1, chat workload,
  steady state, H100 SXM), and a 100 ms power trace of Llama-3.1-8B at batch 128;
* [IPC] "Illusion of Power Capping in LLM Decode" (arXiv 2605.11999);
* [Dynamo] NVIDIA Dynamo's power-planner design notes (ai-dynamo/dynamo,
  docs/design-docs/power-planner.md);
* [NVML] NVIDIA's NVML API reference (power readings, limits, field values).

Where the sources are silent, the docstring that makes a choice names it a modelling choice.
Curves use the logistic form of the [G2G] fits:

    y(b) = b0 + L / (1 + exp(-k * (log2(b) - x0)))        b = running decode batch
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "DEFAULT_KV_CAPACITY_TOKENS",
    "DEFAULT_PROFILE",
    "PROFILES",
    "GpuProfile",
    "SteadyState",
    "decode_power_w",
    "decode_step_s",
    "idle_power_w",
    "logistic",
    "mean_noise_factor",
    "noisy_readings_w",
    "ou_noise_step_w",
    "prefill_power_w",
    "prefill_step_s",
    "steady_state",
    "step_time_s",
]

DEFAULT_PROFILE = "h100-llama8b"
DEFAULT_KV_CAPACITY_TOKENS = 400_000
"""Llama-3.1-8B holds 128 KiB of KV per token (32 layers x 8 KV heads x 128 x 2 x bf16); about
56 GB left on an 80 GB H100 after weights gives roughly 4e5 tokens."""


def logistic(b: float, b0: float, span: float, k: float, x0: float) -> float:
    """The [G2G] fit form in log2(batch); batch below 1 is treated as 1."""
    x = math.log2(max(b, 1.0))
    return b0 + span / (1.0 + math.exp(-k * (x - x0)))


@dataclass(frozen=True)
class GpuProfile:
    """One served model on one GPU set. Powers are totals over the set ([G2G] sums over GPUs)."""

    name: str
    num_gpus: int
    gpu_model_name: str
    """What dcgm-exporter puts in its modelName label."""
    tdp_w_per_gpu: float
    """Board power limit by default and the top of NVML's limit constraints (NVIDIA datasheets:
    H100 SXM and H200 SXM, 700 W)."""

    # Decode power, logistic in log2(b) ([G2G] fits, power).
    dec_base_w: float
    dec_span_w: float
    dec_k: float
    dec_x0: float

    # Decode step time (ITL), logistic in log2(b) ([G2G] fits, ITL).
    itl_base_s: float
    itl_span_s: float
    itl_k: float
    itl_x0: float

    prefill_tok_s: float
    """Compute-bound prefill rate: 2 * params FLOP/token at ~40% of 989 dense bf16 TFLOP/s per
    GPU (modelling choice; the sources give no prefill rate)."""

    idle_w_per_gpu: float = 78.0
    """Idle H200: about 75-80 W (vendor and benchmark pages; low confidence); used for H100 too."""

    min_limit_w_per_gpu: float = 200.0
    """The bottom of NVML's limit constraints (nvmlDeviceGetPowerManagementLimitConstraints): an
    H100 SXM reports 200-700 W in `nvidia-smi -q -d POWER`; used for the other profiles too."""

    prefill_power_frac: float = 0.95
    """Prefill runs near the power limit ([IPC], [Dynamo]: prefill is compute-bound and runs near
    the power limit); 0.95 x TDP is the modelling choice."""

    kv_power_frac: float = 0.08
    """Power rises with KV-cache traffic ([IPC]: decode is memory-bound). Modelling choice: a full
    KV cache fills up to 8% of the headroom left between the batch curve and its ceiling, so the
    fit is exact at empty KV and the curve never exceeds b0 + L (memory traffic saturates at large
    batch)."""

    noise_sigma_w_per_gpu: float = 20.0
    """Gaussian noise on instant readings ([G2G] batch-128 trace: "typically +-40 W" = ~2 sigma)."""

    spike_prob: float = 0.01
    spike_min_w: float = 100.0
    spike_max_w: float = 185.0
    """Rare upward spikes on instant readings: 665 W mean with single readings "up to about
    850 W" ([G2G] trace) gives +185 W at most; 1% is the modelling choice."""

    decode_cap_exponent: float = 0.5
    """How a power limit slows decode: time x (P_dec/limit) ** this. 0.5 is the modelling choice
    for memory-bound decode ([IPC]); 1 is as proportional as compute-bound prefill ([Dynamo])."""

    noise_tau_s: float = 0.0
    """Correlation time of the reading noise (an Ornstein-Uhlenbeck process per GPU). 0: each
    instant reading draws fresh noise and the 1-s mean is noise-free, as the named profiles do;
    > 0: slow noise that a 1-s mean does not average away (a modelling choice for randomized
    plants)."""

    gpu_power_shares: tuple[float, ...] = ()
    """Each GPU's share of the set's power (summing to 1); empty: an even split. Uneven shares
    model imbalance across a tensor-parallel set: the hottest GPU meets its limit first."""

    @property
    def tdp_w(self) -> float:
        return self.tdp_w_per_gpu * self.num_gpus

    @property
    def idle_w(self) -> float:
        return self.idle_w_per_gpu * self.num_gpus

    def shares(self) -> list[float]:
        """Each GPU's share of the set's power (even unless `gpu_power_shares` says otherwise)."""
        if self.gpu_power_shares:
            return list(self.gpu_power_shares)
        return [1.0 / self.num_gpus] * self.num_gpus

    def set_limit_w(self, gpu_limits_w: list[float]) -> float:
        """The set's power limit from per-GPU limits: the set steps in lockstep, so it is held
        where the first GPU reaches its own limit (the lowest limit, times n, when even)."""
        if not self.gpu_power_shares:
            return min(gpu_limits_w) * self.num_gpus
        return min(w / s for w, s in zip(gpu_limits_w, self.gpu_power_shares, strict=True))


_LLAMA8B_PREFILL_TOK_S = 25_000.0  # 989e12 * 0.4 / (2 * 8e9) = 24,725
_LLAMA70B_TP4_PREFILL_TOK_S = 11_000.0  # 4 * 989e12 * 0.4 / (2 * 70e9) = 11,303

_H100_LLAMA8B = GpuProfile(
    name="h100-llama8b",
    num_gpus=1,
    gpu_model_name="NVIDIA H100 80GB HBM3",
    tdp_w_per_gpu=700.0,
    dec_base_w=480.4,
    dec_span_w=210.9,
    dec_k=1.264,
    dec_x0=5.46,
    itl_base_s=0.008525,
    itl_span_s=0.08748,
    itl_k=1.081,
    itl_x0=9.154,
    prefill_tok_s=_LLAMA8B_PREFILL_TOK_S,
)

PROFILES: dict[str, GpuProfile] = {
    "h100-llama8b": _H100_LLAMA8B,
    # [IPC] regime: decode alone draws 137-300 W on an H200; the
    # shape in batch (and the latency) is borrowed from the 8B fit: the paper gives only the range.
    "h200-decode-light": replace(
        _H100_LLAMA8B,
        name="h200-decode-light",
        gpu_model_name="NVIDIA H200",
        dec_base_w=137.0,
        dec_span_w=163.0,
    ),
    "h100x4-llama70b": GpuProfile(
        name="h100x4-llama70b",
        num_gpus=4,
        gpu_model_name="NVIDIA H100 80GB HBM3",
        tdp_w_per_gpu=700.0,
        dec_base_w=1646.7,
        dec_span_w=1154.0,
        dec_k=0.579,
        dec_x0=7.385,
        itl_base_s=0.01581,
        itl_span_s=0.3337,
        itl_k=0.677,
        itl_x0=11.23,
        prefill_tok_s=_LLAMA70B_TP4_PREFILL_TOK_S,
    ),
}


def idle_power_w(profile: GpuProfile) -> float:
    return profile.idle_w


def prefill_power_w(profile: GpuProfile) -> float:
    return profile.prefill_power_frac * profile.tdp_w


def decode_power_w(
    profile: GpuProfile,
    batch: int,
    kv_tokens: int = 0,
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
) -> float:
    """Unclamped decode-step power; see `GpuProfile.kv_power_frac` for the KV term."""
    x = math.log2(max(batch, 1))
    s = 1.0 / (1.0 + math.exp(-profile.dec_k * (x - profile.dec_x0)))
    kv_frac = min(max(kv_tokens / kv_capacity_tokens, 0.0), 1.0) if kv_capacity_tokens > 0 else 0.0
    s += profile.kv_power_frac * kv_frac * (1.0 - s)
    return profile.dec_base_w + profile.dec_span_w * s


def decode_step_s(profile: GpuProfile, batch: int) -> float:
    """Unthrottled decode step time (the ITL fit); 0 with nothing to decode."""
    if batch <= 0:
        return 0.0
    return logistic(batch, profile.itl_base_s, profile.itl_span_s, profile.itl_k, profile.itl_x0)


def prefill_step_s(profile: GpuProfile, prefill_tokens: int) -> float:
    return max(prefill_tokens, 0) / profile.prefill_tok_s


def step_time_s(
    profile: GpuProfile,
    batch: int,
    prefill_tokens: int,
    kv_tokens: int = 0,
    power_limit_w: float | None = None,
    *,
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
) -> tuple[float, float]:
    """(step_s, power_w) of one engine step with `batch` decodes and `prefill_tokens` of prefill.

    Modelling choice: the two parts run back to back, so time adds and power is their
    time-weighted mean. Under a power limit each part is clamped to the limit and slowed: prefill
    time by P_pre/limit (compute-bound; [Dynamo]: 30% less power costs ~30% throughput),
    decode time by (P_dec/limit) ** `decode_cap_exponent` (memory-bound decode is far less
    clock-sensitive, [IPC]; the default square root is our choice). A step with no work draws idle.
    """
    limit = profile.tdp_w if power_limit_w is None else power_limit_w
    t_dec = decode_step_s(profile, batch)
    t_pre = prefill_step_s(profile, prefill_tokens)
    if t_dec <= 0.0 and t_pre <= 0.0:
        return 0.0, profile.idle_w
    p_dec = decode_power_w(profile, batch, kv_tokens, kv_capacity_tokens) if t_dec > 0 else 0.0
    p_pre = prefill_power_w(profile)
    if p_dec > limit:
        if profile.decode_cap_exponent == 0.5:
            t_dec *= math.sqrt(p_dec / limit)
        else:
            t_dec *= (p_dec / limit) ** profile.decode_cap_exponent
        p_dec = limit
    if t_pre > 0.0 and p_pre > limit:
        t_pre *= p_pre / limit
        p_pre = limit
    step_s = t_dec + t_pre
    # Power cannot be capped below idle: the limit slows work, it does not cut static draw.
    power_w = max((p_dec * t_dec + p_pre * t_pre) / step_s, min(profile.idle_w, limit))
    return step_s, power_w


@dataclass(frozen=True, slots=True)
class SteadyState:
    step_s: float
    power_w: float
    output_tok_s: float
    j_per_token: float


def steady_state(
    profile: GpuProfile,
    batch: int,
    *,
    prefill_tokens_per_step: int = 0,
    kv_tokens: int = 0,
    power_limit_w: float | None = None,
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
) -> SteadyState:
    """Repeat one step shape forever: what a calibration check compares with [G2G]'s table."""
    step_s, power_w = step_time_s(
        profile,
        batch,
        prefill_tokens_per_step,
        kv_tokens,
        power_limit_w,
        kv_capacity_tokens=kv_capacity_tokens,
    )
    tok_s = batch / step_s if step_s > 0 and batch > 0 else 0.0
    return SteadyState(
        step_s=step_s,
        power_w=power_w,
        output_tok_s=tok_s,
        j_per_token=power_w / tok_s if tok_s > 0 else math.inf,
    )


def noisy_readings_w(
    profile: GpuProfile, true_power_w: float, rng: np.random.Generator
) -> list[float]:
    """Instant per-GPU readings around the GPUs' shares of the true power ([G2G] trace).

    The true power, not these readings, feeds the energy counter: spikes are sensor artefacts.
    """
    n = profile.num_gpus
    per_gpu: float | np.ndarray = (
        true_power_w * np.asarray(profile.gpu_power_shares)
        if profile.gpu_power_shares
        else true_power_w / n
    )
    noise = rng.normal(0.0, profile.noise_sigma_w_per_gpu, n)
    spikes = np.where(
        rng.random(n) < profile.spike_prob,
        rng.uniform(profile.spike_min_w, profile.spike_max_w, n),
        0.0,
    )
    return [max(0.0, float(v)) for v in per_gpu + noise + spikes]


def ou_noise_step_w(
    profile: GpuProfile, state_w: list[float], dt_s: float, rng: np.random.Generator
) -> list[float]:
    """Advance per-GPU Ornstein-Uhlenbeck noise by `dt_s` (exact discretisation): stationary sd
    `noise_sigma_w_per_gpu`, correlation time `noise_tau_s` (> 0)."""
    a = math.exp(-max(dt_s, 0.0) / profile.noise_tau_s)
    scale = profile.noise_sigma_w_per_gpu * math.sqrt(max(1.0 - a * a, 0.0))
    z = rng.normal(0.0, 1.0, profile.num_gpus)
    return [a * x + scale * float(e) for x, e in zip(state_w, z, strict=True)]


def mean_noise_factor(tau_s: float, window_s: float = 1.0) -> float:
    """The sd of an OU process's `window_s` mean over its own sd: sqrt(2 r (1 - r (1 - e^-1/r)))
    with r = tau/window; 0 for white noise, towards 1 for slow noise."""
    if tau_s <= 0:
        return 0.0
    r = tau_s / window_s
    return math.sqrt(max(2.0 * r * (1.0 - r * (1.0 - math.exp(-1.0 / r))), 0.0))
