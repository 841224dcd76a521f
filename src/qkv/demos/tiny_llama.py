"""A small Llama-style HuggingFace directory with random weights, to try qkv's Llama-family
support on without a download (README: "Use a Llama/Qwen checkpoint"):
``python -m qkv.demos.tiny_llama DIR``.

It holds what a downloaded checkpoint holds: config.json (``model_type`` "llama", written by
``qkv.models.to_hf``), model.safetensors, generation_config.json (the stop id), a byte-level
BPE tokenizer.json (400 tokens, as Llama 3 / Qwen tokenize) and tokenizer_config.json with a
ChatML chat template. The weights are random: the text it generates is noise.

Shapes: V = 400 vocab, C = 64 width, H = 4 heads, Hkv = 2 kv heads, F = 172 FFN width,
2 layers.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..models import GPT, GPTConfig, to_hf

__all__ = ["CHATML", "make_tiny_llama"]

#: the chat template written into tokenizer_config.json (Qwen's ChatML, without tools)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_TEXT = ["Attention lets every token look at every other token.",
         "Queries, keys and values are projections of the same sequence.",
         "Rotary positions rotate queries and keys by their position."]


def make_tiny_llama(directory: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the directory (see the module docstring) and return it as a Path; ``seed``
    draws the weights. An existing directory's files of these names are replaced."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_TEXT * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    torch.manual_seed(seed)
    llama = GPT(GPTConfig(vocab_size=tok.get_vocab_size(), max_len=512, dim=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, ffn_hidden=172, activation="swiglu",
                          norm="rmsnorm", positions="rope", rope_base=500000.0, bias=False))
    out = to_hf(llama, directory, token_ids={"eos_token_id": tok.token_to_id("<|im_end|>")})
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>"}), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m qkv.demos.tiny_llama DIR [--seed N]``."""
    p = argparse.ArgumentParser(prog="python -m qkv.demos.tiny_llama", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="where to write the HF directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(argv)
    print(make_tiny_llama(args.directory, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
