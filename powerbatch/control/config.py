"""The controller's settings: what an operator sets (`ControlConfig`), the gains of each law and
the grid's power shape (`ShapeSettings`).

Each gain sits next to the law it tunes (`Gains`); the laws themselves are in
`powerbatch.control.laws`. All are settings (flags, `POWERBATCH_*`, TOML), defined here once, so
the proxy and the vLLM plugin read the same names with the same bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from powerbatch.errors import ConfigError
from powerbatch.settings import check_bounds, setting


class Mode(StrEnum):
    """Enforce the limits, or observe: decide and report only."""

    ENFORCE = "enforce"
    OBSERVE = "observe"


def prior_max_w(
    configured_w: float | None, device_w: float | None, ceiling_w: float
) -> float | None:
    """The power limit the model's prior scales with: the operator's figure, else the
    device's own (read through NVML) where the ceiling is within it, else None (ceiling / 0.7).
    """
    if configured_w is not None or device_w is None or device_w < ceiling_w:
        return configured_w
    return device_w


@dataclass(frozen=True, slots=True)
class Gains:
    """Controller gains (each tunes one law; defaults are what the replay tests were tuned on)"""

    settings_advanced = True  # tuning, not an operator's: `serve --help-all` (powerbatch.settings)

    # Power. Growth: the batch grows by at most this share of itself per tick, so a wrong
    # probe costs at most one step of watts before the meter shows it.
    step_up_frac: float = setting(0.2, "largest growth of the batch per tick", gt=0, le=1)
    # Power. Dual ascent: λ_power += power_gain × (measured − goal), in W per W, clipped to
    # [0, power_lambda_max_frac × ceiling]; the target is goal − λ_power.
    power_gain: float = setting(
        0.25, "dual ascent step of the power multiplier, W per W of violation", ge=0, le=10
    )
    power_lambda_max_frac: float = setting(
        0.25, "largest power multiplier, as a share of the ceiling", ge=0, le=0.9
    )
    # Power. Over the target, the batch steps down at most this share per tick: a cut deeper
    # than the excess is itself a swing in power.
    step_down_frac: float = setting(0.25, "largest shrink of the batch per tick", gt=0, le=1)
    # Power. A measured breach cuts the batch to emergency_cut × in flight at once, then no
    # second cut for cut_cooldown_s (admission cannot preempt: power falls as requests finish).
    emergency_cut: float = setting(
        0.8, "on a measured breach, the batch drops to this share of in-flight", gt=0, lt=1
    )
    cut_cooldown_s: float = setting(
        1.0, "no second breach cut before the first can show in the power", ge=0
    )
    # Power. The meter's own spread over this window bounds one reading's noise.
    meter_window_s: float = setting(10.0, "window of the meter's recent spread, s", gt=0)
    # Latency. p95 TPOT comes from a sliding window that shows a smaller batch only as its
    # older samples age out, so while over the SLO the law acts at most once per
    # latency_hold_s: λ_latency += latency_gain × (p95 TPOT / SLO − 1) and the batch shrinks
    # by latency_shrink × the excess ratio (capped at 1). Acting every tick on a stale window
    # winds the batch down to 1. Under the SLO λ decays every tick; once it is 0 the batch
    # regrows by latency_regrow per tick (plus one request).
    latency_gain: float = setting(0.2, "dual ascent step of the latency multiplier", ge=0)
    latency_shrink: float = setting(
        0.25, "batch shrink per action per unit of TPOT excess ratio", ge=0, lt=1
    )
    latency_hold_s: float = setting(
        10.0, "no second latency shrink before the first can show in the p95, s", ge=0
    )
    latency_regrow: float = setting(
        0.05, "batch regrowth per tick once TPOT is back under its SLO", ge=0
    )
    # Latency. p95 TTFT over its SLO multiplies the growth step: queueing is hurting first
    # tokens, so grow faster where watts allow (the ceiling still wins).
    ttft_step_boost: float = setting(2.0, "growth step multiplier while TTFT is over SLO", ge=1)
    # KV. λ_kv += kv_gain × (usage − target); over target the KV scale shrinks by kv_shrink
    # per tick down to kv_min_scale, and regrows by kv_regrow while λ_kv is 0.
    kv_gain: float = setting(1.0, "dual ascent step of the KV multiplier", ge=0)
    kv_shrink: float = setting(0.1, "KV cap shrink per tick while usage is over target", ge=0, lt=1)
    kv_regrow: float = setting(0.02, "KV cap regrowth per tick once usage is under target", ge=0)
    kv_min_scale: float = setting(0.1, "smallest KV cap, as a share of the learned one", gt=0, le=1)
    # KV. The cap is kv_lead × batch × the learned KV per request: room for the spread of
    # context lengths, yet a shift to much longer contexts is capped before its power shows.
    kv_lead: float = setting(2.0, "KV cap as a multiple of the batch's usual KV", ge=1)
    # Prefill pace: the fastest prompt flow whose modelled watts fit under the target, at most
    # pace_max times the batch's steady prompt flow (more lets a burst through as a burst of
    # watts the model has not seen); the floor is ControlConfig.min_prefill_tok_s.
    pace_max: float = setting(3.0, "fastest prefill pace, × the steady prompt flow", ge=1)
    # Demand: the batch may lead the last demand_window_s's peak demand by this factor plus
    # demand_slack requests, so a burst ramps in instead of landing at once.
    demand_headroom: float = setting(
        1.25, "the batch may lead recent peak demand by this factor", ge=1
    )
    demand_slack: int = setting(2, "and by this many requests", ge=0)
    demand_window_s: float = setting(10.0, "window of recent peak demand, s", gt=0)
    # Device limit. With a power limiter, the limit is set at ceiling × (1 − limit_margin_frac):
    # the driver holds it within milliseconds, so it needs only a sliver of margin. Power then
    # bounds no batch: a capped batch serves more tokens the larger it is (decode is
    # memory-bound, so the throttle costs it little: ML.ENERGY leaderboard power-limit sweeps;
    # Patel et al., ASPLOS'24), and how deep it may throttle is the latency law's, by p95 time
    # per token, which is what throttling costs a user.
    limit_margin_frac: float = setting(
        0.01, "the device limit is set this share under the ceiling", ge=0, lt=0.5
    )
    # Under a device limit, the most urgent class may also take reserve_frac × batch slots
    # beyond the batch limit: its first tokens need not wait behind batch work, and the cap,
    # not admission, holds the ceiling while it runs.
    reserve_frac: float = setting(
        0.5, "under a device limit, extra slots for the top class, x the batch limit", ge=0, le=4
    )
    # Engine queue: while the upstream's waiting queue is longer than a buffer of
    # max(engine_min_buffer, engine_queue_s × its start rate), in flight is capped at what it
    # runs + that buffer, so the surplus waits here, by class, not in the engine's first-come
    # queue; once the engine's queue is under half the buffer the cap grows by
    # max(buffer, engine_growth_frac × cap) per scrape. Two seconds: the queue must last until
    # the next scrape (once a second) refills it, with as much again to spare.
    engine_queue_s: float = setting(
        2.0, "work left queued in the engine, in seconds of its start rate", gt=0, le=60
    )
    engine_min_buffer: int = setting(2, "and at least this many requests", ge=1)
    engine_growth_frac: float = setting(
        0.25, "growth of the cap per scrape once the engine's queue is short", gt=0, le=4
    )
    # The learned shape of one request (KV, prefill, decode rates) follows the load mix with
    # this EWMA weight per tick: slow, the mix changes over tens of ticks.
    shape_rate: float = setting(0.1, "EWMA weight per tick of the per-request shape", gt=0, le=1)

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """Controller: the ceiling, the batch limits and the latency objectives"""

    ceiling_w: float = setting(help="hard power ceiling for the GPU set, watts", gt=0)
    margin_w: float | None = setting(
        None, "stay this far under the ceiling, watts", ge=0, default_doc="2% of the ceiling"
    )
    hysteresis_w: float | None = setting(
        None,
        "dead band under the target in which the batch holds, watts",
        ge=0,
        default_doc="1% of the ceiling",
    )
    max_w: float | None = setting(
        None,
        "the GPU set's power limit (TDP), watts; the model's prior only",
        gt=0,
        default_doc="NVML's default limit with nvml, else ceiling / 0.7",
    )
    mode: Mode = setting(Mode.ENFORCE, "enforce limits, or observe (decide and report only)")
    tick_hz: float = setting(5.0, "control decisions per second", gt=0, le=100)
    warmup_s: float = setting(5.0, "silent warm-up: learn at the initial batch, s", ge=0)
    min_batch: int = setting(1, "smallest batch limit", ge=1)
    max_batch: int = setting(
        256, "largest batch limit; keep at or under vLLM's --max-num-seqs", ge=1, le=65_536
    )
    initial_batch: int = setting(8, "batch limit during warm-up", ge=1)
    safe_batch: int = setting(2, "batch limit while no power reading can be trusted", ge=1)
    recover_s: float = setting(2.0, "good readings needed before leaving the safe batch, s", ge=0)
    max_kv_tokens: int = setting(2_000_000, "hard cap on estimated KV tokens in flight", ge=1)
    confidence: float = setting(0.95, "confidence of the upper prediction bound", gt=0.5, lt=1)
    model_half_life_s: float = setting(20.0, "the power model forgets with this half-life, s", gt=0)
    model_window: int = setting(1_500, "samples the power model keeps", ge=20)
    ttft_slo_s: float = setting(2.0, "p95 time-to-first-token SLO, s", gt=0)
    tpot_slo_s: float = setting(0.1, "p95 time-per-output-token SLO, s", gt=0)
    interactive_classes: tuple[str, ...] = setting(
        ("high", "normal"), "priority classes whose latency the SLOs are about"
    )
    kv_usage_target: float = setting(
        0.9, "upstream KV-cache usage above this shrinks the KV cap", gt=0, le=1
    )
    prefill_pacing: bool = setting(True, "pace prompt tokens admitted per second")
    min_prefill_tok_s: float = setting(500.0, "slowest prefill pace, tokens/s", gt=0)
    gains: Gains = field(default_factory=Gains)

    def __post_init__(self) -> None:
        check_bounds(self)
        if not self.min_batch <= self.initial_batch <= self.max_batch:
            raise ConfigError(
                f"need min_batch <= initial_batch <= max_batch, got "
                f"{self.min_batch} / {self.initial_batch} / {self.max_batch}"
            )
        if not self.min_batch <= self.safe_batch <= self.max_batch:
            raise ConfigError(
                f"need min_batch <= safe_batch <= max_batch, got "
                f"{self.min_batch} / {self.safe_batch} / {self.max_batch}"
            )
        if self.margin + self.hysteresis >= 0.5 * self.ceiling_w:
            raise ConfigError(
                f"margin_w + hysteresis_w ({self.margin:g} + {self.hysteresis:g} W) must be under "
                f"half the ceiling ({self.ceiling_w:g} W): the target would leave no room to run"
            )
        if self.max_w is not None and self.max_w < self.ceiling_w:
            raise ConfigError(
                f"max_w ({self.max_w:g} W, the GPUs' power limit) is below the ceiling "
                f"({self.ceiling_w:g} W)"
            )
        if not self.interactive_classes:
            raise ConfigError("interactive_classes must name at least one class")

    @property
    def margin(self) -> float:
        return self.margin_at(self.ceiling_w)

    @property
    def hysteresis(self) -> float:
        return self.hysteresis_at(self.ceiling_w)

    def margin_at(self, ceiling_w: float) -> float:
        """The margin under a ceiling that may move (a fleet share): watts, or 2% of it."""
        return self.margin_w if self.margin_w is not None else 0.02 * ceiling_w

    def hysteresis_at(self, ceiling_w: float) -> float:
        return self.hysteresis_w if self.hysteresis_w is not None else 0.01 * ceiling_w


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """Control trace: every tick, written as it goes"""

    record_trace: str | None = setting(
        None, "append the control trace (CSV, one row per tick) to this file as it runs"
    )
    trace_rotate_mib: float = setting(
        64.0, "size at which the trace rotates to FILE.1, FILE.2, ... (~1 day at 5 Hz), MiB", gt=0
    )
    trace_keep: int = setting(4, "rotated trace files kept besides the current one", ge=0)


@dataclass(frozen=True, slots=True)
class ShapeSettings:
    """Power shape: ramp limits and a floor for the grid, and the receding-horizon planner"""

    ramp_up_w_per_s: float | None = setting(
        None, "largest rise of 1-second power per second, W/s; 0 or unset: off", ge=0
    )
    ramp_down_w_per_s: float | None = setting(
        None, "largest fall of 1-second power per second, W/s; 0 or unset: off", ge=0
    )
    floor_w: float | None = setting(
        None, "hold power at least here with deferrable (low) work while it waits, W", ge=0
    )
    swing_band_hz: tuple[float, ...] = setting(
        (0.2, 3.0), "band (lo, hi) whose swing energy is reported, Hz", default_doc="0.2, 3.0"
    )
    planner: Literal["off", "on"] = setting(
        "off", "plan per-second power over a horizon and follow it (off: reactive limits only)"
    )
    plan_horizon_s: float = setting(60.0, "the planner's horizon, s", ge=30, le=120)
    plan_every_s: float = setting(5.0, "re-plan this often, s", ge=0.5, le=60)

    def __post_init__(self) -> None:
        check_bounds(self)
        band = self.swing_band_hz
        if len(band) != 2 or not 0 <= band[0] < band[1]:
            raise ConfigError(f"swing_band_hz must be two numbers lo < hi, got {band}")

    @property
    def ramp_up(self) -> float | None:
        """The rise limit, W/s; None when off (unset or 0)."""
        return self.ramp_up_w_per_s or None

    @property
    def ramp_down(self) -> float | None:
        return self.ramp_down_w_per_s or None

    @property
    def active(self) -> bool:
        """Any limit set: the controller has shaping to do."""
        return bool(self.ramp_up or self.ramp_down or self.floor_w is not None)


@dataclass(frozen=True, slots=True)
class ClockPolicy:
    """SM clock policy: what the clock law optimises (powerbatch.control.laws.clock)"""

    clock_objective: Literal["throughput", "energy", "weighted"] = setting(
        "throughput",
        "throughput: never lock the clock (the driver's policy, fastest); energy: the lock with "
        "the fewest joules per token whose step time keeps the SLOs and the demand; weighted: "
        "between them by clock_energy_weight",
    )
    clock_energy_weight: float = setting(
        0.5, "weighted objective: 1 is energy alone, 0 throughput alone", ge=0, le=1
    )
    clock_boost_classes: tuple[str, ...] = setting(
        ("high",),
        "streamed requests of these classes run their prefill unlocked (at the top clock): a "
        "lock slows prefill about in proportion, and their first token is waited for",
    )
    clock_levels: int = setting(8, "candidate clock tops tried between the top and the floor", ge=2)
    clock_floor_frac: float = setting(
        0.4, "the lowest clock top the law picks, as a share of the highest", gt=0, le=1
    )
    clock_tpot_margin: float = setting(
        0.8, "a lower clock must keep its predicted step time under this share of tpot_slo_s", gt=0
    )
    clock_max_slowdown: float = setting(
        0.5,
        "a lower clock may lengthen the step by at most this share (the TPOT SLO margin is the "
        "constraint; this bounds the capacity given up)",
        ge=0,
    )
    clock_min_gain: float = setting(
        0.03, "move only for a predicted saving of at least this share of J/token", ge=0, lt=1
    )
    clock_explore_every_s: float = setting(
        30.0,
        "once the search has settled, recheck a neighbouring clock this often while the SLOs "
        "have room, s",
        gt=0,
    )
    clock_explore_s: float = setting(
        2.0,
        "a probed clock is judged on this many seconds of readings taken after it settled, s",
        gt=0,
    )
    clock_hold_s: float = setting(
        5.0,
        "after a prefill burst, a growing queue or an SLO at risk, hold the top this long, s",
        ge=0,
    )
    clock_settle_s: float = setting(
        1.5,
        "readings this soon after a clock change are not learned; longer while the meter lags "
        "(its learned lag plus its 1-s window), s",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_bounds(self)
