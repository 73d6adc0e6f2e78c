"""Render the Kubernetes objects that copy a file kept elsewhere in the repository.

    python deploy/k8s/render.py          # rewrite them
    python deploy/k8s/render.py --check  # exit 1 when one is stale (the test suite does this)

- 21-dcgm-counters.yaml: the ConfigMap of deploy/dcgm-exporter/counters.csv;
- monitoring/prometheusrule.yaml: the PrometheusRule of deploy/prometheus/alerts.yml (compose's
  Prometheus loads that file as it is);
- monitoring/dashboard.yaml: the ConfigMap of deploy/grafana/dashboards/powerbatch.json, with
  the label Grafana's dashboard sidecar (kube-prometheus-stack) looks for.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent
NAMESPACE = "powerbatch"
HEADER = "# Rendered by deploy/k8s/render.py from {source}: edit that file, then run render.py.\n"
LABELS = {"app.kubernetes.io/part-of": "powerbatch"}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so a rendered file reads like its source."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _meta(name: str, **labels: str) -> dict[str, Any]:
    return {"name": name, "namespace": NAMESPACE, "labels": {**LABELS, **labels}}


def counters() -> dict[str, Any]:
    text = (DEPLOY / "dcgm-exporter" / "counters.csv").read_text()
    meta = _meta("dcgm-exporter-counters")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {"counters.csv": text},
    }


def prometheus_rule() -> dict[str, Any]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _meta("powerbatch"),
        "spec": {"groups": rules["groups"]},
    }


def dashboard() -> dict[str, Any]:
    text = (DEPLOY / "grafana" / "dashboards" / "powerbatch.json").read_text()
    meta = _meta("powerbatch-dashboard", grafana_dashboard="1")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {"powerbatch.json": text},
    }


RENDERED = {
    "21-dcgm-counters.yaml": ("deploy/dcgm-exporter/counters.csv", counters),
    "monitoring/prometheusrule.yaml": ("deploy/prometheus/alerts.yml", prometheus_rule),
    "monitoring/dashboard.yaml": ("deploy/grafana/dashboards/powerbatch.json", dashboard),
}


def render(path: str) -> str:
    source, build = RENDERED[path]
    body = yaml.dump(build(), Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return HEADER.format(source=source) + body


def main(argv: list[str]) -> int:
    stale = []
    for path in RENDERED:
        text = render(path)
        target = HERE / path
        if "--check" in argv:
            if not target.is_file() or target.read_text() != text:
                stale.append(path)
        else:
            target.write_text(text)
    for path in stale:
        print(f"deploy/k8s/{path} is stale: run python deploy/k8s/render.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
