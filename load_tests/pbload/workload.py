"""What each simulated user sends: endpoint, streaming, priority, prompt and answer lengths.

Plain Python (no locust), so the test suite can check the distributions in-process. Lengths come
either from the generated ShareGPT-shaped sample (`powerbatch.load.sharegpt`; a real ShareGPT
file via PB_DATASET) or from lognormal draws, the usual fit for chat prompt and answer lengths.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Literal

from powerbatch.load import sharegpt

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
_SEQ = itertools.count()


@dataclass(frozen=True, slots=True)
class Mix:
    chat_fraction: float = 0.75
    stream_fraction: float = 0.8
    priority_mix: Mapping[str, float] = field(
        default_factory=lambda: {"high": 0.2, "normal": 0.6, "low": 0.2}
    )
    lengths: Literal["sharegpt", "lognormal"] = "sharegpt"
    prompt_median: float = 600.0  # lognormal only
    prompt_sigma: float = 0.8
    output_median: float = 180.0
    output_sigma: float = 0.6
    max_prompt_tokens: int = 6_000
    max_output_tokens: int = 1_024

    def with_env(self, environ: Mapping[str, str] = os.environ, *, priority: bool = True) -> Mix:
        """Overrides from PB_PRIORITY_MIX ("high=0.2,normal=0.6,low=0.2"), PB_STREAM_FRACTION,
        PB_CHAT_FRACTION and PB_MAX_OUTPUT_TOKENS, so one locustfile serves many experiments."""
        out = self
        if priority and (mix := environ.get("PB_PRIORITY_MIX")):
            pairs = (item.split("=", 1) for item in mix.split(",") if item.strip())
            out = replace(out, priority_mix={k.strip(): float(v) for k, v in pairs})
        if v := environ.get("PB_STREAM_FRACTION"):
            out = replace(out, stream_fraction=float(v))
        if v := environ.get("PB_CHAT_FRACTION"):
            out = replace(out, chat_fraction=float(v))
        if v := environ.get("PB_MAX_OUTPUT_TOKENS"):
            out = replace(out, max_output_tokens=int(v))
        return out


@dataclass(frozen=True, slots=True)
class Planned:
    path: str
    stream: bool
    priority: str
    prompt_tokens: int
    max_tokens: int
    body: bytes

    @property
    def name(self) -> str:
        """The locust entry name: endpoint and mode, so each has its own latency row."""
        kind = "chat" if self.path == CHAT_PATH else "completions"
        return f"{kind} stream" if self.stream else kind


@cache
def _filler(seed: int) -> str:
    return sharegpt.text_of_tokens(50_000, random.Random(seed))


@cache
def _samples(
    path: str | None, seed: int, max_prompt: int, max_output: int
) -> list[sharegpt.Sample]:
    records = sharegpt.load(path) if path else sharegpt.generate(500, seed)
    out = sharegpt.samples(records, max_prompt_tokens=max_prompt, max_output_tokens=max_output)
    if not out:
        raise ValueError(f"no usable conversations in {path or 'the generated sample'}")
    return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


class Workload:
    """Draws requests for one model. `max_model_len` bounds prompt + answer like the server."""

    def __init__(
        self,
        mix: Mix,
        model: str,
        *,
        max_model_len: int = 8_192,
        seed: int = 0,
        dataset: str | None = None,
    ) -> None:
        self.mix = mix
        self.model = model
        self.max_model_len = max_model_len
        self.seed = seed
        self.dataset = dataset
        self._names = list(mix.priority_mix)
        self._weights = [mix.priority_mix[n] for n in self._names]
        # Leave room for the answer and for the server's chat template.
        self._max_prompt = max(16, min(mix.max_prompt_tokens, max_model_len - 64))

    def _lengths(self, rng: random.Random) -> tuple[list[dict[str, str]], int, int]:
        m = self.mix
        if m.lengths == "sharegpt":
            s = rng.choice(_samples(self.dataset, self.seed, self._max_prompt, m.max_output_tokens))
            return [dict(x) for x in s.messages], s.prompt_tokens, s.output_tokens
        prompt = _lognormal(rng, m.prompt_median, m.prompt_sigma, 8, self._max_prompt)
        output = _lognormal(rng, m.output_median, m.output_sigma, 4, m.max_output_tokens)
        text = _filler(self.seed)
        start = rng.randrange(0, len(text) - prompt * sharegpt.CHARS_PER_TOKEN)
        content = text[start : start + prompt * sharegpt.CHARS_PER_TOKEN]
        return [{"role": "user", "content": content}], prompt, output

    def next(self, rng: random.Random) -> Planned:
        m = self.mix
        messages, prompt, output = self._lengths(rng)
        output = max(1, min(output, self.max_model_len - prompt - 32))
        # A unique tag up front: a reused sample must not hit the server's prefix cache.
        tag = f"#{next(_SEQ)}-{rng.randrange(1 << 30)} "
        messages[0] = {**messages[0], "content": tag + messages[0]["content"]}
        chat = rng.random() < m.chat_fraction
        stream = rng.random() < m.stream_fraction
        priority = rng.choices(self._names, self._weights)[0]
        body: dict[str, object] = {"model": self.model, "max_tokens": output, "stream": stream}
        # Ask for exactly max_tokens so the answer length follows the distribution.
        body["ignore_eos"] = True
        if chat:
            body["messages"] = messages
        else:
            body["prompt"] = "\n".join(x["content"] for x in messages)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return Planned(
            path=CHAT_PATH if chat else COMPLETIONS_PATH,
            stream=stream,
            priority=priority,
            prompt_tokens=prompt,
            max_tokens=output,
            body=json.dumps(body).encode(),
        )
