"""How each API family the proxy admits answers: its error shape and its stream's events.

Three families reach vLLM's generating routes (vllm/entrypoints/, v0.33.0):

* OpenAI's chat and completions shape (chat, completions, the chat batch, audio, pooling):
  errors `{"error": {message, type, param, code}}`, streams of `data:` events ending `[DONE]`,
  one event per token group;
* OpenAI's Responses API (`/v1/responses`): the same error body, but a stream of named events
  (`event: response.output_text.delta`, ...) that ends at `response.completed` with no
  `[DONE]`, and an `error` event (`{"type": "error", code, message, param, sequence_number}`,
  openai-python's ResponseErrorEvent) for a failure mid-stream;
* Anthropic's Messages API (`/v1/messages`, vllm/entrypoints/anthropic/): errors
  `{"type": "error", "error": {"type", "message"}}` with Anthropic's type names
  (`rate_limit_error`, `overloaded_error`, ...), streams of named events
  (`content_block_delta`, ...) that end at `message_stop`.

The relay counts a stream's tokens from its event names with one `bytes.count` per chunk and
reads the final count from the last bytes; nothing here parses a whole answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from aiohttp import web

from powerbatch.sse import usage_completion_tokens

_OUTPUT_TOKENS = re.compile(rb'"output_tokens":\s*(\d+)')
_INPUT_TOKENS = re.compile(rb'"input_tokens":\s*(\d+)')

# OpenAI's error types by status: {"error": {"message", "type", "param", "code"}}.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}
# Anthropic's error types by status, as vLLM maps them (anthropic/protocol.py,
# _ANTHROPIC_ERROR_TYPE_BY_STATUS) after https://docs.anthropic.com/en/api/errors.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def _last_int(pattern: re.Pattern[bytes], buf: bytes) -> int | None:
    found = None
    for found in pattern.finditer(buf):  # noqa: B007 - the last match is the one
        pass
    return int(found.group(1)) if found is not None else None


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API family's answers. `token_marker` counts a stream's token events; `overhead`
    is how many events of a stream carry no token, for when no final usage is seen."""

    name: str
    token_marker: bytes = b"data: "
    overhead: int = 2  # OpenAI: the role event and [DONE]
    openai_usage: bool = True  # usage is OpenAI's (prompt_/completion_tokens), energy_j goes in

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, object]:
        if self.name == "anthropic":
            kind = _ANTHROPIC_TYPES.get(
                status, "api_error" if status >= 500 else "invalid_request_error"
            )
            return {"type": "error", "error": {"type": kind, "message": message}}
        kind = _OPENAI_TYPES.get(status, "server_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def error(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> web.Response:
        """A refusal or failure as a JSON answer in this family's shape, with Retry-After where
        the client should wait."""
        body = self.error_body(status, message, code=code, param=param)
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        return web.json_response(body, status=status, headers=headers)

    def stream_error(self, status: int, message: str, code: str, events: int) -> bytes:
        """The end of a stream that failed under way: an error event, then the terminator the
        family's clients wait for. `events`: how many the stream had (the Responses API
        numbers its events from 0)."""
        if self.name == "responses":
            event = {
                "type": "error",
                "code": code,
                "message": message,
                "param": None,
                "sequence_number": events,
            }
            return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
        if self.name == "anthropic":
            body = json.dumps(self.error_body(status, message)).encode()
            return b"event: error\ndata: " + body + b"\n\n"
        body = json.dumps(self.error_body(status, message, code=code)).encode()
        return b"data: " + body + b"\n\ndata: [DONE]\n\n"

    def tokens_in(self, out: bytes) -> int:
        """Token events in `out` (whole events): one per OpenAI `data:` event, one per delta
        event of the named-event families."""
        return out.count(self.token_marker)

    def final_tokens(self, tail: bytes) -> int | None:
        """Output tokens from the usage at a stream's end (`tail`: its last bytes)."""
        if self.openai_usage:
            return usage_completion_tokens(tail)
        return _last_int(_OUTPUT_TOKENS, tail)

    def final_prompt_tokens(self, tail: bytes) -> int | None:
        return None if self.openai_usage else _last_int(_INPUT_TOKENS, tail)


OPENAI = Dialect("openai")
# Token events: response.output_text.delta, response.reasoning_text.delta,
# response.function_call_arguments.delta (openai/responses/streaming_events.py); overhead:
# created, in_progress, output_item.added/done, content_part.added/done, output_text.done,
# completed.
RESPONSES = Dialect("responses", token_marker=b".delta\n", overhead=0, openai_usage=False)
# Token events: content_block_delta (text, thinking, input_json); the rest (message_start,
# content_block_start/stop, message_delta, message_stop, ping) carry none.
ANTHROPIC = Dialect(
    "anthropic", token_marker=b"event: content_block_delta", overhead=0, openai_usage=False
)
