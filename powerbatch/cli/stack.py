"""Start the simulator and the proxy as child processes on loopback, as a user would run them.

Separate processes keep the simulator's step timing honest: in one event loop with the proxy
and the load, every relay would delay the GPU's next step.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import TracebackType

from powerbatch.cli.process import Child, free_port
from powerbatch.control.config import ControlConfig

__all__ = ["Child", "Stack", "add_dcgm_interval_argument", "exporter_metric", "free_port"]


def add_dcgm_interval_argument(p: argparse.ArgumentParser) -> None:
    """`--dcgm-interval-s`, the same for every bench that starts simulators."""
    p.add_argument(
        "--dcgm-interval-s",
        type=float,
        default=1.0,
        help="the simulated dcgm-exporter's collect interval; the proxy reads its 1-s mean "
        "(0: the instant power at every poll)",
    )


def slo_default_s(name: str) -> float:
    """The controller's default for `ttft_slo_s` or `tpot_slo_s`: every bench's SLO."""
    return {f.name: f.default for f in dataclasses.fields(ControlConfig)}[name]  # type: ignore[return-value]


def add_slo_arguments(p: argparse.ArgumentParser) -> None:
    """`--ttft-slo-s` and `--tpot-slo-s` of a bench: the controller's own defaults, passed on to
    the proxy and used to count answers within the SLO."""
    for name in ("ttft_slo_s", "tpot_slo_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=slo_default_s(name))


def slo_s(a: argparse.Namespace) -> tuple[float, float]:
    """A bench's (TTFT SLO, TPOT SLO), from `add_slo_arguments`: what `run_load` drains for."""
    return a.ttft_slo_s, a.tpot_slo_s


def exporter_metric(dcgm_interval_s: float) -> str:
    """The field a proxy reads from a simulator collecting every `dcgm_interval_s`."""
    if dcgm_interval_s <= 0:
        return "DCGM_FI_DEV_POWER_USAGE_INSTANT"
    return "DCGM_FI_DEV_POWER_USAGE"  # the exporter's 1-s mean, as operators read it


class Stack:
    """The simulator, and optionally the proxy in front of it. Use as an async context manager."""

    def __init__(
        self,
        log_dir: Path,
        *,
        sim_args: list[str] | None = None,
        proxy_args: list[str] | None = None,
        with_proxy: bool = True,
        limiter: bool = False,
        dcgm_interval_s: float = 0.0,
    ) -> None:
        """`dcgm_interval_s` > 0: the simulator's exporter collects once a period, and the proxy
        reads its 1-second mean, as an operator's dcgm-exporter is read; 0: the proxy reads the
        instant power at every poll."""
        self.sim_port = free_port()
        self.proxy_port = free_port()
        self.sim_url = f"http://127.0.0.1:{self.sim_port}"
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        sim_cmd = ["sim", "--port", str(self.sim_port), *(sim_args or [])]
        sim_cmd += ["--dcgm-interval-s", str(dcgm_interval_s)]
        self.sim = Child("sim", sim_cmd, log_dir)
        metric = exporter_metric(dcgm_interval_s)
        self.proxy: Child | None = None
        if with_proxy:
            args = [
                "serve",
                "--upstream",
                self.sim_url,
                "--port",
                str(self.proxy_port),
                "--power-source",
                "dcgm",
                "--dcgm-url",
                self.sim_url + "/metrics",
                "--dcgm-metric",
                metric,
                *(proxy_args or []),
            ]
            if limiter:  # the device power limit through the simulator's zeusd API
                args += ["--power-limiter", "zeusd", "--zeusd-url", self.sim_url]
                args += ["--limit-state-dir", str(log_dir / "limits")]
            self.proxy = Child("proxy", args, log_dir)

    @property
    def entry_url(self) -> str:
        """Where the load goes: the proxy when there is one, else the simulator itself."""
        return self.proxy_url if self.proxy else self.sim_url

    async def __aenter__(self) -> Stack:
        await self.sim.start(self.sim_url + "/health")
        if self.proxy:
            try:
                await self.proxy.start(self.proxy_url + "/ready")
            except BaseException:
                await self.sim.stop()
                raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proxy:
            await self.proxy.stop()
        await self.sim.stop()
