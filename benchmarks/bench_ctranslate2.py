"""Greedy CPU decoding: qkv against CTranslate2, fp32 and int8, side by side.

Shapes: B batch, N prompt length, T new tokens, C width, L layers, V vocab.

One HF ``GPT2LMHeadModel`` with random weights (seeded; ``GPT2Config()`` defaults: GPT-2
small, L=12, C=768, V=50257) is saved with safetensors into a temporary directory. qkv loads
that directory with ``qkv.models.from_pretrained`` (fp32) and ``qkv.quantize(model, "int8")``
(int8 weights with per-output-channel scales, per-row dynamic activation scales). CTranslate2
converts the same directory with ``ctranslate2.converters.TransformersConverter`` twice:
``quantization="float32"`` and ``quantization="int8_float32"`` (int8 weights, everything
else fp32; on this fp32 model plain ``"int8"`` resolves to the same type), each run by a
``ctranslate2.Generator(device="cpu", compute_type=<the same>, inter_threads=1,
intra_threads=n)``. The model has no tokenizer: the converter is handed a stand-in whose
vocabulary is the strings "<i>" (id i; the last id is "<|endoftext|>", GPT-2's eos), and the
id <-> string maps are read back from the vocabulary.json the converter writes.

Every run generates exactly T new tokens greedily from the same random N-token prompts (B=1:
the first row of the B=16 prompts; no padding): ``qkv.generate(model, ids,
max_new_tokens=T)`` under ``torch.inference_mode`` (no eos); CTranslate2 ``generate_batch``
with ``sampling_topk=1, max_length=T, min_length=T, include_prompt_in_result=False`` (its
lengths count new tokens only; the prompt is forwarded at once, as qkv's prefill). Each
output is checked to hold T tokens per row. For each thread count (1, and torch's default
``torch.get_num_threads()`` at start; torch gets ``torch.set_num_threads(n)``, CTranslate2
``intra_threads=n``) and each batch size, the four contenders alternate over ``--rounds``
rounds (the order flips each round) after ``--warmup`` untimed rounds of 16-token runs, with
a ``--gap``-second pause before every timed call (so that one engine's OpenMP threads,
which spin a while after their last parallel region, do not eat into the next engine's
time). The table shows the median ms per token step: the wall time of one generate call /
T, the prompt's forward included; and speed qkv vs CT2 = CT2 time / qkv time (> 1: qkv
faster).

Greedy agreement: HF ``GPT2LMHeadModel.generate(do_sample=False, max_new_tokens=T,
min_new_tokens=T)`` in fp32 on the B=1 prompt is the reference; for each engine, precision and
thread count, the number of leading tokens identical to HF's and the total identical out of
T. (Random weights give flat logits: int8 rounding flips an argmax where the top two
logits nearly tie, and after the first difference the sequences go apart.)

int8 weight-read limit: a B=1 decode step reads every int8 weight of the linear layers and
the LM head once (L·(3C² + C² + 4C² + 4C²) + V·C bytes; the embeddings, norms, scales and
KV cache are left out, so the limit is optimistic). The machine's streaming read bandwidth is
measured in the same run at each thread count: ``torch.sum`` over a ``--bw-mib`` MiB fp32
tensor, best of 7. Limit = bytes / bandwidth = the least ms per token at B=1; the table
gives limit / measured for qkv int8 and CT2 int8 (1 = at the limit; the measured time also
holds the prompt's forward).

CTranslate2 is a benchmark-only dependency (``pip install -e ".[bench]"``): without it the
script prints a one-line hint and exits 0.

Usage: python -m benchmarks.bench_ctranslate2 [--quick] [--tokens 128 --prompt 16
       --batches 1 16 --rounds 3 --warmup 1 --gap 0.2 --bw-mib 512]
(``--quick``: a tiny GPT-2 (C=64, L=2, V=512), 8 tokens, batches 1 and 4, one round.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._harness import load_average, print_cpu, print_table
from qkv import generate, models, quantize

EOS = "<|endoftext|>"
WARM_TOKENS = 16  # new tokens of a warm-up run


class StandInTokenizer:
    """What ``TransformersConverter`` reads from a tokenizer (``get_vocab``, bos/eos/unk),
    for a model without one: token i is the string "<i>", the last id is ``EOS``."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bos_token = self.eos_token = self.unk_token = EOS

    def get_vocab(self) -> dict[str, int]:
        """String -> id for all V ids."""
        last = self.vocab_size - 1
        return {(EOS if i == last else f"<{i}>"): i for i in range(self.vocab_size)}


