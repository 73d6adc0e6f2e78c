"""deploy/prometheus/alerts.yml: the alert rules compose's Prometheus loads and deploy/k8s's
PrometheusRule copies.

promtool (Debian's `prometheus` package) parses them and runs alerts.test.yml, whose cases fire
each alert and hold it quiet on a near miss; without promtool those two tests skip. The rest needs
nothing: every metric a rule reads is one the code exports, and the issue's list of alerts is
covered.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from test_deploy_metrics import exported, metric_names_in

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts.test.yml"
# What operators asked to be paged for (issue 26), each with the alert that covers it.
REQUIRED = {
    "ceiling breached": "PowerbatchCeilingBreached",
    "sensor failed or fail-closed": "PowerbatchSensorFailClosed",
    "limiter degraded": "PowerbatchLimiterDegraded",
    "lease lost or on fallback": "PowerbatchFleetFallback",
    "leader count != 1": "PowerbatchFleetLeaderCount",
    "Redis lost": "PowerbatchFleetRedisLost",
    "queue growing": "PowerbatchQueueGrowing",
    "high-class rejections": "PowerbatchHighClassRejections",
    "not ready": "PowerbatchNotReady",
    "tick errors": "PowerbatchTickErrors",
    "stale DCGM data": "DcgmDataStale",
}


def rules() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_checks_the_rules() -> None:
    out = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_fires_every_alert_in_its_test_cases() -> None:
    out = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULE_TESTS.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == {str(r["alert"]) for r in rules()}, "an alert with no firing case"


def test_rules_cover_the_operator_list_and_carry_severity_and_summary() -> None:
    by_name = {str(r["alert"]): r for r in rules()}
    for need, alert in REQUIRED.items():
        assert alert in by_name, f"no alert for {need}"
    for name, r in by_name.items():
        labels = r["labels"]
        assert isinstance(labels, dict) and labels["severity"] in ("warning", "critical"), name
        annotations = r["annotations"]
        assert isinstance(annotations, dict) and annotations["summary"], name


def test_rules_read_only_exported_metrics() -> None:
    names = set(exported())
    for r in rules():
        used = metric_names_in(str(r["expr"]))
        assert used, r["alert"]
        unknown = used - names
        assert not unknown, f"{r['alert']}: {sorted(unknown)} not exported"
