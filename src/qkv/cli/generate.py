"""``qkv generate`` (continue prompts with a trained GPT) and ``qkv translate`` (decode
inputs with a trained encoder-decoder Transformer), from a run directory of ``qkv train``.

A GPT trained on a pair task (run.json names a ``task``) answers each prompt the way it was
trained — bos + prompt + eos, continued up to its eos — and prints the answer; a GPT trained
on plain text continues the text and prints prompt + continuation. Decoding is greedy by
default, beam search with ``--beams K``, sampling with ``--sample``. ``--int8`` decodes with the
model quantized to int8 weights in memory (``qkv.quantize(model, "int8")``; the run directory
is unchanged).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .checks import float_in, int_in, seed

GENERATE_DESCRIPTION = """\
Continue prompts with a GPT run of `qkv train`. A GPT trained on a pair task answers
each prompt the way it was trained (bos + prompt + eos, continued up to its eos) and
prints the answer; a GPT trained on plain text prints prompt + continuation.
Greedy by default, beam search with --beams K, sampling with --sample."""

TRANSLATE_DESCRIPTION = """\
Decode inputs with an encoder-decoder Transformer run of `qkv train`: each input is
read as source + eos and its output printed up to eos.
Greedy by default, beam search with --beams K."""

GENERATE_EXAMPLES = """examples:
  qkv generate runs/shakespeare --prompt "To be, or not" --max-new-tokens 200
  qkv generate runs/shakespeare --prompt "ROMEO:" --sample --temperature 0.8 --top-k 40 --seed 1
  qkv generate runs/shakespeare --prompt "Once" --prompt "Then" --top-p 0.9 --sample
  qkv generate runs/gpt-dates --prompt "March 3, 2021" --beams 4
  qkv generate runs/shakespeare --prompt "ROMEO:" --int8     # int8 weights, faster decoding

Prints one output per --prompt (in order). For a GPT trained on a task, the output is its
answer; for a GPT trained on text, the prompt followed by its continuation.
"""

TRANSLATE_EXAMPLES = """examples:
  qkv translate runs/dates --input "March 3, 2021" --input "3/4/99"
  qkv translate runs/dates --file heldout.tsv --beams 4      # sources = first TSV column
  qkv translate runs/my-model --file sentences.txt            # one input per non-blank line
  qkv translate runs/dates --input "3/4/99" --int8            # int8 weights (qkv.quantize)

