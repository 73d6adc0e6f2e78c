"""Priority classes: names, aliases accepted in the `x-priority` header, and their order."""

from __future__ import annotations

# Highest first. The last class is deferrable: with valley filling it waits for troughs.
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"
DEFERRABLE = PRIORITIES[-1]

_ALIASES = {
    "high": "high",
    "interactive": "high",
    "0": "high",
    "normal": "normal",
    "default": "normal",
    "1": "normal",
    "low": "low",
    "batch": "low",
    "deferrable": "low",
    "2": "low",
}


def parse_priority(value: str | None) -> str:
    """Map a header value to a class; raise ValueError with the accepted values otherwise."""
    if value is None or value.strip() == "":
        return DEFAULT_PRIORITY
    name = _ALIASES.get(value.strip().lower())
    if name is None:
        accepted = ", ".join(sorted(_ALIASES))
        raise ValueError(f"unknown priority {value!r}; accepted: {accepted}")
    return name


def rank(priority: str) -> int:
    """0 for the highest class."""
    return PRIORITIES.index(priority)
