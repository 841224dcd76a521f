"""qkv.models.BERT vs HuggingFace transformers' BertModel, side by side in one run.

Shapes: B batch, N sequence length, C model width, H heads, L layers, F FFN width.

Both models hold the same weights: a HF ``BertModel`` (``attn_implementation="sdpa"``) is
built from a config with random weights, saved, and loaded into qkv with ``BERT.from_hf``.
Eval mode, ``torch.inference_mode()``, fp32 CPU. Two cases: no ``attention_mask`` (every
token real), and right padding (row b keeps N - b·N/(2B) tokens). Each repeat times HF and
qkv back to back, alternating which goes first; the table shows medians and the ratio
HF / qkv (> 1: qkv is faster). Default shape: all-MiniLM-L6-v2 (C=384, L=6, H=12, F=1536),
B=32, N=128.

Usage: python -m benchmarks.bench_bert [--quick] [--preset minilm-l6] [--batch 32 --seq 128]
(``--quick``: tiny sizes, one repeat; the test suite runs it so that the script never rots.)
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile

import torch

from benchmarks._harness import print_cpu, print_table, side_by_side
from qkv.models.bert import BERT, BERTConfig


def build_pair(config: BERTConfig):
    """(HF BertModel with sdpa attention, qkv BERT) holding the same random weights."""
    import transformers  # benchmark-only reference

    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        intermediate_size=config.ffn_hidden, max_position_embeddings=config.max_len,
        type_vocab_size=config.type_vocab_size, layer_norm_eps=config.norm_eps,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.BertModel(hf_config).eval()
    if hf.config._attn_implementation != "sdpa":
        raise SystemExit(f"bench_bert: HF picked {hf.config._attn_implementation!r}, not sdpa")
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        model = BERT.from_hf(d).eval()
    return hf, model


def run(config: BERTConfig, batch: int, seq: int, warmup: int, repeats: int
        ) -> list[tuple[str, float, float]]:
    """Rows ``(case, HF seconds, qkv seconds)``."""
    hf, model = build_pair(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)  # (B, N)
    padded = torch.ones(batch, seq, dtype=torch.long)  # (B, N), right padding
    for b in range(batch):
        padded[b, seq - (b * seq) // (2 * batch):] = 0
    rows = []
    with torch.inference_mode():
        for case, mask in (("no padding (mask=None)", None),
                           ("right padding (attention_mask)", padded)):
            want = hf(ids, attention_mask=mask).last_hidden_state
            got = model(ids, mask).last_hidden_state
            keep = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask.bool()
            err = (want - got)[keep].abs().max().item()
            if err > 1e-3:
                raise SystemExit(f"bench_bert: {case}: outputs differ by {err:.3g}; "
                                 f"not timing")
            times = side_by_side({
                "hf": lambda m=mask: hf(ids, attention_mask=m),
                "qkv": lambda m=mask: model(ids, m),
            }, warmup, repeats)
            rows.append((case, times["hf"], times["qkv"]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="minilm-l6", choices=sorted(BERTConfig.PRESETS))
    parser.add_argument("--batch", type=int, default=32, help="B")
    parser.add_argument("--seq", type=int, default=128, help="N")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and one repeat: checks the script runs, times nothing")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    config = BERTConfig.from_name(args.preset)
    if args.quick:
        config = BERTConfig.from_name("bert-tiny", vocab_size=1000, max_len=64)
        args.batch, args.seq, args.warmup, args.repeats = 2, 16, 1, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print("command:", shlex.join([sys.executable, "-m", "benchmarks.bench_bert", *argv]))
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{'quick' if args.quick else args.preset}: C={config.dim} L={config.num_layers} "
          f"H={config.num_heads} F={config.ffn_hidden}; B={args.batch} N={args.seq} fp32 "
          f"eval inference_mode; median of {args.repeats} (after {args.warmup} warm-up)")
    rows = run(config, args.batch, args.seq, args.warmup, args.repeats)
    table = [[case, f"{t_hf * 1e3:.1f}", f"{t_qkv * 1e3:.1f}", f"{t_hf / t_qkv:.2f}x"]
             for case, t_hf, t_qkv in rows]
    print_table("qkv BERT vs HF BertModel (sdpa), forward",
                ["case", "HF (ms)", "qkv (ms)", "HF / qkv"], table)


if __name__ == "__main__":
    main()
