"""deploy/k8s: objects Kubernetes accepts, wired to settings, endpoints and each other as powerbatch
expects, checked offline.

- Core objects: the Kubernetes OpenAPI schemas that kubernetes-validate bundles, strict (unknown
  fields fail), for the oldest and the newest release the manifests support.
- CRDs (PodMonitor, PrometheusRule) have no schema there: the PrometheusRule's groups must equal
  deploy/prometheus/alerts.yml, which promtool checks and tests (test_deploy_alerts.py); the
  PodMonitors are checked field by field against the operator's API (the keys used are known
  ones) and against the pods they select (labels, named ports).
- Settings: every POWERBATCH_* variable a container sets is a real `serve` setting, and the
  whole environment passes the real resolver; probes ask public endpoints on the right ports;
  the grace period covers the preStop waits and the drain.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from powerbatch.cli.settings import SERVE
from powerbatch.proxy.auth import PUBLIC_PATHS
from powerbatch.settings import load

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# Oldest and newest Kubernetes releases the manifests are validated against.
K8S_VERSIONS = ("1.29.0", "1.37.0")
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
# Containers outside the restricted Pod Security profile, and why (docs/kubernetes.md).
PRIVILEGED_CONTAINERS = {"zeusd", "dcgm-exporter"}  # node daemons: root, host paths
HOSTPATH_VOLUMES = {
    ("DaemonSet", "zeusd"): {"socket-dir"},
    ("DaemonSet", "dcgm-exporter"): {"pod-resources"},
    ("Deployment", "vllm-powerbatch"): {"zeusd"},  # zeusd's socket directory
}


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        out += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    assert out, "no manifests"
    return out


def objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == kind}


def workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("Deployment", "StatefulSet", "DaemonSet"):
        for name, obj in objects(kind).items():
            yield f"{kind}/{name}", obj


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    (c,) = found
    return c


def proxy_pod() -> dict[str, Any]:
    return objects("Deployment")["vllm-powerbatch"]


def env_of(c: dict[str, Any], placeholders: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env
    (later wins), with $(VAR) expanded. Secret and field references take `placeholders`."""
    maps = objects("ConfigMap")
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"]
            )
        else:
            env[var["name"]] = (placeholders or {}).get(var["name"], f"<{var['name']}>")
    return env


def named_ports(obj: dict[str, Any]) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in pod_spec(obj)["containers"]
        for p in c.get("ports", [])
        if "name" in p
    }


def duration_s(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    assert m, text
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2)]


def prestop_sleep_s(c: dict[str, Any]) -> float:
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


GPU_UUID = "GPU-1d3f0a8e-77b2-4c1a-9a55-0f2c3b9d8e11"


def serve_settings(c: dict[str, Any]) -> Any:
    """The proxy container's environment through the real settings resolver."""
    env = env_of(
        c, {"POWERBATCH_FLEET_MEMBER_ID": "vllm-powerbatch-0", "REDIS_PASSWORD": "redis-s3cret"}
    )
    # Set by the container's command from the GPU UUIDs vLLM writes (nvidia-smi's spelling).
    env["POWERBATCH_GPUS"] = GPU_UUID
    return load(SERVE, environ=env)


# ---- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_pass_the_kubernetes_schemas_strictly(version: str) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e .[dev])"
    )
    checked = 0
    for path, obj in manifests():
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{path.name} {obj['kind']}: {where}: {exc.message}") from None
        checked += 1
    assert checked >= 12


