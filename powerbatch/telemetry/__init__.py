"""GPU power readings: sources (NVML, dcgm-exporter, replayed traces), filters and the monitor;
the device power limit; and `factory`, which builds them from settings for each host.

Importing this package never imports pynvml; only constructing an NVML object does.
"""

from powerbatch.telemetry.base import PowerSample, PowerSource
from powerbatch.telemetry.factory import make_limiter
from powerbatch.telemetry.filters import Ewma, HampelFilter
from powerbatch.telemetry.limiter import (
    LimitActuator,
    NoLimiter,
    NvmlLimiter,
    PowerLimiter,
    ZeusdLimiter,
)
from powerbatch.telemetry.monitor import PowerMonitor, PowerReading
from powerbatch.telemetry.nvml import (
    NvmlPowerLimiter,
    NvmlPowerSource,
    default_power_limit_w,
    nvml_available,
)
from powerbatch.telemetry.prometheus import (
    PrometheusPowerSource,
    UpstreamMetricsScraper,
    UpstreamSignals,
)
from powerbatch.telemetry.replay import ReplayPowerSource, TraceExhausted
from powerbatch.telemetry.trace import TraceRow, read_trace, write_trace
from powerbatch.telemetry.zeusd import ZeusdPowerSource

__all__ = [
    "Ewma",
    "HampelFilter",
    "LimitActuator",
    "NoLimiter",
    "NvmlLimiter",
    "NvmlPowerLimiter",
    "NvmlPowerSource",
    "PowerLimiter",
    "PowerMonitor",
    "PowerReading",
    "PowerSample",
    "PowerSource",
    "PrometheusPowerSource",
    "ReplayPowerSource",
    "TraceExhausted",
    "TraceRow",
    "UpstreamMetricsScraper",
    "UpstreamSignals",
    "ZeusdLimiter",
    "ZeusdPowerSource",
    "default_power_limit_w",
    "make_limiter",
    "nvml_available",
    "read_trace",
    "write_trace",
]
