"""The attribution run for one host on the control loop's tick: a `TickObserver` that settles.

The proxy and the vLLM plugin both add one `EnergyAccounting` to their loop's observers, so
every tick (5 Hz) closes an interval: the meter's joules since the last one, split by the
ledger. The proxy also settles when a request ends, so its answer carries all of its energy.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from powerbatch.control import Decision, Observation
from powerbatch.energy.attribution import (
    DEFAULT_PREFILL_WEIGHT,
    EnergyLedger,
    EnergyMeter,
    IntervalSplit,
    Labels,
    RequestEnergy,
    learned_prefill_weight,
)
from powerbatch.energy.metrics import EnergyMetrics
from powerbatch.energy.settings import EnergySettings
from powerbatch.estimate import Features, PowerModel
from powerbatch.jsonsafe import json_safe
from powerbatch.telemetry.monitor import PowerMonitor

_LEARN_EVERY_S = 1.0
_MIN_SAMPLES = 100  # readings the power model needs before its idle and weight are used
_PREFILL_STEP_TOK_S = 1_000.0


class EnergyAccounting:
    """Meter, ledger and counters for one host; call only from the loop's thread."""

    def __init__(
        self,
        monitor: PowerMonitor,
        model: PowerModel,
        metrics: EnergyMetrics,
        settings: EnergySettings | None = None,
        *,
        pull: Callable[[EnergyAccounting], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or EnergySettings()
        self.monitor = monitor
        self.model = model
        self.metrics = metrics
        self.features: Features | None = None  # the last tick's load: where the weight is learned
        self.pull = pull  # brings the host's work in before a settle (the plugin's steps)
        self.clock = clock
        self.meter = EnergyMeter()
        self.ledger = EnergyLedger(self.settings.prefill_weight or DEFAULT_PREFILL_WEIGHT)
        self.idle_w = self.settings.idle_w if self.settings.idle_w is not None else 0.0
        self.weight_source = "set" if self.settings.prefill_weight else "default"
        self.idle_source = "set" if self.settings.idle_w is not None else "default"
        self._learned_at = -math.inf
        self.tokens: dict[Labels, list[int]] = defaultdict(lambda: [0, 0])
        self._learn()

    # -- the request path ---------------------------------------------------------------------

    def begin(
        self, labels: Labels, *, observed: bool = True, prefill_tokens: float = 0.0
    ) -> RequestEnergy:
        return self.ledger.begin(labels, observed=observed, prefill_tokens=prefill_tokens)

    def finish(self, rec: RequestEnergy) -> float:
        """Settle now, so the request's last moments are charged; its joules."""
        rec.finished = True
        self.settle()
        return rec.energy_j

    def count_tokens(self, labels: Labels, prompt: int, completion: int) -> None:
        counts = self.tokens[labels]
        counts[0] += max(0, prompt)
        counts[1] += max(0, completion)
        self.metrics.count_tokens(labels, prompt, completion)

    # -- settling -----------------------------------------------------------------------------

    def settle(self) -> IntervalSplit:
        if self.pull is not None:
            self.pull(self)
        t_s = self.clock()
        power_w, energy_j, age_s = self.monitor.metered()
        if not math.isfinite(age_s):
            age_s = 0.0
        delta_j, dt_s = self.meter.advance(t_s, power_w, energy_j, age_s)
        split = self.ledger.settle(delta_j, dt_s, self.idle_w)
        self.metrics.charge(split.by_labels_j, split.idle_j)
        return split

    def observe(self, obs: Observation, decision: Decision) -> None:
        self.settle()
        if decision.t_s - self._learned_at >= _LEARN_EVERY_S:
            self._learned_at = decision.t_s
            self._learn()
        self.features = obs.features

    def fail_safe(self) -> None:
        self.settle()  # the GPUs still draw power while the controller holds the safe batch

    # -- what the power model says ------------------------------------------------------------

    def _learn(self) -> None:
        """Idle power: the model at batch 0. The prefill weight: its marginal joules per prompt
        token over its joules per generated token at the operating point (docs/energy.md)."""
        model = self.model
        if model.n_samples < _MIN_SAMPLES:
            return
        if self.settings.idle_w is None:
            idle_w, _ = model.predict_one(Features(0.0, 0.0, 0.0, 0.0))
            if math.isfinite(idle_w) and idle_w >= 0:
                self.idle_w, self.idle_source = idle_w, "learned"
        f = self.features
        if self.settings.prefill_weight is None and f is not None and f.batch > 0:
            base = f.with_prefill(0.0)
            p0, _ = model.predict_one(base)
            p1, _ = model.predict_one(base.with_prefill(_PREFILL_STEP_TOK_S))
            weight = learned_prefill_weight(
                (p1 - p0) / _PREFILL_STEP_TOK_S, p0 - self.idle_w, f.decode_tok_s
            )
            if weight is not None:
                self.ledger.prefill_weight, self.weight_source = weight, "learned"

    # -- /status ------------------------------------------------------------------------------

    def status_extra(self) -> dict[str, Any]:
        return {"energy": json_safe(self.status())}

    def status(self) -> dict[str, Any]:
        """Totals since start by class (and tenant), idle, and the rule's parameters."""
        by_class: dict[str, float] = defaultdict(float)
        by_tenant: dict[str, float] = defaultdict(float)
        tokens_by_class: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for (p, t, _), j in self.ledger.totals_j.items():
            by_class[p] += j
            by_tenant[t] += j
        for (p, _, _), (prompt, completion) in self.tokens.items():
            tokens_by_class[p][0] += prompt
            tokens_by_class[p][1] += completion
        led = self.ledger
        return {
            "metered_j": led.metered_j,
            "idle_j": led.idle_j,
            "attributed_j": math.fsum(led.totals_j.values()),
            "by_class_j": dict(by_class),
            "by_tenant_j": dict(by_tenant),
            "tokens_by_class": {
                p: {"prompt": n[0], "completion": n[1]} for p, n in tokens_by_class.items()
            },
            "j_per_completion_token_by_class": {
                p: by_class[p] / n[1] for p, n in tokens_by_class.items() if n[1] > 0
            },
            "idle_w": self.idle_w,
            "idle_source": self.idle_source,
            "prefill_weight": led.prefill_weight,
            "prefill_weight_source": self.weight_source,
            "unmetered_s": self.meter.unmetered_s,
            "in_flight": led.in_flight,
        }
