"""`powerbatch_*` metrics and status of the in-engine controller, on an HTTP endpoint of its own.

The scheduler runs in vLLM's EngineCore process, which the API server's /metrics cannot see, so
the plugin serves its own: /metrics (Prometheus text), /status and /history (JSON). With the
model power source it also exports the modelled watts as dcgm-exporter names a GPU's, so anything
that reads dcgm-exporter (the powerbatch proxy, a dashboard) can read the model the same way: the
1-second mean as `DCGM_FI_DEV_POWER_USAGE` and the latest as `DCGM_FI_DEV_POWER_USAGE_INSTANT`.
A reader chooses how to filter by the name (`PowerSettings.averages`), so each name must mean
what it means on a GPU: a prefill window's watts exported as the 1-s mean would reach the
controller unfiltered and read as a second over the ceiling.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from powerbatch.control.metrics import ControlMetrics
from powerbatch.energy.metrics import EnergyMetrics
from powerbatch.telemetry.monitor import PowerReading

log = logging.getLogger("vllm.powerbatch")


class PluginMetrics(ControlMetrics):
    """The controller's gauges (shared with the proxy) plus what the engine knows exactly."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.engine_limit = Gauge(
            "powerbatch_engine_limit",
            "Limit in force in vLLM's scheduler, in the engine's units",
            ["knob"],
            registry=r,
        )
        self.engine_configured = Gauge(
            "powerbatch_engine_configured",
            "What vLLM was configured with: the limits never exceed these",
            ["knob"],
            registry=r,
        )
        self.running = Gauge(
            "powerbatch_engine_requests_running", "Requests in the running set", registry=r
        )
        self.waiting = Gauge(
            "powerbatch_engine_requests_waiting", "Requests waiting in vLLM", registry=r
        )
        self.kv_usage = Gauge(
            "powerbatch_engine_kv_cache_usage_ratio", "KV blocks in use, 0..1", registry=r
        )
        self.step_s = Gauge(
            "powerbatch_engine_step_seconds", "Smoothed interval between busy steps", registry=r
        )
        self.energy = EnergyMetrics(r)


def _json(obj: Any) -> bytes:
    """Strict JSON: the loop writes null for unknown numbers, never NaN."""
    return json.dumps(obj, allow_nan=False).encode()


class ModelMeter:
    """The modelled watts as dcgm-exporter shows a GPU's: a monitor listener.

    The mean is over the raw samples of the last `window_s` (NVML API reference,
    nvmlDeviceGetPowerUsage: a 1-second mean on Ampere, except GA100, and later). Both figures
    are plain floats, set on the control thread and read whole by the HTTP thread.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self.mean_w: float | None = None
        self.instant_w: float | None = None
        self._samples: deque[tuple[float, float]] = deque()

    def __call__(self, reading: PowerReading) -> None:
        if reading.t_s is None or reading.raw_w is None or not math.isfinite(reading.raw_w):
            return
        self._samples.append((reading.t_s, reading.raw_w))
        while self._samples[0][0] <= reading.t_s - self.window_s:
            self._samples.popleft()
        self.mean_w = sum(w for _, w in self._samples) / len(self._samples)
        self.instant_w = reading.raw_w

    def text(self, gpu: str, model_name: str) -> str:
        """Both fields in dcgm-exporter's format (empty while there is no reading)."""
        labels = f'gpu="{gpu}",modelName="{model_name}"'
        return _field(
            "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W), 1-second mean", labels, self.mean_w
        ) + _field(
            "DCGM_FI_DEV_POWER_USAGE_INSTANT", "Power draw (in W), latest", labels, self.instant_w
        )


def _field(name: str, help_: str, labels: str, power_w: float | None) -> str:
    if power_w is None or not math.isfinite(power_w):
        return ""
    return (
        f"# HELP {name} {help_}, modelled by powerbatch-vllm.\n"
        f"# TYPE {name} gauge\n"
        f"{name}{{{labels}}} {power_w:.3f}\n"
    )


class StatusServer:
    """A small threaded HTTP server; handlers only read state the control thread publishes."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: PluginMetrics,
        extra_text: Callable[[], str],
        status: Callable[[], dict[str, Any]],
        history: Callable[[], list[dict[str, Any]]],
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        body = generate_latest(outer.metrics.registry) + outer.extra().encode()
                        ctype = CONTENT_TYPE_LATEST
                    elif path == "/status":
                        body, ctype = _json(outer.status()), "application/json"
                    elif path == "/history":
                        body, ctype = _json(outer.history()), "application/json"
                    else:
                        self.send_error(404)
                        return
                except Exception as exc:  # a bug here must not take the engine down
                    log.exception("status endpoint failed")
                    self.send_error(500, str(exc))
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.metrics = metrics
        self.extra = extra_text
        self.status = status
        self.history = history
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="powerbatch-metrics", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
