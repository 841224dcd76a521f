"""``qkv bench attention``: time and peak memory against sequence length for dense causal
SDPA, biased chunked attention (ALiBi), sliding window, BigBird and causal linear attention
(B=1, H=8, D=64, fp32, forward), as a table and a log-log PNG — the picture to choose an
attention method for long sequences on this machine."""

from __future__ import annotations

import argparse
import os
import sys

from .checks import int_in

#: the most --threads accepted: beyond this many per core, threads only wait on each other
THREADS_PER_CORE = 4

EXAMPLES = """examples:
  qkv bench attention                          N = 1024 ... 16384, writes bench-attention.png
  qkv bench attention --quick                  tiny lengths in this process (seconds)
  qkv bench attention --lengths 4096,65536 --methods window,linear --out long.png
  qkv bench attention --window 256 --repeat 5
  qkv bench attention --threads 1              steadier on a machine shared with other jobs

Each (method, N) runs in a fresh process (unless --quick or --in-process): time is the
median of --repeat calls after a warm-up call, peak memory the peak resident memory during
the warm-up call above the inputs. The full default run takes a few minutes on 2 cores.
A length whose inputs alone cannot fit the memory available is refused before anything
runs; a case that fails while running (out of memory, Ctrl-C) is listed with its reason
after the tables of the cases that finished, and the exit status is then 1 (130 on Ctrl-C).
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv bench`` to the command parsers."""
    p = sub.add_parser("bench", help="benchmark attention methods: time and memory vs length",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=("attention",), help="what to benchmark")
    p.add_argument("--lengths", default=None,
                   help="comma-separated sequence lengths (default 1024,2048,4096,8192,16384)")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of dense,alibi,window,bigbird,linear "
                        "(default: all)")
    p.add_argument("--quick", action="store_true",
                   help="lengths 128,256, window 32, one repeat, in this process (a smoke "
                        "test; figures are not meaningful)")
    p.add_argument("--repeat", type=int_in(1), default=3,
                   help="timed calls per case (default 3)")
    p.add_argument("--window", type=int_in(1), default=512,
                   help="sliding-window size W (default 512)")
    p.add_argument("--threads", type=int_in(1, THREADS_PER_CORE * (os.cpu_count() or 1)),
                   default=None,
                   help="torch intra-op threads (default: torch's default). On a machine "
                        "shared with other jobs, 1 avoids threads waiting on each other")
    p.add_argument("--in-process", action="store_true",
                   help="measure every case in this process (faster; memory figures less "
                        "reliable)")
    p.add_argument("--out", default="bench-attention.png",
                   help="PNG to write, replaced if it exists (default bench-attention.png)")
    p.set_defaults(func=_run)


def _ints(text: str, what: str) -> list[int]:
    from . import UserError

    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"{what} must be positive integers, got {text!r}")
    return vals


def _run(args: argparse.Namespace) -> int:
    from .. import bench
    from ..outputs import new_output_file
    from . import UserError
    from .checks import check_fits

    lengths = list(bench.QUICK_LENGTHS if args.quick else bench.DEFAULT_LENGTHS)
    if args.lengths is not None:
        lengths = _ints(args.lengths, "--lengths")
    methods = list(bench.METHODS)
    if args.methods is not None:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in bench.METHODS]
        if unknown or not methods:
            raise UserError(f"--methods: unknown {unknown or args.methods!r}; choose from "
                            f"{','.join(bench.METHODS)}")
    longest = max(lengths)  # every case allocates at least its inputs and output
    check_fits(f"--lengths {longest} (one case's q, k, v and output, 4 × 1×8×N×64 fp32)",
               max(bench.min_bytes(m, longest) for m in methods))
    out = new_output_file(args.out)
    window, repeat = (32, 1) if args.quick else (args.window, args.repeat)
    if args.quick and args.window != 512:
        window = args.window
    isolate = not (args.quick or args.in_process)
    threads = bench.torch.get_num_threads() if args.threads is None else args.threads
    print(f"qkv bench attention: B=1 H=8 D=64 fp32, causal forward, torch "
          f"{bench.torch.__version__}, {threads} threads, window {window}, median of {repeat}"
          f"{', one process per case' if isolate else ', in process'}", flush=True)
    before = bench.torch.get_num_threads()
    try:
        results = bench.run(lengths, methods, repeat=repeat, window=window, isolate=isolate,
                            threads=args.threads,
                            log=lambda line: print("  " + line, file=sys.stderr, flush=True))
    finally:
        bench.torch.set_num_threads(before)
    print(bench.format_table(results, window=window))
    if any(m.ok for m in results):
        print(f"plot: {bench.plot(results, out, window=window)}")
    failed = [m for m in results if not m.ok]
    if failed:
        print(f"qkv bench: {len(failed)} of {len(results)} cases failed (listed after the "
              f"tables)", file=sys.stderr)
        return 130 if failed[-1].error == "interrupted" else 1
    return 0
