"""Greedy generation: ``qkv.generate`` vs HF ``GPT2LMHeadModel.generate``, side by side.

Shapes: B batch (1), N prompt length, T new tokens, C width, L layers, H heads, V vocab.

Both models hold identical weights: an HF ``GPT2LMHeadModel`` with random weights is saved
with safetensors and loaded into qkv with ``GPT.from_hf``. Each run generates exactly T new
tokens greedily from the same prompt (HF: ``do_sample=False, max_new_tokens=T,
min_new_tokens=T``; qkv: ``eos_token_id=None``), fp32 on CPU, under inference mode; the two
outputs are checked to be the same tokens. Runs alternate (which goes first flips each round)
after warm-up; the table shows the median seconds per run, tokens/s (T / time) and the
speed ratio qkv / HF, per round and overall.

A decode step at B=1 is ~2·P FLOPs (P ≈ 14.6M weights here, ~30 MFLOP) but reads every
weight once (~58 MB fp32): on a CPU its time is dispatch overhead plus memory traffic. The
floor is timed in the same alternation: runs that only read every linear weight (LM head
included) once per token, T times, nothing else, through each matmul layout torch offers
for a (1, in) row times a weight — ``mm(x, W_t)`` on a pre-transposed (in, out) copy, the
same with ``out=``, ``addmm(b, x, W_t, out=)``, ``mv(W_t.T, x)``, ``mv(W, x)`` and
``F.linear(x, W)`` on the (out, in) weight — and qkv's own C kernel
(``qkv.generation.gemv_kernel``, bias added, on the (in, out) copy), which the one-row,
one-thread step uses and which reads the weights faster than torch's GEMM here. The fastest
layout by median is the floor: no decoder that reads its fp32 weights once per token through
these kernels goes faster. The
decode alone (qkv's decode engine stepper: prefill + T - 1 steps, argmax, no search loop) is
timed too, so that what the search loop adds is visible.

Each thread count in ``--threads`` (default 1 and 2) gets its own alternating rounds; the
table shows per contender the median and best ms/token over all repeats of all rounds, and
qkv / floor (tokens/s ratio; ≥ 0.9 is the goal). ``--clock cpu`` times with
``time.process_time`` (this process's CPU time: at one thread its own work, less disturbed
than wall time by other jobs on a shared machine; at 2 threads it adds both threads' time, so
use wall time there).

Usage: python -m benchmarks.bench_generate [--quick] [--tokens 128 --prompt 8 --dim 384
       --layers 6 --heads 6 --vocab 8192 --repeats 5 --warmup 1 --rounds 1 --threads 1 2
       --layouts all --clock wall]
(``--quick``: tiny sizes and one timed run, so the test suite can run it. ``--floor`` is
accepted for old command lines: the floor is always timed now.)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile

import torch

from benchmarks._harness import alternate_times, load_average, print_cpu, print_table
from qkv import generate
from qkv.generation import gemv_kernel
from qkv.models import GPT


def build(args) -> tuple[torch.nn.Module, GPT]:
    """HF GPT2LMHeadModel with random weights and a qkv GPT loaded from its safetensors."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
                     n_positions=args.prompt + args.tokens, vocab_size=args.vocab,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        model = GPT.from_hf(d).eval()
    return hf, model


LAYOUTS = ("mm(x, W_t)", "mm(x, W_t, out=)", "addmm(b, x, W_t, out=)", "mv(W_t.T, x)",
           "mv(W, x)", "F.linear(x, W)", "qkv gemv_kernel(x, W_t)")


def weight_reads(model: GPT, tokens: int, layout: str = "mm(x, W_t)"):
    """A run that only reads every linear weight once per token (the LM head included),
    ``tokens`` times, through one matmul ``layout`` of ``LAYOUTS`` (W: (out, in) as stored;
    W_t: an (in, out) contiguous copy; x: (1, in), or (in,) for mv): a decoder's floor."""
    import torch.nn.functional as F

    if layout not in LAYOUTS:
        raise ValueError(f"weight_reads: layout must be one of {LAYOUTS}, got {layout!r}")
    lins = [lin for layer in model.layers for lin in (layer.attn.in_proj, layer.attn.out_proj,
                                                     layer.ffn.fc_in, layer.ffn.fc_out)]
    ws = [lin.weight.detach() for lin in lins] + [model.lm_head.weight.detach()]  # (out, in)
    wts = [w.t().contiguous() for w in ws]  # (in, out)
    bs = [torch.zeros(w.shape[0]) for w in ws]
    xs = [torch.randn(1, w.shape[1]) for w in ws]  # (1, in)
    vs = [x[0] for x in xs]  # (in,)
    outs = [torch.empty(1, w.shape[0]) for w in ws]  # (1, out)
    mm, addmm, mv, linear = torch.mm, torch.addmm, torch.mv, F.linear
    gemv = gemv_kernel.load() if layout == "qkv gemv_kernel(x, W_t)" else None
    if layout == "qkv gemv_kernel(x, W_t)" and gemv is None:
        raise RuntimeError("weight_reads: qkv's C GEMV kernel cannot be built here")
    ptrs = [(x.data_ptr(), w.data_ptr(), b.data_ptr(), o.data_ptr(), *w.shape)
            for x, w, b, o in zip(xs, wts, bs, outs, strict=True)]  # w: (in, out)
    body = {
        "mm(x, W_t)": lambda: [mm(x, w) for x, w in zip(xs, wts, strict=True)],
        "mm(x, W_t, out=)": lambda: [mm(x, w, out=o)
                                     for x, w, o in zip(xs, wts, outs, strict=True)],
        "addmm(b, x, W_t, out=)": lambda: [addmm(b, x, w, out=o)
                                           for b, x, w, o in zip(bs, xs, wts, outs, strict=True)],
        "mv(W_t.T, x)": lambda: [mv(w.t(), v) for w, v in zip(wts, vs, strict=True)],
        "mv(W, x)": lambda: [mv(w, v) for w, v in zip(ws, vs, strict=True)],
        "F.linear(x, W)": lambda: [linear(x, w) for x, w in zip(xs, ws, strict=True)],
        "qkv gemv_kernel(x, W_t)": lambda: [gemv(x, w, b, None, o, k, n)
                                            for x, w, b, o, k, n in ptrs],
    }[layout]

    def run() -> None:
        with torch.inference_mode():
            for _ in range(tokens):
                body()

    run.tensors = (xs, wts, bs, outs)  # the kernel layout holds raw pointers into these
    return run


