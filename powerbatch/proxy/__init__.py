"""Proxy: the aiohttp reverse proxy and the control loop behind it."""

from powerbatch.proxy.app import ProxySettings, create_app
from powerbatch.proxy.governor import Governor, TickRecord
from powerbatch.proxy.metrics import ProxyMetrics

__all__ = ["Governor", "ProxyMetrics", "ProxySettings", "TickRecord", "create_app"]
