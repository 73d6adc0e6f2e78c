"""Just enough of a request to decide on it: streaming or not, and a KV-token estimate.

The body is forwarded byte for byte; this only reads it. Prompt tokens are estimated from the
text length (about 4 characters a token for English BPE tokenizers): the decision needs a size,
not a tokenizer, and a tokenizer per model would put milliseconds on the hot path.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec

from powerbatch.errors import RequestError

CHARS_PER_TOKEN = 4
P = ParamSpec("P")


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
    requests: int = 1  # how many the upstream runs it as (a batch's conversations, windows)

    @property
    def kv_tokens(self) -> int:
        """What the request may hold in the KV cache at its end (all of its parts)."""
        return self.prompt_tokens + self.requests * self.max_tokens


_CHAT_KEYS = ("content", "text")
# Responses input items (openai-python types/responses): messages (content, input_text parts),
# function_call (arguments), function_call_output (output).
_RESPONSES_KEYS = ("content", "text", "arguments", "output")
# Anthropic content blocks: text, tool_result (content), tool_use (input), thinking.
_ANTHROPIC_KEYS = ("content", "text", "input", "thinking")


def _text_len(value: Any, keys: tuple[str, ...] = _CHAT_KEYS) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_len(v, keys) for v in value)
    if isinstance(value, dict):
        # chat content parts: {"type": "text", "text": ...}; other parts count by their text
        return sum(_text_len(v, keys) for k, v in value.items() if k in keys)
    return 0


def _stream_flag(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    return stream


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


def _guarded(parse: Callable[P, RequestInfo]) -> Callable[P, RequestInfo]:
    """`parse` with content nested deeper than any real message answered as a 400."""

    @functools.wraps(parse)
    def run(*args: P.args, **kwargs: P.kwargs) -> RequestInfo:
        try:
            return parse(*args, **kwargs)
        except RecursionError as exc:
            raise BadRequest("request body is nested too deeply") from exc

    return run


def _info(
    body: dict[str, Any], stream: bool, chars: int, max_tokens: int, *, include_usage: bool = False
) -> RequestInfo:
    """A JSON request's info, its prompt estimated from `chars` of text (at least one token).
    A `max_tokens` read by _positive_int is None or at least 1, so callers default it with `or`."""
    return RequestInfo(
        stream=stream,
        prompt_tokens=max(1, chars // CHARS_PER_TOKEN),
        max_tokens=max_tokens,
        model=body.get("model", ""),
        include_usage=include_usage,
    )


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


@_guarded
def parse_request(
    raw: bytes, *, chat: bool, default_max_tokens: int, max_tokens_limit: int
) -> RequestInfo:
    """Validate the fields a decision needs; raise BadRequest with an OpenAI-style param."""
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
    usage = isinstance(options, dict) and options.get("include_usage") is True
    return _info(body, stream, chars, max_tokens or default_max_tokens, include_usage=usage)


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


@_guarded
def parse_pooling_request(raw: bytes) -> RequestInfo:
    """A prefill-only request (embeddings, pooling, classify, score, rerank) sized by its input.

    Nothing is decoded, so max_tokens is 0 and the KV estimate is the prompt alone. A scorer
    runs the query once per document (vLLM pairs each query with each document for a
    cross-encoder), so one query against N documents costs N queries' worth of prefill.
    """
    body = _json_object(raw)
    chars = sum(_input_len(body.get(k)) for k in _POOLING_SINGLE)
    docs = [body[k] for k in _POOLING_DOCS if k in body]
    for k in _POOLING_QUERY:
        if k in body:
            query = body[k]
            pairs = max((_items(d) for d in docs), default=1)
            per_query = 1 if _items(query) > 1 else pairs
            chars += per_query * _input_len(query)
    chars += sum(_input_len(d) for d in docs)
    return _info(body, False, chars, 0)


@_guarded
def parse_responses_request(
    raw: bytes, *, default_max_tokens: int, max_tokens_limit: int
) -> RequestInfo:
    """`/v1/responses` (vllm/entrypoints/openai/responses/protocol.py, ResponsesRequest):
    `input` (text or items) and `instructions`, `max_output_tokens`, `stream`.

    `background: true` is refused: vLLM answers at once and generates afterwards, where no
    slot can hold it. A `previous_response_id`'s stored turns are not in the body, so the
    prompt of a chained response is undercounted by them (the KV estimate still holds the
    output).
    """
    body = _json_object(raw)
    stream = _stream_flag(body)
    if body.get("background") is True:
        raise BadRequest(
            "background responses generate after the answer, outside admission; powerbatch "
            "serves only foreground ones",
            "background",
        )
    value = body.get("input")
    if not isinstance(value, (str, list)) or not value:
        raise BadRequest("input must be a string or a non-empty array", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    chars = _text_len(value, _RESPONSES_KEYS) + len(instructions or "")
    max_tokens = _positive_int(body, "max_output_tokens", max_tokens_limit)
    return _info(body, stream, chars, max_tokens or default_max_tokens)


@_guarded
def parse_messages_request(raw: bytes, *, max_tokens_limit: int) -> RequestInfo:
    """`/v1/messages`, Anthropic's Messages API as vLLM serves it (anthropic/protocol.py,
    AnthropicMessagesRequest): `messages`, `system`, a required `max_tokens`, `stream`."""
    body = _json_object(raw)
    stream = _stream_flag(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRequest("each message must be an object", "messages")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise BadRequest("system must be a string or an array of content blocks", "system")
    max_tokens = _positive_int(body, "max_tokens", max_tokens_limit)
    if max_tokens is None:
        raise BadRequest("max_tokens is required", "max_tokens")
    chars = _text_len(messages, _ANTHROPIC_KEYS) + _text_len(system, _ANTHROPIC_KEYS)
    return _info(body, stream, chars, max_tokens)


@_guarded
def parse_chat_batch_request(
    raw: bytes, *, default_max_tokens: int, max_tokens_limit: int
) -> RequestInfo:
    """`/v1/chat/completions/batch` (openai/chat_completion/protocol.py,
    BatchChatCompletionRequest): `messages` is a list of conversations, each run as its own
    engine request; no streaming. It holds one batch place per conversation."""
    body = _json_object(raw)
    if _stream_flag(body):
        raise BadRequest("the batch route does not stream", "stream")
    convs = body.get("messages")
    if not isinstance(convs, list) or not convs:
        raise BadRequest("messages must be a non-empty array of conversations", "messages")
    for conv in convs:
        if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) for m in conv):
            raise BadRequest("each conversation must be a non-empty array of messages", "messages")
    max_tokens = _positive_int(body, "max_completion_tokens", max_tokens_limit)
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens", max_tokens_limit)
    prompt = sum(max(1, _text_len(conv) // CHARS_PER_TOKEN) for conv in convs)
    return RequestInfo(
        stream=False,
        prompt_tokens=prompt,
        max_tokens=max_tokens or default_max_tokens,
        model=body.get("model", ""),
        requests=len(convs),
    )


# ---- audio (multipart uploads) -----------------------------------------------------------

# Whisper (arXiv 2212.04356, section 2.2) cuts audio into 30-s windows, pads each to 30 s and
# encodes it as 1,500 positions; its decoder holds at most 448 tokens. vLLM cuts a longer
# upload into windows of the model's max_audio_clip_s (30 s for Whisper) and runs each as its
# own engine request (vllm/entrypoints/speech_to_text/base/serving.py).
AUDIO_WINDOW_S = 30.0
AUDIO_TOKENS_PER_WINDOW = 1500
AUDIO_MAX_DECODE_TOKENS = 448
# Compressed audio's duration is not in a header the proxy can read cheaply: it is priced at
# 32 kbit/s, below speech codecs' usual rates (MP3 64-128, Opus 24-64), so a file is counted
# as at least as long as it is.
AUDIO_ASSUMED_BYTES_PER_S = 4000.0
_BOUNDARY = re.compile(r'boundary="?([^";,]+)"?', re.IGNORECASE)
_PART_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)
_TRUE = (b"true", b"1", b"yes", b"on")


def _multipart_fields(raw: bytes, content_type: str) -> tuple[dict[str, bytes], bytes | None, int]:
    """The small form fields, the file part's first 64 bytes and its size, found with
    `bytes.find` over the body (no copy of the upload)."""
    found = _BOUNDARY.search(content_type)
    if not content_type.lower().startswith("multipart/form-data") or found is None:
        raise BadRequest("the body must be multipart/form-data with a boundary", "file")
    delim = b"--" + found.group(1).encode("latin-1")
    fields: dict[str, bytes] = {}
    head: bytes | None = None
    size = 0
    pos = raw.find(delim)
    while pos >= 0:
        start = pos + len(delim)
        if raw[start : start + 2] == b"--":
            break
        hend = raw.find(b"\r\n\r\n", start)
        if hend < 0:
            break
        nxt = raw.find(b"\r\n" + delim, hend + 4)
        end = nxt if nxt >= 0 else len(raw)
        headers = raw[start:hend]
        name = _PART_NAME.search(headers)
        if name is not None:
            key = name.group(1).decode("utf-8", "replace")
            if key == "file":
                head, size = raw[hend + 4 : min(hend + 68, end)], end - hend - 4
            elif end - hend - 4 <= 1024:
                fields[key] = raw[hend + 4 : end]
        pos = nxt + 2 if nxt >= 0 else -1
    return fields, head, size


def audio_duration_s(head: bytes, size: int) -> float:
    """Seconds of audio in an upload: a WAV's from its header (byte rate at offset 28), any
    other format's at AUDIO_ASSUMED_BYTES_PER_S."""
    if len(head) >= 32 and head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        byte_rate = int.from_bytes(head[28:32], "little")
        if byte_rate > 0:
            return max(size - 44, 0) / byte_rate
    return size / AUDIO_ASSUMED_BYTES_PER_S


