"""Power and step-time model of a GPU set serving an LLM; pure functions, no I/O.

Every number here is calibrated to published figures, cited where used:

* [G2G] the GPU-to-Grid paper (arXiv 2602.05116) and its repository gpu2grid/openg2g: the fits in
  logistic_fits.csv, made from the ML.ENERGY leaderboard's v3 data (vLLM 0.11.1, chat workload,
  steady state, H100 SXM), and a 100 ms power trace of Llama-3.1-8B at batch 128;
* [IPC] "Illusion of Power Capping in LLM Decode" (arXiv 2605.11999);
* [Dynamo] NVIDIA Dynamo's power-planner design notes (ai-dynamo/dynamo,
  docs/design-docs/power-planner.md);
* [NVML] NVIDIA's NVML API reference (power readings, limits, field values, clocks);
* [Voltana] VoltanaLLM (arXiv 2509.04827): prefill and decode at separate SM frequencies on A100;
  energy against clock is U-shaped, and 1410 -> 1005 MHz lengthens decode steps sub-linearly;
* [Char] "Characterizing LLM Inference Energy-Performance Tradeoffs across Workloads and GPU
  Scaling" (arXiv 2501.08219): decode largely insensitive to the SM clock, prefill ~ 1/f;
* [throttLL'eM] (arXiv 2408.05235) and [DynamoLLM] (arXiv 2408.00741): the SM frequency as an
  energy knob for serving, with SLOs met.

The SM clock (docs/clock.md) is an addition to the fitted curves, a no-op at the top clock: each
part of a step has a roofline split into memory time and SM time (`clocked_part`), SM power
follows f x V(f)^2 with V flat under a knee, and a power limit is met by the driver lowering the
clock (`step_at_clock`).

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
    "ClockedStep",
    "GpuProfile",
    "SteadyState",
    "clocked_part",
    "decode_power_w",
    "decode_sm_share",
    "decode_step_s",
    "idle_power_w",
    "logistic",
    "mean_noise_factor",
    "noisy_readings_w",
    "ou_noise_step_w",
    "prefill_power_w",
    "prefill_step_s",
    "steady_state",
    "step_at_clock",
    "step_time_s",
    "supported_clocks_mhz",
    "voltage_frac",
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

    # The SM clock (docs/clock.md). Flat fields, so a profile still round-trips through JSON.
    sm_clock_max_mhz: int = 1980
    """H100 and H200 SXM maximum boost clock, 1980 MHz (NVIDIA datasheets); the clock the
    fitted curves were measured at (unlocked, boosting)."""
    sm_clock_min_mhz: int = 345
    sm_clock_step_mhz: int = 15
    """Graphics clocks are set on a grid, 15 MHz steps on H100 (`nvidia-smi -q -d
    SUPPORTED_CLOCKS`); the bottom of the grid is a modelling choice, a real list comes from
    nvmlDeviceGetSupportedGraphicsClocks."""
    voltage_knee_frac: float = 0.6
    voltage_floor_frac: float = 0.65
    """Core voltage falls linearly with the clock from the top down to the knee (this share of
    the top clock), then stays at the floor (this share of the top voltage): dynamic power goes
    as f x V^2, so it falls faster than linearly above the knee and linearly below it. Knee and
    floor are modelling choices (no source gives Hopper's V/f table)."""
    clock_power_frac: float = 0.6
    """Of the dynamic power not spent on arithmetic (memory-bound stretches, stalled warps,
    the clock tree), the share that follows the SM clock as f x V^2; the rest is memory traffic,
    a fixed energy per byte. Modelling choice, set so that the decode-light plant saves about
    30 % of decode energy at its best locked clock ([IPC]: up to 32 %)."""
    mem_issue_clock_frac: float = 0.45
    """Below this share of the top clock the SMs cannot issue memory requests fast enough to
    keep HBM busy, and memory-bound time grows as 1/f too: the left arm of [Voltana]'s U. Near
    0, decode stays flat down to the lowest clock, as [Char] measured on Blackwell (the sources
    disagree: docs/clock.md). Modelling choice."""
    cap_by_clock: bool = False
    """How a power limit slows work. False (the named profiles): the reduced forms of
    `step_at_clock` (prefill by P/limit, decode by (P/limit) ** `decode_cap_exponent`). True:
    the driver lowers each part's clock until its power on the clock model fits, so a cap and
    a locked clock are judged by the same physics (the clock benches use this)."""
    roofline_p: float = 2.0
    """Memory and SM time of a part combine as a p-norm: 1 adds them (no overlap), a large p
    is the roofline's max (full overlap). Modelling choice: kernels overlap partly."""

    @property
    def tdp_w(self) -> float:
        return self.tdp_w_per_gpu * self.num_gpus

    @property
    def min_limit_w(self) -> float:
        """The set's lowest power limit (NVML's constraints, per GPU, times the GPUs)."""
        return self.min_limit_w_per_gpu * self.num_gpus

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
    s = logistic(batch, 0.0, 1.0, profile.dec_k, profile.dec_x0)  # the fit's shape, 0 to 1
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


def supported_clocks_mhz(profile: GpuProfile) -> list[int]:
    """The SM clocks the device accepts, highest first, as nvmlDeviceGetSupportedGraphicsClocks
    lists them."""
    top, bottom, step = (
        profile.sm_clock_max_mhz,
        profile.sm_clock_min_mhz,
        profile.sm_clock_step_mhz,
    )
    return list(range(top, bottom - 1, -step))


def voltage_frac(profile: GpuProfile, sm_clock_mhz: float) -> float:
    """Core voltage at a clock over the voltage at the top clock (see `voltage_floor_frac`)."""
    top = profile.sm_clock_max_mhz
    knee = profile.voltage_knee_frac * top
    floor = profile.voltage_floor_frac
    x = min(max((sm_clock_mhz - knee) / (top - knee), 0.0), 1.0)
    return floor + (1.0 - floor) * x


def _part_time_s(profile: GpuProfile, t_mem_s: float, t_sm_s: float, f_rel: float) -> float:
    """A part's time at clock f_rel (share of the top clock), from its memory and SM time at the
    top: SM time goes as 1/f, memory time as 1/f only under `mem_issue_clock_frac`."""
    p = profile.roofline_p
    t_mem = t_mem_s * max(1.0, profile.mem_issue_clock_frac / f_rel)
    t_sm = t_sm_s / f_rel
    return float((t_mem**p + t_sm**p) ** (1.0 / p))


def _mem_time_s(profile: GpuProfile, t0_s: float, sm_share: float) -> float:
    """The memory part of a step's time `t0_s` at the top clock, given the share the SMs
    would need alone (the roofline split that `_part_time_s` adds back)."""
    p = profile.roofline_p
    return float(t0_s * max(1.0 - sm_share**p, 0.0) ** (1.0 / p))


def clocked_part(
    profile: GpuProfile, t0_s: float, p0_w: float, sm_share: float, sm_clock_mhz: float
) -> tuple[float, float]:
    """(time, power) of one part of a step at an SM clock, from its (time, power) at the top
    clock and the share of its time the SMs would need alone (`sm_share`, the roofline split).

    Energy at clock f: idle power x T(f), plus memory traffic (a fixed energy), plus arithmetic
    (a fixed count of operations at V(f)^2 each), plus clock-driven power (f x V(f)^2, the whole
    time). At the top clock every term is at its measured value, so the fits stay exact.
    """
    f_rel = min(max(sm_clock_mhz / profile.sm_clock_max_mhz, 1e-3), 1.0)
    s = min(max(sm_share, 0.0), 1.0)
    t_s = _part_time_s(profile, _mem_time_s(profile, t0_s, s), s * t0_s, f_rel)
    v2 = voltage_frac(profile, sm_clock_mhz) ** 2
    idle_w = min(profile.idle_w, p0_w)
    dyn_w = p0_w - idle_w
    q_sm = s
    q_clk = profile.clock_power_frac * (1.0 - s)
    q_mem = 1.0 - q_sm - q_clk
    energy_j = idle_w * t_s + dyn_w * t0_s * (q_mem + q_sm * v2) + dyn_w * q_clk * t_s * f_rel * v2
    return t_s, energy_j / t_s


def _clock_for_time(
    profile: GpuProfile, t_mem0: float, t_sm0: float, f_hi: float, target_s: float
) -> float:
    """The clock (share of the top) at or under `f_hi` whose part time is `target_s`."""
    lo, hi = 1e-3, f_hi
    if _part_time_s(profile, t_mem0, t_sm0, hi) >= target_s:
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _part_time_s(profile, t_mem0, t_sm0, mid) > target_s:
            lo = mid
        else:
            hi = mid
    return hi


def _driver_clock(
    profile: GpuProfile, t0_s: float, p0_w: float, sm_share: float, f_mhz: float, limit_w: float
) -> tuple[float, float, float]:
    """(clock share, time, power) of a part whose power at `f_mhz` is over the limit: the
    highest clock under `f_mhz` whose power fits (power rises with the clock: bisection). Where
    even the lowest clock draws more, it runs there, clamped to the limit and slowed in
    proportion (the driver has nothing left but to stall)."""
    lo = float(profile.sm_clock_min_mhz)
    t_lo, p_lo = clocked_part(profile, t0_s, p0_w, sm_share, lo)
    top = profile.sm_clock_max_mhz
    if p_lo > limit_w:
        return lo / top, t_lo * p_lo / limit_w, limit_w
    hi = f_mhz
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if clocked_part(profile, t0_s, p0_w, sm_share, mid)[1] > limit_w:
            hi = mid
        else:
            lo = mid
    t_s, p_w = clocked_part(profile, t0_s, p0_w, sm_share, lo)
    return lo / top, t_s, p_w


@dataclass(frozen=True, slots=True)
class ClockedStep:
    step_s: float
    power_w: float
    sm_clock_mhz: float
    """The clock the step ran at: the top of the locked range, or lower where the driver met the
    power limit (time-weighted over the step's parts)."""


def decode_sm_share(profile: GpuProfile, batch: int) -> float:
    """The share of a decode step the SMs would need alone at the top clock: the batch's tokens
    at the compute-bound prefill rate, over the fitted step time. Small at small batch
    (memory-bound decode, [IPC]), rising with batch (modelling choice: the SM rate of a decode
    token is the prefill rate)."""
    t = decode_step_s(profile, batch)
    return min(batch / profile.prefill_tok_s / t, 1.0) if t > 0 else 0.0


def step_at_clock(
    profile: GpuProfile,
    batch: int,
    prefill_tokens: int,
    kv_tokens: int = 0,
    power_limit_w: float | None = None,
    *,
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
    sm_clock_mhz: float | None = None,
) -> ClockedStep:
    """One engine step with `batch` decodes and `prefill_tokens` of prefill, at a locked SM clock
    (`sm_clock_mhz`, the top of the locked range; None or the top clock: unlocked).

    Modelling choice: the two parts run back to back, so time adds and power is their
    time-weighted mean. A locked clock moves each part along its roofline (`clocked_part`).
    Under a power limit each part is then clamped to the limit and slowed: the driver lowers
    the clock until the power fits, which costs prefill time by P_pre/limit (compute-bound;
    [Dynamo]: 30% less power costs ~30% throughput) and decode time by
    (P_dec/limit) ** `decode_cap_exponent` (memory-bound decode is far less clock-sensitive,
    [IPC]; the default square root is our choice). These reduced forms keep the named profiles'
    capped behaviour; the clock reported is the one that gives the throttled step its time on
    the roofline. A step with no work draws idle.
    """
    limit = profile.tdp_w if power_limit_w is None else power_limit_w
    top = float(profile.sm_clock_max_mhz)
    f = top if sm_clock_mhz is None else min(max(float(sm_clock_mhz), 1.0), top)
    # Each part at the top clock, unthrottled: what the clock and the limit act on.
    t0_dec = t_dec = decode_step_s(profile, batch)
    t0_pre = t_pre = prefill_step_s(profile, prefill_tokens)
    if t_dec <= 0.0 and t_pre <= 0.0:
        return ClockedStep(0.0, profile.idle_w, float(profile.sm_clock_min_mhz))
    p0_dec = p_dec = (
        decode_power_w(profile, batch, kv_tokens, kv_capacity_tokens) if t_dec > 0 else 0.0
    )
    p0_pre = p_pre = prefill_power_w(profile)
    s_dec = decode_sm_share(profile, batch)
    if f < top:
        if t_dec > 0.0:
            t_dec, p_dec = clocked_part(profile, t_dec, p_dec, s_dec, f)
        if t_pre > 0.0:
            t_pre, p_pre = clocked_part(profile, t_pre, p_pre, 1.0, f)
    f_dec = f_pre = f / top
    if profile.cap_by_clock:
        if t_dec > 0.0 and p_dec > limit:
            f_dec, t_dec, p_dec = _driver_clock(profile, t0_dec, p0_dec, s_dec, f, limit)
        if t_pre > 0.0 and p_pre > limit:
            f_pre, t_pre, p_pre = _driver_clock(profile, t0_pre, p0_pre, 1.0, f, limit)
    else:
        if p_dec > limit:
            t_free = t_dec
            if profile.decode_cap_exponent == 0.5:
                t_dec *= math.sqrt(p_dec / limit)
            else:
                t_dec *= (p_dec / limit) ** profile.decode_cap_exponent
            p_dec = limit
            if t_dec > t_free:
                t_mem0 = _mem_time_s(profile, t0_dec, s_dec)
                f_dec = _clock_for_time(profile, t_mem0, s_dec * t0_dec, f / top, t_dec)
        if t_pre > 0.0 and p_pre > limit:
            f_pre *= limit / p_pre
            t_pre *= p_pre / limit
            p_pre = limit
    step_s = t_dec + t_pre
    # Power cannot be capped below idle: the limit slows work, it does not cut static draw.
    power_w = max((p_dec * t_dec + p_pre * t_pre) / step_s, min(profile.idle_w, limit))
    clock = top * (f_dec * t_dec + f_pre * t_pre) / step_s
    return ClockedStep(step_s, power_w, clock)


def step_time_s(
    profile: GpuProfile,
    batch: int,
    prefill_tokens: int,
    kv_tokens: int = 0,
    power_limit_w: float | None = None,
    *,
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
    sm_clock_mhz: float | None = None,
) -> tuple[float, float]:
    """(step_s, power_w) of one engine step: `step_at_clock` without the clock."""
    st = step_at_clock(
        profile,
        batch,
        prefill_tokens,
        kv_tokens,
        power_limit_w,
        kv_capacity_tokens=kv_capacity_tokens,
        sm_clock_mhz=sm_clock_mhz,
    )
    return st.step_s, st.power_w


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
    sm_clock_mhz: float | None = None,
) -> SteadyState:
    """Repeat one step shape forever: what a calibration check compares with [G2G]'s table."""
    step_s, power_w = step_time_s(
        profile,
        batch,
        prefill_tokens_per_step,
        kv_tokens,
        power_limit_w,
        kv_capacity_tokens=kv_capacity_tokens,
        sm_clock_mhz=sm_clock_mhz,
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
