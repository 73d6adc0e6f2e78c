"""OpenAI-style server-sent event streams, as the proxy and the load client read them."""

from __future__ import annotations

import json


def usage_completion_tokens(tail: bytes) -> int | None:
    """completion_tokens from the usage event at the end of a stream (`tail`: its last bytes),
    if the client asked for one (`stream_options.include_usage`); None without a usable one."""
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                usage = json.loads(event[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens")
                return int(tokens) if tokens is not None else None
            except (ValueError, AttributeError, TypeError):
                return None
    return None