def gpt2_config(quick: bool):
    """GPT-2 small (``GPT2Config()`` defaults), or a tiny one for ``--quick``."""
    from transformers import GPT2Config

    if quick:
        return GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=512, n_positions=64,
                          bos_token_id=511, eos_token_id=511)
    return GPT2Config()


def convert(hf_dir: Path, out_dir: Path, quantization: str, vocab_size: int) -> list[str]:
    """Convert ``hf_dir`` for CTranslate2 (``quantization``: "float32" or "int8_float32")
    into ``out_dir``; returns the vocabulary it wrote (id -> string, V entries)."""
    from ctranslate2.converters import TransformersConverter

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return StandInTokenizer(vocab_size)

    Converter(str(hf_dir)).convert(str(out_dir), quantization=quantization)
    if (out_dir / "vocabulary.json").exists():
        vocab = json.loads((out_dir / "vocabulary.json").read_text(encoding="utf-8"))
    else:
        vocab = (out_dir / "vocabulary.txt").read_text(encoding="utf-8").split("\n")[:vocab_size]
    if len(vocab) != vocab_size:
        raise RuntimeError(f"{out_dir}: vocabulary of {len(vocab)} tokens, expected {vocab_size}")
    return vocab


def ct2_run(generator, prompts: list[list[str]], tokens: int, str_to_id: dict[str, int]):
    """A CTranslate2 greedy run of exactly ``tokens`` new tokens; returns the (B, T) ids."""

    def run() -> torch.Tensor:
        results = generator.generate_batch(prompts, max_length=tokens, min_length=tokens,
                                           sampling_topk=1, beam_size=1,
                                           include_prompt_in_result=False)
        return torch.tensor([[str_to_id[s] for s in r.sequences[0]] for r in results])

    return run


def qkv_run(model: torch.nn.Module, ids: torch.Tensor, tokens: int):
    """A qkv greedy run of exactly ``tokens`` new tokens from ``ids`` (B, N); (B, T) ids."""

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return generate(model, ids, max_new_tokens=tokens, eos_token_id=None)[:, -tokens:]

    return run