def test_the_schema_check_can_fail() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    pod = dict(proxy_pod())
    bad = {**pod, "spec": {**pod["spec"], "terminationGracePeriod": 75}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_every_object_is_namespaced_labelled_and_selects_its_pods() -> None:
    for path, obj in manifests():
        meta = obj["metadata"]
        if obj["kind"] != "Namespace":
            assert meta.get("namespace") == "powerbatch", f"{path.name} {meta['name']}"
    for where, obj in workloads():
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items(), where
    for kind in ("PodDisruptionBudget", "NetworkPolicy", "Service"):
        for name, obj in objects(kind).items():
            spec = obj["spec"]
            if kind == "NetworkPolicy":
                selector = spec["podSelector"]["matchLabels"]
            elif kind == "Service":
                selector = spec["selector"]
            else:
                selector = spec["selector"]["matchLabels"]
            matched = [
                w
                for w, o in workloads()
                if selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()
            ]
            assert len(matched) == 1, f"{kind}/{name} selects {matched}"


def test_rendered_copies_are_fresh() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    assert spec and spec.loader
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    for rel in render.RENDERED:
        assert (K8S / rel).read_text() == render.render(rel), (
            f"deploy/k8s/{rel} is stale: run python deploy/k8s/render.py"
        )
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert objects("PrometheusRule")["powerbatch"]["spec"]["groups"] == alerts["groups"]
    dashboard = (ROOT / "deploy" / "grafana" / "dashboards" / "powerbatch.json").read_text()
    assert objects("ConfigMap")["powerbatch-dashboard"]["data"]["powerbatch.json"] == dashboard
    counters = (ROOT / "deploy" / "dcgm-exporter" / "counters.csv").read_text()
    assert objects("ConfigMap")["dcgm-exporter-counters"]["data"]["counters.csv"] == counters


# ---- images, resources, security -------------------------------------------------------------


def test_images_are_pinned_and_every_container_has_requests_and_a_memory_limit() -> None:
    for where, obj in workloads():
        for c in pod_spec(obj)["containers"]:
            image = c["image"]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert (tag and tag != "latest" and "@" not in tag) or "@sha256:" in image, (
                where,
                image,
            )
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), (where, c["name"])
            assert "memory" in resources.get("limits", {}), (where, c["name"])


