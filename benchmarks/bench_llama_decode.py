"""Greedy decoding of a Llama-family checkpoint (SmolLM2-135M's shape, random weights): qkv fp32
and int8 against HF ``LlamaForCausalLM.generate`` fp32 and CTranslate2 fp32 and int8, side by
side in one run.

Shapes: B batch, N prompt length, T new tokens, C width, L layers, H query heads, Hkv key/value
heads, F FFN width, V vocab.

The model: ``transformers.LlamaConfig`` of SmolLM2-135M's shape (L=30, C=576, H=9, Hkv=3,
F=1536, V=49152, tied embeddings, rope_theta 100000, rms_norm_eps 1e-5, SiLU-gated FFN),
seeded random weights (``LlamaForCausalLM(config)``), saved with ``save_pretrained`` into a
temporary directory. The last vocabulary id is the stand-in eos: its row of the tied embedding
table is zeroed before saving, so its logit is exactly 0 and never the argmax (every engine
then decodes the same T tokens whether or not it suppresses eos before T: HF's and
CTranslate2's minimum lengths do, qkv's ``eos_token_id=None`` has none to suppress).

Contenders, every one greedy, exactly T new tokens per row from the same random N-token prompts
(B=1: the first row of the B=16 prompts; no padding), fp32 activations on the CPU:

- qkv fp32: ``qkv.models.from_pretrained(dir)``, ``qkv.generate(model, ids,
  max_new_tokens=T, eos_token_id=None)`` under ``torch.inference_mode``;
- qkv int8: ``qkv.quantize(qkv.models.from_pretrained(dir), "int8")``, the same call;
- HF fp32: the ``LlamaForCausalLM`` itself (sdpa attention), ``generate(ids,
  attention_mask=1, do_sample=False, max_new_tokens=T, min_new_tokens=T)`` (its dynamic KV
  cache) under ``torch.inference_mode``;
- CTranslate2 fp32 and int8: ``TransformersConverter(dir).convert(out, quantization=
  "float32" / "int8_float32")`` (int8 weights, everything else fp32; a stand-in tokenizer
  whose vocabulary is "<i>", as benchmarks/bench_ctranslate2.py), ``Generator(out,
  compute_type=<the same>, intra_threads=n, inter_threads=1).generate_batch(prompts,
  sampling_topk=1, beam_size=1, min_length=T, max_length=T, include_prompt_in_result=False)``.

For each thread count n (``--threads``; torch gets ``torch.set_num_threads(n)``, CTranslate2
``intra_threads=n``) and batch size, the contenders alternate over ``--rounds`` rounds (the
order flips each round) after ``--warmup`` untimed rounds of 16-token runs, with a
``--gap``-second pause before each timed call (OpenMP threads spin a while after their last
parallel region). Figures: tokens/s = B·T / (median seconds of one generate call, the prompt's
forward included), by ``--clock`` (wall, or this process's CPU time: all its threads); a
second table gives the slowest and fastest round.

The qkv decode backend that runs for each (precision, B, n) is the ``*`` line of
``qkv.generation.explain(model, batch=B)`` (the engine times the accepting backends once per
process and remembers the winner, so under load a measurement can pick a slower one: the
explain text shows the figures it chose by).

Agreement (printed): each contender's tokens against HF fp32's at the same B and n: rows
identical, mean leading identical tokens, total identical fraction. qkv fp32 is expected to
equal HF fp32 token for token; int8 rounding flips the argmax where the top two logits nearly
tie (random weights give flat logits), after which a row goes its own way.

Ratios against the issue's goals (tokens/s over tokens/s): qkv fp32 / HF fp32 >= 1.5, qkv fp32
/ CT2 fp32 >= 1.0, qkv int8 / CT2 int8 >= 1.5.

CTranslate2 is a benchmark-only dependency (``pip install -e ".[bench]"``): without it the CT2
contenders are left out (a line says so) and the rest runs.

Usage: python -m benchmarks.bench_llama_decode [--quick] [--tokens 128 --prompt 16
       --batches 1 16 --threads 1 2 --rounds 3 --warmup 1 --gap 0.2 --layers 30
       --clock wall|cpu]
(``--quick``: 2 layers, V=4096, 8 tokens, a 4-token prompt, batches 1 and 4, one thread, one
round, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks._harness import CLOCKS, load_average, print_cpu, print_table
from benchmarks.bench_ctranslate2 import agreement, convert, ct2_run, qkv_run
from qkv import models, quantize
from qkv.generation import explain

WARM_TOKENS = 16  # new tokens of a warm-up run
CT2_TYPES = {"fp32": "float32", "int8": "int8_float32"}
CONTENDERS = (("qkv", "fp32"), ("qkv", "int8"), ("HF", "fp32"), ("CT2", "fp32"),
              ("CT2", "int8"))
GOALS = ((("qkv", "fp32"), ("HF", "fp32"), 1.5), (("qkv", "fp32"), ("CT2", "fp32"), 1.0),
         (("qkv", "int8"), ("CT2", "int8"), 1.5))


def llama_config(layers: int = 30, vocab: int = 49152):
    """A ``transformers.LlamaConfig`` of SmolLM2-135M's shape (C=576, H=9, Hkv=3, F=1536,
    tied embeddings, rope_theta 1e5, rms_norm_eps 1e-5) with ``layers`` layers and a
    ``vocab``-token vocabulary whose last id is bos/eos/pad (``zero_last_token``)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, hidden_size=576, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=1536, vocab_size=vocab,
                       tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                       hidden_act="silu", max_position_embeddings=8192,
                       bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=vocab - 1)


