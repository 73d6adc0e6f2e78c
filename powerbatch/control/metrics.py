"""The controller's state as Prometheus gauges: one definition for the proxy and the vLLM plugin.

Names carry units (`_watts`, `_tokens`); one-hot gauges carry the binding constraint and the
state, so a dashboard can plot which constraint binds over time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.types import CONSTRAINTS, Binding, Decision, Deferrable, State


class ShapeMetrics:
    """`powerbatch_shape_*`: what the ramp and floor laws achieved (powerbatch.shape.tracker)."""

    def __init__(self, r: CollectorRegistry) -> None:
        gauge, counter = partial(Gauge, registry=r), partial(Counter, registry=r)
        self.ramp_violations = counter(
            "powerbatch_shape_ramp_violations",
            "Seconds whose 1-second power moved more than the ramp limit, by direction",
            ["direction"],
        )
        self.largest_ramp = gauge(
            "powerbatch_shape_largest_ramp_watts_per_second",
            "Largest change of 1-second power in one second since start, by direction",
            ["direction"],
        )
        self.floor_shortfall_w = gauge(
            "powerbatch_shape_floor_shortfall_watts",
            "Floor less 1-second power while deferrable work waits (0 otherwise)",
        )
        self.floor_shortfall_s = counter(
            "powerbatch_shape_floor_shortfall_seconds",
            "Seconds under the floor while deferrable work waited",
        )
        self.power_w = gauge(
            "powerbatch_shape_power_watts", "Planned and measured 1-second power", ["kind"]
        )
        self.plan_solve_s = gauge(
            "powerbatch_shape_plan_solve_seconds", "Time the last plan took to solve"
        )
        self.deferrable = gauge(
            "powerbatch_shape_deferrable_mode",
            "1 for what admission does with deferrable work now",
            ["mode"],
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
        gauge, counter = partial(Gauge, registry=r), partial(Counter, registry=r)
        self.power_w = gauge(
            "powerbatch_power_watts",
            "Measured power the controller acted on: 1-second mean (or the source's own average)",
        )
        self.power_raw_w = gauge(
            "powerbatch_power_raw_watts",
            "Latest power sample as the source reported it, unfiltered",
        )
        self.predicted_w = gauge(
            "powerbatch_power_predicted_watts", "Model mean at the chosen batch"
        )
        self.predicted_upper_w = gauge(
            "powerbatch_power_predicted_upper_watts", "Upper prediction bound at the chosen batch"
        )
        self.ceiling_w = gauge(
            "powerbatch_power_ceiling_watts", "Hard ceiling in force (a fleet share moves it)"
        )
        self.power_limit_w = gauge(
            "powerbatch_device_power_limit_watts",
            "The GPUs' power limit, summed: what the controller asked for, and what is in force",
            ["kind"],
        )
        self.power_limit_degraded = gauge(
            "powerbatch_device_power_limit_degraded",
            "1 while the power limiter fails: admission alone holds the ceiling",
        )
        self.power_limit_changes = counter(
            "powerbatch_device_power_limit_changes", "Device power limit changes applied"
        )
        self.power_limit_failures = counter(
            "powerbatch_device_power_limit_failures",
            "Device power limit sets or reads that failed or timed out",
        )
        self._limiter_counts = (0, 0)
        self.target_w = gauge("powerbatch_power_target_watts", "Ceiling less margin and multiplier")
        self.energy_j = gauge("powerbatch_energy_joules", "The sensor's cumulative energy counter")
        self.sensor_ok = gauge("powerbatch_sensor_ok", "1 while the power reading is trusted")
        self.limit_requests = gauge(
            "powerbatch_limit_requests", "Batch limit (requests in flight)", ["kind"]
        )
        self.limit_kv_tokens = gauge(
            "powerbatch_limit_kv_tokens", "KV tokens in flight limit", ["kind"]
        )
        self.limit_prefill = gauge(
            "powerbatch_limit_prefill_tokens_per_second", "Prefill pace (0 when not paced)"
        )
        self.multiplier = gauge(
            "powerbatch_multiplier", "Lagrange multiplier per constraint", ["constraint"]
        )
        self.binding = gauge(
            "powerbatch_binding_constraint",
            "1 for the constraint setting the batch",
            ["constraint"],
        )
        self.state = gauge("powerbatch_controller_state", "1 for the controller's state", ["state"])
        self.latency_p95_s = gauge(
            "powerbatch_latency_p95_seconds", "Sliding-window p95", ["metric"]
        )
        self.slo_s = gauge("powerbatch_slo_seconds", "Configured SLO", ["metric"])
        self.latency_cuts_undone = counter(
            "powerbatch_latency_cuts_undone",
            "Times the TPOT law undid its cuts: no batch met the SLO at the step it measured",
        )
        self.feature = gauge(
            "powerbatch_feature",
            "What the power model regresses on, over the last second",
            ["name"],
        )
        self.ticks = counter("powerbatch_control_ticks", "Control decisions made")
        self.tick_errors = counter(
            "powerbatch_control_tick_errors", "Ticks that failed (safe limits held)"
        )
        self.shape = ShapeMetrics(r)
        self.ready = gauge(
            "powerbatch_ready",
            "1 once a good power reading has been had and the sensor is good now",
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
