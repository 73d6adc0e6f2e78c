"""Putting a request's joules into the OpenAI `usage` object it is answered with.

The field is `energy_j` beside `prompt_tokens` and `completion_tokens`: clients read it from
`usage` (the openai SDK keeps unknown fields: `completion.usage.model_extra["energy_j"]`).
"""

from __future__ import annotations

import json
from typing import Any

FIELD = "energy_j"
HEADER = "x-powerbatch-energy-j"


def json_usage(body: bytes) -> tuple[Any, dict[str, Any] | None]:
    """(the parsed answer, its usage object or None); (None, None) when it is not JSON."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or compressed (the proxy relays as is)
        return None, None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return doc, usage if isinstance(usage, dict) else None


def usage_int(usage: dict[str, Any] | None, key: str) -> int | None:
    value = usage.get(key) if usage is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def with_energy(doc: Any, usage: dict[str, Any], energy_j: float) -> bytes:
    """`doc` as JSON again, with `usage.energy_j` set (usage: the object inside doc)."""
    usage[FIELD] = round(energy_j, 6)
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _event_json(event: bytes) -> tuple[Any, dict[str, Any] | None]:
    stripped = event.strip()
    if not stripped.startswith(b"data: {") or b'"usage"' not in stripped:
        return None, None
    return json_usage(stripped[6:])


def split_events(buf: bytes) -> list[bytes]:
    """`buf` cut after each blank line: whole SSE events, each with its terminator."""
    out, start = [], 0
    while (end := buf.find(b"\n\n", start)) >= 0:
        out.append(buf[start : end + 2])
        start = end + 2
    if start < len(buf):
        out.append(buf[start:])
    return out


def usage_event_at(events: list[bytes]) -> int | None:
    """Index of the first event that carries a usage object (not `"usage": null`)."""
    for i, event in enumerate(events):
        if _event_json(event)[1] is not None:
            return i
    return None


def events_with_energy(buf: bytes, energy_j: float) -> tuple[bytes, int | None]:
    """The held end of a stream with `usage.energy_j` put into its usage event; also that
    event's prompt_tokens, where it has them."""
    out, prompt = [], None
    for event in split_events(buf):
        doc, usage = _event_json(event)
        if usage is not None:
            prompt = usage_int(usage, "prompt_tokens")
            event = b"data: " + with_energy(doc, usage, energy_j) + b"\n\n"
        out.append(event)
    return b"".join(out), prompt


def tail_energy_j(tail: bytes) -> float | None:
    """`usage.energy_j` of the usage event at the end of a stream (`tail`: its last bytes)."""
    for event in reversed(split_events(tail)):
        _, usage = _event_json(event)
        if usage is not None:
            value = usage.get(FIELD)
            return float(value) if isinstance(value, int | float) else None
    return None