def decode_only(model: GPT, ids: torch.Tensor, tokens: int):
    """qkv's decode without the search loop: the decode engine's stepper (the backend
    ``qkv.generate`` would choose), prefill + ``tokens`` - 1 steps, each fed the argmax of the
    last logits (R, V)."""
    from qkv.generation.engine import decoder_stepper

    def run() -> torch.Tensor:
        with torch.inference_mode():
            stepper = decoder_stepper(model, ids, None, ids.shape[1] + tokens)
            logits = stepper.prefill()
            for _ in range(tokens - 1):
                logits = stepper.step(logits.argmax(dim=-1))
            return logits

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed run")
    p.add_argument("--tokens", type=int, default=128, help="new tokens T")
    p.add_argument("--prompt", type=int, default=8, help="prompt length N")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="independent side-by-side rounds per thread count")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="torch thread counts, each timed apart (0: torch's default)")
    p.add_argument("--layouts", nargs="+", default=["all"],
                   help=f"floor layouts to time: 'all' or some of {LAYOUTS}")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: time.process_time (this process)")
    p.add_argument("--floor", action="store_true", help="(ignored: the floor is always timed)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompt, args.dim, args.layers, args.heads, args.vocab = \
            8, 4, 64, 2, 4, 128
        args.repeats, args.warmup, args.rounds = 1, 1, 1
    layouts = LAYOUTS if args.layouts == ["all"] else tuple(args.layouts)
    if args.layouts == ["all"] and gemv_kernel.load() is None:  # no C compiler here
        layouts = tuple(lay for lay in layouts if lay != "qkv gemv_kernel(x, W_t)")
    print("command: python -m benchmarks.bench_generate "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    print(f"torch {torch.__version__}, fp32 CPU; B=1 N={args.prompt} T={args.tokens} "
          f"C={args.dim} L={args.layers} H={args.heads} V={args.vocab}, greedy; {args.clock} "
          f"clock; load average at start {load_average()}")

    hf, model = build(args)
    torch.manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.prompt))
    t = args.tokens

    def hf_run() -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=t, min_new_tokens=t, pad_token_id=0)

    def qkv_run() -> torch.Tensor:
        return generate(model, ids, max_new_tokens=t)

    a, b = hf_run(), qkv_run()
    same = int((a[0] == b[0]).sum()) if a.shape == b.shape else -1
    print(f"same tokens: {a.shape == b.shape and torch.equal(a, b)} ({same} of "
          f"{a.shape[1]} positions agree; HF {tuple(a.shape)}, qkv {tuple(b.shape)})")

    qkv_name, hf_name = "qkv.generate", "HF GPT2LMHeadModel.generate"
    fns = {hf_name: hf_run, qkv_name: qkv_run,
           "qkv decode step alone (no search loop)": decode_only(model, ids, t)}
    for layout in layouts:
        fns[f"floor: {layout}"] = weight_reads(model, t, layout)
    rows, summary = [], []
    for threads in args.threads:
        if threads:
            torch.set_num_threads(threads)
        per: dict[str, list[float]] = {name: [] for name in fns}
        loads = [load_average()]
        for _ in range(args.rounds):
            times = alternate_times(fns, args.warmup, args.repeats, args.clock)
            for name, ts in times.items():
                per[name] += ts
            loads.append(load_average())
        med = {name: statistics.median(ts) for name, ts in per.items()}
        best = {name: min(ts) for name, ts in per.items()}
        floor = min((n for n in fns if n.startswith("floor: ")), key=med.__getitem__)
        for name in fns:
            tag = " **(floor)**" if name == floor else ""
            rows.append([str(torch.get_num_threads()), name + tag,
                         f"{med[name] / t * 1e3:.2f}", f"{best[name] / t * 1e3:.2f}",
                         f"{t / med[name]:.0f}", f"{med[hf_name] / med[name]:.2f}x",
                         f"{med[floor] / med[name]:.2f}", f"{best[floor] / best[name]:.2f}"])
        summary.append(f"{torch.get_num_threads()} thread(s): qkv.generate / floor "
                       f"{med[floor] / med[qkv_name]:.2f} (median), "
                       f"{best[floor] / best[qkv_name]:.2f} (best); floor = {floor}; "
                       f"qkv / HF {med[hf_name] / med[qkv_name]:.2f}x; load average "
                       f"{' -> '.join(loads)}")
    print_table(f"Greedy generation, B=1, {t} new tokens, fp32 CPU, {args.rounds} round(s) of "
                f"{args.repeats} alternating repeats per thread count ({args.clock} clock)",
                ["threads", "run", "ms/token median", "ms/token best", "tokens/s median",
                 "speed vs HF", "floor / this (median)", "floor / this (best)"], rows)
    print()
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
