"""The compiled static-shape decode step against the hand-written decode paths, side by side.

Shapes: R rows (batch), N prompt length, T new tokens, C width, L layers, H heads, V vocab.

The model is the GPT of ``benchmarks/bench_generate.py`` (an HF ``GPT2LMHeadModel`` with random
weights loaded into qkv: L=6, C=384, H=6, V=8192), fp32 on CPU, under inference mode. Each
contender is a decode backend's stepper (``qkv.generation.backends`` and
``qkv.generation.static_backend``) on the same R random prompts of N tokens: untimed stepper
build and prefill, then T greedy steps, timed; ms/token is their time / T (per step of all R
rows). Contenders: ``compiled`` (``static_layer.static_step`` under ``torch.compile``, one
per ``--modes`` entry), ``static-eager`` (the same step without compiling: what compiling
buys), and the hand paths ``torch``, ``onednn-packed`` (R >= 4) and ``c-layer-fp32`` (R = 1,
one thread). Each (R, threads) gets its own rounds; in each round every contender runs once,
in an order that flips every round, after one untimed warm-up run each (which for
``compiled`` compiles: its time, minus a normal run's, is the compile time, reported apart;
the inductor cache starts empty in a temporary directory unless ``--keep-cache``). The table
shows medians over rounds of wall time and of this process's CPU time (at one thread its
own work, less disturbed by other jobs on a shared machine), and for each hand path its
speed-up over the fastest compiled mode (compiled ms / its ms) and whether it clears the
bar (>= 1.10: keep the hand path; judged on CPU time at one thread, on wall time at more,
where CPU time adds up every thread's).
Every contender's greedy tokens are compared with ``torch``'s.

Usage: python -m benchmarks.bench_compiled_decode [--quick] [--rows 1 16] [--threads 1 0]
       [--tokens 128 --prompt 8 --rounds 7 --modes default max-autotune-no-cudagraphs]
(``--threads 0``: torch's default thread count; ``--quick``: a tiny model, one row, one
thread, few tokens, for the test suite.)
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch
from torch._dynamo.utils import counters

from benchmarks._harness import load_average, print_cpu, print_table
from qkv.generation.engine import named_backend
from qkv.generation.plan import decode_plan
from qkv.generation.static_backend import Compiled, StaticEager
from qkv.generation.static_layer import COMPILE_MODES

HAND = ("torch", "onednn-packed", "c-layer-fp32")
BAR = 1.10


def decode_run(backend, model, ids: torch.Tensor, tokens: int):
    """A run: ``backend``'s stepper on ids (R, N), prefill, then ``tokens`` greedy steps;
    returns (wall seconds of the steps, this process's CPU seconds of them, the tokens fed
    (R, T))."""
    plan = decode_plan(model)

    def run() -> tuple[float, float, torch.Tensor]:
        with torch.inference_mode():
            st = backend.stepper(plan, model, ids, None, ids.shape[1] + tokens + 1)
            tok = st.prefill().argmax(dim=-1)
            fed = []
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(tokens):
                fed.append(tok)
                tok = st.step(tok).argmax(dim=-1)
            return (time.perf_counter() - start, time.process_time() - cpu,
                    torch.stack(fed, 1))

    return run


def contenders(model, rows: int, threads: int, modes) -> tuple[dict, list[str]]:
    """name -> backend for (rows, threads), and the lines of those that refuse."""
    plan = decode_plan(model)
    out, refused = {}, []
    named = [(f"compiled ({m})", Compiled(m)) for m in modes] + [("static-eager", StaticEager())]
    named += [(name, named_backend(name)) for name in HAND]
    for name, b in named:
        if b.name == "c-layer-fp32" and threads != 1:
            continue  # a one-thread kernel: timed at one thread only
        why = b.supports(plan, rows, plan.dtype, plan.device, threads)
        if why is None:
            out[name] = b
        else:
            refused.append(f"  {name} at R={rows}, {threads} thread(s): {why}")
    return out, refused


def bench(model, rows: int, threads: int, args) -> tuple[list[list[str]], list[str]]:
    """The table rows and notes of one (rows, threads) setting."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(1, model.config.vocab_size, (rows, args.prompt), generator=g)
    backends, notes = contenders(model, rows, threads, args.modes)
    runs = {name: decode_run(b, model, ids, args.tokens) for name, b in backends.items()}
    first, fed, graphs = {}, {}, {}
    for name, run in runs.items():  # warm-up: compiles the compiled step
        before = counters["stats"]["unique_graphs"]
        first[name], _, fed[name] = run()
        graphs[name] = counters["stats"]["unique_graphs"] - before
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu, _ = runs[name]()
            times[name].append(wall)
            cpus[name].append(cpu)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}
    cpu_med = {name: statistics.median(ts) for name, ts in cpus.items()}
    ref = fed.get("torch")
    for name in runs:
        if name.startswith("compiled"):
            notes.append(f"  {name} at R={rows}, {threads} thread(s): compile "
                         f"{first[name] - med[name]:.1f} s (first run {first[name]:.1f} s, "
                         f"a normal run {med[name]:.3f} s; {graphs[name]} graph(s) "
                         f"captured)")
        if ref is not None and not torch.equal(fed[name], ref):
            agree = int((fed[name] == ref).all(0).sum())
            notes.append(f"  {name} at R={rows}: greedy tokens differ from torch's after "
                         f"{agree} of {args.tokens} steps agree (fp32 rounding order)")
    table = []
    comp = min((n for n in runs if n.startswith("compiled")), key=med.__getitem__,
               default=None)
    for name in runs:
        ms = 1e3 / args.tokens
        row = [str(rows), str(threads), name, f"{med[name] * ms:.3f}", f"{best[name] * ms:.3f}",
               f"{cpu_med[name] * ms:.3f}"]
        if comp is not None and name in HAND:
            up, up_cpu = med[comp] / med[name], cpu_med[comp] / cpu_med[name]
            row += [f"{up:.2f}x", f"{up_cpu:.2f}x",
                    "yes" if (up_cpu if threads == 1 else up) >= BAR else "no"]
        else:
            row += ["", "", ""]
        table.append(row)
    return table, notes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, one row, one thread")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="batch sizes R")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                   help="torch thread counts (0: the default)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens T")
    p.add_argument("--prompt", type=int, default=8, help="prompt length N")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--modes", nargs="+", default=["default"], choices=COMPILE_MODES,
                   help="torch.compile modes of the compiled step")
    p.add_argument("--keep-cache", action="store_true",
                   help="use inductor's usual cache (default: a fresh one: cold compiles)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    default_threads = torch.get_num_threads()
    if args.quick:  # no compile: it takes minutes here (test_static_layer's slow test compiles)
        args.rows, args.threads, args.tokens, args.prompt, args.rounds = [1], [1], 8, 4, 1
        args.dim, args.layers, args.heads, args.vocab = 64, 2, 4, 128
        args.modes = []
    threads = [t or default_threads for t in args.threads]
    print("command: python -m benchmarks.bench_compiled_decode "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    print(f"torch {torch.__version__}, fp32 CPU; N={args.prompt} T={args.tokens} C={args.dim} "
          f"L={args.layers} H={args.heads} V={args.vocab}, greedy; {args.rounds} round(s); "
          f"default threads {default_threads}; load average at start {load_average()}")
    with tempfile.TemporaryDirectory() as cache:
        if not args.keep_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        from benchmarks.bench_generate import build

        _, model = build(args)
        rows, notes = [], []
        before = torch.get_num_threads()
        try:
            for r in args.rows:
                for t in threads:
                    table, lines = bench(model, r, t, args)
                    rows += table
                    notes += lines
        finally:
            torch.set_num_threads(before)
    print_table(f"Decode ms/token (per step of all R rows), compiled static step vs hand "
                f"paths, medians of {args.rounds} alternating round(s)",
                ["R", "threads", "backend", "wall ms/token median", "wall best",
                 "CPU ms/token median", "hand speed-up over compiled (wall)",
                 "(CPU)", f"clears {BAR:.2f}x"], rows)
    print()
    for line in notes:
        print(line)
    print(f"load average at end {load_average()}")


if __name__ == "__main__":
    main()
