"""Translation on the CPU: qkv fp32 and int8 against HF transformers fp32 and CTranslate2 fp32
and int8, side by side in one run, on an opus-mt-en-zh-shaped Marian model (greedy and
4-beam) and a T5-small-shaped model (greedy), random weights.

Shapes: B batch (sentences per call), S source length, K beams, T new tokens, C width, L
layers, H heads, F FFN width, V vocab.

The models (seeded random weights, built by transformers from a config, saved with
``save_pretrained`` into a temporary directory):

- Marian: ``MarianConfig`` of Helsinki-NLP/opus-mt-en-zh's shape: 6 + 6 post-norm layers,
  C=512, H=8, F=2048, swish (SiLU) FFN, V=65001, sinusoidal positions in halves,
  ``scale_embedding``, ``final_logits_bias``, one table shared by the encoder, the decoder
  and the head; pad 65000 = the decoder's start token, eos 0.
- T5-small: ``T5Config`` of t5-small's shape: 6 + 6 pre-norm RMSNorm layers, C=512, H=8,
  D=64, F=2048, ReLU, V=32128, bucketed relative positions (32 buckets, 128), tied head
  (input scaled by C^-0.5); pad 0 = the decoder's start token, eos 1.

The stand-in eos: its row of the (tied) token table is zeroed (Marian's head bias starts at
zero), so its logit is 0, never among a random model's top candidates: every engine decodes
exactly T tokens per row (HF's ``min_new_tokens`` and CTranslate2's ``min_decoding_length``
suppress an eos none of them would pick; qkv has nothing to suppress), and the work is the
same for all. HF's ``forced_eos_token_id`` is off for the same reason.

The sources: 64 random sentences of 20-40 ids (each ending in eos, as a tokenizer frames a
source), sorted by length (what CTranslate2's ``max_batch_size`` does itself) and cut into
batches of B=16, right-padded. Every contender translates the same batches, one call per
batch, T new tokens each:

- qkv fp32: ``qkv.models.from_pretrained(dir)`` (the registry's Marian / T5 mappings),
  ``qkv.generate(model, src, attention_mask=keep, num_beams=K, max_new_tokens=T)`` under
  ``torch.inference_mode``; qkv int8: the same on ``qkv.quantize(model, "int8")``;
- HF fp32: the model itself, ``generate(src, attention_mask=keep, num_beams=K,
  do_sample=False, max_new_tokens=T, min_new_tokens=T)`` under ``torch.inference_mode``;
- CTranslate2 fp32 and int8: ``TransformersConverter(dir).convert(out, quantization=
  "float32" / "int8_float32")`` (a stand-in tokenizer whose vocabulary is "<i>"), then
  ``Translator(out, compute_type=<the same>, intra_threads=n, inter_threads=1)
  .translate_batch(batch, beam_size=K, max_decoding_length=T, min_decoding_length=T)``.

For each thread count n (``--threads``; 0 = torch's default count at start; torch gets
``torch.set_num_threads(n)``, CTranslate2 ``intra_threads=n``) the contenders alternate over
``--rounds`` rounds (the order flips each round) after one untimed round on the first batch
with ``--warm-tokens`` tokens (qkv's engine times its accepting backends then, once per
shape), with a ``--gap``-second pause before each timed call (OpenMP threads spin a while
after their last parallel region). Figures: sentences/s = 64 / the median seconds of
translating all batches (the encoder included), by ``--clock`` (wall, or this process's CPU
time: all its threads); the min-max over the rounds is printed too.

The qkv decode backend is the ``*`` line of ``qkv.generation.explain(model, batch=B,
num_beams=K)``. Agreement (printed): qkv fp32 tokens against HF fp32's (the same math:
equal but where random weights' flat logits nearly tie), qkv int8 against CTranslate2 int8
(two int8 schemes: they part after the first flip).

Ratios against the issue's goals (sentences/s over sentences/s): qkv fp32 / HF fp32 >= 2,
qkv fp32 / CT2 fp32 >= 1, qkv int8 / CT2 int8 >= 1.

CTranslate2 is a benchmark-only dependency (``pip install ctranslate2``): without it the CT2
contenders are left out (a line says so) and the rest runs.

Usage: python -m benchmarks.bench_translate [--quick] [--models marian t5]
       [--sentences 64 --batch 16 --tokens 40 --threads 1 0 --rounds 3 --gap 0.2
       --clock wall|cpu]
(``--quick``: 2 + 2 layers, C=64, V=512, 8 sentences of 5-10 ids, batch 4, 6 tokens, one
thread, one round, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks._harness import CLOCKS, load_average, print_cpu, print_table
from qkv import generate, models, quantize
from qkv.generation import explain

CT2_TYPES = {"fp32": "float32", "int8": "int8_float32"}
CONTENDERS = (("qkv", "fp32"), ("qkv", "int8"), ("HF", "fp32"), ("CT2", "fp32"),
              ("CT2", "int8"))
GOALS = ((("qkv", "fp32"), ("HF", "fp32"), 2.0), (("qkv", "fp32"), ("CT2", "fp32"), 1.0),
         (("qkv", "int8"), ("CT2", "int8"), 1.0))


def marian_config(quick: bool):
    """A ``transformers.MarianConfig`` of opus-mt-en-zh's shape (or a tiny one)."""
    from transformers import MarianConfig

    v = 512 if quick else 65001
    size = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128) \
        if quick else dict(d_model=512, encoder_layers=6, decoder_layers=6,
                           encoder_attention_heads=8, decoder_attention_heads=8,
                           encoder_ffn_dim=2048, decoder_ffn_dim=2048)
    return MarianConfig(vocab_size=v, decoder_vocab_size=v, activation_function="swish",
                        scale_embedding=True, max_position_embeddings=512, pad_token_id=v - 1,
                        eos_token_id=0, decoder_start_token_id=v - 1, forced_eos_token_id=None,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **size)


