"""Build a tiny, randomly initialised Llama model and tokenizer in a folder, with no hub access.

vLLM needs a real checkpoint to serve; this one loads in a second on a CPU. A word-level tokenizer
over the words ``w0 .. wN`` makes prompt lengths exact: ``"w1 w2 w3"`` is three tokens (plus BOS),
so tests can assert on token counts. Sampled text from random weights is junk by design.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")


def build(out: Path, *, vocab_words: int = 500, layers: int = 4, hidden: int = 512) -> None:
    """Big enough that the engine's step, not the HTTP clients, is the bottleneck on 2 cores."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(vocab_words):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    # A plain template so /v1/chat/completions works too; content is whitespace-joined words.
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)

    head_dim = 32
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,  # head size 32: the CPU attention backend supports it
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=hidden // head_dim,
        head_dim=head_dim,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "powerbatch-tiny.json").write_text(json.dumps({"vocab_words": vocab_words}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    build(a.out, hidden=a.hidden, layers=a.layers)
    print(f"tiny llama written to {a.out}")


if __name__ == "__main__":
    main()
