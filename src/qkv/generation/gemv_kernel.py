"""An optional C kernel for the one-row fp32 C layer (``c_layer``, and the fp32 products of
``row_step_kernel``): a row vector times a weight stored as (in, out), plus bias and an
optional residual, in one call.

Shapes: K input features, N output features.

At one row a decode step is bound by reading every weight once, and torch's CPU GEMM reads a
(K, N) weight for one row slower than a plain streaming read of the same bytes. This kernel
streams whole rows of the (in, out) weight, eight at a time, into an output row that stays in
L1 cache: ``y = res + b + x @ W`` (``benchmarks/bench_generate.py`` measures the decode it
gives against the torch-GEMM floor; BENCHMARKS.md).

The math is ``addmm``'s in another summation order (the output starts at b + res, then adds
the rows of x·W in order of the inputs; |diff| ~1e-7 relative, fp32). The C code is
``kernels/gemv.c`` (16-float vectors through the GCC/clang vector extension: AVX-512 here,
narrower registers elsewhere), declared as the ``"gemv"`` kernel of ``kernel_registry``
(``kernel_registry.call("gemv", x=..., w=..., b=..., res=..., y=..., k=..., n=...)`` checks
its tensors), compiled on first use (``cc -O3 -march=native -Wall -Werror``, cached;
``c_kernels``) and loaded with ``ctypes``. Any failure leaves ``load()`` returning None and
the caller on ``addmm``. ``QKV_GEMV_KERNEL=0`` turns it off. fp32 only; single-threaded (the
engine measures the C layer against the threaded torch backend at more threads).
"""

from __future__ import annotations

from . import kernel_registry

__all__ = ["disabled", "load"]


def disabled() -> bool:
    """True when ``QKV_GEMV_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return kernel_registry.disabled("gemv")


def load():
    """The raw C function ``qkv_gemv(x, w, b, res, y, k, n)`` (ctypes; int pointers to fp32
    data x (K,), w (K, N) row-major, b (N,), res (N,), y (N,); b and res may be None; nothing
    checked), or None when the kernel is turned off or cannot be built or loaded here. Built
    once per process (``kernel_registry.load("gemv")``)."""
    return kernel_registry.load("gemv")
