"""A small Marian (opus-mt) HuggingFace directory with random weights, to try qkv's
encoder-decoder checkpoint support on without a download (README: "Translate with a Marian or
T5 checkpoint"): ``python -m qkv.demos.tiny_marian DIR``.

It holds what a downloaded ``Helsinki-NLP/opus-mt-en-zh`` holds, written here without
transformers:

- config.json: a ``MarianConfig`` (``model_type`` "marian", shared source / target table,
  sinusoidal positions, ``decoder_start_token_id`` = pad, as opus-mt);
- model.safetensors: the tensors under the names ``MarianMTModel.save_pretrained`` writes
  (``model.shared.weight``, ``final_logits_bias``, each layer's q/k/v/out projections, norms
  and FFN), random;
- source.spm (English) and target.spm (Chinese): SentencePiece unigram models trained on the
  bundled ``PAIRS``; vocab.json: ``</s>`` 0, ``<unk>`` 1, the source pieces, the target
  pieces the source lacks, ``<pad>`` last (opus-mt's order); tokenizer_config.json;
- generation_config.json: opus-mt's decoding settings (4 beams, ``bad_words_ids`` [[pad]],
  ``forced_eos_token_id``, ``renormalize_logits``), ``max_length`` 24.

``--pairs FILE`` also writes ``PAIRS`` as a TSV file to fine-tune on (``write_pairs``).

The weights are random: its translations are noise, but they are what transformers'
``MarianMTModel.generate`` outputs for the same directory (tests/demos/test_tiny_marian.py).

Shapes: V vocab (``len(vocab.json)``, ~300), C = 64 width, H = 4 heads, F = 128 FFN width,
2 encoder + 2 decoder layers, P = 64 positions.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..files import CONFIG_NAME, WEIGHTS_NAME, atomic_write

__all__ = ["PAIRS", "make_tiny_marian", "marian_config", "marian_state", "write_pairs"]

#: English / Chinese sentence pairs: the SentencePiece models' training text (and a tiny
#: parallel corpus to fine-tune on)
PAIRS = (
    ("Attention lets every token look at every other token.",
     "注意力让每个词元都能看到其他所有词元。"),
    ("Queries, keys and values are projections of the same sequence.",
     "查询、键和值是同一序列的投影。"),
    ("The encoder reads the source sentence.", "编码器读取源句子。"),
    ("The decoder writes the translation one token at a time.", "解码器一次写出译文的一个词元。"),
    ("Cross-attention connects the decoder to the encoder.",
     "交叉注意力把解码器和编码器连接起来。"),
    ("Each head learns a different pattern.", "每个注意力头学习不同的模式。"),
    ("The model was trained on many sentences.", "这个模型在许多句子上训练过。"),
    ("Beam search keeps the best four hypotheses.", "束搜索保留最好的四个假设。"),
    ("Good morning, how are you today?", "早上好，你今天好吗？"),
    ("I would like a cup of tea, please.", "请给我一杯茶。"),
    ("The weather is very nice this afternoon.", "今天下午天气很好。"),
    ("She is reading a book in the library.", "她正在图书馆里看书。"),
    ("We will meet at the station at eight.", "我们八点在车站见面。"),
    ("This city has a long history.", "这座城市有悠久的历史。"),
    ("He wrote a letter to his old friend.", "他给老朋友写了一封信。"),
    ("The children are playing in the park.", "孩子们在公园里玩。"),
    ("Please close the window before you leave.", "离开之前请关上窗户。"),
    ("The train to Shanghai leaves at noon.", "去上海的火车中午出发。"),
    ("My brother works at a small hospital.", "我哥哥在一家小医院工作。"),
    ("Learning a new language takes time.", "学习一门新语言需要时间。"),
    ("The restaurant opens at six in the evening.", "这家餐馆晚上六点开门。"),
    ("Thank you very much for your help.", "非常感谢你的帮助。"),
    ("The river flows through the old town.", "这条河流过老城。"),
    ("Where is the nearest bookshop?", "最近的书店在哪里？"),
)

#: the opus-mt-style settings of generation_config.json (ids filled in by the writer)
_GENERATION = {"num_beams": 4, "max_length": 24, "renormalize_logits": True}
_SIZES = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
          "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
          "decoder_ffn_dim": 128, "max_position_embeddings": 64}


def _train_spm(lines: list[str], vocab_size: int) -> bytes:
    """A SentencePiece unigram model (serialized) of at most ``vocab_size`` pieces trained on
    ``lines``: every character kept (``character_coverage`` 1), ``<unk>`` 0, ``</s>`` 1, no
    ``<s>``, one thread (the same bytes on every run)."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, num_threads=1, minloglevel=2)
    return out.getvalue()


def _pieces(model: bytes) -> list[str]:
    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_proto=model)
    return [spm.id_to_piece(i) for i in range(spm.get_piece_size())
            if not (spm.is_control(i) or spm.is_unknown(i))]


