"""The Grafana dashboard and docs/metrics.md against the metrics the code really exports.

Exported names come from the code, not from a list: ProxyMetrics' and FleetMetrics' registries
(powerbatch_*; a fleet member adds its gauges to the proxy's registry), and a scrape of the
simulator's /metrics (vllm:* and DCGM_FI_*, the names vLLM and dcgm-exporter use).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from powerbatch.control.clock import ClockMetrics
from powerbatch.fleet.member import FleetMetrics
from powerbatch.proxy.metrics import ProxyMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# Gauges that carry a cumulative counter of the sensor's (energy since driver load): rate() on
# them is right even without `_total`.
CUMULATIVE_GAUGES = {"powerbatch_energy_joules", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created"),
}


# ---- what the code exports -------------------------------------------------------------------


def _names(families: Any) -> dict[str, str]:
    """Every series name a scrape can hold -> its family's type."""
    out: dict[str, str] = {}
    for family in families:
        suffixes = SUFFIXES.get(family.type, ("",))
        for suffix in suffixes:
            out[family.name + suffix] = family.type
        for sample in family.samples:
            out[sample.name] = family.type
    return out


def powerbatch_families() -> list[Any]:
    """Every powerbatch_* family an instance can export: the proxy's, a fleet member's, and
    those of clock control."""
    registry = ProxyMetrics().registry
    FleetMetrics(registry)
    ClockMetrics(registry)
    return list(registry.collect())


@cache
def proxy_metric_names() -> dict[str, str]:
    return _names(powerbatch_families())


@cache
def sim_metric_names() -> dict[str, str]:
    from powerbatch.sim import SimEngine, create_sim_app

    async def scrape() -> str:
        runner = web.AppRunner(create_sim_app(SimEngine()))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            url = f"http://127.0.0.1:{port}/metrics"
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                return await r.text()
        finally:
            await runner.cleanup()

    return _names(text_string_to_metric_families(asyncio.run(scrape())))


def exported() -> dict[str, str]:
    return {**sim_metric_names(), **proxy_metric_names()}


# ---- what the dashboard queries --------------------------------------------------------------

_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}  # fmt: skip


