"""The proxy's Prometheus metrics: `powerbatch_*`, units in names, one registry per proxy."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from powerbatch.admission import PRIORITIES, REJECTION_REASONS
from powerbatch.control.metrics import ControlMetrics
from powerbatch.energy.metrics import EnergyMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


OUTCOMES = (
    "ok",
    "upstream_error",  # the upstream failed: 5xx, unreachable, timed out, broke off
    "upstream_client_error",  # the upstream refused the request with a 4xx, relayed as is
    "cancelled",
    "rejected",
    "bad_request",
)
"""Every `outcome` of powerbatch_requests_total."""


class ProxyMetrics(ControlMetrics):
    """The controller's gauges plus what only a proxy sees: requests, queue, latency."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.in_flight = Gauge("powerbatch_requests_in_flight", "Requests upstream now", registry=r)
        self.kv_in_flight = Gauge(
            "powerbatch_kv_tokens_in_flight", "Estimated KV tokens upstream now", registry=r
        )
        self.queue_length = Gauge(
            "powerbatch_queue_length", "Requests waiting", ["priority"], registry=r
        )
        self.requests = Counter(
            "powerbatch_requests",
            "Requests answered, by outcome",
            ["priority", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "powerbatch_rejections", "Requests refused", ["priority", "reason"], registry=r
        )
        self.output_tokens = Counter(
            "powerbatch_output_tokens", "Output tokens relayed", ["priority"], registry=r
        )
        self.prompt_tokens = Counter(
            "powerbatch_prompt_tokens", "Prompt tokens admitted (estimated)", registry=r
        )

        def by_priority(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["priority"], buckets=buckets, registry=r)

        self.ttft_s = by_priority(
            "powerbatch_ttft_seconds", "Time to first token, queue included", _LATENCY_BUCKETS
        )
        self.tpot_s = by_priority(
            "powerbatch_time_per_output_token_seconds",
            "Time per output token after the first",
            _TPOT_BUCKETS,
        )
        self.e2e_s = by_priority(
            "powerbatch_e2e_latency_seconds", "Request latency, queue included", _LATENCY_BUCKETS
        )
        self.queue_wait_s = by_priority(
            "powerbatch_queue_wait_seconds", "Time in the admission queue", _LATENCY_BUCKETS
        )
        self.energy = EnergyMetrics(r)
        # Every labelled child exists from the start so dashboards see zeros, not gaps, and rate()
        # sees a counter's first increase: a series born at 1 has no earlier sample to rise from.
        self.by_class = {p: ClassSeries(self, p) for p in PRIORITIES}
        for p in PRIORITIES:
            self.queue_length.labels(p)


class ClassSeries:
    """One priority class's labelled children, looked up once: each `labels()` call takes a lock
    and builds a key, which the request path need not pay per request."""

    __slots__ = ("e2e_s", "outcomes", "output_tokens", "queue_wait_s", "tpot_s", "ttft_s")

    def __init__(self, m: ProxyMetrics, p: str) -> None:
        self.outcomes = {outcome: m.requests.labels(p, outcome) for outcome in OUTCOMES}
        for reason in REJECTION_REASONS:
            m.rejections.labels(p, reason)
        self.output_tokens = m.output_tokens.labels(p)
        self.ttft_s = m.ttft_s.labels(p)
        self.tpot_s = m.tpot_s.labels(p)
        self.e2e_s = m.e2e_s.labels(p)
        self.queue_wait_s = m.queue_wait_s.labels(p)
