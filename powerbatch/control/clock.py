"""The SM clock as the loop sees it: the clock law's choice, applied off the tick (a lock takes
milliseconds through NVML, about 100 ms through zeusd's block=true, and a tick must not wait),
and the clock's metrics (`powerbatch_sm_clock_*`, J/token by phase).

The clock starts with the device limit, before the monitor, so a lock a crashed run left
behind is reset before anything else; on stop it is reset before the limit is restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from powerbatch.control.config import ClockPolicy, ControlConfig
from powerbatch.control.laws.clock import READING_WINDOW_S, ClockChoice, ClockInput, ClockLaw
from powerbatch.control.types import Observation
from powerbatch.control.window import counter_rate
from powerbatch.telemetry.clock import ClockActuator

log = logging.getLogger("powerbatch.control")

PREFILL_WEIGHT = 0.25
"""A prompt token's energy relative to a generated token's, for J/token by phase: the published
figures in powerbatch.energy.attribution (665 W / 25,000 prompt tokens/s against 0.11 J per
generated token at batch 64, arXiv 2605.11999 and 2602.05116)."""
PHASE_WINDOW_S = 30.0
SAMPLE_EVERY_S = 1.0


class ClockMetrics:
    """`powerbatch_sm_clock_*` and J/token by phase, on the host's registry."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.sm_clock_mhz = Gauge(
            "powerbatch_sm_clock_mhz", "The GPUs' SM clock now (mean over the set)", registry=r
        )
        self.locked_mhz = Gauge(
            "powerbatch_sm_clock_locked_mhz",
            "The locked SM clock range in force, by bound (NaN: unlocked)",
            ["bound"],
            registry=r,
        )
        self.changes = Counter(
            "powerbatch_sm_clock_changes", "SM clock lock changes applied", registry=r
        )
        self.fallbacks = Counter(
            "powerbatch_sm_clock_fallbacks",
            "Failed, refused or timed-out clock changes that fell back to unlocked clocks",
            registry=r,
        )
        self.boosts = Counter(
            "powerbatch_sm_clock_boosts",
            "Streamed requests whose prefill ran unlocked (the prefill boost)",
            registry=r,
        )
        self.degraded = Gauge(
            "powerbatch_sm_clock_degraded",
            "1 while clock control fails (clocks unlocked)",
            registry=r,
        )
        self.j_per_token = Gauge(
            "powerbatch_j_per_token",
            "Joules per token by phase over the last 30 s (prefill: per prompt token)",
            ["phase"],
            registry=r,
        )
        self._counts = (0, 0, 0)
        for b in ("min", "max"):
            self.locked_mhz.labels(b).set(math.nan)
        for ph in ("prefill", "decode"):
            self.j_per_token.labels(ph).set(math.nan)
        self.sm_clock_mhz.set(math.nan)

    def export(self, status: dict[str, Any]) -> None:
        lock = status.get("locked_mhz")
        for b, v in zip(("min", "max"), lock or (math.nan, math.nan), strict=True):
            self.locked_mhz.labels(b).set(v)
        clock = status.get("sm_clock_mhz")
        self.sm_clock_mhz.set(math.nan if clock is None else clock)
        self.degraded.set(1.0 if status.get("degraded") else 0.0)
        changes, fallbacks = int(status["changes_total"]), int(status["fallbacks_total"])
        boosts = int(status.get("boosts_total", 0))
        self.changes.inc(max(0, changes - self._counts[0]))
        self.fallbacks.inc(max(0, fallbacks - self._counts[1]))
        self.boosts.inc(max(0, boosts - self._counts[2]))
        self._counts = (changes, fallbacks, boosts)


