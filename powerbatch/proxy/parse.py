"""Just enough of a request to decide on it: streaming or not, and a KV-token estimate.

The body is forwarded byte for byte; this only reads it. Prompt tokens are estimated from the
text length (about 4 characters a token for English BPE tokenizers): the decision needs a size,
not a tokenizer, and a tokenizer per model would put milliseconds on the hot path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from powerbatch.errors import RequestError

CHARS_PER_TOKEN = 4


class BadRequest(RequestError, ValueError):
    """A request body the proxy cannot serve (400); also a ValueError, as it always was."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestInfo:
    stream: bool
    prompt_tokens: int
    max_tokens: int
    model: str = ""
    include_usage: bool = False  # a stream whose client asked for a final usage chunk

    @property
    def kv_tokens(self) -> int:
        """What the request may hold in the KV cache at its end."""
        return self.prompt_tokens + self.max_tokens


def _text_len(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_len(v) for v in value)
    if isinstance(value, dict):
        # chat content parts: {"type": "text", "text": ...}; other parts count by their text
        return sum(_text_len(v) for k, v in value.items() if k in ("content", "text"))
    return 0


def _positive_int(body: dict[str, Any], key: str, limit: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer", key)
    if value < 1:
        raise BadRequest(f"{key} must be at least 1", key)
    if value > limit:
        raise BadRequest(f"{key} must be at most {limit}", key)
    return value


def parse_request(
    raw: bytes, *, chat: bool, default_max_tokens: int, max_tokens_limit: int
) -> RequestInfo:
    """Validate the fields a decision needs; raise BadRequest with an OpenAI-style param."""
    try:
        return _parse(raw, chat, default_max_tokens, max_tokens_limit)
    except RecursionError as exc:  # content nested deeper than any real message
        raise BadRequest("request body is nested too deeply") from exc


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object with a string `model` (if any), or BadRequest."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also a 5,000-digit number, deep nesting
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if not isinstance(body.get("model", ""), str):
        raise BadRequest("model must be a string", "model")
    return body


def _parse(raw: bytes, chat: bool, default_max_tokens: int, max_tokens_limit: int) -> RequestInfo:
    body = _json_object(raw)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty array", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each message must be an object", "messages")
        chars = _text_len(messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise BadRequest("prompt must be a string or a non-empty array", "prompt")
        if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            chars = CHARS_PER_TOKEN * len(prompt)  # already token ids
        else:
            chars = _text_len(prompt)
    max_tokens = _positive_int(body, "max_completion_tokens", max_tokens_limit)
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens", max_tokens_limit)
    options = body.get("stream_options")
    return RequestInfo(
        stream=stream,
        prompt_tokens=max(1, chars // CHARS_PER_TOKEN),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        model=body.get("model", ""),
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


# Fields that carry a pooling request's input in vLLM's pooling APIs (embeddings, pooling,
# classify, score, rerank, Cohere embed), per https://docs.vllm.ai/en/stable/serving/online_serving.html.
_POOLING_SINGLE = ("input", "messages", "texts", "inputs", "prompt")
_POOLING_QUERY = ("query", "queries", "text_1", "data_1")
_POOLING_DOCS = ("documents", "text_2", "data_2")


def _input_len(value: Any) -> int:
    """Characters of a pooling input: text, chat messages, token ids (one list or several)."""
    if isinstance(value, list) and value and all(isinstance(x, int) for x in value):
        return CHARS_PER_TOKEN * len(value)
    if isinstance(value, list):
        return sum(_input_len(v) for v in value)
    return _text_len(value)


def _items(value: Any) -> int:
    """How many inputs a field holds: a list of texts (or of token lists) is one per item."""
    if isinstance(value, list) and value and not all(isinstance(x, int) for x in value):
        return len(value)
    return 1


def parse_pooling_request(raw: bytes) -> RequestInfo:
    """A prefill-only request (embeddings, pooling, classify, score, rerank) sized by its input.

    Nothing is decoded, so max_tokens is 0 and the KV estimate is the prompt alone. A scorer
    runs the query once per document (vLLM pairs each query with each document for a
    cross-encoder), so one query against N documents costs N queries' worth of prefill.
    """
    body = _json_object(raw)
    try:
        chars = sum(_input_len(body.get(k)) for k in _POOLING_SINGLE)
        docs = [body[k] for k in _POOLING_DOCS if k in body]
        for k in _POOLING_QUERY:
            if k in body:
                query = body[k]
                pairs = max((_items(d) for d in docs), default=1)
                per_query = 1 if _items(query) > 1 else pairs
                chars += per_query * _input_len(query)
        chars += sum(_input_len(d) for d in docs)
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
    return RequestInfo(
        stream=False,
        prompt_tokens=max(1, chars // CHARS_PER_TOKEN),
        max_tokens=0,
        model=body.get("model", ""),
    )
