"""docker-compose.yml, Dockerfile, Prometheus and Grafana provisioning, checked without Docker.

The static tests parse the files and check what Docker would only find out at `up` time: files
that do not exist, services that point at hosts or ports nobody serves, profiles that lack a
piece. The last test starts the `sim` profile's `sim` and `powerbatch` services as plain
processes, with the argv the image's entrypoint would run, and sends a request through them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from powerbatch.cli.process import Child, free_port

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
OPERATIONS = ROOT / "docs" / "operations.md"

PROFILES: dict[str, set[str]] = {
    "sim": {"sim", "powerbatch", "prometheus", "grafana"},
    "gpu": {"vllm", "powerbatch-gpu", "dcgm-exporter", "prometheus-gpu", "grafana"},
    "fleet": {
        "redis-fleet",
        "fleet-sim-0",
        "fleet-sim-1",
        "fleet-powerbatch-0",
        "fleet-powerbatch-1",
        "prometheus-fleet",
    },
}
# Ports of services whose command does not say (the image's default).
DEFAULT_PORTS = {
    "dcgm-exporter": 9400,
    "prometheus": 9090,
    "prometheus-gpu": 9090,
    "prometheus-fleet": 9090,
    "redis-fleet": 6379,
}

# ---- compose helpers -------------------------------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable syntax: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $$."""

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = not value
        if op == ":-":
            return arg if unset_or_empty else str(value)
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?"):
            if (op == ":?" and unset_or_empty) or value is None:
                raise AssertionError(f"compose needs ${name}: {arg}")
            return str(value)
        if op == ":+":
            return "" if unset_or_empty else arg
        if op == "+":
            return "" if value is None else arg
        return value or ""

    return _VAR.sub(sub, text)