class PhaseEnergy:
    """Joules per token by phase: each tick's energy split over prompt and generated tokens by
    work units (`PREFILL_WEIGHT` per prompt token), summed over `PHASE_WINDOW_S`."""

    def __init__(self) -> None:
        self._ticks: deque[tuple[float, float, float, float, float]] = deque()
        self._t_last: float | None = None

    def add(
        self, t_s: float, power_w: float | None, prefill_tok_s: float, decode_tok_s: float
    ) -> None:
        dt = 0.0 if self._t_last is None else max(t_s - self._t_last, 0.0)
        self._t_last = t_s
        if power_w is None or dt <= 0 or dt > 5.0:
            return
        pre, dec = prefill_tok_s * dt, decode_tok_s * dt
        units = PREFILL_WEIGHT * pre + dec
        e = power_w * dt
        e_pre = e * PREFILL_WEIGHT * pre / units if units > 0 else 0.0
        self._ticks.append((t_s, e_pre, e - e_pre if units > 0 else 0.0, pre, dec))
        while self._ticks and self._ticks[0][0] < t_s - PHASE_WINDOW_S:
            self._ticks.popleft()

    def j_per_token(self) -> dict[str, float | None]:
        e_pre = sum(t[1] for t in self._ticks)
        e_dec = sum(t[2] for t in self._ticks)
        n_pre = sum(t[3] for t in self._ticks)
        n_dec = sum(t[4] for t in self._ticks)
        return {
            "prefill": e_pre / n_pre if n_pre > 0 else None,
            "decode": e_dec / n_dec if n_dec > 0 else None,
        }


class Boost:
    """One prefill run at the top clock; `end()` (idempotent) gives the clock back."""

    __slots__ = ("_clock", "_on")

    def __init__(self, clock: DeviceClock) -> None:
        self._clock, self._on = clock, True

    def end(self) -> None:
        if self._on:
            self._on = False
            self._clock._boost_ended()