def t5_config(quick: bool):
    """A ``transformers.T5Config`` of t5-small's shape (or a tiny one)."""
    from transformers import T5Config

    size = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=512) \
        if quick else dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                           vocab_size=32128)
    return T5Config(feed_forward_proj="relu", relative_attention_num_buckets=32,
                    relative_attention_max_distance=128, dropout_rate=0.0, pad_token_id=0,
                    eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=True, **size)


def random_hf(kind: str, quick: bool, seed: int = 0):
    """The HF model of ``kind`` ("marian" / "t5") with seeded random weights, eval mode, the
    eos row of its token table zeroed (module docstring)."""
    from transformers import MarianMTModel, T5ForConditionalGeneration

    torch.manual_seed(seed)
    if kind == "marian":
        model = MarianMTModel(marian_config(quick))
    else:
        model = T5ForConditionalGeneration(t5_config(quick))
    model.eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[model.config.eos_token_id].zero_()
    return model


class StandInTokenizer:
    """What ``TransformersConverter`` reads from a tokenizer, for a model without one: token
    i is the string "<i>", but eos "</s>", pad "<pad>" and unk "<unk>"."""

    def __init__(self, vocab_size: int, eos: int, pad: int):
        self.vocab_size, self.eos, self.pad = vocab_size, eos, pad
        self.eos_token, self.pad_token, self.unk_token = "</s>", "<pad>", "<unk>"
        self.bos_token = None
        self.eos_token_id, self.pad_token_id = eos, pad

    def get_vocab(self) -> dict[str, int]:
        """String -> id for all V ids."""
        names = {self.eos: "</s>", self.pad: "<pad>", 2 if self.eos != 2 else 3: "<unk>"}
        return {names.get(i, f"<{i}>"): i for i in range(self.vocab_size)}

    def convert_ids_to_tokens(self, i: int) -> str:
        """The string of id ``i``."""
        return {v: k for k, v in self.get_vocab().items()}[i]


