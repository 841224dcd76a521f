"""``qkv attention``: draw the attention of a trained run on one input — a PNG grid (layers ×
heads) per attention map, the cross-attention alignment of an encoder-decoder, and one
self-contained interactive HTML page.

Inputs are framed as in training (``qkv.train.data``): an encoder-decoder reads source +
eos and its decoder is fed bos + target (generated greedily when --target is not given); a
GPT trained on pairs reads bos + input + eos (+ target, or its own greedy answer); a BERT
reads bos + input [+ " " + target] + eos; models trained on plain text read the text as is.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch import nn

from .checks import int_in

#: the files ``qkv attention`` writes into its output directory; a rerun may replace these
#: (and only these) in an existing directory
ATTENTION_FILES = ("attention_*.png", "attention.html")

EXAMPLES = """examples:
  qkv attention runs/dates --input "March 5, 2024"
        greedy-translate, then draw encoder, decoder and cross-attention
  qkv attention runs/dates --input "March 5, 2024" --target 2024-03-05 --out viz
        teacher-forced on a given target; files go to viz/
  qkv attention runs/dates --input "2024年3月5日" --layer -1 --head 0
        only the last layer's head 0 in the PNG grids (the HTML keeps every layer and head)
  qkv attention runs/lm --input "the cat sat on the mat"
        a GPT or BERT run: its self-attention

writes DIR/attention_<map>.png for each map (encoder, decoder, cross), DIR/attention_
alignment.png (encoder-decoder: cross-attention averaged over heads) and DIR/attention.html
(open it in a browser; it needs no network). DIR (--out, default RUN/attention) must be new,
empty, or hold only these files of an earlier run (they are replaced); never inside a
training checkpoint directory (given RUN/checkpoint, the default is RUN/attention).
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv attention`` to the command parsers."""
    p = sub.add_parser("attention", help="draw a trained run's attention on one input "
                       "(PNG grids + an interactive HTML page)", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="a run directory of `qkv train` (or a "
                   "checkpoint directory with config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--input", required=True, metavar="TEXT", help="the input (source) text")
    p.add_argument("--target", default=None, metavar="TEXT",
                   help="the target text, teacher-forced (default for an encoder-decoder or "
                        "a GPT trained on pairs: the model's own greedy output)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory: new, empty or holding only attention_*.png / "
                        "attention.html (default: RUN/attention)")
    p.add_argument("--layer", type=int_in(), default=None, metavar="L",
                   help="draw only layer L in the PNGs (negative: from the end); the HTML "
                        "opens on it")
    p.add_argument("--head", type=int_in(), default=None, metavar="H",
                   help="draw only head H in the PNGs (negative: from the end); the HTML "
                        "opens on it (default: the mean over heads)")
    p.add_argument("--max-new-tokens", type=int_in(1), default=64, metavar="N",
                   help="longest generated target when --target is not given (default 64)")
    p.set_defaults(func=_run)


def _max_len(model: nn.Module) -> int | None:
    """The longest sequence the model's positions allow, or None (relative positions)."""
    from ..models import Transformer

    c = model.config
    if isinstance(model, Transformer) and not c.absolute_positions:
        return None
    return getattr(c, "max_len", None)


def _generate(model: nn.Module, ids: list[int], tok: Any, budget: int, *,
              encoder_decoder: bool) -> list[int]:
    """Greedy decoding, cut before the first eos: bos + output (encoder-decoder, ``ids`` the
    framed source) or ``ids`` + continuation (GPT)."""
    from ..generation import complete_ids, translate_ids

    if encoder_decoder:
        return [tok.bos_id, *translate_ids(model, [ids], pad_id=tok.pad_id, bos_id=tok.bos_id,
                                           eos_id=tok.eos_id, max_new_tokens=budget)[0]]
    return ids + complete_ids(model, [ids], pad_id=tok.pad_id, eos_id=tok.eos_id,
                              max_new_tokens=budget)[0]


def _frame(model: nn.Module, tok: Any, info: dict[str, Any], text: str, target: str | None,
           budget: int) -> tuple[list[int], list[int] | None, str | None]:
    """(input ids, target ids or None, the generated target text or None), framed as in
    training."""
    from ..models import BERT, Transformer
    from ..train.checkpoint import trained_on_pairs

    bos, eos = tok.bos_id, tok.eos_id
    pairs = trained_on_pairs(info)
    limit = _max_len(model)
    if isinstance(model, Transformer):
        src = [*tok.encode(text), eos]
        if target is not None:
            return src, [bos, *tok.encode(target)], None
        room = budget if limit is None else min(budget, limit - 1)
        tgt = _generate(model, src, tok, room, encoder_decoder=True)
        return src, tgt, tok.decode(tgt[1:])
    if isinstance(model, BERT):
        full = text if target is None else f"{text} {target}"
        return ([bos, *tok.encode(full), eos] if pairs else tok.encode(full)), None, None
    if not pairs:  # a GPT language model on plain text
        return tok.encode(text if target is None else text + target), None, None
    prompt = [bos, *tok.encode(text), eos]
    if target is not None:
        return [*prompt, *tok.encode(target)], None, None
    room = budget if limit is None else min(budget, limit - len(prompt))
    ids = _generate(model, prompt, tok, room, encoder_decoder=False) if room > 0 else prompt
    return ids, None, tok.decode(ids[len(prompt):])


