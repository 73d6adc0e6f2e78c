"""powerbatch.sse: the usage event in a stream's tail, read by the proxy and the load client."""

from __future__ import annotations

from powerbatch.sse import usage_completion_tokens


def test_usage_event_in_the_tail() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}'
    tail = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' + usage + b"\n\ndata: [DONE]\n\n"
    assert usage_completion_tokens(tail) == 7
    assert usage_completion_tokens(tail[-20:]) is None  # cut off: no usage event
    assert usage_completion_tokens(b'data: {"usage": null}\n\n') is None
    assert usage_completion_tokens(b'data: {"usage": {"completion_tokens": "x"}}\n\n') is None
    assert usage_completion_tokens(b'data: {"usage": {broken\n\n') is None
