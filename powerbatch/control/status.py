"""The `/status` document: one shape for every host (the proxy, the vLLM plugin), strict JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from powerbatch.control.config import ControlConfig
from powerbatch.control.latency import LatencySnapshot
from powerbatch.control.types import AdmissionLimits, Decision, State
from powerbatch.jsonsafe import json_safe
from powerbatch.telemetry.monitor import PowerReading

if TYPE_CHECKING:
    from powerbatch.control.loop import HostSample


def _limits(x: AdmissionLimits | None) -> dict[str, Any] | None:
    return asdict(x) if x is not None else None


def status_document(
    *,
    state: State,
    decision: Decision | None,
    config: ControlConfig,
    reading: PowerReading,
    source: str,
    host: HostSample | None,
    latency: LatencySnapshot | None,
    tick_error: str | None,
    model: dict[str, Any],
    power_limit: dict[str, Any] | None,
    sections: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The loop's own sections, then the host's and observers' (`sections`): a new key is
    added, a dict under an existing key is merged into it."""
    d, lat = decision, latency
    reason = d.reason if d else ""
    if tick_error is not None:
        reason = f"control tick failed ({tick_error}); safe limits held"
    doc: dict[str, Any] = {
        "state": state,
        "mode": config.mode,
        "ready": reading.ok,
        "binding": d.binding if d else None,
        "reason": reason,
        "emergency": d.emergency if d else False,
        "limits": {
            "enforced": _limits(d.enforced if d else None),
            "proposed": _limits(d.proposed if d else None),
        },
        "power": {
            "source": source,
            "measured_w": d.power_w if d else None,
            "raw_w": reading.raw_w,
            "predicted_w": d.predicted_w if d else None,
            "predicted_upper_w": d.predicted_upper_w if d else None,
            "target_w": d.target_w if d else None,
            "ceiling_w": d.ceiling_w if d else config.ceiling_w,
            "capped": d.capped if d else False,
            "energy_j": reading.energy_j,
            "sensor_ok": reading.ok,
            "sensor_error": reading.error,
        },
        "multipliers": d.multipliers if d else {},
        "latency": {
            "ttft_p95_s": lat.ttft_p95_s if lat else None,
            "tpot_p95_s": lat.tpot_p95_s if lat else None,
            "ttft_p95_by_class_s": lat.ttft_by_class_s if lat else {},
            "samples": lat.samples if lat else 0,
            "ttft_slo_s": config.ttft_slo_s,
            "tpot_slo_s": config.tpot_slo_s,
        },
        "queue": {
            "in_flight": host.in_flight if host else 0,
            "kv_tokens_in_flight": host.kv_tokens if host else 0.0,
            "queued_total": host.queued if host else 0,
        },
        "model": dict(model),
        "power_limit": power_limit,
    }
    for extra in sections:
        for key, section in extra.items():
            if isinstance(doc.get(key), dict) and isinstance(section, dict):
                doc[key].update(section)
            else:
                doc[key] = section
    result: dict[str, Any] = json_safe(doc)
    return result