def alternate(fns: dict, warm: dict, warmup: int, rounds: int,
              gap: float) -> tuple[dict, dict]:
    """Wall seconds of every timed call of each function of ``fns`` (the order flips every
    round, ``gap`` seconds of sleep before each call) and each one's last output; first
    ``warmup`` untimed rounds of the short runs ``warm`` (the same keys)."""
    names, outs = list(fns), {}
    for _ in range(warmup):
        for name in names:
            warm[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            time.sleep(gap)
            t0 = time.perf_counter()
            outs[name] = fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times, outs


def read_bandwidth(mib: int, repeat: int = 7) -> float:
    """Streaming read bandwidth in bytes/s at torch's current thread count: ``torch.sum``
    over a ``mib`` MiB fp32 tensor, best of ``repeat``."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeat + 1):  # the first call is a warm-up
        t0 = time.perf_counter()
        torch.sum(x)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def agreement(ref: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(leading tokens identical, total tokens identical) of two (T,) id rows."""
    same = (ref == out).tolist()
    lead = same.index(False) if False in same else len(same)
    return lead, sum(same)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny GPT-2, few tokens, one round")
    p.add_argument("--tokens", type=int, default=128, help="new tokens T")
    p.add_argument("--prompt", type=int, default=16, help="prompt length N")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3, help="timed alternating rounds")
    p.add_argument("--warmup", type=int, default=1,
                   help=f"untimed rounds of {WARM_TOKENS}-token runs first")
    p.add_argument("--gap", type=float, default=0.2, help="seconds of sleep before each call")
    p.add_argument("--bw-mib", type=int, default=512, help="bandwidth tensor size (MiB)")
    args = p.parse_args(argv)
    try:
        import ctranslate2
    except ImportError:
        print("bench_ctranslate2: skipped, ctranslate2 is not installed "
              "(pip install -e \".[bench]\" or pip install ctranslate2)")
        return

    if args.quick:
        args.tokens, args.prompt, args.batches = 8, 4, [1, 4]
        args.rounds, args.warmup, args.gap, args.bw_mib = 1, 1, 0.0, 16
    if args.tokens < 1 or args.prompt < 1 or args.rounds < 1 or min(args.batches) < 1:
        p.error("--tokens, --prompt, --rounds and --batches must be >= 1")
    if 1 not in args.batches:
        p.error("--batches must include 1 (agreement and the weight-read limit are at B=1)")
    t, default_threads = args.tokens, torch.get_num_threads()
    thread_counts = sorted({1, default_threads})
    print("command: python -m benchmarks.bench_ctranslate2 "
          + shlex.join(sys.argv[1:] if argv is None else argv))
    print_cpu()
    print(f"torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}; torch's default "
          f"thread count {default_threads}; load average at start {load_average()}")

    from transformers import GPT2LMHeadModel

    cfg = gpt2_config(args.quick)
    c, n_layer, v = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    ffn = cfg.n_inner or 4 * c
    print(f"model: random-weight HF GPT-2, L={n_layer} C={c} H={cfg.n_head} V={v}; "
          f"N={args.prompt} T={t} greedy, batches {args.batches}, threads {thread_counts}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(cfg).eval()
        hf.save_pretrained(hf_dir, safe_serialization=True)
        torch.manual_seed(1)
        prompt_ids = torch.randint(0, v - 1, (max(args.batches), args.prompt))  # (B, N), no eos
        with torch.inference_mode():
            ref = hf.generate(prompt_ids[:1], attention_mask=torch.ones_like(prompt_ids[:1]),
                              do_sample=False, max_new_tokens=t, min_new_tokens=t,
                              pad_token_id=v - 1)[0, -t:]  # (T,)
        del hf

        ct2_types = {"fp32": "float32", "int8": "int8_float32"}
        vocab = None
        for qtype in ct2_types.values():
            got = convert(hf_dir, Path(tmp) / f"ct2_{qtype}", qtype, v)
            if vocab is not None and got != vocab:
                raise RuntimeError("the two CTranslate2 conversions wrote different vocabularies")
            vocab = got
        str_to_id = {s: i for i, s in enumerate(vocab)}
        print("CTranslate2 model.bin: " + ", ".join(
            f"{qtype} {(Path(tmp) / f'ct2_{qtype}' / 'model.bin').stat().st_size / 1e6:.1f} MB"
            for qtype in ct2_types.values()))
        qkv_models = {"fp32": models.from_pretrained(hf_dir)}
        qkv_models["int8"] = quantize(models.from_pretrained(hf_dir), "int8")
        int8_bytes_formula = n_layer * (3 * c * c + c * c + 2 * c * ffn) + v * c
        int8_bytes_model = sum(x.numel() for x in qkv_models["int8"].state_dict().values()
                               if x.dtype == torch.int8)

        med: dict[tuple, float] = {}  # (engine, prec, batch, threads) -> seconds
        spread: dict[tuple, str] = {}
        agree_rows, bandwidth, resolved = [], {}, {}
        loads = [load_average()]
        for n in thread_counts:
            torch.set_num_threads(n)
            bandwidth[n] = read_bandwidth(args.bw_mib)
            gens = {prec: ctranslate2.Generator(str(Path(tmp) / f"ct2_{qtype}"), device="cpu",
                                                compute_type=qtype, intra_threads=n,
                                                inter_threads=1)
                    for prec, qtype in ct2_types.items()}
            resolved.update({prec: g.compute_type for prec, g in gens.items()})
            for b in args.batches:
                ids = prompt_ids[:b]  # (B, N)
                strs = [[vocab[i] for i in row] for row in ids.tolist()]
                fns, warm = {}, {}
                for prec in ("fp32", "int8"):
                    for d, steps in ((fns, t), (warm, min(t, WARM_TOKENS))):
                        d[("qkv", prec)] = qkv_run(qkv_models[prec], ids, steps)
                        d[("CT2", prec)] = ct2_run(gens[prec], strs, steps, str_to_id)
                times, outs = alternate(fns, warm, args.warmup, args.rounds, args.gap)
                for key, ts in times.items():
                    if tuple(outs[key].shape) != (b, t):
                        raise RuntimeError(f"{key}: output {tuple(outs[key].shape)}, expected "
                                           f"({b}, {t})")
                    med[(*key, b, n)] = statistics.median(ts)
                    spread[(*key, b, n)] = f"{min(ts) / t * 1e3:.2f}-{max(ts) / t * 1e3:.2f}"
                print(f"timed B={b} threads={n}: {sum(map(sum, times.values())):.0f} s",
                      file=sys.stderr, flush=True)
                if b == 1:
                    for (engine, prec), out in outs.items():
                        lead, total = agreement(ref, out[0])
                        agree_rows.append([f"{engine} {prec}", str(n), f"{lead} / {t}",
                                           f"{total} / {t}"])
                loads.append(load_average())
            del gens
        torch.set_num_threads(default_threads)

    print(f"CTranslate2 compute types as loaded: fp32 -> {resolved['fp32']}, "
          f"int8 -> {resolved['int8']}")
    rows, spread_rows = [], []
    for n in thread_counts:
        for b in args.batches:
            row = [str(b), str(n)]
            for prec in ("fp32", "int8"):
                q, k = med[("qkv", prec, b, n)], med[("CT2", prec, b, n)]
                row += [f"{q / t * 1e3:.2f}", f"{k / t * 1e3:.2f}", f"{k / q:.2f}x"]
            rows.append(row)
            spread_rows.append([str(b), str(n)] + [spread[(e, prec, b, n)] for prec in
                                                   ("fp32", "int8") for e in ("qkv", "CT2")])
    print_table(f"ms per token step (wall time of one generate call / {t}, the {args.prompt}-"
                f"token prompt's forward included), median of {args.rounds} alternating "
                f"round(s); speed = CT2 time / qkv time (> 1: qkv faster)",
                ["B", "threads", "qkv fp32", "CT2 fp32", "speed fp32", "qkv int8",
                 "CT2 int8_float32", "speed int8"], rows)
    print_table("min-max ms per token step over the rounds",
                ["B", "threads", "qkv fp32", "CT2 fp32", "qkv int8", "CT2 int8_float32"],
                spread_rows)
    print(f"\nload average during the run: {' -> '.join(loads)}")

    print_table(f"greedy agreement with HF GPT2LMHeadModel.generate fp32, B=1, T={t}",
                ["engine", "threads", "leading identical", "total identical"], agree_rows)

    lim_rows = []
    for n in thread_counts:
        limit = int8_bytes_formula / bandwidth[n]  # seconds per token
        lim_rows.append([str(n), f"{bandwidth[n] / 1e9:.1f}", f"{limit * 1e3:.2f}",
                         f"{med[('qkv', 'int8', 1, n)] / t * 1e3:.2f}",
                         f"{limit / (med[('qkv', 'int8', 1, n)] / t):.2f}",
                         f"{med[('CT2', 'int8', 1, n)] / t * 1e3:.2f}",
                         f"{limit / (med[('CT2', 'int8', 1, n)] / t):.2f}"])
    print_table(f"int8 weight-read limit at B=1: {int8_bytes_formula / 1e6:.1f} MB of int8 "
                f"weights (linear layers + LM head) / read bandwidth (torch.sum over a "
                f"{args.bw_mib} MiB fp32 tensor, best of 7)",
                ["threads", "read GB/s", "limit ms/token", "qkv int8 ms/token",
                 "qkv limit / measured", "CT2 int8 ms/token", "CT2 limit / measured"], lim_rows)
    print(f"\nint8 weight bytes: {int8_bytes_formula} from the config; the qkv int8 model holds "
          f"{int8_bytes_model} bytes of int8 tensors")


if __name__ == "__main__":
    main()
