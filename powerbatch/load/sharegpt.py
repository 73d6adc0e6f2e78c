"""A small ShareGPT-shaped conversation sample, generated deterministically in code.

Load tests need realistic *length distributions* (short prompts with a long tail, answers of a
few hundred tokens, some multi-turn context), not real text. Generating the sample from a seed
means no download, no licence question and the same requests on every machine. The records use
ShareGPT's JSON layout (`{"id", "conversations": [{"from": "human"|"gpt", "value"}]}`), so a real
ShareGPT file can be dropped in with `load(path)` instead. The length parameters are ours.

Token counts are approximate: four characters per token, the simulator's own rule; a real
tokenizer will count common English words at roughly one token each.

    python -m powerbatch.load.sharegpt --n 500 --seed 0 --out sample.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4

_VOCAB = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part model token batch "
    "power watt queue latency server request answer question explain summary code python data "
    "list table memory cache prompt reply please thanks because between under again example"
)
_WORDS = tuple(_VOCAB.split())

# (turn pairs, weight): most ShareGPT conversations are one exchange, some carry context.
_TURNS = ((1, 0.6), (2, 0.25), (3, 0.1), (4, 0.05))
_HUMAN_MEDIAN, _HUMAN_SIGMA, _HUMAN_MAX = 80.0, 1.1, 3_000
_GPT_MEDIAN, _GPT_SIGMA, _GPT_MAX = 220.0, 0.8, 2_000


@dataclass(frozen=True, slots=True)
class Sample:
    """One request taken from a conversation: the history as chat messages, and the answer
    length to ask for (the recorded reply's length, as a benchmark replaying ShareGPT does)."""

    messages: tuple[dict[str, str], ...]
    prompt_tokens: int
    output_tokens: int


def approx_tokens(text: str) -> int:
    return max(1, len(text) // CHARS_PER_TOKEN)


def text_of_tokens(n: int, rng: random.Random) -> str:
    """Plausible filler of about `n` tokens (by `approx_tokens`)."""
    target = max(1, n) * CHARS_PER_TOKEN
    words: list[str] = []
    size = 0
    while size < target:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:target]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def generate(n: int = 500, seed: int = 0) -> list[dict[str, Any]]:
    """`n` ShareGPT-format records; the same (n, seed) always gives the same records."""
    rng = random.Random(seed)
    turns = [t for t, _ in _TURNS]
    weights = [w for _, w in _TURNS]
    out: list[dict[str, Any]] = []
    for i in range(n):
        conv: list[dict[str, str]] = []
        for _ in range(rng.choices(turns, weights)[0]):
            human = _lognormal_int(rng, _HUMAN_MEDIAN, _HUMAN_SIGMA, 4, _HUMAN_MAX)
            gpt = _lognormal_int(rng, _GPT_MEDIAN, _GPT_SIGMA, 8, _GPT_MAX)
            conv.append({"from": "human", "value": text_of_tokens(human, rng)})
            conv.append({"from": "gpt", "value": text_of_tokens(gpt, rng)})
        out.append({"id": f"pb-{seed}-{i}", "conversations": conv})
    return out


def load(path: str | Path) -> list[dict[str, Any]]:
    """Records from a ShareGPT-format JSON file (a list of {"conversations": [...]})."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    return data


def samples(
    records: Sequence[dict[str, Any]],
    *,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[Sample]:
    """One Sample per record: every turn before the last answer is the prompt.

    Records without a human turn followed by an answer are skipped; so are those whose prompt is
    over `max_prompt_tokens` (dropped, not truncated, so the length distribution keeps its shape
    below the cap). Output lengths are clipped to `max_output_tokens`.
    """
    out: list[Sample] = []
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    for rec in records:
        conv = [
            (roles.get(str(t.get("from")), ""), str(t.get("value", "")))
            for t in rec.get("conversations", [])
            if isinstance(t, dict)
        ]
        last = max((i for i, (r, _) in enumerate(conv) if r == "assistant"), default=-1)
        if last < 1 or conv[last - 1][0] != "user":
            continue
        history = tuple({"role": r, "content": v} for r, v in conv[:last] if r)
        prompt = sum(approx_tokens(m["content"]) for m in history)
        output = approx_tokens(conv[last][1])
        if max_prompt_tokens is not None and prompt > max_prompt_tokens:
            continue
        if max_output_tokens is not None:
            output = min(output, max_output_tokens)
        out.append(Sample(history, prompt, output))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the generated ShareGPT-shaped sample as JSON")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    Path(a.out).write_text(json.dumps(generate(a.n, a.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
