"""The ``Padding`` NaN guard of ``qkv.attention``: its cost before (zero the padded keys and
values with a copy whenever a row is padded) and after (a read-only finiteness sum of k and
v; copy only when they hold NaN/inf), side by side in one run.

Shapes: B batch, H heads, N query length, S key length, D head dim.

For each shape, three guards run inside the same ``qkv.attention(q, k, v,
mask=Padding(lengths))`` call (fp32, CPU, SDPA backend, inference mode), alternating (the
order flips every repeat): "copy" (the guard as it was), "sum check" (the guard as it is) and
"none" (the guard removed: what attention costs without it). The guard alone is timed too.
Lengths are drawn in [S/2, S] with one row at S/2 (so something is always padded) and the
padded memory is finite (the common case; non-finite memory still takes the copy).

Usage: python -m benchmarks.bench_padding_guard [--quick] [--repeats 21] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from torch import Tensor

import qkv
from benchmarks._harness import print_cpu, print_table

attention_module = importlib.import_module("qkv.ops.attention")  # not the function

SHAPES = {  # name: (B, H, N, S, D)
    "prefill B=8 H=8 N=S=512 D=64": (8, 8, 512, 512, 64),
    "encoder B=32 H=12 N=S=128 D=64": (32, 12, 128, 128, 64),
    "decode B=8 H=8 N=1 S=2048 D=64": (8, 8, 1, 2048, 64),
}
QUICK = {"tiny B=2 H=2 N=S=16 D=8": (2, 2, 16, 16, 8)}


def copy_guard(k: Tensor, v: Tensor, mask) -> tuple[Tensor, Tensor]:
    """The guard before: zero the padded keys/values (a copy of each) whenever a row is
    padded (the code as it stood, kept here for the comparison)."""
    parts = mask.parts if isinstance(mask, qkv.masks.And) else (mask,)
    pads = [p for p in parts if isinstance(p, qkv.masks.Padding)]
    if not pads:
        return k, v
    keep = pads[0].block(0, 1, 0, k.shape[2], 1, k.shape[2], k.device)  # (B|1, 1, 1, S)
    for p in pads[1:]:
        keep = keep & p.block(0, 1, 0, k.shape[2], 1, k.shape[2], k.device)
    keep = keep[:, :, 0, :, None]  # (B|1, 1, S, 1)
    if bool(keep.all()):
        return k, v
    return k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0)


def no_guard(k: Tensor, v: Tensor, mask) -> tuple[Tensor, Tensor]:
    return k, v


GUARDS = {"copy (before)": copy_guard, "sum check (now)": attention_module._clear_padding,
          "none": no_guard}


def time_shape(b: int, h: int, n: int, s: int, d: int, repeats: int
               ) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds per attention call and per guard call alone, by guard, alternating."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, m, d, generator=g) for m in (n, s, s))
    lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
    lengths[0] = s // 2
    mask = qkv.masks.Padding(lengths)
    want = qkv.attention(q, k, v, mask=mask, backend="sdpa")

    def call(guard):
        attention_module._clear_padding = guard
        return qkv.attention(q, k, v, mask=mask, backend="sdpa")

    times = {label: ([], []) for label in GUARDS}
    with torch.inference_mode():
        for guard in GUARDS.values():
            assert torch.equal(call(guard), want)
            guard(k, v, mask)
        for r in range(repeats):
            for label in list(GUARDS) if r % 2 == 0 else list(GUARDS)[::-1]:
                t0 = time.perf_counter()
                call(GUARDS[label])
                times[label][0].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                GUARDS[label](k, v, mask)
                times[label][1].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one tiny shape, 3 repeats")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    shapes = QUICK if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32 CPU, SDPA "
          f"backend, {repeats} alternating repeats; load average {load}")
    real = attention_module._clear_padding
    rows = []
    try:
        for name, shape in shapes.items():
            times = time_shape(*shape, repeats)
            base = statistics.median(times["none"][0])
            for label, (calls, alone) in times.items():
                med = statistics.median(calls)
                rows.append([name, label, f"{med * 1e3:.3f}", f"{min(calls) * 1e3:.3f}",
                             f"{statistics.median(alone) * 1e3:.3f}",
                             f"{(med / base - 1) * 100:+.1f} %"])
    finally:
        attention_module._clear_padding = real
    print_table("qkv.attention(q, k, v, mask=Padding(lengths)) by guard, ms per call",
                ["shape", "guard", "attention median", "attention best", "guard alone median",
                 "vs no guard (median)"], rows)


if __name__ == "__main__":
    main()
