"""Energy counters, the same for the proxy and the vLLM plugin, so J/token is a PromQL ratio:

rate(powerbatch_request_energy_joules_total[5m])
  / on(priority, tenant, model) sum without(kind) (rate(powerbatch_request_tokens_total[5m]))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

from prometheus_client import CollectorRegistry, Counter

from powerbatch.energy.attribution import Labels

TOKEN_KINDS = ("prompt", "completion")


class EnergyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        counter = partial(Counter, registry=registry)
        self.request_energy_j = counter(
            "powerbatch_request_energy_joules",
            "Metered energy above idle, attributed to requests by their work (docs/energy.md)",
            ["priority", "tenant", "model"],
        )
        self.request_tokens = counter(
            "powerbatch_request_tokens",
            "Tokens of requests answered, by kind (prompt, completion)",
            ["kind", "priority", "tenant", "model"],
        )
        self.idle_energy_j = counter(
            "powerbatch_idle_energy_joules",
            "Metered energy at idle power (or with nothing in flight): charged to no request",
        )

    def seed(self, labels: Iterable[Labels]) -> None:
        """Create the series at zero, so rate() sees their first increase."""
        for p, t, m in labels:
            self.request_energy_j.labels(p, t, m)
            for kind in TOKEN_KINDS:
                self.request_tokens.labels(kind, p, t, m)

    def charge(self, by_labels_j: Mapping[Labels, float], idle_j: float) -> None:
        for (p, t, m), j in by_labels_j.items():
            if j > 0:
                self.request_energy_j.labels(p, t, m).inc(j)
        if idle_j > 0:
            self.idle_energy_j.inc(idle_j)

    def count_tokens(self, labels: Labels, prompt: int, completion: int) -> None:
        p, t, m = labels
        if prompt > 0:
            self.request_tokens.labels("prompt", p, t, m).inc(prompt)
        if completion > 0:
            self.request_tokens.labels("completion", p, t, m).inc(completion)