Prints one output per input, in order.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv generate`` and ``qkv translate`` to the command parsers."""
    g = sub.add_parser("generate", help="continue prompts with a trained GPT run",
                       description=GENERATE_DESCRIPTION, epilog=GENERATE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("run", help="run directory written by `qkv train --model gpt`")
    g.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for several)")
    _decoding_options(g)
    g.add_argument("--sample", action="store_true",
                   help="sample from the model's distribution instead of the argmax")
    g.add_argument("--temperature", type=float_in(0, low_open=True), default=None,
                   help="sampling temperature > 0 (default 1.0; needs --sample)")
    g.add_argument("--top-k", type=int_in(1), default=None,
                   help="sample among the K most likely tokens (needs --sample)")
    g.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=None,
                   help="sample among the most likely tokens holding probability P, 0 < P <= 1 "
                        "(needs --sample)")
    g.add_argument("--seed", type=seed, default=None,
                   help="seed of the sampling generator (default: unseeded)")
    g.set_defaults(func=_run_generate)

    t = sub.add_parser("translate", help="decode inputs with a trained encoder-decoder run",
                       description=TRANSLATE_DESCRIPTION, epilog=TRANSLATE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("run", help="run directory written by `qkv train` (model transformer)")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", action="append", help="an input text (repeat for several)")
    src.add_argument("--file", help="a TSV file (inputs = first column) or a text file (one "
                                    "input per non-blank line)")
    _decoding_options(t)
    t.set_defaults(func=_run_translate)


def _decoding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int_in(1), default=None,
                   help="most tokens to generate per output (default: up to 100, within the "
                        "model's max_len)")
    p.add_argument("--beams", type=int_in(1), default=1,
                   help="beam search with K beams (default 1: greedy)")
    p.add_argument("--length-penalty", type=float_in(), default=1.0,
                   help="beam search: rank hypotheses by log-prob / length**P (default 1.0)")
    p.add_argument("--stop", action="append", default=[], metavar="TOKEN",
                   help="also end an output at this token (one token of the run's tokenizer, "
                        "e.g. '.'; kept in the output), repeatable; eos always ends it")
    p.add_argument("--int8", action="store_true",
                   help="quantize the model's linear layers and LM head to int8 weights "
                        "(per-channel scales) in memory before decoding: faster on a CPU, "
                        "outputs may differ slightly from fp32")


def _stop_tokens(tok: Any, stops: list[str]) -> list[int]:
    """Token ids of the --stop texts: each must be exactly one token the tokenizer knows
    (a text it would read as <unk> could never be produced, so it could never stop)."""
    from . import UserError

    ids = []
    for text in stops:
        enc = tok.encode(text)
        if not enc:
            raise UserError(f"--stop {text!r} is empty for this run's tokenizer; a stop token "
                            f"must be exactly one token")
        if tok.unk_id in enc:
            raise UserError(f"--stop {text!r} is not in this run's vocabulary (the tokenizer "
                            f"reads it as <unk>), so the model can never produce it")
        if len(enc) != 1:
            shown = " ".join(repr(t) for t in tok.tokens(enc))
            raise UserError(f"--stop {text!r} is {len(enc)} tokens of this run's tokenizer "
                            f"({shown}); a stop token must be exactly one token")
        ids.append(enc[0])
    return ids


def _check_sizes(model: Any, rows: list[list[int]], args: argparse.Namespace) -> None:
    """--max-new-tokens and --beams against the model: the positions its max_len leaves
    (absolute positions), and a lower bound of what decoding will allocate — one step's
    logits and the token buffer of every row and beam — against the memory available."""
    from ..generation.text import DEFAULT_MAX_NEW_TOKENS
    from ..models import Transformer
    from . import UserError
    from .checks import check_fits

    c = model.config
    width = max(len(r) for r in rows)
    t = args.max_new_tokens
    if isinstance(model, Transformer):
        limit = c.max_len if c.absolute_positions else None
        if limit is not None and t is not None and t > limit - 1:
            raise UserError(f"--max-new-tokens {t}: the decoder's positions end at the "
                            f"model's max_len={limit} (at most {limit - 1} new tokens)")
        vocab = c.tgt_vocab_size
        total = 1 + (t or min(DEFAULT_MAX_NEW_TOKENS, (limit or 10**9) - 1))
    else:
        room = c.max_len - width + 1
        if t is not None and t > room:
            raise UserError(f"--max-new-tokens {t}: a prompt of {width} tokens leaves room "
                            f"for {max(room, 0)} in the model's max_len={c.max_len}")
        vocab, total = c.vocab_size, width + (t or min(DEFAULT_MAX_NEW_TOKENS, room))
    decoding_rows = min(len(rows), 64) * args.beams
    check_fits(f"--beams {args.beams} with --max-new-tokens {t or 'default'} "
               f"({decoding_rows} rows × {total} tokens, vocabulary {vocab})",
               decoding_rows * (4 * vocab + 8 * total))


def warn_unknown(tok: Any, texts: list[str]) -> None:
    """One line on stderr when inputs hold characters a character tokenizer maps to <unk>
    (the model would see <unk> in their place)."""
    from ..data import CharTokenizer

    if not isinstance(tok, CharTokenizer):
        return
    unknown = sorted({c for text in texts for c in text if tok.encode(c) == [tok.unk_id]})
    if unknown:
        shown = "".join(unknown[:20]) + ("..." if len(unknown) > 20 else "")
        print(f"qkv: warning: {len(unknown)} character(s) unknown to the run's tokenizer "
              f"(read as <unk>): {shown!r}", file=sys.stderr)


def _load(run: str, want: str, int8: bool = False) -> tuple[Any, Any, dict]:
    """(model, tokenizer, run.json dict) of a run directory holding a ``want`` model,
    quantized to int8 (``qkv.quantize``) when ``int8``."""
    from ..models import GPT, Transformer
    from ..train.checkpoint import load_run, read_run_info
    from . import UserError

    model, tokenizer = load_run(run)
    info = read_run_info(run)
    kinds = {"gpt": GPT, "transformer": Transformer}
    if not isinstance(model, kinds[want]):
        other = "qkv translate" if want == "gpt" else "qkv generate"
        hint = f" (use {other})" if isinstance(model, (GPT, Transformer)) else ""
        raise UserError(f"{run} holds a {type(model).__name__} model; this command needs a "
                        f"{kinds[want].__name__} run{hint}")
    if int8:
        from ..generation.quantize import quantize
        from ..peft import adapter_file_kind
        from ..train.checkpoint import find_checkpoint
        from ..train.finetune import is_adapter_checkpoint
        from .peft import UNMERGEABLE

        ckpt = find_checkpoint(run)
        if is_adapter_checkpoint(ckpt):  # int8 quantizes plain weights: say how to get them
            kind = adapter_file_kind(ckpt)
            if kind == "lora":
                raise UserError(f"--int8: {run} is a LoRA adapter run and int8 quantizes plain "
                                f"weights: `qkv peft merge {run} --out DIR` writes them (the "
                                f"adapter merged in), then give DIR with --int8")
            raise UserError(f"--int8: {run} trained a {kind} adapter and int8 quantizes plain "
                            f"weights, which cannot hold it ({UNMERGEABLE[kind]}, not "
                            f"mergeable into the weights): leave out --int8")
        try:
            quantize(model.float().cpu(), "int8")
        except (TypeError, ValueError) as err:
            raise UserError(f"--int8: {err}") from None
    return model, tokenizer, info


def _run_generate(args: argparse.Namespace) -> int:
    import torch

    from ..generation import complete
    from ..train.checkpoint import trained_on_pairs
    from . import UserError

    sampling = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                               ("--top-p", args.top_p)) if v is not None]
    if sampling and not args.sample:
        settings = (sampling[0] if len(sampling) == 1
                    else f"{', '.join(sampling[:-1])} and {sampling[-1]}")
        raise UserError(f"{settings} {'applies' if len(sampling) == 1 else 'apply'} only "
                        f"with --sample")
    if args.sample and args.beams > 1:
        raise UserError("--sample and --beams > 1 cannot be combined")
    model, tok, info = _load(args.run, "gpt", args.int8)
    warn_unknown(tok, args.prompt)
    framed = trained_on_pairs(info)
    _check_sizes(model, [[tok.bos_id, *tok.encode(p), tok.eos_id] if framed else tok.encode(p)
                         for p in args.prompt], args)
    generator = None if args.seed is None else torch.Generator().manual_seed(args.seed)
    outputs = complete(model, tok, args.prompt, framed=framed,
                       max_new_tokens=args.max_new_tokens, num_beams=args.beams,
                       length_penalty=args.length_penalty, do_sample=args.sample,
                       temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k, top_p=args.top_p, generator=generator,
                       stop_tokens=_stop_tokens(tok, args.stop))
    print("\n".join(outputs))
    sys.stdout.flush()
    return 0


def _inputs(args: argparse.Namespace) -> list[str]:
    from ..data import read_pairs
    from ..data.files import DataError, read_utf8
    from . import UserError

    if args.input is not None:
        return args.input
    path = Path(args.file)
    try:  # a regular file only: /dev/zero or a FIFO is refused before it is read
        text = read_utf8(path, name="--file")
    except DataError as exc:
        raise UserError(str(exc)) from None
    if "\t" in text:
        return [source for source, _ in read_pairs(path)]
    lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not lines:
        raise UserError(f"{path}: no inputs (the file is empty)")
    return lines


def _run_translate(args: argparse.Namespace) -> int:
    from ..generation import translate

    sources = _inputs(args)
    model, tok, _ = _load(args.run, "transformer", args.int8)
    warn_unknown(tok, sources)
    _check_sizes(model, [[*tok.encode(s), tok.eos_id] for s in sources], args)
    outputs = translate(model, tok, sources, max_new_tokens=args.max_new_tokens,
                        num_beams=args.beams, length_penalty=args.length_penalty,
                        stop_tokens=_stop_tokens(tok, args.stop))
    print("\n".join(outputs))
    sys.stdout.flush()
    return 0