def metric_names_in(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords and labels removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboards() -> list[tuple[Path, dict[str, Any]]]:
    paths = sorted(DASHBOARD_DIR.glob("*.json"))
    assert paths, "no dashboard"
    return [(p, json.loads(p.read_text())) for p in paths]


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expression) for every panel target and every templating query."""
    out = []
    for panel in _panels(dash["panels"]):
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dash.get("templating", {}).get("list", []):
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
            out.append((f"variable {var['name']}", m.group(1) if m else query))
    return out


def test_query_parser_finds_metric_names() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, gpu_set) (rate(a_bucket{x="y"}[$__rate_interval])))'
        " / on (gpu_set) group_left b_total > bool c offset 5m"
    )
    assert metric_names_in(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names_in("sum(rate(vllm:generation_tokens_total[1m])) / 1000") == {
        "vllm:generation_tokens_total"
    }


def test_dashboard_queries_only_exported_metrics() -> None:
    names = exported()
    for path, dash in dashboards():
        for where, expr in dashboard_queries(dash):
            used = metric_names_in(expr)
            assert used, f"{path.name} {where}: no metric in {expr!r}"
            unknown = used - set(names)
            assert not unknown, f"{path.name} {where}: {sorted(unknown)} not exported"


def test_dashboard_queries_use_each_type_correctly() -> None:
    names = exported()
    for path, dash in dashboards():
        for where, expr in dashboard_queries(dash):
            for name in metric_names_in(expr):
                if name.endswith("_bucket"):
                    assert "histogram_quantile(" in expr, f"{where}: raw buckets"
                if names.get(name) in ("counter", "histogram") or name in CUMULATIVE_GAUGES:
                    assert re.search(rf"(rate|increase)\({re.escape(name)}\b", expr), (
                        f"{path.name} {where}: counter {name} not under rate()/increase()"
                    )
                else:
                    assert not re.search(rf"(rate|increase)\({re.escape(name)}\b", expr), (
                        f"{path.name} {where}: rate() of gauge {name}"
                    )


def test_dashboard_covers_the_operator_questions() -> None:
    """Power vs ceiling, predicted vs measured, limits, binding, p95 vs SLO, queue, J/token,
    the device limit, the fleet, readiness."""
    required = {
        "powerbatch_power_watts", "powerbatch_power_ceiling_watts",
        "powerbatch_power_predicted_watts", "powerbatch_power_predicted_upper_watts",
        "powerbatch_limit_requests", "powerbatch_limit_kv_tokens",
        "powerbatch_binding_constraint",
        "powerbatch_ttft_seconds_bucket", "powerbatch_time_per_output_token_seconds_bucket",
        "powerbatch_slo_seconds", "powerbatch_queue_length", "powerbatch_rejections_total",
        "powerbatch_output_tokens_total", "powerbatch_energy_joules",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_POWER_USAGE",
        # the device limit, the fleet's lease and shares, readiness and tick errors (issue 26)
        "powerbatch_device_power_limit_watts", "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        "powerbatch_device_power_limit_degraded", "powerbatch_fleet_share_watts",
        "powerbatch_fleet_leader", "powerbatch_fleet_fallback",
        "powerbatch_fleet_lease_age_seconds", "powerbatch_ready",
        "powerbatch_control_tick_errors_total",
    }  # fmt: skip
    for path, dash in dashboards():
        used = set().union(*(metric_names_in(e) for _, e in dashboard_queries(dash)))
        assert required <= used, f"{path.name} lacks {sorted(required - used)}"


def test_dashboard_is_provisionable() -> None:
    for path, dash in dashboards():
        assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
        ids = [p["id"] for p in _panels(dash["panels"])]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in _panels(dash["panels"]):
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
                assert panel.get("targets"), panel["title"]
        variables = {v["name"] for v in dash["templating"]["list"]}
        for _, expr in dashboard_queries(dash):
            for var in re.findall(r"\$\{?(\w+)", expr):
                assert var.startswith("__") or var in variables, var


# ---- naming conventions and documentation ----------------------------------------------------


def test_proxy_metrics_follow_prometheus_conventions() -> None:
    for family in powerbatch_families():
        name = family.name
        assert re.fullmatch(r"powerbatch_[a-z][a-z0-9_]*", name), name
        assert not re.search(r"_(milliseconds|millis|ms|kilowatts|kw|percent)$", name), (
            f"{name}: use base units (seconds, watts, joules, ratio 0..1)"
        )
        if family.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: latency histograms are in seconds"
        if family.type == "gauge":
            assert not name.endswith(("_total", "_count", "_sum", "_bucket")), name
    for name, kind in proxy_metric_names().items():
        if kind == "counter" and not name.endswith("_created"):
            assert name.endswith("_total"), name


def _documented_families() -> dict[str, str]:
    """Family name -> its table row in docs/metrics.md."""
    rows = {}
    for line in METRICS_DOC.read_text().splitlines():
        m = re.match(r"\|\s*`(powerbatch_[a-z0-9_]+)`", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_metrics_doc_lists_every_metric_with_its_labels() -> None:
    rows = _documented_families()
    families = powerbatch_families()
    assert any(f.name.startswith("powerbatch_fleet_") for f in families)
    for family in families:
        series = family.name + ("_total" if family.type == "counter" else "")
        row = rows.get(series)
        assert row, f"docs/metrics.md has no row for `{series}`"
        assert family.type in row, f"{series}: row does not give its type {family.type}"
        labels = set(_label_names(family.name))
        for label in labels:
            assert f"`{label}`" in row, f"{series}: label {label} undocumented"


def test_metrics_doc_names_only_exported_metrics() -> None:
    families = powerbatch_families()
    names = set(exported()) | {f.name for f in families}  # a histogram's family name too
    text = METRICS_DOC.read_text()
    for token in set(re.findall(r"\b(powerbatch_[a-z0-9_]+|vllm:[a-z0-9_:]+)", text)):
        assert token in names, f"docs/metrics.md names {token}, which nothing exports"


def _label_names(family_name: str) -> tuple[str, ...]:
    metrics = ProxyMetrics()
    # Metrics are attributes of ProxyMetrics, or of a section of it (shape, energy), or of
    # FleetMetrics.
    values = [*vars(metrics).values(), *vars(metrics.shape).values()]
    values += vars(metrics.energy).values()
    values += vars(FleetMetrics()).values()
    values += vars(ClockMetrics(CollectorRegistry())).values()
    for value in values:
        if getattr(value, "_name", None) in (family_name, family_name.removesuffix("_total")):
            return tuple(value._labelnames)
    raise AssertionError(family_name)
