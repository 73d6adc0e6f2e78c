"""Read an OpenAI-style SSE stream as it arrives and note what a user would see.

Fed raw bytes chunk by chunk with the time each arrived, so time to first token is the arrival of
the first chunk holding a non-empty content delta (the role-only first event of a chat stream
does not count, as it carries no token).
"""

from __future__ import annotations

import json
from typing import Any


class StreamMeter:
    def __init__(self) -> None:
        self.first_token_s: float | None = None
        self.content_events = 0
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self.done = False
        self.bytes = 0
        self._buf = b""

    @property
    def output_tokens(self) -> int:
        """From the usage event when the server sent one; else one token per content event."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_events

    def feed(self, chunk: bytes, now_s: float) -> None:
        self.bytes += len(chunk)
        buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        for event in events:
            self._event(event, now_s)

    def _event(self, event: bytes, now_s: float) -> None:
        data = b"\n".join(
            line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            return
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj: Any = json.loads(data)
        except ValueError:
            self.error = "malformed SSE event"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message") if isinstance(err, dict) else err)[:200]
            return
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        for choice in obj.get("choices") or ():
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                self.content_events += 1
                if self.first_token_s is None:
                    self.first_token_s = now_s
