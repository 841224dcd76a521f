"""``qkv generate`` (continue prompts with a trained GPT, or with a model directory) and
``qkv translate`` (decode inputs with a trained encoder-decoder Transformer, or with an HF
encoder-decoder directory), from a run directory of ``qkv train``.

A GPT trained on a pair task (run.json names a ``task``) answers each prompt the way it was
trained — bos + prompt + eos, continued up to its eos — and prints the answer; a GPT trained
on plain text continues the text and prints prompt + continuation. Decoding is greedy by
default, beam search with ``--beams K``, sampling with ``--sample``. ``--int8`` decodes with the
model quantized to int8 weights in memory (``qkv.quantize(model, "int8")``; the run directory
is unchanged).

A model directory (config.json + weights + a HuggingFace tokenizer.json, e.g. a HF
checkpoint ``qkv.models.from_pretrained`` reads) is continued the same way (prompt +
continuation; the prompt encoded as the tokenizer does by default, its special tokens
included), or answers ``--chat`` questions through its chat template
(``qkv.generation.chat``); it stops at the eos ids of its generation_config.json (else
config.json, else tokenizer_config.json's ``eos_token``), and ``--stop`` adds to them.

One output (one prompt or question, no beams) is printed as it is generated: the text of
each new token once it is stable (a character whose bytes are still arriving waits for
them), then the speed in tokens/s on stderr. Several outputs are printed at the end, one per
line.

``qkv translate DIR`` on a HuggingFace encoder-decoder directory (T5 / Flan-T5, BART, Marian
opus-mt: config.json, weights and tokenizer files, ``qkv.cli.seq2seq_directory``) frames each
input with the directory's tokenizer and decodes with its generation_config.json (beams,
lengths, ``no_repeat_ngram_size``, ``bad_words_ids``...; ``qkv.generation.translate`` with
``settings=``): the outputs of transformers' ``generate`` + ``batch_decode(...,
skip_special_tokens=True)``. --beams, --length-penalty and --max-new-tokens override the
file's values.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checks import float_in, int_in, seed
from .stream import TokenStream

GENERATE_DESCRIPTION = """\
Continue prompts with a GPT run of `qkv train`, or with a model directory (config.json,
weights and a HuggingFace tokenizer.json). A GPT trained on a pair task answers
each prompt the way it was trained (bos + prompt + eos, continued up to its eos) and
prints the answer; a GPT trained on plain text prints prompt + continuation. A model
directory with a chat template answers --chat questions. One output is printed as it
is generated (tokens/s on stderr).
Greedy by default, beam search with --beams K, sampling with --sample."""

TRANSLATE_DESCRIPTION = """\
Decode inputs with an encoder-decoder Transformer run of `qkv train` (each input is
read as source + eos and its output printed up to eos; greedy by default, beam search
with --beams K), or with a HuggingFace encoder-decoder directory (T5, BART, Marian:
config.json, weights and tokenizer files), framed by its tokenizer and decoded with
its generation_config.json (opus-mt: 4 beams) unless options say otherwise."""

GENERATE_EXAMPLES = """examples:
  qkv generate runs/shakespeare --prompt "To be, or not" --max-new-tokens 200
  qkv generate runs/shakespeare --prompt "ROMEO:" --sample --temperature 0.8 --top-k 40 --seed 1
  qkv generate runs/shakespeare --prompt "Once" --prompt "Then" --top-p 0.9 --sample
  qkv generate runs/gpt-dates --prompt "March 3, 2021" --beams 4
  qkv generate runs/shakespeare --prompt "ROMEO:" --int8     # int8 weights, faster decoding
  qkv generate models/qwen2-0.5b-instruct --chat "What is attention?" --system "Be brief."

Prints one output per --prompt or --chat (in order). For a GPT trained on a task, the
output is its answer; for a GPT trained on text or a model directory's --prompt, the prompt
followed by its continuation; for --chat, the answer.
"""

TRANSLATE_EXAMPLES = """examples:
  qkv translate runs/dates --input "March 3, 2021" --input "3/4/99"
  qkv translate runs/dates --file heldout.tsv --beams 4      # sources = first TSV column
  qkv translate runs/my-model --file sentences.txt            # one input per non-blank line
  qkv translate runs/dates --input "3/4/99" --int8            # int8 weights (qkv.quantize)
  qkv translate models/opus-mt-en-zh --input "How are you?"   # an HF Marian directory
  qkv translate models/flan-t5-small --input "translate English to German: Hi" --beams 1