def parse_audio_request(
    raw: bytes, content_type: str, *, default_max_tokens: int, max_tokens_limit: int
) -> RequestInfo:
    """`/v1/audio/transcriptions` and `/v1/audio/translations` (speech_to_text/*/protocol.py):
    a multipart upload with `file`, `model`, `stream`, `max_completion_tokens`. Sized as
    prefill by the audio's 30-s windows, one batch place per window."""
    fields, head, size = _multipart_fields(raw, content_type)
    if head is None or size <= 0:
        raise BadRequest("file is required", "file")
    windows = max(1, math.ceil(audio_duration_s(head, size) / AUDIO_WINDOW_S))
    stream = fields.get("stream", b"false").strip().lower() in _TRUE
    per_window = min(default_max_tokens, AUDIO_MAX_DECODE_TOKENS)
    text = fields.get("max_completion_tokens")
    if text is not None:
        try:
            asked = int(text.strip())
        except ValueError:
            raise BadRequest(
                "max_completion_tokens must be an integer", "max_completion_tokens"
            ) from None
        if not 1 <= asked <= max_tokens_limit:
            raise BadRequest(
                f"max_completion_tokens must be between 1 and {max_tokens_limit}",
                "max_completion_tokens",
            )
        per_window = min(asked, AUDIO_MAX_DECODE_TOKENS)
    return RequestInfo(
        stream=stream,
        prompt_tokens=windows * AUDIO_TOKENS_PER_WINDOW,
        max_tokens=per_window,
        model=fields.get("model", b"").decode("utf-8", "replace").strip(),
        requests=windows,
    )
