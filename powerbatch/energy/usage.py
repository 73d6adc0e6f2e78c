"""Putting a request's joules into the OpenAI `usage` object it is answered with.

The field is `energy_j` beside `prompt_tokens` and `completion_tokens`: clients read it from
`usage` (the openai SDK keeps unknown fields: `completion.usage.model_extra["energy_j"]`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

FIELD = "energy_j"
HEADER = "x-powerbatch-energy-j"


def json_usage(body: bytes) -> tuple[Any, dict[str, Any] | None]:
    """(the parsed answer, its usage object or None); (None, None) when it is not JSON.

    Where the bytes show the top-level usage object plainly (the last `"usage"` key, its
    object then only the answer's closing brace), only that object is parsed and the answer
    comes back as None: the rest is the upstream's text (kilobytes of it), which the proxy
    relays without reading, so it is not checked to be JSON either.
    """
    m = _usage_open(body)
    if m is not None and body.lstrip()[:1] == b"{":
        try:
            text = body[m.start(1) :].decode()
            usage, end = _DECODER.raw_decode(text)
        except (ValueError, RecursionError):
            pass
        else:  # the usage object, then only the answer's closing brace: it is the top one
            if isinstance(usage, dict) and text[end:].strip(_WS) == "}":
                return None, usage
    return _parsed_usage(body)


def _parsed_usage(body: bytes) -> tuple[Any, dict[str, Any] | None]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or compressed (the proxy relays as is)
        return None, None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return doc, usage if isinstance(usage, dict) else None


def usage_int(usage: dict[str, Any] | None, key: str) -> int | None:
    value = usage.get(key) if usage is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def with_energy(raw: bytes, doc: Any, usage: dict[str, Any], energy_j: float) -> bytes:
    """The answer `raw` (as `json_usage` gave it: `doc`, its top-level usage object: `usage`)
    with `usage.energy_j` set: spliced into the bytes where they show that object plainly, else
    the answer serialised again."""
    value = round(energy_j, 6)
    if FIELD not in usage and math.isfinite(value):
        out = _spliced(raw, repr(value).encode(), top=doc is None)  # a float's JSON: its repr
        if out is not None:
            return out
    if doc is None:  # only the usage object was read: the whole answer is needed now
        doc, usage_read = _parsed_usage(raw)
        if usage_read is None:  # the rest of it is no JSON: relayed as it came
            return raw
        usage = usage_read
    usage[FIELD] = value
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


_DECODER = json.JSONDecoder()
_WS = " \t\r\n"  # JSON's whitespace
_USAGE_OPEN = re.compile(rb'"usage"\s*:\s*(\{)\s*')
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _usage_open(raw: bytes) -> re.Match[bytes] | None:
    """The last `"usage": {` in the bytes where it is a key (after `{` or `,`), not text inside
    a string (a quote there would be escaped); None where there is none."""
    at = raw.rfind(b'"usage"')
    m = _USAGE_OPEN.match(raw, at) if at >= 0 else None
    if m is None:
        return None
    before = at - 1
    while before >= 0 and raw[before] in b" \t\r\n":
        before -= 1
    return m if before >= 0 and raw[before] in b"{," else None


def _spliced(raw: bytes, value: bytes, *, top: bool = False) -> bytes | None:
    """`raw` with `"energy_j":value` first in its top-level usage object; None where that
    object is not the last `"usage"` key in the bytes, so it cannot be told apart by the bytes.
    `top`: `json_usage` has already read that object off these bytes as the top one.

    A `"usage"` key after `{` or `,` is no text inside a string (a quote there would be
    escaped). What follows the object's `{`, strings taken out (their brackets are text),
    must close exactly two levels, the usage object and the answer: then it is the top one.
    """
    m = _usage_open(raw)
    if m is None:
        return None
    rest = raw[m.end() :].rstrip()
    if not top:
        if not rest.endswith(b"}"):
            return None
        # Brackets inside strings would count: take the strings out where it matters (slower,
        # rare in usage). Without an opening one in `rest`, one in a string could only add
        # to 2.
        plain = b"{" not in rest and b"[" not in rest and _closes(rest) == 2
        if not plain and _closes(_STRING.sub(b"", rest)) != 2:
            return None
    sep = b"" if rest.startswith(b"}") else b","
    return b"".join((raw[: m.end()], b'"' + FIELD.encode() + b'":', value, sep, raw[m.end() :]))


def _closes(b: bytes) -> int:
    return b.count(b"}") + b.count(b"]") - b.count(b"{") - b.count(b"[")


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
            data = event.strip()[6:]
            event = b"data: " + with_energy(data, doc, usage, energy_j) + b"\n\n"
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