def marian_config(vocab_size: int) -> dict:
    """The config.json of a tiny ``MarianConfig`` with ``vocab_size`` ids (pad = the last)."""
    pad = vocab_size - 1
    return {"model_type": "marian", "architectures": ["MarianMTModel"],
            "vocab_size": vocab_size, **_SIZES, "activation_function": "swish",
            "scale_embedding": True, "share_encoder_decoder_embeddings": True,
            "tie_word_embeddings": True, "dropout": 0.1, "attention_dropout": 0.0,
            "activation_dropout": 0.1, "pad_token_id": pad, "decoder_start_token_id": pad,
            "eos_token_id": 0, "forced_eos_token_id": 0, "bos_token_id": 0,
            "is_encoder_decoder": True, "torch_dtype": "float32"}


def marian_state(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights (fp32) under ``MarianMTModel``'s names for ``config``: matrices
    (out, in) N(0, 1/in), the token table (V, C) N(0, 1/C) (scaled by √C when read:
    unit-variance embeddings), biases N(0, 0.1²), LayerNorm weights 1 + N(0, 0.1²) and
    biases N(0, 0.1²), ``final_logits_bias`` (1, V) zeros. The sinusoid tables are not
    stored (transformers 5 computes them)."""
    c, v, f = config["d_model"], config["vocab_size"], config["encoder_ffn_dim"]

    def draw(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(*shape, generator=generator)

    state = {"model.shared.weight": draw(v, c, std=1 / math.sqrt(c)),
             "final_logits_bias": torch.zeros(1, v)}

    def linear(name: str, rows: int, cols: int) -> None:
        state[f"{name}.weight"] = draw(rows, cols, std=1 / math.sqrt(cols))  # (out, in)
        state[f"{name}.bias"] = draw(rows, std=0.1)

    def norm(name: str) -> None:
        state[f"{name}.weight"], state[f"{name}.bias"] = draw(c, std=0.1, mean=1.0), draw(
            c, std=0.1)

    def attention(name: str) -> None:
        for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{name}.{p}", c, c)

    for stack in ("encoder", "decoder"):
        for i in range(config[f"{stack}_layers"]):
            layer = f"model.{stack}.layers.{i}"
            attention(f"{layer}.self_attn")
            norm(f"{layer}.self_attn_layer_norm")
            if stack == "decoder":
                attention(f"{layer}.encoder_attn")
                norm(f"{layer}.encoder_attn_layer_norm")
            linear(f"{layer}.fc1", f, c)
            linear(f"{layer}.fc2", c, f)
            norm(f"{layer}.final_layer_norm")
    return state


def _write_json(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def make_tiny_marian(directory: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the directory (see the module docstring) and return it as a Path; ``seed``
    draws the weights (the tokenizer is the same for every seed). An existing directory's
    files of these names are replaced."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    source = _train_spm([en for en, _ in PAIRS], 160)
    target = _train_spm([zh for _, zh in PAIRS], 240)
    names = ["</s>", "<unk>"]
    for piece in (*_pieces(source), *_pieces(target)):
        if piece not in names:
            names.append(piece)
    names.append("<pad>")
    vocab = {piece: i for i, piece in enumerate(names)}
    config = marian_config(len(vocab))
    pad = config["pad_token_id"]
    state = marian_state(config, torch.Generator().manual_seed(seed))
    atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    _write_json(out / CONFIG_NAME, config)
    _write_json(out / "generation_config.json", {
        **_GENERATION, "bad_words_ids": [[pad]], "bos_token_id": 0,
        "decoder_start_token_id": pad, "eos_token_id": 0, "forced_eos_token_id": 0,
        "pad_token_id": pad})
    _write_bytes(out / "source.spm", source)
    _write_bytes(out / "target.spm", target)
    _write_json(out / "vocab.json", vocab)
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "MarianTokenizer", "source_lang": "en", "target_lang": "zh",
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "separate_vocabs": False, "model_max_length": config["max_position_embeddings"]})
    return out


def write_pairs(path: str | os.PathLike) -> Path:
    """Write ``PAIRS`` as a TSV file (English<TAB>Chinese per line, what ``qkv train --data``
    reads) and return its Path."""
    path = Path(path)
    text = "".join(f"{en}\t{zh}\n" for en, zh in PAIRS)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m qkv.demos.tiny_marian DIR [--seed N] [--pairs FILE]``."""
    p = argparse.ArgumentParser(prog="python -m qkv.demos.tiny_marian", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="where to write the HF directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--pairs", default=None, metavar="FILE",
                   help="also write the bundled English/Chinese pairs to FILE (TSV)")
    args = p.parse_args(argv)
    print(make_tiny_marian(args.directory, seed=args.seed))
    if args.pairs is not None:
        print(write_pairs(args.pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
