"""``qkv train --fsdp`` vs DDP (plain ``qkv train``) under ``torchrun --nproc-per-node 2``
(gloo, CPU), end to end through the command line: the step time (median of the steps after
the first, from metrics.jsonl's cumulative tokens/s) and the peak RSS of the largest process
(``getrusage(RUSAGE_CHILDREN).ru_maxrss`` of a fresh launcher process per mode: a rank).

Shapes: none; a GPT of the given preset on the embedded ``copy`` task.

Usage: python benchmarks/fsdp_train_compare.py [--preset gpt-small-cpu] [--steps 6]
       [--batch-size 16] [--extra "--activation-checkpointing"]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(cmd: list[str]) -> None:
    """Run ``cmd`` and print the peak RSS (KiB) of its biggest descendant."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(done.returncode)
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def measure(args: argparse.Namespace, fsdp: bool, root: Path) -> dict[str, float]:
    out = root / ("fsdp" if fsdp else "ddp")
    train = ["train", "--model", "gpt", "--preset", args.preset, "--task", "copy", "--steps",
             str(args.steps), "--batch-size", str(args.batch_size), "--eval-every",
             str(args.steps), "--eval-examples", "8", "--no-progress", "--device", "cpu",
             "--out", str(out), *(["--fsdp"] if fsdp else []), *shlex.split(args.extra)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_port()), "-m", "qkv.cli", *train]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    text = subprocess.run([sys.executable, __file__, "--child", json.dumps(cmd)], env=env,
                          capture_output=True, text=True, check=True).stdout
    rss_kib = int(text.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    # tokens_per_s is cumulative since the start: per-step times from its differences
    ends = [sum(x["tokens"] for x in rows[:i + 1]) / r["tokens_per_s"]
            for i, r in enumerate(rows)]
    steps = [b - a for a, b in itertools.pairwise(ends)]
    return {"step_s": statistics.median(steps), "rss_mib": rss_kib / 1024,
            "loss": rows[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-small-cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--extra", default="", help="more qkv train flags for both modes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(json.loads(args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ddp = measure(args, False, Path(tmp))
        fsdp = measure(args, True, Path(tmp))
    print(f"qkv train --model gpt --preset {args.preset}, torchrun 2 processes (gloo, CPU, "
          f"{args.threads} thread each), batch {args.batch_size}, {args.steps} steps")
    print("| mode | step time (median) | peak RSS of a rank | final loss |")
    print("|---|---:|---:|---:|")
    for name, m in (("DDP", ddp), ("FSDP2 (--fsdp)", fsdp)):
        print(f"| {name} | {m['step_s'] * 1e3:.0f} ms | {m['rss_mib']:.0f} MiB "
              f"| {m['loss']:.5f} |")
    print(f"FSDP/DDP: step time {fsdp['step_s'] / ddp['step_s']:.2f}x, peak RSS "
          f"{fsdp['rss_mib'] / ddp['rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