def convert(hf_dir: Path, out_dir: Path, quantization: str, tok: StandInTokenizer
            ) -> dict[str, int]:
    """Convert ``hf_dir`` for CTranslate2 (``quantization`` "float32" / "int8_float32") into
    ``out_dir``; returns its vocabulary, string -> id (V entries; V - 1 for Marian, whose
    converter drops the last id, the pad that HF's decoder starts from: CTranslate2 starts
    from a zero embedding instead, which that pad's row is)."""
    from ctranslate2.converters import TransformersConverter

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return tok

    Converter(str(hf_dir)).convert(str(out_dir), quantization=quantization)
    names = sorted(out_dir.glob("*vocabulary*"))
    if names[0].suffix == ".json":
        vocab = json.loads(names[0].read_text(encoding="utf-8"))
    else:
        vocab = names[0].read_text(encoding="utf-8").split("\n")[:tok.vocab_size]
    if len(vocab) not in (tok.vocab_size, tok.vocab_size - 1):
        raise RuntimeError(f"{out_dir}: vocabulary of {len(vocab)} tokens, expected "
                           f"{tok.vocab_size}")
    return {s: i for i, s in enumerate(vocab)}


def sentences(count: int, lo: int, hi: int, vocab: int, specials: tuple[int, ...],
              eos: int, seed: int = 1) -> list[list[int]]:
    """``count`` random sources of ``lo``-``hi`` ids (the last one ``eos``, no other special
    id), sorted by length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    allowed = torch.tensor([i for i in range(vocab) if i not in specials])
    for _ in range(count):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = allowed[torch.randint(0, len(allowed), (n - 1,), generator=g)].tolist()
        out.append([*ids, eos])
    return sorted(out, key=len)


def batches(sents: list[list[int]], size: int, pad: int
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(src (B, S) right-padded with ``pad``, keep (B, S) bool) of each ``size`` sentences."""
    out = []
    for i in range(0, len(sents), size):
        chunk = sents[i:i + size]
        width = max(map(len, chunk))
        src = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
        keep = torch.tensor([[True] * len(s) + [False] * (width - len(s)) for s in chunk])
        out.append((src, keep))
    return out


def qkv_run(model, data, beams: int, tokens: int) -> Callable[[], list[torch.Tensor]]:
    """qkv's translation of every batch: (B, T) new ids each."""
    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [generate(model, src, attention_mask=keep, num_beams=beams,
                             max_new_tokens=tokens)[:, 1:] for src, keep in data]
    return run


def hf_run(hf, data, beams: int, tokens: int) -> Callable[[], list[torch.Tensor]]:
    """HF's translation of every batch: (B, T) new ids each."""
    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [hf.generate(src, attention_mask=keep.long(), num_beams=beams,
                                do_sample=False, max_new_tokens=tokens,
                                min_new_tokens=tokens)[:, 1:] for src, keep in data]
    return run


def ct2_run(translator, data, beams: int, tokens: int, vocab: dict[str, int],
            names: list[str]) -> Callable[[], list[torch.Tensor]]:
    """CTranslate2's translation of every batch: (B, T) new ids each."""
    strs = [[[names[i] for i in row[k].tolist()] for row, k in zip(src, keep, strict=True)]
            for src, keep in data]

    def run() -> list[torch.Tensor]:
        out = []
        for chunk in strs:
            res = translator.translate_batch(chunk, beam_size=beams,
                                             max_decoding_length=tokens,
                                             min_decoding_length=tokens)
            out.append(torch.tensor([[vocab[s] for s in r.hypotheses[0]] for r in res]))
        return out
    return run


def agreement(ref: list[torch.Tensor], got: list[torch.Tensor]) -> list[str]:
    """Rows identical, mean leading identical tokens, tokens identical (fraction)."""
    ref, got = torch.cat(ref), torch.cat(got)
    if ref.shape != got.shape:
        return [f"shapes {tuple(ref.shape)} vs {tuple(got.shape)}", "", ""]
    same = ref == got
    lead = same.long().cumprod(dim=1).sum(dim=1).float()
    t = ref.shape[1]
    return [f"{int(same.all(dim=1).sum())} / {ref.shape[0]}", f"{lead.mean():.1f} / {t}",
            f"{same.float().mean():.4f}"]


def backend_line(model, batch: int, beams: int) -> str:
    """The backend of ``explain(model, batch=, num_beams=)``'s running line."""
    text = explain(model, batch=batch, num_beams=beams)
    line = next((s for s in text.splitlines() if s.lstrip().startswith("* ")), None)
    if line is None:
        raise RuntimeError(f"explain() names no running backend:\n{text}")
    return line.strip()[2:]