Prints one output per input, in order.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv generate`` and ``qkv translate`` to the command parsers."""
    g = sub.add_parser("generate", help="continue prompts with a trained GPT run",
                       description=GENERATE_DESCRIPTION, epilog=GENERATE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("run", help="run directory written by `qkv train --model gpt`, or a model "
                               "directory (config.json, weights, HF tokenizer.json)")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    what.add_argument("--chat", action="append", metavar="QUESTION",
                      help="model directories with a chat template: a question, asked as one "
                           "user message through the template (repeat for several, each its "
                           "own conversation)")
    g.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message before each question")
    _decoding_options(g, settings=True)
    how = g.add_mutually_exclusive_group()
    how.add_argument("--sample", action="store_true", default=None,
                     help="sample from the model's distribution instead of the argmax "
                          "(default: a model directory's generation settings, else off)")
    how.add_argument("--greedy", dest="sample", action="store_false",
                     help="take the argmax (or search with --beams) even where a model "
                          "directory's generation settings sample")
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
    t.add_argument("run", help="run directory written by `qkv train` (model transformer), "
                               "or an HF encoder-decoder directory (T5, BART, Marian)")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", action="append", help="an input text (repeat for several)")
    src.add_argument("--file", help="a TSV file (inputs = first column) or a text file (one "
                                    "input per non-blank line)")
    _decoding_options(t, settings=True)
    t.set_defaults(func=_run_translate)


def _decoding_options(p: argparse.ArgumentParser, *, settings: bool = False) -> None:
    """The decoding options; ``settings``: a model directory's generation settings are the
    defaults (None here: not given)."""
    where = " an HF directory's generation_config.json, else" if settings else ""
    p.add_argument("--max-new-tokens", type=int_in(1), default=None,
                   help=f"most tokens to generate per output (default:{where} up to 100, "
                        f"within the model's max_len)")
    p.add_argument("--beams", type=int_in(1), default=None if settings else 1,
                   help=f"beam search with K beams (default:{where} 1, greedy)")
    p.add_argument("--length-penalty", type=float_in(), default=None if settings else 1.0,
                   help=f"beam search: rank hypotheses by log-prob / length**P (default:"
                        f"{where} 1.0)")
    p.add_argument("--stop", action="append", default=[], metavar="TOKEN",
                   help="also end an output at this token (one token of the run's or model's "
                        "tokenizer, e.g. '.'; kept in the output), repeatable; eos always ends it")
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
    from . import UserError

    if args.sample and (args.beams or 1) > 1:
        raise UserError("--sample and --beams > 1 cannot be combined")
    if args.system is not None and args.chat is None:
        raise UserError("--system applies only with --chat")
    if _is_model_directory(Path(args.run)):
        if args.sample is False:  # --greedy; without either, the settings may sample
            _check_sampling_options(args, False)
        return _generate_model_directory(args)
    _check_sampling_options(args, bool(args.sample))
    if args.chat is not None:
        raise UserError(f"--chat needs a model directory with a chat template (a HuggingFace "
                        f"tokenizer.json and its chat template); {args.run} is a `qkv train` "
                        f"run, whose prompts are given with --prompt")
    return _generate_run(args)


def _check_sampling_options(args: argparse.Namespace, sampling: bool) -> None:
    """--temperature / --top-k / --top-p only where the call samples (``sampling``)."""
    from . import UserError

    given = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                            ("--top-p", args.top_p)) if v is not None]
    if given and not sampling:
        names = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        raise UserError(f"{names} {'applies' if len(given) == 1 else 'apply'} only with "
                        f"--sample")


def _decoding(args: argparse.Namespace) -> dict[str, Any]:
    """The ``qkv.generate`` options the command line gives (those it leaves out take the
    model's generation settings, else qkv's defaults)."""
    import torch

    given = dict(num_beams=args.beams, length_penalty=args.length_penalty,
                 do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p)
    decoding = {k: v for k, v in given.items() if v is not None}
    if args.seed is not None:
        decoding["generator"] = torch.Generator().manual_seed(args.seed)
    return decoding


def _generate_run(args: argparse.Namespace) -> int:
    from ..generation import complete
    from ..train.checkpoint import trained_on_pairs

    model, tok, info = _load(args.run, "gpt", args.int8)
    warn_unknown(tok, args.prompt)
    framed = trained_on_pairs(info)
    rows = [[tok.bos_id, *tok.encode(p), tok.eos_id] if framed else tok.encode(p)
            for p in args.prompt]
    args.beams = args.beams or 1  # a run carries no generation settings
    _check_sizes(model, rows, args)
    decoding = _decoding(args)
    stream = None
    if len(rows) == 1 and args.beams == 1:
        stream = TokenStream(tok.decode, head=[] if framed else rows[0], ends={tok.eos_id},
                         lead="" if framed else args.prompt[0])
        decoding["streamer"] = stream
    outputs = complete(model, tok, args.prompt, framed=framed,
                       max_new_tokens=args.max_new_tokens,
                       stop_tokens=_stop_tokens(tok, args.stop), **decoding)
    _print(outputs, stream)
    return 0


def _print(outputs: list[str], stream: TokenStream | None) -> None:
    if stream is not None:
        stream.finish(outputs[0])
        return
    print("\n".join(outputs))
    sys.stdout.flush()


def _is_model_directory(path: Path) -> bool:
    """A model directory (a HuggingFace tokenizer.json in it) rather than a `qkv train` run
    (whose tokenizer.json is qkv's own, with a "kind")."""
    from ..models.hub import tokenizer_file_kind

    tok = path / "tokenizer.json"  # unreadable: the run's reader says what is wrong with it
    return tok.is_file() and tokenizer_file_kind(tok) == "hf"


def _generate_model_directory(args: argparse.Namespace) -> int:
    """``qkv generate DIR``: --prompt continued, or --chat answered through the template."""
    from ..generation.chat import chat_prompt_ids, read_chat_template, read_special_tokens
    from ..models.hub import load_tokenizer
    from . import UserError

    path = Path(args.run)
    model = _load_decoder(path, args.int8)
    tok = load_tokenizer(path)
    specials = read_special_tokens(path)
    ends, pad = _directory_stops(path, tok, specials)
    stops = _directory_stop_tokens(tok, args.stop)
    texts = args.chat if args.chat is not None else args.prompt
    if args.chat is not None:
        template = read_chat_template(path)
        if template is None:
            raise UserError(f"--chat: {path} has no chat template (no chat_template in "
                            f"tokenizer_config.json, no chat_template.jinja): it is not a chat "
                            f"model; continue text with --prompt")
        system = [] if args.system is None else [{"role": "system", "content": args.system}]
        rows = [chat_prompt_ids(tok, [*system, {"role": "user", "content": q}],
                                chat_template=template, **specials) for q in texts]
    else:
        rows = [tok.encode(p).ids for p in texts]
        if any(not r for r in rows):
            raise UserError("a prompt is empty: give at least one token to continue")
    decoding, note = _directory_decoding(model, args, max(len(r) for r in rows))
    args.beams, args.max_new_tokens = decoding["num_beams"], decoding.pop("max_new_tokens")
    _check_sizes(model, rows, args)
    say_settings(*note)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    stream = None
    chat = args.chat is not None
    if len(rows) == 1 and args.beams == 1:
        stream = TokenStream(decode, head=[] if chat else rows[0], ends=set(ends),
                         lead="" if chat else texts[0])
        decoding["streamer"] = stream
    news = _complete_rows(model, rows, ends, pad, stops, args.max_new_tokens, decoding)
    outputs = [decode(new) if chat else text + _added_text(decode, row, new)
               for row, new, text in zip(rows, news, texts, strict=True)]
    _print(outputs, stream)
    return 0


def _directory_decoding(model: Any, args: argparse.Namespace, width: int
                        ) -> tuple[dict[str, Any], tuple[Any, dict[str, Any]]]:
    """``qkv.generate``'s options for a model directory: its generation settings
    (``model.generation_settings``, the prompts' padded width ``width`` counted in a
    ``max_length``) under the command line's, ``settings=None`` so that generate adds
    nothing else; and (the settings, the options taken from their file) for
    ``say_settings``. ``num_beams`` and ``max_new_tokens`` (None: qkv's default) are always
    in the options."""
    from ..generation.defaults import model_settings
    from . import UserError

    settings = model_settings(model)
    given = _decoding(args)
    if args.max_new_tokens is not None:
        given["max_new_tokens"] = args.max_new_tokens
    from_file: dict[str, Any] = {}
    used: dict[str, Any] = {}
    if settings is not None and settings.refused is not None:
        raise UserError(f"the directory's generation settings cannot be honoured: "
                        f"{settings.refused}")
    if settings is not None and settings.source is not None:
        try:
            from_file = settings.generate_kwargs(False, prompt_length=width,
                                                 do_sample=args.sample)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        from_file.pop("eos_token_id", None)  # the stops are _directory_stops'
        from_file.pop("pad_token_id", None)
        room = model.config.max_len - width + 1  # a file's max_length within max_len
        if from_file.get("max_new_tokens", 0) > room >= 1:
            from_file["max_new_tokens"] = room
        used = {k: v for k, v in from_file.items() if k not in given}
    decoding = {"num_beams": 1, "max_new_tokens": None, **from_file, **given}
    _check_sampling_options(args, bool(decoding.get("do_sample")))
    if decoding.get("do_sample") and decoding["num_beams"] > 1:
        raise UserError(f"sampling with {decoding['num_beams']} beams (from "
                        f"{settings.source.name if settings else 'the options'}) cannot be "
                        f"combined: pass --greedy or --beams 1")
    decoding["settings"] = None
    return decoding, (settings, used)


def say_settings(settings: Any, used: dict[str, Any]) -> None:
    """One stderr line: the decoding options taken from the directory's generation
    settings file (``used``), when there are any."""
    if used:
        print(f"qkv: decoding with {settings.source.name}'s "
              f"{', '.join(f'{k}={v!r}' for k, v in used.items())} (options override them)",
              file=sys.stderr)


def _load_decoder(path: Path, int8: bool) -> Any:
    from ..models import Transformer, from_pretrained
    from . import UserError

    model = from_pretrained(path)
    if isinstance(model, Transformer) or not callable(getattr(model, "new_cache", None)):
        raise UserError(f"{path} holds a {type(model).__name__} model; qkv generate needs a "
                        f"decoder-only model (GPT-like)")
    if int8:
        from ..generation.quantize import quantize

        try:
            quantize(model.float().cpu(), "int8")
        except (TypeError, ValueError) as err:
            raise UserError(f"--int8: {err}") from None
    return model


def _directory_stops(path: Path, tok: Any, specials: dict[str, str]
                     ) -> tuple[tuple[int, ...], int]:
    """(the eos ids of a model directory, the pad id): ``stop_token_ids``; the pad of
    generation_config.json, else tokenizer_config.json's ``pad_token``, else the first eos."""
    from ..generation.chat import read_generation_config, stop_token_ids

    ends = stop_token_ids(path, tok) or ()
    pad = read_generation_config(path).pad_token_id
    if pad is None and "pad_token" in specials:
        pad = tok.token_to_id(specials["pad_token"])
    if pad is None:
        pad = ends[0] if ends else 0
    return ends, pad


def _directory_stop_tokens(tok: Any, stops: list[str]) -> list[int]:
    """Token ids of the --stop texts for a HuggingFace tokenizer: each exactly one token."""
    from . import UserError

    ids = []
    for text in stops:
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc.ids) != 1:
            shown = " ".join(repr(t) for t in enc.tokens) or "no token"
            raise UserError(f"--stop {text!r} is {len(enc.ids)} tokens of this model's "
                            f"tokenizer ({shown}); a stop token must be exactly one token")
        ids.append(enc.ids[0])
    return ids


