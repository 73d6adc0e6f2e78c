"""Proxy: the aiohttp reverse proxy and the control loop behind it."""

from powerbatch.control.record import TickRecord
from powerbatch.proxy.app import create_app
from powerbatch.proxy.governor import Governor
from powerbatch.proxy.metrics import ProxyMetrics
from powerbatch.proxy.settings import ProxySettings

__all__ = ["Governor", "ProxyMetrics", "ProxySettings", "TickRecord", "create_app"]
