"""Bounded label values: tenants and models come from clients, series must not grow with them."""

from __future__ import annotations

from collections.abc import Iterable

OTHER = "other"
DEFAULT_TENANT = "default"  # a key configured without a name
ANONYMOUS = "anonymous"  # no client keys configured


class Bounded:
    """A fixed set of names, or the first `max_seen` seen; everything else is `other`."""

    def __init__(self, names: Iterable[str] = (), max_seen: int = 0) -> None:
        self.fixed = bool(tuple(names))
        self.names: set[str] = set(names)
        self.max_seen = max_seen

    def __call__(self, name: str) -> str:
        if name in self.names:
            return name
        if not self.fixed and len(self.names) < self.max_seen and name:
            self.names.add(name)
            return name
        return OTHER

    def known(self) -> list[str]:
        return sorted(self.names)