def _complete_rows(model: Any, rows: list[list[int]], ends: tuple[int, ...], pad: int,
                   stops: list[int], max_new_tokens: int | None,
                   decoding: dict[str, Any]) -> list[list[int]]:
    """The new ids of each prompt (left-padded in batches of 64), cut before its first eos
    or after its first --stop token, up to ``max_new_tokens`` (default what ``max_len``
    leaves, at most 100)."""
    import torch

    from ..generation import generate
    from ..generation.text import DEFAULT_MAX_NEW_TOKENS

    width = max(len(r) for r in rows)
    room = model.config.max_len - width + 1
    if room < 1:
        raise ValueError(f"a prompt of {width} tokens does not fit the model's max_len="
                         f"{model.config.max_len}")
    budget = max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, room)
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(rows), 64):
        batch = rows[start:start + 64]
        n = max(len(r) for r in batch)
        ids = torch.tensor([[pad] * (n - len(r)) + r for r in batch], device=device)  # (B, N)
        keep = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in batch], device=device)
        res = generate(model, ids, attention_mask=keep, max_new_tokens=budget,
                       eos_token_id=[*ends, *stops] or None, pad_token_id=pad,
                       **decoding)  # (B, N + T)
        for new in res[:, n:].tolist():
            cut = next((i + (t not in ends) for i, t in enumerate(new)
                        if t in ends or t in stops), len(new))
            out.append(new[:cut])
    return out