def _walk(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Docker would see it with `env` as the shell environment."""
    raw = yaml.safe_load(COMPOSE.read_text())
    return dict(_walk(raw, env or {}))


def compose_variables() -> set[str]:
    """Variables the compose file's values use (comments excluded)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, str):
            found.update(m.group("name") for m in _VAR.finditer(node) if m.group("name"))
        elif isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for x in node.values():
                walk(x)

    walk(yaml.safe_load(COMPOSE.read_text()))
    return found


def services_in(compose: Mapping[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if not svc.get("profiles") or profile in svc["profiles"]
    }


def names_and_aliases(services: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Host name -> service, on the default network."""
    out = {name: name for name in services}
    for name, svc in services.items():
        networks = svc.get("networks") or {}
        if isinstance(networks, dict):
            for net in networks.values():
                for alias in (net or {}).get("aliases", []):
                    out[alias] = name
    return out


def listening_port(name: str, svc: Mapping[str, Any]) -> int:
    cmd = [str(x) for x in svc.get("command") or []]
    if "--port" in cmd:
        return int(cmd[cmd.index("--port") + 1])
    return DEFAULT_PORTS[name]


def admin_port(svc: Mapping[str, Any]) -> int | None:
    """powerbatch's admin listener (/metrics, /status without client keys), where set."""
    port = (svc.get("environment") or {}).get("POWERBATCH_ADMIN_PORT")
    return int(port) if port is not None else None


def served_ports(name: str, svc: Mapping[str, Any]) -> set[int]:
    admin = admin_port(svc)
    return {listening_port(name, svc)} | ({admin} if admin is not None else set())


def published_host_port(entry: Any) -> tuple[str, str]:
    """(host address, host port) of a `ports:` entry ("8000:8000", "127.0.0.1:3000:3000")."""
    parts = str(entry).split(":")
    return ("0.0.0.0" if len(parts) == 2 else parts[0]), parts[-2]


def bind_mounts(svc: Mapping[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount with a path relative to the project."""
    out = []
    for vol in svc.get("volumes") or []:
        source, target = str(vol).split(":")[:2]
        if source.startswith("./"):
            out.append((ROOT / source, target))
    return out


def command(svc: Mapping[str, Any]) -> list[str]:
    return [str(x) for x in svc.get("command") or []]


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


# ---- Dockerfile helpers ----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in final_stage():
        if keyword == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def dockerfile_exec_form(keyword: str) -> list[str]:
    (rest,) = [r for k, r in final_stage() if k == keyword]
    if keyword == "HEALTHCHECK":
        rest = rest[rest.index("CMD") + 3 :].strip()
    value = json.loads(rest)
    assert isinstance(value, list), f"{keyword} must use the exec (JSON) form"
    return [str(x) for x in value]


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch(part, pattern[3:]) for part in parts)
        )
        if hit:
            allowed = negate
    return allowed


# ---- static tests ----------------------------------------------------------------------------


def test_compose_parses_with_profiles_and_known_keys() -> None:
    compose = load_compose()
    assert set(compose) <= {"name", "services", "volumes", "networks", "configs", "secrets"} | {
        k for k in compose if k.startswith("x-")
    }
    for profile, expected in PROFILES.items():
        assert set(services_in(compose, profile)) == expected, profile
    for name, svc in compose["services"].items():
        assert set(svc.get("profiles", [])) <= set(PROFILES), name
        assert "image" in svc, f"{name}: no image"
    text = interpolate(COMPOSE.read_text(), {})
    assert not re.search(r"\$[A-Za-z_{]", text), "a variable compose would not expand"


def test_compose_references_existing_files() -> None:
    compose = load_compose()
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            context = ROOT / build["context"]
            assert context.is_dir(), name
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        for host, _ in bind_mounts(svc):
            assert host.exists(), f"{name}: bind mount source {host} does not exist"
        for volume in svc.get("volumes") or []:
            source = str(volume).split(":")[0]
            if not source.startswith(("./", "/", "~")):
                assert source in (compose.get("volumes") or {}), f"{name}: volume {source}"


def test_compose_dependencies_and_targets_stay_inside_their_profile() -> None:
    compose = load_compose()
    for profile in PROFILES:
        services = services_in(compose, profile)
        hosts = names_and_aliases(services)
        for name, svc in services.items():
            for dep in svc.get("depends_on") or {}:
                assert dep in services, f"{profile}: {name} depends on {dep}"
            for arg in command(svc) + [str(v) for v in (svc.get("environment") or {}).values()]:
                for host, port in re.findall(r"https?://([a-z][a-z0-9-]*):(\d+)", arg):
                    if host in ("127.0.0.1", "localhost"):
                        continue
                    assert host in hosts, f"{profile}: {name} points at unknown host {host}"
                    target = hosts[host]
                    assert int(port) in served_ports(target, services[target]), (name, arg)
        published = [
            published_host_port(p)[1] for svc in services.values() for p in svc.get("ports") or []
        ]
        assert len(published) == len(set(published)), f"{profile}: a host port published twice"


def test_sim_profile_wiring() -> None:
    compose = load_compose()
    proxy = command(compose["services"]["powerbatch"])
    assert proxy[0] == "serve"
    assert flag(proxy, "--upstream") == "http://sim:8001"
    assert flag(proxy, "--power-source") == "dcgm"
    assert flag(proxy, "--dcgm-url") == "http://sim:8001/metrics"
    assert flag(proxy, "--dcgm-metric") == "DCGM_FI_DEV_POWER_USAGE_INSTANT"
    sim = command(compose["services"]["sim"])
    assert sim[0] == "sim"
    from powerbatch.sim import PROFILES as SIM_PROFILES

    assert flag(sim, "--profile") in SIM_PROFILES


def test_gpu_profile_wiring_follows_the_variables() -> None:
    env = {"GPU_IDS": "2,3", "VLLM_MAX_NUM_SEQS": "64", "VLLM_MODEL": "org/model"}
    services = load_compose(env)["services"]
    proxy, vllm = services["powerbatch-gpu"], services["vllm"]
    assert flag(command(proxy), "--power-source") == "nvml"
    assert flag(command(proxy), "--upstream") == "http://vllm:8000"
    assert proxy["environment"]["POWERBATCH_GPUS"] == "2,3"
    assert proxy["environment"]["POWERBATCH_MAX_BATCH"] == "64"
    assert flag(command(vllm), "--max-num-seqs") == "64"
    assert flag(command(vllm), "--model") == "org/model"
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["2,3"]
    assert "ports" not in vllm, "clients must not bypass the proxy"
    # NVML: device nodes and the driver's utility libraries, read as the unprivileged user.
    (device,) = proxy["deploy"]["resources"]["reservations"]["devices"]
    assert {"gpu", "utility"} <= set(device["capabilities"])
    assert "cap_add" not in proxy, "a capability is no use to a non-root user"
    assert proxy["user"] != "0"
    assert "cap_add" not in services["dcgm-exporter"], "no profiling fields: no SYS_ADMIN"
    assert services["dcgm-exporter"]["volumes"], "dcgm-exporter needs its counters file"
    collect_ms = int(flag(command(services["dcgm-exporter"]), "-c"))
    assert collect_ms <= 1000, "dcgm-exporter's default 30 s interval is too slow"


def test_backstop_override_runs_the_proxy_as_root_with_sys_admin() -> None:
    """deploy/compose/backstop.yml, merged as compose merges a second -f file."""
    from powerbatch.cli.settings import SERVE
    from powerbatch.settings import load

    override = yaml.safe_load((ROOT / "deploy" / "compose" / "backstop.yml").read_text())
    assert set(override["services"]) == {"powerbatch-gpu"}
    base = load_compose()["services"]["powerbatch-gpu"]
    extra = override["services"]["powerbatch-gpu"]
    merged = {**base, **extra, "environment": {**base["environment"], **extra["environment"]}}
    assert merged["user"] == "0" and merged["cap_add"] == ["SYS_ADMIN"]
    env = {k: str(v) for k, v in merged["environment"].items() if k != "POWERBATCH_CONFIG"}
    opts = load(SERVE, environ={**env, "POWERBATCH_UPSTREAM": "http://vllm:8000"})
    assert opts.hardware_backstop is True


def test_images_are_pinned_and_consoles_listen_on_loopback() -> None:
    compose = load_compose()
    for name, svc in compose["services"].items():
        image = svc["image"]
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest" and not re.fullmatch(r"\d+(-\w+)?", tag), (name, image)
    for name in ("grafana", "prometheus", "prometheus-gpu", "prometheus-fleet"):
        for entry in compose["services"][name]["ports"]:
            assert published_host_port(entry)[0] == "127.0.0.1", (
                f"{name} published on all interfaces"
            )
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    # Each profile keeps its own Prometheus data: a sim run does not mix into a GPU host's.
    data = [
        str(v).split(":")[0]
        for n, svc in compose["services"].items()
        if n.startswith("prometheus")
        for v in svc["volumes"]
        if not str(v).startswith("./")
    ]
    assert len(data) == len(set(data)), data


def test_powerbatch_settings_in_compose_are_valid() -> None:
    """The mounted TOML and the POWERBATCH_* variables pass the real settings resolver."""
    import argparse

    from powerbatch.cli.settings import SERVE
    from powerbatch.settings import add_arguments, load

    compose = load_compose()
    toml_path = ROOT / "deploy" / "powerbatch" / "powerbatch.toml"
    for name in ("powerbatch", "powerbatch-gpu"):
        svc = compose["services"][name]
        mounts = {target: host for host, target in bind_mounts(svc)}
        env = {k: str(v) for k, v in svc["environment"].items()}
        env["POWERBATCH_CONFIG"] = str(mounts[env["POWERBATCH_CONFIG"]])
        parser = argparse.ArgumentParser()
        add_arguments(parser, SERVE)
        opts = load(SERVE, args=parser.parse_args(command(svc)[1:]), environ=env)
        assert opts.control.ceiling_w > 0
        drain = tomllib.loads(toml_path.read_text())["powerbatch"]["drain_grace_s"]
        assert opts.proxy.drain_grace_s == drain
        grace = str(svc["stop_grace_period"])
        assert grace.endswith("s") and float(grace[:-1]) > drain, "docker would kill a drain"


def test_dockerfile_is_small_non_root_with_healthcheck() -> None:
    keywords = [k for k, _ in final_stage()]
    assert "HEALTHCHECK" in keywords
    args = dict(r.partition("=")[::2] for k, r in final_stage() if k == "ARG")
    (user,) = [r for k, r in final_stage() if k == "USER"]
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user.split(":")[0])
    assert uid.isdigit() and int(uid) != 0, "run as a numeric non-root user"
    assert "${UID}" in user, "USER follows ARG UID (docker build --build-arg UID=...)"
    (useradd,) = [r for k, r in final_stage() if k == "RUN" and "useradd" in r]
    assert '--uid "${UID}"' in useradd
    assert dockerfile_exec_form("ENTRYPOINT") == ["python", "-m", "powerbatch"]
    assert dockerfile_exec_form("HEALTHCHECK")[0] == "python"
    froms = [r for k, r in dockerfile_instructions() if k == "FROM"]
    assert all("slim" in f or "distroless" in f for f in froms)
    for needed in ("pyproject.toml", "powerbatch/__init__.py", "powerbatch/cli/main.py"):
        assert dockerignore_allows(needed), needed
    for excluded in (".venv/bin/python", "tests/test_estimate.py", "results/x.csv", ".git/HEAD"):
        assert not dockerignore_allows(excluded), excluded


@pytest.mark.parametrize("profile", ["sim", "gpu", "fleet"])
def test_prometheus_config_is_valid_and_scrapes_the_profile(profile: str) -> None:
    compose = load_compose()
    services = services_in(compose, profile)
    hosts = names_and_aliases(services)
    (prom_name,) = [n for n in services if n.startswith("prometheus")]
    mounts = {t: h for h, t in bind_mounts(services[prom_name])}
    host_path = mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(host_path.read_text())
    # The alert rules: named relative to the config, mounted beside it, the file k8s copies.
    (rules,) = config["rule_files"]
    assert mounts[f"/etc/prometheus/{rules}"] == ROOT / "deploy" / "prometheus" / "alerts.yml"
    assert (host_path.parent / rules).is_file()
    assert set(config) <= {"global", "scrape_configs", "rule_files", "alerting"}
    duration = re.compile(r"^\d+(ms|s|m|h)$")
    for key in ("scrape_interval", "evaluation_interval", "scrape_timeout"):
        assert duration.match(config["global"][key]), key
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert len(jobs) == len(set(jobs))
    scraped = set()
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in hosts, f"{profile}: scrape target {target} is no service"
                service = hosts[host]
                assert int(port) in served_ports(service, services[service]), target
                if "powerbatch" in service:  # no client key is sent
                    assert int(port) == admin_port(services[service]), f"{target}: admin port"
                scraped.add(service)
    expected = {
        "sim": {"powerbatch", "sim"},
        "gpu": {"powerbatch-gpu", "vllm", "dcgm-exporter"},
        "fleet": {"fleet-powerbatch-0", "fleet-powerbatch-1", "fleet-sim-0", "fleet-sim-1"},
    }
    assert scraped == expected[profile]
    promtool = shutil.which("promtool")
    if promtool:  # the real validator where it is installed
        out = subprocess.run(
            [promtool, "check", "config", str(host_path)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_provisioning_matches_the_mounts() -> None:
    compose = load_compose()
    grafana = compose["services"]["grafana"]
    mounts = {target: host for host, target in bind_mounts(grafana)}
    provisioning = mounts["/etc/grafana/provisioning"]
    (ds_file,) = (provisioning / "datasources").glob("*.yml")
    (datasource,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    host, port = re.findall(r"http://([a-z-]+):(\d+)", datasource["url"])[0]
    for profile in grafana["profiles"]:
        services = services_in(compose, profile)
        hosts = names_and_aliases(services)
        assert host in hosts, f"{profile}: Grafana's data source host {host} is no service"
        assert int(port) == listening_port(hosts[host], services[hosts[host]])
    (dash_file,) = (provisioning / "dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(dash_file.read_text())["providers"]
    container_dir = provider["options"]["path"]
    host_dir = mounts[container_dir]
    dashboards = list(host_dir.glob("*.json"))
    assert dashboards
    uses = json.dumps([json.loads(p.read_text()) for p in dashboards])
    assert datasource["uid"] in uses or '"query": "prometheus"' in uses
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (host_dir / Path(home).relative_to(container_dir)).is_file()


def test_every_compose_variable_is_documented() -> None:
    doc = OPERATIONS.read_text()
    missing = sorted(v for v in compose_variables() if f"`{v}`" not in doc)
    assert not missing, f"docs/operations.md lacks compose variables {missing}"


# ---- the sim stack as processes --------------------------------------------------------------


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


class _Stack:
    """The `sim` profile's Python services as local processes, argv and environment as in Docker."""

    def __init__(self, log_dir: Path) -> None:
        self.compose = load_compose()
        self.services = services_in(self.compose, "sim")
        self.log_dir = log_dir
        self.ports: dict[str, int] = {}
        self.admin_ports: dict[str, int] = {}  # a service's POWERBATCH_ADMIN_PORT, moved
        self.children: dict[str, Child] = {}

    def url(self, service: str, path: str = "") -> str:
        """The service's URL for `path`: /metrics and /status on the admin port where set."""
        admin = path.startswith(("/metrics", "/status")) and service in self.admin_ports
        port = self.admin_ports[service] if admin else self.ports[service]
        return f"http://127.0.0.1:{port}{path}"

    def _rewrite(self, value: str, mounts: Mapping[str, Path]) -> str:
        hosts = names_and_aliases(self.services)
        for host, service in hosts.items():
            if service in self.ports:
                port = listening_port(service, self.services[service])
                value = value.replace(f"://{host}:{port}", f"://127.0.0.1:{self.ports[service]}")
        value = value.replace("0.0.0.0", "127.0.0.1")
        return str(mounts.get(value, value))

    def argv_env(self, name: str) -> tuple[list[str], dict[str, str]]:
        svc = self.services[name]
        mounts = {target: host for host, target in bind_mounts(svc)}
        entry = dockerfile_exec_form("ENTRYPOINT")
        assert entry[0] == "python"
        cmd = command(svc)
        if "--port" in cmd:
            cmd[cmd.index("--port") + 1] = str(self.ports[name])
        argv = [sys.executable, *entry[1:], *(self._rewrite(a, mounts) for a in cmd)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("POWERBATCH_")}
        image_env = {
            **dockerfile_env(),
            **{k: str(v) for k, v in svc.get("environment", {}).items()},
        }
        for key, value in image_env.items():
            if key.startswith(("POWERBATCH_", "PROMETHEUS_", "PYTHON")):
                env[key] = self._rewrite(value, mounts)
        if admin_port(svc) is not None:
            env["POWERBATCH_ADMIN_PORT"] = str(self.admin_ports.setdefault(name, free_port()))
        if "POWERBATCH_HEALTH_URL" in env:  # the healthcheck probes the container's own port
            env["POWERBATCH_HEALTH_URL"] = re.sub(
                r"127\.0\.0\.1:\d+", f"127.0.0.1:{self.ports[name]}", env["POWERBATCH_HEALTH_URL"]
            )
        return argv, env

    def start(self, name: str) -> None:
        self.ports.setdefault(name, free_port())
        argv, env = self.argv_env(name)
        child = Child(name, argv, self.log_dir, command=(), env=env, cwd=self.log_dir)
        self.children[name] = child
        child.launch()

    def log(self, name: str) -> str:
        return self.children[name].log_tail()

    def wait_for(self, name: str, path: str, deadline: float) -> bytes:
        """GET `path` until it answers 200 (the child must stay up); its body."""
        child = self.children[name]

        def answered() -> tuple[bytes] | None:
            assert child.running(), f"{name} exited {child.returncode}:\n{self.log(name)}"
            status, body = _get(self.url(name, path))
            return (body,) if status == 200 else None

        (body,) = wait_until(
            answered,
            deadline - time.monotonic(),
            lambda: f"{name} {path} to answer 200:\n{self.log(name)}",
            interval_s=0.1,
        )
        return body

    def healthcheck(self, name: str) -> int:
        """Run the image's HEALTHCHECK command as Docker would inside the container."""
        _, env = self.argv_env(name)
        hc = dockerfile_exec_form("HEALTHCHECK")
        return subprocess.run([sys.executable, *hc[1:]], env=env, timeout=10).returncode

    def stop(self) -> None:
        for child in reversed(self.children.values()):  # dependents first, as compose stops them
            child.terminate(timeout_s=8)


@pytest.fixture
def sim_stack(tmp_path: Path) -> Iterator[_Stack]:
    stack = _Stack(tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.timeout(60)
def test_sim_stack_starts_and_answers_as_compose_runs_it(sim_stack: _Stack) -> None:
    stack = sim_stack
    deadline = time.monotonic() + 30
    # depends_on: powerbatch waits for a healthy sim.
    order = ["sim", "powerbatch"]
    assert "sim" in stack.services["powerbatch"]["depends_on"]
    stack.ports = {name: free_port() for name in order}
    stack.start("sim")
    stack.wait_for("sim", "/health", deadline)
    assert stack.healthcheck("sim") == 0
    stack.start("powerbatch")
    stack.wait_for("powerbatch", "/health", deadline)
    assert stack.healthcheck("powerbatch") == 0
    stack.wait_for("powerbatch", "/ready", deadline)

    model = flag(command(stack.services["sim"]), "--model-name")
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    ).encode()
    assert stack.admin_ports, "compose gives powerbatch an admin port"
    request = urllib.request.Request(
        stack.url("powerbatch", "/v1/chat/completions"),
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=15) as r:
        assert r.status == 200
        answer = json.loads(r.read())
    assert answer["choices"][0]["message"]["content"]

    # The proxy reads power where compose points it (the simulator's DCGM series).
    def power_reading() -> tuple[str, float] | None:
        metrics = stack.wait_for("powerbatch", "/metrics", deadline).decode()
        m = re.search(r"^powerbatch_power_watts (\S+)$", metrics, re.M)
        return (metrics, float(m.group(1))) if m and m.group(1).lower() != "nan" else None

    metrics, watts = wait_until(
        power_reading,
        deadline - time.monotonic(),
        lambda: f"a power reading:\n{stack.log('powerbatch')}",
        interval_s=0.2,
    )
    assert watts > 0
    assert re.search(r'powerbatch_requests_total\{[^}]*outcome="ok"[^}]*\} 1\.0', metrics)
    assert "powerbatch_power_ceiling_watts" in metrics
    assert "_created" not in metrics, "the image disables prometheus_client's _created series"
    sim_metrics = stack.wait_for("sim", "/metrics", deadline).decode()
    assert "DCGM_FI_DEV_POWER_USAGE_INSTANT" in sim_metrics
    assert "vllm:num_requests_running" in sim_metrics
    status = json.loads(stack.wait_for("powerbatch", "/status", deadline))
    assert isinstance(status, dict)
