"""``qkv demo tour``: a short tour of the attention core (masks, backends agreeing with an
fp64 reference, relative positions at a long length in O(N) memory)."""

from __future__ import annotations

import argparse
import time


def format_size(n_bytes: float) -> str:
    """``n_bytes`` in the largest binary unit that keeps it at least 1: "32 B", "1.5 KiB",
    "32.0 MiB", "2.0 GiB" (GiB beyond)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:,.1f} {unit}"
    return f"{n_bytes:,.0f} B"


def run_tour(args: argparse.Namespace) -> int:
    """Print the tour; ``args.length`` is the relative-position part's sequence length N,
    ``args.seed`` seeds the random inputs. Refuses (``UserError``) an N whose inputs and
    output, 4 × (1, 8, N, 64) fp32, cannot fit the memory available."""
    import torch

    import qkv
    from qkv.masks import Causal, Padding
    from qkv.positions import ALiBi, ShawRelative, T5Bias

    from .checks import check_fits

    check_fits(f"--length {args.length} (q, k, v and the output, 4 × 1×8×N×64 fp32)",
               4 * 8 * args.length * 64 * 4)
    torch.manual_seed(args.seed)
    print("qkv demo — one attention core, one mask convention (True = may attend)\n")
    print("Causal masks for N=2 queries, S=5 keys:")
    for alignment in ("bottom_right", "top_left"):
        rows = Causal(alignment).dense(2, 5)[0, 0].int().tolist()
        print(f"  {alignment:12s} {rows}")

    b, h, n, d = 2, 8, 64, 32
    q = torch.randn(b, h, n, d)
    k, v = torch.randn(b, 2, n, d), torch.randn(b, 2, n, d)  # 4 query heads per kv head
    mask = Causal() & Padding(torch.tensor([64, 40]))
    print(f"\nGrouped-query attention q {tuple(q.shape)}, k/v {tuple(k.shape)}, "
          f"mask = {mask.describe()}")
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    for backend in qkv.BACKENDS:
        out = qkv.attention(q, k, v, mask=mask, backend=backend)
        err = (out.double() - ref).abs().max().item()
        print(f"  backend {backend:9s} max |error| vs fp64 reference = {err:.2e}")

    n_long = args.length
    print(f"\nRelative positions at N = {n_long} (B=1, H=8, D=64), causal, chunked backend:")
    ql, kl, vl = (torch.randn(1, 8, n_long, 64) for _ in range(3))
    schemes = {"ALiBi": ALiBi(8), "T5 buckets": T5Bias(8, bidirectional=False),
               "Shaw k=16": ShawRelative(64, max_distance=16)}
    with torch.inference_mode():
        for name, scheme in schemes.items():
            t0 = time.perf_counter()
            out = qkv.attention(ql, kl, vl, causal=True, bias=scheme)
            dt = time.perf_counter() - t0
            print(f"  {name:11s} {dt:6.2f} s, output finite: {bool(torch.isfinite(out).all())}"
                  f" — an N×S fp32 bias alone would take "
                  f"{format_size(8 * n_long * n_long * 4)}")
    return 0
