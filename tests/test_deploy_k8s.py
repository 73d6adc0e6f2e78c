"""deploy/k8s: well-formed objects whose ports, names and settings agree with powerbatch's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from powerbatch.cli.settings import SERVE
from powerbatch.settings import load

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]


def docs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def test_every_object_has_api_version_kind_and_name() -> None:
    known = {"v1": {"ConfigMap", "Service"}, "apps/v1": {"Deployment", "DaemonSet"}}
    assert docs()
    for d in docs():
        assert d["kind"] in known[d["apiVersion"]], d
        assert d["metadata"]["name"]
    for dep in by_kind("Deployment").values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_proxy_ports_and_settings_agree_with_powerbatch() -> None:
    (cm,) = by_kind("ConfigMap").values()
    env = {**cm["data"], "POWERBATCH_FLEET_MEMBER_ID": "pod-0"}
    s = load(SERVE, environ={**env, "POWERBATCH_UPSTREAM": "http://127.0.0.1:8001"})
    assert s.fleet.fleet_budget and s.fleet.fleet_budget_w > 0
    pod = by_kind("Deployment")["vllm-powerbatch"]
    assert pod["spec"]["replicas"] <= s.fleet.fleet_members, "safe shares would sum over budget"
    (proxy,) = [
        c for c in pod["spec"]["template"]["spec"]["containers"] if c["name"] == "powerbatch"
    ]
    args = proxy["args"]
    port = int(args[args.index("--port") + 1])
    assert [p["containerPort"] for p in proxy["ports"]] == [port]
    assert proxy["readinessProbe"]["httpGet"]["port"] == port
    upstream = args[args.index("--upstream") + 1]
    (vllm,) = [c for c in pod["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    assert upstream.endswith(":" + vllm["args"][vllm["args"].index("--port") + 1])
    redis = by_kind("Service")["powerbatch-redis"]
    host_port = s.fleet.fleet_redis_url.split("//")[1].split("/")[0]
    assert host_port == f"powerbatch-redis:{redis['spec']['ports'][0]['port']}"
