"""FSDP2 vs DDP, 2 processes under torchrun (gloo, CPU): per-rank memory of parameters +
gradients + optimizer state, process RSS, step time; and the activation memory that
per-layer activation checkpointing saves.

Shapes: B rows per rank, T sequence length, C width, L layers, V vocab, P parameters.

One training step = forward + next-token cross-entropy (summed / global token count) +
backward + AdamW step, fp32, on GPT-2 small (``GPTConfig.from_name("gpt2")``, 124M
parameters, random weights) with B rows of T tokens on each of 2 ranks.

Measured per rank, side by side in one run (each mode in its own ``torchrun`` launch, so
each process's peak RSS is its own):

- tensor bytes: the parameters, gradients and AdamW moments this rank holds (``to_local()``
  of FSDP's DTensors): DDP holds all of them (4·P bytes each, 16·P in all); FSDP2 holds
  1/2 of each (a shard of dim 0; rows are padded to a multiple of the world size);
- RSS: the process's peak resident memory during the training steps (VmHWM, reset after
  the model is built, sharded / wrapped and its optimizer made: building the whole model on
  every rank first is not what training needs) above its RSS after imports — tensors plus
  activations, FSDP's all-gathered buffers (the root's embedding stays gathered from forward
  to backward) and allocator slack (glibc's mmap threshold is fixed at 1 MiB for the ranks,
  so that freed tensors leave the RSS);
- step time: the median over the timed steps of the slower rank.

Activation memory: the bytes autograd saves for backward during one forward
(``torch.autograd.graph.saved_tensors_hooks``, storages counted once, parameters included),
plain vs ``apply_activation_checkpointing`` (each layer keeps only its input), one process.

Usage: python -m benchmarks.bench_fsdp [--quick] [--preset gpt2 --batch 2 --seq 256
       --steps 3 --warmup 1]
(``--quick``: gpt-tiny-sized model, one timed step, so the test suite can run it. The script
launches ``torchrun --nproc-per-node 2`` itself; ``--worker`` is its internal entry point.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks._harness import print_cpu, print_table
from qkv.models import GPT, GPTConfig

WORLD = 2


def _config(args: argparse.Namespace) -> GPTConfig:
    if args.quick:
        return GPTConfig.from_name("gpt-tiny", vocab_size=512, max_len=64, dim=64)
    return GPTConfig.from_name(args.preset)


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in MiB; ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Reset the resident high-water mark (VmHWM) to the current RSS (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _batch(cfg: GPTConfig, args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)


def worker(args: argparse.Namespace) -> None:
    """One rank of a torchrun launch: train ``--steps`` steps in mode ``--worker``."""
    from datetime import timedelta

    import torch.distributed as dist

    from qkv.train.distributed import World, teardown_world
    from qkv.train.sharding import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    rss0 = _status_mib("VmRSS")
    cfg = _config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.worker == "fsdp":
        shard_model(model)
        wrapped: nn.Module = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()  # the unsharded initial weights are gone under FSDP
    _reset_peak()  # the peak of building the whole model on every rank is not training's
    times = []
    for step in range(args.warmup + args.steps):
        ids = _batch(cfg, args, step, rank)
        dist.barrier()
        t0 = time.perf_counter()
        logits = wrapped(ids[:, :-1])  # (B, T, V)
        loss_sum = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(),
                                               reduction="sum")
        (loss_sum * (WORLD / (WORLD * ids[:, 1:].numel()))).backward()
        opt.step()
        if step == args.warmup + args.steps - 1:  # the gradients, before they are freed
            grad_bytes = _local_bytes(p.grad for p in model.parameters())
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times[args.warmup:])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    result = {
        "params": _local_bytes(model.parameters()),
        "grads": grad_bytes,
        "optim": _local_bytes(v for s in opt.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0),
        "rss_peak": _status_mib("VmHWM") - rss0,
        "step_s": statistics.median(slowest.tolist()),
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    Path(f"{args.out}.{rank}").write_text(json.dumps(result))
    # leave the group as `qkv train` does: dropping the DDP wrapper while gloo's workers still
    # finish its last all-reduce can deadlock (qkv.train.distributed); a sharded model keeps
    # the group for the process's life, so that rank ends without the interpreter's shutdown
    box = {"wrapped": wrapped}
    del wrapped, model, opt
    freed = teardown_world(World(rank=rank, size=WORLD), release=box.clear)
    if not freed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, argv: list[str]) -> list[dict]:
    """Run ``worker`` in ``mode`` under ``torchrun --nproc-per-node 2``; each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / mode)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--master-port", str(_free_port()), "-m", "benchmarks.bench_fsdp",
               "--worker", mode, "--out", out, *argv]
        # a fixed mmap threshold: glibc then returns freed tensors (>= 1 MiB) to the system,
        # so RSS follows the live tensors instead of the allocator's high-water slack
        env = {"MALLOC_MMAP_THRESHOLD_": str(2**20), **os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            sys.exit(f"bench_fsdp: {shlex.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]


def activation_bytes(args: argparse.Namespace) -> tuple[int, int, float, float]:
    """Saved-tensor bytes of one forward, plain vs checkpointed, and the step times."""
    from qkv.train.sharding import apply_activation_checkpointing, saved_activation_bytes

    cfg = _config(args)
    out = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        if checkpointed:
            apply_activation_checkpointing(model)
        ids = _batch(cfg, args, 0, 0)
        for _ in range(2):  # the first pass warms up; the second is measured
            t0 = time.perf_counter()
            with saved_activation_bytes() as saved:
                logits = model(ids[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
        out.append((saved[0], elapsed))
        del model, logits, loss
    return out[0][0], out[1][0], out[0][1], out[1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--batch", type=int, default=2, help="rows per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.seq, args.steps, args.warmup = 32, 1, 1
    if args.worker:
        worker(args)
        return
    argv = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq),
            "--steps", str(args.steps), "--warmup", str(args.warmup)] + (
        ["--quick"] if args.quick else [])
    cfg = _config(args)
    results = {mode: launch(mode, argv) for mode in ("ddp", "fsdp")}
    p = results["ddp"][0]["num_params"]
    print(f"python -m benchmarks.bench_fsdp {' '.join(sys.argv[1:])}")
    print_cpu()
    print(f"GPT L={cfg.num_layers} C={cfg.dim} V={cfg.vocab_size}, P={p / 1e6:.1f}M, "
          f"B={args.batch} rows x T={args.seq} per rank, {WORLD} ranks (gloo, CPU, 1 thread "
          f"each), torch {torch.__version__}")
    rows = []
    for mode in ("ddp", "fsdp"):
        for rank, r in enumerate(results[mode]):
            total = r["params"] + r["grads"] + r["optim"]
            rows.append([mode, str(rank), f"{r['params'] / 2**20:.1f}",
                         f"{r['grads'] / 2**20:.1f}", f"{r['optim'] / 2**20:.1f}",
                         f"{total / 2**20:.1f}", f"{r['rss_peak']:.0f}",
                         f"{r['step_s']:.3f}"])
    print_table("per-rank memory (MiB) and step time",
                ["mode", "rank", "params", "grads", "AdamW moments", "params+grads+optim",
                 "peak RSS in steps − after imports", "step s"], rows)
    d, f = results["ddp"][0], results["fsdp"][0]
    tot = {m: r["params"] + r["grads"] + r["optim"] for m, r in (("ddp", d), ("fsdp", f))}
    print(f"\nFSDP / DDP: params+grads+optim {tot['fsdp'] / tot['ddp']:.3f}, peak RSS "
          f"{f['rss_peak'] / max(d['rss_peak'], 1e-9):.3f}, step time "
          f"{f['step_s'] / d['step_s']:.2f}x")
    plain, ckpt, t_plain, t_ckpt = activation_bytes(args)
    print_table("activation memory of one forward (1 process, B rows x T)",
                ["", "saved for backward (MiB)", "forward+backward s"],
                [["plain", f"{plain / 2**20:.1f}", f"{t_plain:.3f}"],
                 ["activation checkpointing", f"{ckpt / 2**20:.1f}", f"{t_ckpt:.3f}"]])
    print(f"\ncheckpointing keeps {ckpt / plain:.3f} of the saved bytes "
          f"({(plain - ckpt) / 2**20:.1f} MiB less; parameters saved by reference are counted "
          f"in both)")


if __name__ == "__main__":
    main()