def alternate(fns: dict, warm: dict, rounds: int, gap: float, clock: str
              ) -> tuple[dict, dict]:
    """Seconds of every timed call of each function (the order flips each round, ``gap``
    seconds of sleep before each call) and each one's last output, after one untimed round
    of ``warm``."""
    now, names, outs = CLOCKS[clock], list(fns), {}
    for name in names:
        warm[name]()
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            time.sleep(gap)
            t0 = now()
            outs[name] = fns[name]()
            times[name].append(now() - t0)
    return times, outs


def bench_model(kind: str, args, have_ct2: bool, tmp: Path) -> tuple[list, list, list, list]:
    """Every contender on ``kind``'s model for each search and thread count; returns the
    rows of the speed, spread, backend and agreement tables."""
    hf = random_hf(kind, args.quick)
    c = hf.config
    vocab, eos, pad = c.vocab_size, c.eos_token_id, c.pad_token_id
    hf_dir = tmp / f"{kind}_hf"
    hf.save_pretrained(hf_dir)
    qkv_models = {"fp32": models.from_pretrained(hf_dir).eval()}
    qkv_models["int8"] = quantize(models.from_pretrained(hf_dir).eval(), "int8")
    searches = (1, 4) if kind == "marian" else (1,)
    tok = StandInTokenizer(vocab, eos, pad)
    ct2_vocab, names = None, None
    if have_ct2:
        import ctranslate2

        for qtype in CT2_TYPES.values():
            ct2_vocab = convert(hf_dir, tmp / f"{kind}_ct2_{qtype}", qtype, tok)
        names = ["<pad>"] * vocab
        for s, i in ct2_vocab.items():
            names[i] = s
    lo, hi = args.lengths
    sents = sentences(args.sentences, lo, hi, vocab, (eos, pad, 2, 3), eos)
    data = batches(sents, args.batch, pad)
    contenders = [x for x in CONTENDERS if have_ct2 or x[0] != "CT2"]
    speed, spread, backend_rows, agree_rows = [], [], [], []
    default = torch.get_num_threads()
    for n in [default if t == 0 else t for t in args.threads]:
        torch.set_num_threads(n)
        translators = {}
        if have_ct2:
            translators = {prec: ctranslate2.Translator(
                str(tmp / f"{kind}_ct2_{qtype}"), device="cpu", compute_type=qtype,
                intra_threads=n, inter_threads=1) for prec, qtype in CT2_TYPES.items()}
        for beams in searches:
            fns, warm = {}, {}
            for d, sub, steps in ((fns, data, args.tokens), (warm, data[:1],
                                                              args.warm_tokens)):
                for engine, prec in contenders:
                    d[(engine, prec)] = (
                        qkv_run(qkv_models[prec], sub, beams, steps) if engine == "qkv" else
                        hf_run(hf, sub, beams, steps) if engine == "HF" else
                        ct2_run(translators[prec], sub, beams, steps, ct2_vocab, names))
            times, outs = alternate(fns, warm, args.rounds, args.gap, args.clock)
            for prec in ("fp32", "int8"):
                backend_rows.append([kind, f"qkv {prec}", str(beams), str(n),
                                     backend_line(qkv_models[prec], args.batch, beams)])
            for key in times:
                shapes = {tuple(o.shape[1:]) for o in outs[key]}
                if shapes != {(args.tokens,)}:
                    raise RuntimeError(f"{kind} {key}: outputs of {shapes} tokens, expected "
                                       f"{args.tokens}")
            search = "greedy" if beams == 1 else f"beam {beams}"
            s = args.sentences
            speed.append([kind, search, str(n)] + [
                f"{s / statistics.median(times[x]):.2f}" for x in contenders])
            spread.append([kind, search, str(n)] + [
                f"{s / max(times[x]):.2f}-{s / min(times[x]):.2f}" for x in contenders])
            agree_rows.append([kind, search, str(n), "qkv fp32 vs HF fp32",
                               *agreement(outs[("HF", "fp32")], outs[("qkv", "fp32")])])
            if have_ct2:
                agree_rows.append([kind, search, str(n), "qkv int8 vs CT2 int8",
                                   *agreement(outs[("CT2", "int8")], outs[("qkv", "int8")])])
                agree_rows.append([kind, search, str(n), "CT2 fp32 vs HF fp32",
                                   *agreement(outs[("HF", "fp32")], outs[("CT2", "fp32")])])
            for key in contenders:
                med = statistics.median(times[key])
                speed_key = (kind, search, n, key)
                args.medians[speed_key] = med
            print(f"timed {kind} {search} threads={n}: "
                  f"{sum(map(sum, times.values())):.0f} s", file=sys.stderr, flush=True)
        del translators
    torch.set_num_threads(default)
    return speed, spread, backend_rows, agree_rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny models, 8 short sentences, batch 4, 6 tokens, one thread, one "
                        "round")
    p.add_argument("--models", nargs="+", choices=("marian", "t5"), default=["marian", "t5"])
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs=2, default=[20, 40],
                   help="the shortest and longest source, in ids")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=40, help="new tokens T per sentence")
    p.add_argument("--warm-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                   help="thread counts; 0 = torch's default")
    p.add_argument("--rounds", type=int, default=3, help="timed alternating rounds")
    p.add_argument("--gap", type=float, default=0.2, help="seconds of sleep before each call")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    args = p.parse_args(argv)
    if args.quick:
        args.sentences, args.lengths, args.batch, args.tokens = 8, [5, 10], 4, 6
        args.threads, args.rounds, args.gap, args.warm_tokens = [1], 1, 0.0, 3
    if min(args.sentences, args.batch, args.tokens, args.rounds, args.warm_tokens,
           *args.lengths) < 1 or min(args.threads) < 0 or args.lengths[0] > args.lengths[1]:
        p.error("--sentences, --batch, --tokens, --rounds, --warm-tokens and --lengths must "
                "be >= 1 (lengths in order), --threads >= 0")
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    have_ct2 = ctranslate2 is not None
    print("command: python -m benchmarks.bench_translate "
          + shlex.join(sys.argv[1:] if argv is None else argv))
    print_cpu()
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if have_ct2:
        versions += f", ctranslate2 {ctranslate2.__version__}"
    print(f"{versions}; default threads {torch.get_num_threads()}; load average at start "
          f"{load_average()}")
    if not have_ct2:
        print("CTranslate2 contenders skipped: ctranslate2 is not installed "
              "(pip install ctranslate2)")
    print(f"{args.sentences} sentences of {args.lengths[0]}-{args.lengths[1]} ids, batch "
          f"{args.batch}, T={args.tokens} new tokens each, {args.rounds} round(s), "
          f"{args.clock} clock")
    contenders = [x for x in CONTENDERS if have_ct2 or x[0] != "CT2"]
    args.medians = {}
    tables = [[], [], [], []]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            for table, rows in zip(tables, bench_model(kind, args, have_ct2, Path(tmp)),
                                   strict=True):
                table.extend(rows)
    speed, spread, backend_rows, agree_rows = tables
    names = [f"{e} {p}" for e, p in contenders]
    print_table("qkv decode backend (the running line of qkv.generation.explain)",
                ["model", "qkv", "beams", "threads", "backend"], backend_rows)
    print_table(f"sentences/s ({args.sentences} / median {args.clock} seconds of translating "
                f"them, the encoder included)", ["model", "search", "threads", *names], speed)
    print_table("min-max sentences/s over the rounds", ["model", "search", "threads", *names],
                spread)
    goal_rows = []
    for (kind, search, n, key), med in args.medians.items():
        for mine, theirs, goal in GOALS:
            if key != mine or (kind, search, n, theirs) not in args.medians:
                continue
            ratio = args.medians[(kind, search, n, theirs)] / med
            goal_rows.append([kind, search, str(n), f"{' '.join(mine)} / {' '.join(theirs)}",
                              f"{ratio:.2f}x", f">= {goal:.1f}x",
                              "met" if ratio >= goal else "not met"])
    print_table("ratios of sentences/s against the issue's goals",
                ["model", "search", "threads", "ratio", "measured", "goal", ""], goal_rows)
    print_table(f"agreement, T={args.tokens}", ["model", "search", "threads", "pair",
                                                  "rows identical", "mean leading identical",
                                                  "tokens identical"], agree_rows)
    print(f"\nload average at the end: {load_average()}")


if __name__ == "__main__":
    main()