def _restricted_violations(obj: dict[str, Any]) -> set[str]:
    """What the restricted Pod Security profile (v1.29+) would reject in a pod template."""
    spec = pod_spec(obj)
    pod_sc = spec.get("securityContext", {})
    out = set()
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral"}
    allowed_volumes |= {"persistentVolumeClaim", "projected", "secret"}
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= allowed_volumes:
            out.add(f"volume {v['name']}: {sorted(kinds)}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.add(key)
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.add(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation", True):
            out.add(f"{name}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.add(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.add(f"{name}: adds {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot", False)):
            out.add(f"{name}: may run as root")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.add(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.add(f"{name}: seccomp")
        for p in c.get("ports", []):
            if "hostPort" in p:
                out.add(f"{name}: hostPort")
    return out


def test_only_the_named_exceptions_fall_outside_the_restricted_profile() -> None:
    for where, obj in workloads():
        kind, name = where.split("/")
        violations = _restricted_violations(obj)
        host_paths = HOSTPATH_VOLUMES.get((kind, name), set())
        expected_volumes = {f"volume {v}: ['hostPath']" for v in host_paths}
        if name in PRIVILEGED_CONTAINERS:
            assert {v for v in violations if v.startswith("volume")} == expected_volumes, where
            # Still: no privilege escalation, capabilities dropped and only the needed ones added.
            (c,) = pod_spec(obj)["containers"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "ALL" in c["securityContext"]["capabilities"]["drop"]
        else:
            assert violations == expected_volumes, f"{where}: {sorted(violations)}"
    assert _restricted_violations(objects("DaemonSet")["zeusd"]) >= {"zeusd: runAsUser 0"}


def test_namespace_enforces_what_its_pods_need_and_warns_at_restricted() -> None:
    (ns,) = objects("Namespace").values()
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"  # zeusd, hostPath
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


# ---- the proxy and its vLLM ------------------------------------------------------------------


def test_proxy_environment_is_real_settings_and_starts_observing() -> None:
    c = container(proxy_pod(), "powerbatch")
    env = env_of(c)
    names = {SERVE.env(f) for f in SERVE.fields} | {SERVE.config_env}
    set_here = set(env) | set(re.findall(r"\bPOWERBATCH_[A-Z0-9_]+(?==)", "\n".join(c["args"])))
    for name in sorted(set_here):
        if name.startswith("POWERBATCH_"):
            assert name in names, f"{name} is no powerbatch serve setting"
        else:  # a helper, only there to build a setting's value
            users = [v for v in c["env"] if f"$({name})" in v.get("value", "")]
            assert users, f"{name} is set but no POWERBATCH_* value uses it"
    s = serve_settings(c)
    assert s.control.mode == "observe", "observe first (docs/operations.md, rollout)"
    assert s.power.power_source == "zeusd", "the proxy container has no GPU of its own for NVML"
    assert s.limiter.power_limiter == "zeusd"
    assert s.limiter.zeusd_token, "zeusd requires a token (--signing-key-path)"
    assert s.proxy.api_keys_file and s.proxy.admin_port is not None
    assert s.fleet.fleet_budget and s.fleet.fleet_budget_w > 0
    assert proxy_pod()["spec"]["replicas"] <= s.fleet.fleet_members, "safe shares over budget"
    assert "POWERBATCH_GPUS" in set_here, "a pod must name the GPUs it was given"
    assert s.power.gpu_indices() == [GPU_UUID], "found by UUID in zeusd, NVML and DCGM alike"


def test_the_settings_check_can_fail() -> None:
    c = container(proxy_pod(), "powerbatch")
    bad = {**c, "env": [*c["env"], {"name": "POWERBATCH_CEILING_WATTS", "value": "700"}]}
    with pytest.raises(Exception, match="unknown settings"):
        serve_settings(bad)


def test_ports_and_probes_name_real_endpoints() -> None:
    from powerbatch.sim import SimEngine, create_sim_app

    pod = proxy_pod()
    ports = named_ports(pod)
    proxy = container(pod, "powerbatch")
    s = serve_settings(proxy)
    assert ports["http"] == s.proxy.port and ports["admin"] == s.proxy.admin_port
    assert s.proxy.host == "0.0.0.0" and s.proxy.admin_host == "0.0.0.0"
    # vLLM listens where Prometheus can reach it, on the port the proxy sends to.
    vllm = container(pod, "vllm")
    script = vllm["args"][0]
    assert "--host 0.0.0.0" in script
    vllm_port = int(re.search(r"--port (\d+)", script).group(1))  # type: ignore[union-attr]
    assert ports["vllm"] == vllm_port and s.proxy.upstream == f"http://127.0.0.1:{vllm_port}"
    # vLLM's routes, as the simulator (which stands in for vLLM in the tests) serves them.
    sim_paths = {r.canonical for r in create_sim_app(SimEngine()).router.resources()}
    for c, public in ((proxy, PUBLIC_PATHS), (vllm, sim_paths)):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]["httpGet"]
            assert probe["path"] in public, f"{c['name']} {kind}: {probe['path']}"
            assert probe["port"] in {p["name"] for p in c["ports"]}, f"{c['name']} {kind}"
    # /ready waits up to 2 s on the upstream; /health answers at once: 5 s covers both.
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert proxy[kind]["timeoutSeconds"] > 2, kind
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/health"
    # A start-up (power probe, then waiting for the GPU file) fits the startup probe.
    startup = proxy["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > s.power.startup_probe_s + 15


def test_stopping_drains_before_vllm_goes_and_within_the_grace_period() -> None:
    pod = proxy_pod()
    proxy, vllm = container(pod, "powerbatch"), container(pod, "vllm")
    s = serve_settings(proxy)
    grace = pod_spec(pod)["terminationGracePeriodSeconds"]
    proxy_done = prestop_sleep_s(proxy) + s.proxy.drain_grace_s + s.limiter.limit_timeout_s
    assert prestop_sleep_s(proxy) > 0, "the endpoints need a moment to drop the pod"
    assert prestop_sleep_s(vllm) > proxy_done, "vLLM would stop under requests being drained"
    assert grace > prestop_sleep_s(vllm) + 10, "vLLM needs time to exit after its SIGTERM"
    assert grace > proxy_done, "the kubelet would kill the drain or the limit's restore"


def test_limiter_state_and_gpu_identity_live_on_shared_volumes() -> None:
    pod = proxy_pod()
    proxy, vllm = container(pod, "powerbatch"), container(pod, "vllm")
    s = serve_settings(proxy)
    volumes = {v["name"]: v for v in pod_spec(pod)["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in proxy["volumeMounts"]}
    state = s.limiter.limit_state_dir
    assert state and not state.startswith("/tmp"), state
    assert "emptyDir" in volumes[mounts[state]], "the state must outlive a container restart"
    # The GPU file: written by vLLM (which has the GPU), read by the proxy, one volume.
    v_mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    p_mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    written = re.findall(r"> (/\S+)", vllm["args"][0])
    read = re.findall(r"cat (/\S+?)\)", proxy["args"][0])
    assert read and all(Path(p).parent.as_posix() == p_mounts["gpu-info"] for p in read)
    assert written and all(Path(p).parent.as_posix() == v_mounts["gpu-info"] for p in written)
    assert "nvidia.com/gpu" in vllm["resources"]["limits"]
    assert "nvidia.com/gpu" not in proxy["resources"].get("limits", {})
    # Weights cache and shared memory for vLLM.
    assert volumes[next(n for n, p in v_mounts.items() if p == "/dev/shm")]["emptyDir"]["medium"]
    assert "/models" in v_mounts.values() and "--download-dir /models" in vllm["args"][0]
    assert shlex.split(proxy["args"][0].splitlines()[-1])[:4] == [
        "exec", "python", "-m", "powerbatch",
    ]  # fmt: skip


def test_zeusd_daemonset_socket_token_and_privilege() -> None:
    ds = objects("DaemonSet")["zeusd"]
    (z,) = pod_spec(ds)["containers"]
    args = z["args"]

    def arg(name: str) -> str:
        return str(args[args.index(name) + 1])

    socket = Path(arg("--socket-path"))
    mode = int(arg("--socket-permissions"), 8)
    assert mode & 0o007 == 0, "no access for others: tighter than zeusd's default 666"
    z_mounts = {m["mountPath"]: m["name"] for m in z["volumeMounts"]}
    z_vols = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    host = z_vols[z_mounts[socket.parent.as_posix()]]["hostPath"]
    assert host["type"] in ("Directory", "DirectoryOrCreate") and host["path"] == "/run/zeusd"
    assert z["securityContext"]["runAsUser"] == 0
    assert "SYS_ADMIN" in z["securityContext"]["capabilities"]["add"]
    assert {e["name"]: e.get("value") for e in z["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "gpu-control" in arg("--enable")
    # The proxy: same directory from the same host path, in the socket's group, same Secret.
    pod = proxy_pod()
    proxy = container(pod, "powerbatch")
    s = serve_settings(proxy)
    assert s.limiter.zeusd_url == f"unix://{socket}"
    mounts = {m["mountPath"]: m["name"] for m in proxy["volumeMounts"]}
    vols = {v["name"]: v for v in pod_spec(pod)["volumes"]}
    assert vols[mounts[socket.parent.as_posix()]]["hostPath"]["path"] == host["path"]
    pod_sc = pod_spec(pod)["securityContext"]
    groups = {
        pod_sc.get("runAsGroup"),
        pod_sc.get("fsGroup"),
        *pod_sc.get("supplementalGroups", []),
    }
    assert int(arg("--socket-gid")) in groups
    key_secret = z_vols[z_mounts[Path(arg("--signing-key-path")).parent.as_posix()]]["secret"]
    (token_ref,) = [e for e in proxy["env"] if e["name"] == "POWERBATCH_ZEUSD_TOKEN"]
    assert token_ref["valueFrom"]["secretKeyRef"]["name"] == key_secret["secretName"]


def test_the_proxy_finds_its_gpu_uuid_among_zeusds_through_the_nodes_dcgm_exporter() -> None:
    # zeusd lists PCI addresses, not UUIDs, and the proxy container has no NVML: the UUID's PCI
    # address comes from the dcgm-exporter on the pod's own node, which must let the pod in.
    from urllib.parse import urlsplit

    s = serve_settings(container(proxy_pod(), "powerbatch"))
    assert s.power.power_source == "zeusd" and s.power.dcgm_url
    url = urlsplit(s.power.dcgm_url)
    name, namespace = (url.hostname or "").split(".")[:2]
    service = objects("Service")[name]
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["internalTrafficPolicy"] == "Local", "another node's exporter"
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    ds = objects("DaemonSet")["dcgm-exporter"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert named_ports(ds)[port["targetPort"]] == 9400
    assert "UUID" in s.power.dcgm_labels() and url.path == "/metrics"
    policy = objects("NetworkPolicy")["dcgm-exporter"]
    proxy_labels = proxy_pod()["spec"]["template"]["metadata"]["labels"]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert any(
        "podSelector" in p and p["podSelector"]["matchLabels"].items() <= proxy_labels.items()
        for p in peers
    ), "the exporter's NetworkPolicy shuts the proxy out"


def test_redis_is_a_single_writer_with_auth_and_a_network_policy() -> None:
    (sts,) = objects("StatefulSet").values()
    assert sts["spec"]["replicas"] == 1
    assert "Deployment" not in {o["kind"] for n, o in workloads() if "redis" in n}
    r = container(sts, "redis")
    assert r["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert r["readinessProbe"] and r["livenessProbe"]
    (pw,) = [e for e in r["env"] if e["name"] == "REDIS_PASSWORD"]
    secret = pw["valueFrom"]["secretKeyRef"]
    proxy = container(proxy_pod(), "powerbatch")
    (proxy_pw,) = [e for e in proxy["env"] if e["name"] == "REDIS_PASSWORD"]
    assert proxy_pw["valueFrom"]["secretKeyRef"] == secret
    s = serve_settings(proxy)
    service = objects("Service")[sts["spec"]["serviceName"]]
    assert s.fleet.fleet_redis_url == (
        f"redis://:redis-s3cret@{service['metadata']['name']}:"
        f"{service['spec']['ports'][0]['port']}/0"
    )
    assert "redis-s3cret" not in repr(s), "the URL holds the password: a secret setting"
    policy = objects("NetworkPolicy")["powerbatch-redis"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    pod_labels = proxy_pod()["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items()


def test_only_prometheus_reaches_vllm_and_the_admin_port() -> None:
    policy = objects("NetworkPolicy")["vllm-powerbatch"]
    open_ports = set()
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if "from" not in rule:
            open_ports |= ports
        else:
            (peer,) = rule["from"]
            assert peer["namespaceSelector"]["matchLabels"] == {
                "kubernetes.io/metadata.name": "monitoring"
            }
    assert open_ports == {"http"}, "clients must not bypass the proxy or read its admin port"


def test_dcgm_exporter_collects_every_second_and_is_scraped_as_often() -> None:
    ds = objects("DaemonSet")["dcgm-exporter"]
    (c,) = pod_spec(ds)["containers"]
    collect_ms = int(c["args"][c["args"].index("-c") + 1])
    assert collect_ms <= 1000
    assert not c["securityContext"]["capabilities"].get("add"), "no profiling fields: no SYS_ADMIN"
    monitor = objects("PodMonitor")["dcgm-exporter"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert duration_s(endpoint["interval"]) * 1000 <= collect_ms


# ---- CRDs: their shape, and what they point at -----------------------------------------------

# PodMonitor fields of the Prometheus Operator's monitoring.coreos.com/v1 API that are used here.
PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
ENDPOINT_KEYS = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings"}
RELABEL_KEYS = {"sourceLabels", "targetLabel", "regex", "replacement", "action", "separator"}


def test_pod_monitors_select_pods_and_named_ports() -> None:
    monitors = objects("PodMonitor")
    assert set(monitors) == {"vllm-powerbatch", "dcgm-exporter"}
    for name, m in monitors.items():
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(m["spec"]) <= PODMONITOR_SPEC, name
        selector = m["spec"]["selector"]["matchLabels"]
        (target,) = [
            o
            for _, o in workloads()
            if selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()
        ]
        for endpoint in m["spec"]["podMetricsEndpoints"]:
            assert set(endpoint) <= ENDPOINT_KEYS, (name, endpoint)
            assert endpoint["port"] in named_ports(target), (name, endpoint["port"])
            assert duration_s(endpoint["scrapeTimeout"]) <= duration_s(endpoint["interval"])
            for relabel in endpoint.get("relabelings", []):
                assert set(relabel) <= RELABEL_KEYS
    # The dashboard selects on gpu_set: every pod's series carry it.
    for endpoint in monitors["vllm-powerbatch"]["spec"]["podMetricsEndpoints"]:
        assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"gpu_set"}


def test_prometheus_rule_and_dashboard_reach_their_consumers() -> None:
    rule = objects("PrometheusRule")["powerbatch"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"}
    board = objects("ConfigMap")["powerbatch-dashboard"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana sidecar's label
    assert len(yaml.safe_dump(board)) < 262144, "over kubectl apply's annotation limit"


# ---- docs/kubernetes.md ----------------------------------------------------------------------


def _secret_refs() -> dict[str, set[str]]:
    """Secret name -> the keys the manifests read from it."""
    refs: dict[str, set[str]] = {}
    for _, obj in workloads():
        spec = pod_spec(obj)
        for c in spec["containers"]:
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(ref["name"], set()).add(ref["key"])
        for v in spec.get("volumes", []):
            if "secret" in v:
                items = v["secret"].get("items") or [{"key": "*"}]
                refs.setdefault(v["secret"]["secretName"], set()).update(i["key"] for i in items)
    return refs


def test_kubernetes_doc_names_every_file_image_and_secret() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for path in sorted(K8S.rglob("*")):
        if path.is_file() and path.suffix in (".yaml", ".py"):
            assert f"`{path.relative_to(K8S).as_posix()}`" in doc, f"docs lack {path.name}"
    for where, obj in workloads():
        for c in pod_spec(obj)["containers"]:
            if not c["image"].startswith("powerbatch:"):
                assert f"`{c['image']}`" in doc, f"{where}: image {c['image']} undocumented"
    created = {
        m.group(1): m.group(2)
        for m in re.finditer(r"create secret generic ([\w-]+)((?:\\\n|[^\n])*)", doc)
    }
    for name, keys in _secret_refs().items():
        assert name in created, f"docs/kubernetes.md does not create Secret {name}"
        for key in keys - {"*"}:
            assert re.search(rf"--from-(file|literal)={key}=", created[name]), (name, key)
    assert "(operations.md#rolling-out)" in doc
    assert "kubernetes.md" in (ROOT / "docs" / "operations.md").read_text()