def random_llama(config, seed: int = 0):
    """``LlamaForCausalLM(config)`` with seeded random weights, eval mode, the last token's
    embedding row zeroed (``zero_last_token``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    zero_last_token(model)
    return model


def zero_last_token(hf) -> None:
    """Zero the last id's row of the (tied) embedding table in place: its logit is then 0,
    which a random model's largest logit over V ids always exceeds, so no greedy decoder picks
    the stand-in eos and none stops or suppresses differently."""
    with torch.no_grad():
        hf.get_input_embeddings().weight[-1].zero_()


def hf_run(hf, ids: torch.Tensor, tokens: int) -> Callable[[], torch.Tensor]:
    """An HF greedy run of exactly ``tokens`` new tokens from ``ids`` (B, N); (B, T) ids."""
    mask = torch.ones_like(ids)
    eos = hf.config.eos_token_id

    def run() -> torch.Tensor:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                              min_new_tokens=tokens, eos_token_id=eos, pad_token_id=eos)
        return out[:, -tokens:]

    return run


def alternate(fns: dict, warm: dict, warmup: int, rounds: int, gap: float,
              clock: str) -> tuple[dict, dict]:
    """Seconds (``CLOCKS[clock]``) of every timed call of each function of ``fns`` (the
    order flips every round, ``gap`` seconds of sleep before each call, outside the timing)
    and each one's last output; first ``warmup`` untimed rounds of the short runs ``warm``
    (the same keys)."""
    now, names, outs = CLOCKS[clock], list(fns), {}
    for _ in range(warmup):
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


def chosen_backend(model: torch.nn.Module, batch: int) -> str:
    """The line of ``explain(model, batch=batch)`` naming the backend that runs, stripped."""
    text = explain(model, batch=batch)
    line = next((s for s in text.splitlines() if s.lstrip().startswith("* ")), None)
    if line is None:
        raise RuntimeError(f"explain() names no running backend:\n{text}")
    return line.strip()[2:]


def agree_row(name: str, ref: torch.Tensor, out: torch.Tensor) -> list[str]:
    """Agreement of ``out`` (B, T) with ``ref`` (B, T): rows identical, mean leading
    identical tokens, total identical fraction."""
    b, t = ref.shape
    per_row = [agreement(ref[i], out[i]) for i in range(b)]
    rows_same = sum(total == t for _, total in per_row)
    lead = statistics.mean(lead for lead, _ in per_row)
    total = sum(total for _, total in per_row)
    return [name, f"{rows_same} / {b}", f"{lead:.1f} / {t}", f"{total / (b * t):.4f}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 layers, V=4096, 8 tokens, batches 1 and 4, one thread, one round")
    p.add_argument("--tokens", type=int, default=128, help="new tokens T")
    p.add_argument("--prompt", type=int, default=16, help="prompt length N")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="timed alternating rounds")
    p.add_argument("--warmup", type=int, default=1,
                   help=f"untimed rounds of {WARM_TOKENS}-token runs first")
    p.add_argument("--gap", type=float, default=0.2, help="seconds of sleep before each call")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    args = p.parse_args(argv)
    vocab = 49152
    if args.quick:
        args.tokens, args.prompt, args.batches, args.threads = 8, 4, [1, 4], [1]
        args.layers, args.rounds, args.warmup, args.gap, vocab = 2, 1, 1, 0.0, 4096
    if min(args.tokens, args.prompt, args.rounds, args.layers, *args.batches,
           *args.threads) < 1:
        p.error("--tokens, --prompt, --rounds, --layers, --batches and --threads must be >= 1")
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    have_ct2 = ctranslate2 is not None
    t = args.tokens
    print("command: python -m benchmarks.bench_llama_decode "
          + shlex.join(sys.argv[1:] if argv is None else argv))
    print_cpu()
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if have_ct2:
        versions += f", ctranslate2 {ctranslate2.__version__}"
    print(f"{versions}; load average at start {load_average()}")
    if not have_ct2:
        print("CTranslate2 contenders skipped: ctranslate2 is not installed "
              "(pip install -e \".[bench]\" or pip install ctranslate2)")
    contenders = [c for c in CONTENDERS if have_ct2 or c[0] != "CT2"]

    cfg = llama_config(args.layers, vocab)
    print(f"model: random-weight HF LlamaForCausalLM, L={cfg.num_hidden_layers} "
          f"C={cfg.hidden_size} H={cfg.num_attention_heads} Hkv={cfg.num_key_value_heads} "
          f"F={cfg.intermediate_size} V={vocab}, tied, "
          f"rope_theta={cfg.rope_parameters['rope_theta']:g}; "
          f"N={args.prompt} T={t} greedy; batches {args.batches}, threads {args.threads}, "
          f"{args.rounds} round(s), {args.clock} clock")
    default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        hf = random_llama(cfg)
        hf.save_pretrained(hf_dir)
        print(f"HF attention implementation: {hf.config._attn_implementation}")
        qkv_models = {"fp32": models.from_pretrained(hf_dir).eval()}
        qkv_models["int8"] = quantize(models.from_pretrained(hf_dir).eval(), "int8")
        print(f"qkv model: {type(qkv_models['fp32']).__name__}")
        vocab_strs = None
        if have_ct2:
            for qtype in CT2_TYPES.values():
                vocab_strs = convert(hf_dir, Path(tmp) / f"ct2_{qtype}", qtype, vocab)
            str_to_id = {s: i for i, s in enumerate(vocab_strs)}
        torch.manual_seed(1)
        prompt_ids = torch.randint(0, vocab - 1, (max(args.batches), args.prompt))  # (B, N)

        med: dict[tuple, float] = {}  # (engine, prec, batch, threads) -> seconds
        spread: dict[tuple, str] = {}  # the same keys -> "min-max" tokens/s over the rounds
        backend_rows, agree_rows, loads = [], [], [load_average()]
        compute_types = {}
        for n in args.threads:
            torch.set_num_threads(n)
            gens = {}
            if have_ct2:
                gens = {prec: ctranslate2.Generator(
                    str(Path(tmp) / f"ct2_{qtype}"), device="cpu", compute_type=qtype,
                    intra_threads=n, inter_threads=1) for prec, qtype in CT2_TYPES.items()}
                compute_types.update({prec: g.compute_type for prec, g in gens.items()})
            for b in args.batches:
                ids = prompt_ids[:b]  # (B, N)
                strs = [[vocab_strs[i] for i in row] for row in ids.tolist()] if gens else []
                fns, warm = {}, {}
                for d, steps in ((fns, t), (warm, min(t, WARM_TOKENS))):
                    for engine, prec in contenders:
                        d[(engine, prec)] = (
                            qkv_run(qkv_models[prec], ids, steps) if engine == "qkv" else
                            hf_run(hf, ids, steps) if engine == "HF" else
                            ct2_run(gens[prec], strs, steps, str_to_id))
                for prec in ("fp32", "int8"):
                    backend_rows.append([f"qkv {prec}", str(b), str(n),
                                         chosen_backend(qkv_models[prec], b)])
                times, outs = alternate(fns, warm, args.warmup, args.rounds, args.gap,
                                        args.clock)
                for key, ts in times.items():
                    if tuple(outs[key].shape) != (b, t):
                        raise RuntimeError(f"{key}: output {tuple(outs[key].shape)}, expected "
                                           f"({b}, {t})")
                    med[(*key, b, n)] = statistics.median(ts)
                    spread[(*key, b, n)] = f"{b * t / max(ts):.1f}-{b * t / min(ts):.1f}"
                ref = outs[("HF", "fp32")]
                for key in contenders:
                    if key != ("HF", "fp32"):
                        agree_rows.append([str(b), str(n),
                                           *agree_row(f"{key[0]} {key[1]}", ref, outs[key])])
                if have_ct2:
                    agree_rows.append([str(b), str(n), *agree_row(
                        "qkv int8 vs CT2 int8 (not HF)", outs[("CT2", "int8")],
                        outs[("qkv", "int8")])])
                loads.append(load_average())
                print(f"timed B={b} threads={n}: {sum(map(sum, times.values())):.0f} s",
                      file=sys.stderr, flush=True)
            del gens
        torch.set_num_threads(default_threads)

    if compute_types:
        print(f"CTranslate2 compute types as loaded: fp32 -> {compute_types['fp32']}, "
              f"int8 -> {compute_types['int8']}")
    print_table("qkv decode backend (the running line of qkv.generation.explain)",
                ["model", "B", "threads", "backend"], backend_rows)
    names = [f"{e} {p}" for e, p in contenders]
    rows = []
    for n in args.threads:
        for b in args.batches:
            rows.append([str(b), str(n)] + [f"{b * t / med[(*c, b, n)]:.1f}"
                                            for c in contenders])
    print_table(f"tokens/s (B·T / median {args.clock} seconds of one generate call, the "
                f"{args.prompt}-token prompt's forward included), {args.rounds} alternating "
                f"round(s)", ["B", "threads", *names], rows)
    print_table("min-max tokens/s over the rounds", ["B", "threads", *names],
                [[str(b), str(n)] + [spread[(*c, b, n)] for c in contenders]
                 for n in args.threads for b in args.batches])
    goal_rows = []
    for mine, theirs, goal in GOALS:
        if theirs not in contenders:
            continue
        for n in args.threads:
            for b in args.batches:
                ratio = med[(*theirs, b, n)] / med[(*mine, b, n)]  # tokens/s over tokens/s
                goal_rows.append([f"{' '.join(mine)} / {' '.join(theirs)}", str(b), str(n),
                                  f"{ratio:.2f}x", f">= {goal:.1f}x",
                                  "met" if ratio >= goal else "not met"])
    print_table("ratios of tokens/s against the issue's goals",
                ["ratio", "B", "threads", "measured", "goal", ""], goal_rows)
    print_table(f"greedy agreement with HF fp32 at the same B and threads, T={t}",
                ["B", "threads", "contender", "rows identical", "mean leading identical",
                 "tokens identical"], agree_rows)
    print(f"\nload average during the run: {' -> '.join(loads)}")


if __name__ == "__main__":
    main()