def _added_text(decode: Callable[[list[int]], str], prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt`` (decoded together, less the prompt's own)."""
    whole, head = decode(prompt + new), decode(prompt)
    return whole[len(head):] if whole.startswith(head) else decode(new)


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
    from .seq2seq_directory import is_seq2seq_directory

    sources = _inputs(args)
    if is_seq2seq_directory(Path(args.run)):
        return _translate_directory(args, sources)
    args.beams = 1 if args.beams is None else args.beams
    penalty = 1.0 if args.length_penalty is None else args.length_penalty
    model, tok, _ = _load(args.run, "transformer", args.int8)
    if callable(getattr(tok, "encode_target", None)):  # fine-tuned from an HF directory
        from .seq2seq_directory import stop_token_ids, warn_unknown_pieces

        warn_unknown_pieces(tok, sources)
        rows, stops = [tok.encode(s) for s in sources], stop_token_ids(tok, args.stop)
    else:
        warn_unknown(tok, sources)
        rows = [[*tok.encode(s), tok.eos_id] for s in sources]
        stops = _stop_tokens(tok, args.stop)
    _check_sizes(model, rows, args)
    outputs = translate(model, tok, sources, max_new_tokens=args.max_new_tokens,
                        num_beams=args.beams, length_penalty=penalty, stop_tokens=stops)
    print("\n".join(outputs))
    sys.stdout.flush()
    return 0


def _translate_directory(args: argparse.Namespace, sources: list[str]) -> int:
    """``qkv translate DIR`` on an HF encoder-decoder directory: its tokenizer's framing, its
    generation settings under the command line's options."""
    from ..generation import translate
    from .seq2seq_directory import load_seq2seq_directory, stop_token_ids, warn_unknown_pieces

    d = load_seq2seq_directory(Path(args.run), int8=args.int8)
    warn_unknown_pieces(d.tokenizer, sources)
    explicit = dict(num_beams=args.beams, length_penalty=args.length_penalty,
                    max_new_tokens=args.max_new_tokens)
    decoding = d.decoding(**explicit)
    sizes = argparse.Namespace(beams=decoding.get("num_beams", 1),
                               max_new_tokens=decoding.get("max_new_tokens"))
    _check_sizes(d.model, [d.tokenizer.encode(s) for s in sources], sizes)
    stops = stop_token_ids(d.tokenizer, args.stop)
    say_settings(d.settings, {k: v for k, v in d.decoding().items()
                              if explicit.get(k) is None and k not in (
                                  "eos_token_id", "pad_token_id", "decoder_start_token_id")})
    outputs = translate(d.model, d.tokenizer, sources, stop_tokens=stops, **decoding)
    print("\n".join(outputs))
    sys.stdout.flush()
    return 0