class DeviceClock:
    """The clock law and its actuator: one change at a time, then the newest wanted.

    **Prefill boost.** A lock slows prefill about in proportion to the clock (it is SM-bound;
    arXiv 2501.08219) while it saves energy in decode, so a stream whose first token someone
    waits for (`boost()`, from the proxy, for the classes in `clock_boost_classes`) runs its
    prefill unlocked: the lock is lifted at once when the first such prefill starts and put
    back, unpaced, when the last one has its first token, as VoltanaLLM (arXiv 2509.04827)
    sets prefill and decode clocks apart. A clock change takes milliseconds through NVML
    (about 100 ms through zeusd's block=true), and there are at most two per boosted request.
    The law is told the lock it chose, not the boost's: its readings then price a level as it
    is run, boosts and all.
    """

    def __init__(
        self,
        actuator: ClockActuator,
        policy: ClockPolicy,
        config: ControlConfig,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.actuator = actuator
        self.law = ClockLaw(policy, config)
        self.metrics = ClockMetrics(registry)
        self.phases = PhaseEnergy()
        self.boost_classes = frozenset(policy.clock_boost_classes)
        self._clock = clock
        self._tick_hz = config.tick_hz
        self._observing = config.mode == "observe"
        self._task: asyncio.Task[None] | None = None
        self._sampled_at = -math.inf
        self._changed_at = -math.inf
        self._decode_tok_s: float | None = None  # the engine's, over the reading's second
        self._law_lock: tuple[int, int] | None = None  # the law's choice (None: unlocked)
        self._law_in_force: tuple[int, int] | None = None  # the law's lock as last applied
        self._want: tuple[tuple[int, int] | None, bool, float] = (None, False, 0.0)
        """The lock wanted now, whether it is a boost's lift, and when it was asked for."""
        self._lifted = False  # a boost's lift is in force: the way back is not paced
        self.boosting = 0  # prefills running at the top clock now
        self.boosts_total = 0

    async def start(self) -> None:
        if not await self.actuator.start():
            log.error("clock control degraded at start: %s", self.actuator.degraded_reason)
        self.law.set_supported(self.actuator.supported_mhz(), self._tick_hz)

    def _top_mhz(self) -> float:
        """The top of the lock the law has in force (a boost's lift is not the law's)."""
        lock = self._law_in_force
        if lock is not None:
            return float(lock[1])
        supported = self.actuator.supported_mhz()
        return float(supported[-1]) if supported else math.nan

    def tick(self, obs: Observation, t_s: float, meter_lag_s: float = 0.0) -> ClockChoice:
        """One tick of the law; its choice is applied off the tick."""
        if not self.law.levels:
            self.law.set_supported(self.actuator.supported_mhz(), self._tick_hz)
        seen = obs.seen
        lat = obs.latency
        inp = ClockInput(
            t_s=t_s,
            power_w=obs.power_w,
            batch=seen.batch,
            decode_tok_s=self._decode_rate(obs, t_s, meter_lag_s),
            prefill_tok_s=seen.prefill_tok_s,
            queued=obs.queued,
            ttft_p95_s=lat.ttft_p95_s if lat else None,
            tpot_p95_s=lat.tpot_p95_s if lat else None,
            top_mhz=self._top_mhz(),
            changed_at_s=self._changed_at,
            reading_weight=obs.reading_weight,
            meter_lag_s=meter_lag_s,
            prefill_now_tok_s=obs.features.prefill_tok_s,
        )
        choice = self.law.tick(inp, obs.sensor_ok and obs.power_w is not None)
        self.phases.add(t_s, obs.power_w, obs.features.prefill_tok_s, obs.features.decode_tok_s)
        # Observing enforces nothing, the clock included: the choice is reported, not applied.
        self._law_lock = None if self._observing else choice.lock
        self._request(t_s, tick=True)
        self.metrics.export(self.status_counts())
        for phase, v in self.phases.j_per_token().items():
            self.metrics.j_per_token.labels(phase).set(math.nan if v is None else v)
        return choice

    def _decode_rate(self, obs: Observation, t_s: float, meter_lag_s: float) -> float:
        """The decode rate of the second the reading measured: the engine's generated-token
        counter where it is scraped, else the proxy's count. The law prices a clock by watts
        against tokens/s and steps by batch over tokens/s, so a rate 2-4x off on the second a
        probe is judged (the proxy's: it sees an answer's tokens at its end, but for one per
        streamed event) decides the probe. A held reading keeps the rate of its second."""
        generated = obs.engine.generated if obs.engine is not None else ()
        if obs.reading_weight > 0 or self._decode_tok_s is None:
            end_s = t_s - meter_lag_s
            self._decode_tok_s = counter_rate(generated, end_s - READING_WINDOW_S, end_s)
        if self._decode_tok_s is None or not generated:
            return obs.seen.decode_tok_s
        return self._decode_tok_s

    def fail_safe(self) -> None:
        """A tick failed: back to the driver's own clock policy until ticks work again."""
        self._law_lock = None
        self._request(self._clock())

    def boost(self) -> Boost:
        """Run the prefill about to start at the top clock until the returned `Boost` ends."""
        self.boosting += 1
        self.boosts_total += 1
        if self.boosting == 1 and self._law_lock is not None:
            self._request(self._clock())
        return Boost(self)

    def _boost_ended(self) -> None:
        self.boosting -= 1
        if self.boosting == 0 and self._law_lock is not None:
            self._request(self._clock())

    def _request(self, t_s: float, *, tick: bool = False) -> None:
        """Want the law's lock (unlocked while a prefill is boosted); a change in flight is
        followed by the newest wanted, never queued behind stale ones."""
        lift = self.boosting > 0 and self._law_lock is not None
        self._want = (None if lift else self._law_lock, lift, t_s)
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        sample = tick and t_s - self._sampled_at >= SAMPLE_EVERY_S
        if sample:
            self._sampled_at = t_s
        self._task = loop.create_task(self._apply(sample), name="powerbatch-clock")

    async def _apply(self, sample: bool) -> None:
        try:
            while True:
                want = self._want
                lock, lift, t_s = want
                # Raising is never paced; the way back from a lift is not either.
                await self.actuator.apply(lock, paced=not self._lifted)
                if lift:
                    self._lifted = True
                else:  # the law's lock
                    self._lifted = False
                    in_force = self.actuator.in_force
                    if in_force != self._law_in_force:
                        self._law_in_force, self._changed_at = in_force, t_s
                if self._want == want:
                    break
            if sample:
                await self.actuator.sample()
        except Exception:  # the actuator reports its own failures; this is a bug guard
            log.exception("applying the SM clock failed")

    def status_counts(self) -> dict[str, Any]:
        """The actuator's status with the boosts: what the metrics export."""
        return {
            **self.actuator.status(),
            "boosting": self.boosting,
            "boosts_total": self.boosts_total,
        }

    def status(self) -> dict[str, Any]:
        return {
            **self.status_counts(),
            "law": self.law.summary(),
            "j_per_token": self.phases.j_per_token(),
        }

    async def stop(self) -> None:
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        try:
            await self.actuator.restore()
        except Exception as exc:  # the state file makes the next start reset them
            log.error("could not reset the SM clocks: %s", exc)
        await self.actuator.backend.close()