def _stack_sizes(model: nn.Module) -> tuple[int, int]:
    """(layers of the shallowest attention stack, heads) of a qkv model."""
    c = model.config
    layers = [getattr(c, k) for k in ("num_layers", "num_encoder_layers", "num_decoder_layers")
              if isinstance(getattr(c, k, None), int)]
    return min(layers), c.num_heads


def default_out(run: Path) -> Path:
    """``qkv attention``'s default output directory: RUN/attention for a run directory, and
    for a training checkpoint directory (RUN/checkpoint) its run's RUN/attention — never a
    folder inside the checkpoint, which every save replaces. A model directory outside any
    run (``save_pretrained``, ``qkv demo coref``) gets DIR/attention."""
    from ..outputs import inside_checkpoint

    ckpt = inside_checkpoint(run)
    return (run if ckpt is None else ckpt.parent) / "attention"


def _index(name: str, value: int | None, total: int) -> int | None:
    from . import UserError

    if value is not None and not -total <= value < total:
        raise UserError(f"--{name} {value} is out of range: the model has {total} {name}s "
                        f"(0..{total - 1}, or negative from the end)")
    return value


def _run(args: argparse.Namespace) -> int:
    from ..outputs import new_output_dir
    from ..train.checkpoint import load_run, read_run_info
    from ..viz import (
        attention_html,
        attention_maps,
        plot_alignment,
        plot_attention_grid,
        token_labels,
    )
    from . import UserError
    from .checks import check_fits
    from .generate import warn_unknown

    if not args.input.strip():
        raise UserError("--input is empty")
    if args.target is not None and not args.target.strip():
        raise UserError("--target is empty (leave it out to generate the target)")
    run = Path(args.run)
    model, tok = load_run(run)
    model.eval()
    from ..peft import PrefixAttention

    if any(isinstance(m, PrefixAttention) and m.active is not None for m in model.modules()):
        raise UserError(f"{run} trained a prefix (learned key/value positions before every "
                        f"token); its attention maps have key columns no token labels, which "
                        f"qkv attention does not draw yet (qkv.viz.attention_maps returns "
                        f"them, prefix columns first)")
    n_layers, n_heads = _stack_sizes(model)
    layer = _index("layer", args.layer, n_layers)
    head = _index("head", args.head, n_heads)
    if _max_len(model) is None:  # relative positions: nothing else bounds the output length
        longest = len(tok.encode(args.input)) + 2 + (
            args.max_new_tokens if args.target is None else len(tok.encode(args.target)))
        check_fits(f"--max-new-tokens {args.max_new_tokens} (attention maps of up to "
                   f"{longest} tokens, {n_layers}×{n_heads}×{longest}² fp32)",
                   4 * n_layers * n_heads * longest**2)
    out = new_output_dir(Path(args.out) if args.out is not None else default_out(run),
                         replaceable=ATTENTION_FILES)
    info = read_run_info(run)
    warn_unknown(tok, [args.input, args.target or ""])
    src, tgt, generated = _frame(model, tok, info, args.input, args.target,
                                 args.max_new_tokens)
    maps = attention_maps(model, src, target_ids=tgt)
    src_tokens = tok.tokens(src)
    tgt_tokens = None if tgt is None else tok.tokens(tgt)
    labels = token_labels(maps, input_tokens=src_tokens, target_tokens=tgt_tokens)
    if generated is not None:
        print(f"generated target: {generated}")
    written = []
    for name, weights in maps.items():
        q, k = labels[name]
        written.append(plot_attention_grid(
            weights, query_tokens=q, key_tokens=k, path=out / f"attention_{name}.png",
            title=f"{name} attention: {args.input}", layers=None if layer is None else [layer],
            heads=None if head is None else [head]))
    if "cross" in maps:
        n_layers, n_heads = maps["cross"].shape[:2]
        at = (-1 if layer is None else layer) % n_layers
        cross = maps["cross"][at]  # (H, T, S)
        which = "mean of heads" if head is None else f"head {head % n_heads}"
        written.append(plot_alignment(
            cross if head is None else cross[head], source_tokens=src_tokens,
            target_tokens=tgt_tokens, path=out / "attention_alignment.png",
            title=f"cross-attention, layer {at}, {which}: {args.input}"))
    written.append(attention_html(maps, tokens=labels, path=out / "attention.html",
                                  title=f"qkv attention: {args.input}", layer=layer,
                                  head=head))
    for path in written:
        print(path)
    return 0
