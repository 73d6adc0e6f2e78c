"""docs/operations.md "Without containers": the shipped configs agree with the doc's commands.

Everything there listens on loopback, so the Prometheus targets and Grafana's data source must be
loopback too, on the very ports the commands give.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _recipe() -> list[list[str]]:
    """The section's shell commands, continuation lines joined, each split into words."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Without containers", 1)[1].split("\n##", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the no-container recipe lost its sh block"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def _command(words: list[list[str]], head: str) -> list[str]:
    """The command line whose program (after any VAR=value words) starts with `head`."""
    for line in words:
        program = [w for w in line if not re.match(r"[A-Z_]+=", w)]
        if " ".join(program).startswith(head):
            return line
    raise AssertionError(f"no `{head}` command in the recipe")


def _flag(line: list[str], name: str) -> str:
    for i, word in enumerate(line):
        if word == name:
            return line[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} missing from {' '.join(line)}")


def _loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def test_local_prometheus_and_grafana_configs_match_the_recipe() -> None:
    words = _recipe()
    sim = _command(words, "powerbatch sim")
    serve = _command(words, "powerbatch serve")
    prom = _command(words, "prometheus")
    grafana = _command(words, "grafana")
    sim_port, proxy_port = int(_flag(sim, "--port")), int(_flag(serve, "--port"))
    assert _loopback(_flag(sim, "--host")) and _loopback(_flag(serve, "--host"))
    upstream = urlsplit(_flag(serve, "--upstream"))
    assert upstream.hostname and _loopback(upstream.hostname) and upstream.port == sim_port

    config = yaml.safe_load((ROOT / _flag(prom, "--config.file")).read_text())
    ports = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert _loopback(host.strip("[]")), f"{job['job_name']}: {target} not loopback"
                ports[job["job_name"]] = int(port)
    assert ports == {"powerbatch": proxy_port, "vllm": sim_port}

    prom_host, prom_port = _flag(prom, "--web.listen-address").rsplit(":", 1)
    assert _loopback(prom_host)
    env = dict(w.split("=", 1) for w in grafana if re.match(r"[A-Z_]+=", w))
    assert _loopback(env["GF_SERVER_HTTP_ADDR"])
    provisioning = ROOT / env["GF_PATHS_PROVISIONING"].replace("$PWD/", "")
    (ds_file,) = (provisioning / "datasources").glob("*.yml")
    (source,) = yaml.safe_load(ds_file.read_text())["datasources"]
    url = urlsplit(source["url"])
    assert url.hostname and _loopback(url.hostname) and url.port == int(prom_port)
    dashboards = ROOT / env["POWERBATCH_DASHBOARDS"].replace("$PWD/", "")
    assert (dashboards / "powerbatch.json").is_file()
    (provider_file,) = (provisioning / "dashboards").glob("*.yml")
    assert "$POWERBATCH_DASHBOARDS" in provider_file.read_text()
