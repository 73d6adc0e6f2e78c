"""The controller's state as Prometheus gauges: one definition for the proxy and the vLLM plugin.

Names carry units (`_watts`, `_tokens`); one-hot gauges carry the binding constraint and the
state, so a dashboard can plot which constraint binds over time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.types import CONSTRAINTS, Binding, Decision, Deferrable, State


class ShapeMetrics:
    """`powerbatch_shape_*`: what the ramp and floor laws achieved (powerbatch.shape.tracker)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.ramp_violations = Counter(
            "powerbatch_shape_ramp_violations",
            "Seconds whose 1-second power moved more than the ramp limit, by direction",
            ["direction"],
            registry=r,
        )
        self.largest_ramp = Gauge(
            "powerbatch_shape_largest_ramp_watts_per_second",
            "Largest change of 1-second power in one second since start, by direction",
            ["direction"],
            registry=r,
        )
        self.floor_shortfall_w = Gauge(
            "powerbatch_shape_floor_shortfall_watts",
            "Floor less 1-second power while deferrable work waits (0 otherwise)",
            registry=r,
        )
        self.floor_shortfall_s = Counter(
            "powerbatch_shape_floor_shortfall_seconds",
            "Seconds under the floor while deferrable work waited",
            registry=r,
        )
        self.power_w = Gauge(
            "powerbatch_shape_power_watts",
            "Planned and measured 1-second power",
            ["kind"],
            registry=r,
        )
        self.plan_solve_s = Gauge(
            "powerbatch_shape_plan_solve_seconds", "Time the last plan took to solve", registry=r
        )
        self.deferrable = Gauge(
            "powerbatch_shape_deferrable_mode",
            "1 for what admission does with deferrable work now",
            ["mode"],
            registry=r,
        )
        for d in ("up", "down"):
            self.ramp_violations.labels(d)
            self.largest_ramp.labels(d).set(0.0)
        for k in ("planned", "measured"):
            self.power_w.labels(k).set(math.nan)
        for m in Deferrable:
            self.deferrable.labels(m).set(1.0 if m == "default" else 0.0)
        self.plan_solve_s.set(math.nan)


class ControlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.power_w = Gauge(
            "powerbatch_power_watts",
            "Measured power the controller acted on: 1-second mean (or the source's own average)",
            registry=r,
        )
        self.power_raw_w = Gauge(
            "powerbatch_power_raw_watts",
            "Latest power sample as the source reported it, unfiltered",
            registry=r,
        )
        self.predicted_w = Gauge(
            "powerbatch_power_predicted_watts", "Model mean at the chosen batch", registry=r
        )
        self.predicted_upper_w = Gauge(
            "powerbatch_power_predicted_upper_watts",
            "Upper prediction bound at the chosen batch",
            registry=r,
        )
        self.ceiling_w = Gauge(
            "powerbatch_power_ceiling_watts",
            "Hard ceiling in force (a fleet share moves it)",
            registry=r,
        )
        self.power_limit_w = Gauge(
            "powerbatch_device_power_limit_watts",
            "The GPUs' power limit, summed: what the controller asked for, and what is in force",
            ["kind"],
            registry=r,
        )
        self.power_limit_degraded = Gauge(
            "powerbatch_device_power_limit_degraded",
            "1 while the power limiter fails: admission alone holds the ceiling",
            registry=r,
        )
        self.power_limit_changes = Counter(
            "powerbatch_device_power_limit_changes",
            "Device power limit changes applied",
            registry=r,
        )
        self.power_limit_failures = Counter(
            "powerbatch_device_power_limit_failures",
            "Device power limit sets or reads that failed or timed out",
            registry=r,
        )
        self._limiter_counts = (0, 0)
        self.target_w = Gauge(
            "powerbatch_power_target_watts", "Ceiling less margin and multiplier", registry=r
        )
        self.energy_j = Gauge(
            "powerbatch_energy_joules", "The sensor's cumulative energy counter", registry=r
        )
        self.sensor_ok = Gauge(
            "powerbatch_sensor_ok", "1 while the power reading is trusted", registry=r
        )
        self.limit_requests = Gauge(
            "powerbatch_limit_requests", "Batch limit (requests in flight)", ["kind"], registry=r
        )
        self.limit_kv_tokens = Gauge(
            "powerbatch_limit_kv_tokens", "KV tokens in flight limit", ["kind"], registry=r
        )
        self.limit_prefill = Gauge(
            "powerbatch_limit_prefill_tokens_per_second",
            "Prefill pace (0 when not paced)",
            registry=r,
        )
        self.multiplier = Gauge(
            "powerbatch_multiplier",
            "Lagrange multiplier per constraint",
            ["constraint"],
            registry=r,
        )
        self.binding = Gauge(
            "powerbatch_binding_constraint",
            "1 for the constraint setting the batch",
            ["constraint"],
            registry=r,
        )
        self.state = Gauge(
            "powerbatch_controller_state", "1 for the controller's state", ["state"], registry=r
        )
        self.latency_p95_s = Gauge(
            "powerbatch_latency_p95_seconds", "Sliding-window p95", ["metric"], registry=r
        )
        self.slo_s = Gauge("powerbatch_slo_seconds", "Configured SLO", ["metric"], registry=r)
        self.feature = Gauge(
            "powerbatch_feature",
            "What the power model regresses on, over the last second",
            ["name"],
            registry=r,
        )
        self.ticks = Counter("powerbatch_control_ticks", "Control decisions made", registry=r)
        self.tick_errors = Counter(
            "powerbatch_control_tick_errors", "Ticks that failed (safe limits held)", registry=r
        )
        self.shape = ShapeMetrics(r)
        self.ready = Gauge(
            "powerbatch_ready",
            "1 once a good power reading has been had and the sensor is good now",
            registry=r,
        )
        for name in ("batch", "kv_tokens", "prefill_tok_s", "decode_tok_s"):
            self.feature.labels(name)
        for c in CONSTRAINTS:
            self.multiplier.labels(c)
        for b in Binding:
            self.binding.labels(b)
        for s in State:
            self.state.labels(s).set(1.0 if s == "starting" else 0.0)
        self.sensor_ok.set(0.0)
        self.power_w.set(math.nan)

    def export_decision(
        self, d: Decision, raw_w: float | None = None, energy_j: float | None = None
    ) -> None:
        """Set every gauge above from one tick's decision; `raw_w` is the unfiltered sample."""
        self.power_w.set(d.power_w if d.power_w is not None else math.nan)
        if math.isfinite(d.ceiling_w):
            self.ceiling_w.set(d.ceiling_w)
        self.power_raw_w.set(raw_w if raw_w is not None else math.nan)
        self.energy_j.set(energy_j if energy_j is not None else math.nan)
        self.sensor_ok.set(0.0 if d.state == "fail_closed" else 1.0)
        self.predicted_w.set(d.predicted_w)
        self.predicted_upper_w.set(d.predicted_upper_w)
        self.target_w.set(d.target_w)
        for kind, limits in (("enforced", d.enforced), ("proposed", d.proposed)):
            self.limit_requests.labels(kind).set(limits.max_requests)
            self.limit_kv_tokens.labels(kind).set(limits.max_kv_tokens)
        self.limit_prefill.set(d.proposed.prefill_tok_s or 0.0)
        for c, v in d.multipliers.items():
            self.multiplier.labels(c).set(v)
        for b in Binding:
            self.binding.labels(b).set(1.0 if b == d.binding else 0.0)
        for s in State:
            self.state.labels(s).set(1.0 if s == d.state else 0.0)

    def export_limiter(self, status: Mapping[str, Any]) -> None:
        """The power limiter's state (`LimitActuator.status()`)."""
        for kind, key in (("requested", "requested_w"), ("in_force", "in_force_w")):
            value = status.get(key)
            self.power_limit_w.labels(kind).set(math.nan if value is None else value)
        self.power_limit_degraded.set(1.0 if status.get("degraded") else 0.0)
        changes, failures = int(status["changes_total"]), int(status["failures_total"])
        seen_changes, seen_failures = self._limiter_counts
        self.power_limit_changes.inc(max(0, changes - seen_changes))
        self.power_limit_failures.inc(max(0, failures - seen_failures))
        self._limiter_counts = (changes, failures)

    def export_latency(self, lat: LatencySnapshot | None) -> None:
        """The p95s the latency constraint sees (NaN while the window holds too few)."""
        ttft = lat.ttft_p95_s if lat else None
        tpot = lat.tpot_p95_s if lat else None
        self.latency_p95_s.labels("ttft").set(math.nan if ttft is None else ttft)
        self.latency_p95_s.labels("tpot").set(math.nan if tpot is None else tpot)
