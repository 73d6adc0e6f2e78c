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
        # Each label set's children, looked up once: labels() takes a lock and builds a key,
        # and these are counted at every request's end. The label sets are bounded (labels.py).
        self._energy_of: dict[Labels, Counter] = {}
        self._tokens_of: dict[Labels, tuple[Counter, Counter]] = {}

    def _energy(self, labels: Labels) -> Counter:
        child = self._energy_of.get(labels)
        if child is None:
            child = self._energy_of[labels] = self.request_energy_j.labels(*labels)
        return child

    def _tokens(self, labels: Labels) -> tuple[Counter, Counter]:
        pair = self._tokens_of.get(labels)
        if pair is None:
            prompt, completion = (self.request_tokens.labels(k, *labels) for k in TOKEN_KINDS)
            pair = self._tokens_of[labels] = (prompt, completion)
        return pair

    def seed(self, labels: Iterable[Labels]) -> None:
        """Create the series at zero, so rate() sees their first increase."""
        for one in labels:
            self._energy(one)
            self._tokens(one)

    def charge(self, by_labels_j: Mapping[Labels, float], idle_j: float) -> None:
        for labels, j in by_labels_j.items():
            if j > 0:
                self._energy(labels).inc(j)
        if idle_j > 0:
            self.idle_energy_j.inc(idle_j)

    def count_tokens(self, labels: Labels, prompt: int, completion: int) -> None:
        prompt_c, completion_c = self._tokens(labels)
        if prompt > 0:
            prompt_c.inc(prompt)
        if completion > 0:
            completion_c.inc(completion)
