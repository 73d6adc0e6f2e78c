"""Locust users that speak the OpenAI API, and the LLM metrics they report.

Each user is closed-loop: one request at a time, then an exponential think time (PB_THINK_S,
default 1 s), so the offered load follows the user count the profile's shape sets.

Besides one HTTP entry per endpoint and mode ("chat stream", "completions", ...; its time is the
whole request, not just the headers), each answered request fires custom entries whose "response
time" column holds the figure named by the type, per priority class:

  TTFT     time to the first content token, ms (streamed requests)
  TPOT     time per output token after the first, ms (streamed, 2+ tokens)
  E2E      end-to-end latency, ms
  TOK/S    output tokens per second over the whole request (tokens/s, not ms); its
           "average content size" column is the mean number of output tokens
  REJECTED one entry per answer with status 429 or 503, named "<status> <class>"; its time is
           how long the rejection took. Rejections are also failures of the HTTP entry.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any, ClassVar

import requests
from locust import User, events, task
from locust.env import Environment

from pbload.server import auth_headers, discover
from pbload.sse import StreamMeter
from pbload.workload import Mix, Workload

READ_TIMEOUT_S = float(os.environ.get("PB_READ_TIMEOUT_S", "300"))
_SERVER: dict[str, Any] = {}


class HTTPStatusError(Exception):
    """A non-200 answer; the message is the status and error code, so locust groups them."""


def _discover(environment: Environment, **_: Any) -> None:
    """Ask the server (through the proxy, which passes /v1/models on) for the model name and
    context length, unless PB_MODEL / PB_MAX_MODEL_LEN name them."""
    model, max_len = discover(environment.host or "")
    _SERVER["model"] = model
    _SERVER["max_model_len"] = max_len


events.test_start.add_listener(_discover)  # type: ignore[no-untyped-call]


class OpenAIUser(User):
    abstract = True
    mix: ClassVar[Mix] = Mix()
    think_s: ClassVar[float] = float(os.environ.get("PB_THINK_S", "1.0"))
    env_priority: ClassVar[bool] = True  # False where the class is its priority

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        seed = int(os.environ.get("PB_SEED", "0"))
        self.rng = random.Random(f"{seed}-{type(self).__name__}-{id(self)}")
        self.session = requests.Session()
        self.session.trust_env = False
        self.auth = auth_headers()
        self._workload: Workload | None = None

    def wait_time(self) -> float:
        return self.rng.expovariate(1.0 / self.think_s) if self.think_s > 0 else 0.0

    @property
    def workload(self) -> Workload:
        if self._workload is None:
            self._workload = Workload(
                self.mix.with_env(priority=self.env_priority),
                _SERVER.get("model", "default"),
                max_model_len=_SERVER.get("max_model_len", 8192),
                seed=int(os.environ.get("PB_SEED", "0")),
                dataset=os.environ.get("PB_DATASET") or None,
            )
        return self._workload

    def on_stop(self) -> None:
        self.session.close()

    @task
    def completion(self) -> None:
        p = self.workload.next(self.rng)
        url = (self.host or "").rstrip("/") + p.path
        headers = {"Content-Type": "application/json", "x-priority": p.priority, **self.auth}
        start_wall = time.time()
        t0 = time.perf_counter()
        exc: Exception | None = None
        length = 0
        ttft_s: float | None = None
        tokens = 0
        status = 0
        try:
            with self.session.post(
                url, data=p.body, headers=headers, stream=True, timeout=(10, READ_TIMEOUT_S)
            ) as resp:
                status = resp.status_code
                if status != 200:
                    body = resp.content
                    length = len(body)
                    exc = HTTPStatusError(f"HTTP {status} {_error_code(body)}")
                elif p.stream:
                    meter = StreamMeter()
                    for chunk in resp.iter_content(chunk_size=None):
                        meter.feed(chunk, time.perf_counter())
                    length = meter.bytes
                    if meter.error:
                        exc = HTTPStatusError(f"error event: {meter.error}")
                    elif not meter.done:
                        exc = HTTPStatusError("stream ended without [DONE]")
                    ttft_s = None if meter.first_token_s is None else meter.first_token_s - t0
                    tokens = meter.output_tokens
                else:
                    body = resp.content
                    length = len(body)
                    tokens = int(json.loads(body)["usage"]["completion_tokens"])
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            exc = e
        e2e_s = time.perf_counter() - t0
        fire = self.environment.events.request.fire
        ctx = {"priority": p.priority, "prompt_tokens": p.prompt_tokens}
        fire(
            request_type="POST",
            name=p.name,
            response_time=e2e_s * 1000,
            response_length=length,
            exception=exc,
            context=ctx,
            start_time=start_wall,
            url=url,
        )
        if status in (429, 503):
            _metric(fire, "REJECTED", f"{status} {p.priority}", e2e_s * 1000, 0, start_wall)
        if exc is not None:
            return
        _metric(fire, "E2E", p.priority, e2e_s * 1000, tokens, start_wall)
        if e2e_s > 0 and tokens:
            _metric(fire, "TOK/S", p.priority, tokens / e2e_s, tokens, start_wall)
        if ttft_s is not None:
            _metric(fire, "TTFT", p.priority, ttft_s * 1000, 0, start_wall)
            if tokens >= 2 and e2e_s > ttft_s:
                tpot_ms = (e2e_s - ttft_s) * 1000 / (tokens - 1)
                _metric(fire, "TPOT", p.priority, tpot_ms, 0, start_wall)


def _metric(fire: Any, kind: str, name: str, value: float, length: int, start: float) -> None:
    fire(
        request_type=kind,
        name=name,
        response_time=value,
        response_length=length,
        exception=None,
        context={},
        start_time=start,
    )


def _error_code(body: bytes) -> str:
    try:
        err = json.loads(body).get("error") or {}
        return str(err.get("code") or err.get("type") or "")
    except (ValueError, AttributeError):
        return ""


class ChatUser(OpenAIUser):
    """Mostly streamed chat; lengths from the ShareGPT-shaped sample; the default class mix."""

    weight = 3
    mix = Mix(chat_fraction=1.0, stream_fraction=0.85)


class CompletionUser(OpenAIUser):
    """Legacy /v1/completions with lognormal lengths, half streamed."""

    weight = 1
    mix = Mix(chat_fraction=0.0, stream_fraction=0.5, lengths="lognormal")


class LongContextUser(OpenAIUser):
    """Long prompts (lognormal around 3,000 tokens, capped below the context length) and short
    answers: prefill-heavy load, where KV cache and prompt pacing bind, not the batch size."""

    mix = Mix(
        chat_fraction=0.75,
        stream_fraction=0.8,
        lengths="lognormal",
        prompt_median=3_000,
        prompt_sigma=0.5,
        output_median=150,
        output_sigma=0.6,
        max_prompt_tokens=7_500,
        max_output_tokens=512,
    )


class InteractiveUser(OpenAIUser):
    """x-priority: high. Short streamed chats with a short think time."""

    env_priority = False
    weight = 3
    think_s = 0.5
    mix = Mix(chat_fraction=1.0, stream_fraction=1.0, priority_mix={"high": 1.0})


class StandardUser(OpenAIUser):
    """x-priority: normal. The default chat mix."""

    env_priority = False
    weight = 2
    mix = Mix(chat_fraction=0.8, stream_fraction=0.7, priority_mix={"normal": 1.0})


class BatchUser(OpenAIUser):
    """x-priority: low. Non-streamed completions with long answers and no think time: the
    deferrable work that should yield to the interactive classes under the ceiling."""

    env_priority = False
    weight = 1
    think_s = 0.0
    mix = Mix(
        chat_fraction=0.2,
        stream_fraction=0.0,
        priority_mix={"low": 1.0},
        lengths="lognormal",
        prompt_median=800,
        output_median=400,
        output_sigma=0.4,
    )
