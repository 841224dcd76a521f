"""An optional fused int8 linear layer for the decode engine's int8 backends
(``linears.Int8KernelLinears``, and the int8 products of ``row_step_kernel``): one C call
quantizes the activation rows, takes their int8 dot products with the weight rows and applies
the epilogue ``acc·(a·s/127) + b`` (+ a residual), where the plain path runs ~7 torch ops.

Shapes: M rows, K input features, N output features.

The C code is ``kernels/int8.c``, declared as the ``"int8_linear"`` kernel of
``kernel_registry`` (which also checks its tensors: ``kernel_registry.call("int8_linear",
...)``), compiled on first use (about one second; ``-Wall -Werror``) and loaded by
``qkv.generation.c_kernels``. With AVX-512 VNNI it uses ``vpdpbusd`` on |xq| and the weight
with xq's signs (exact: |xq|, |Wq| ≤ 127); elsewhere (or built with ``-DQKV_PORTABLE``, as
the tests also do) plain C loops. The math is ``qkv.modules.quantized.int8_linear``'s,
operation for operation (the same rounding of ``127·x/a``, half to even, the int32 sum is
exact, the same fp32 epilogue), so the outputs equal the plain path's (the tests check both
builds bit for bit, .5 ties included).

Any failure (no compiler, a compile error, a load error) leaves ``load()`` returning None and
the caller on the plain torch path. ``QKV_INT8_KERNEL=0`` turns it off.
"""

from __future__ import annotations

from . import kernel_registry

__all__ = ["disabled", "load"]

# (symbol, portable) -> the registry's kernel
_KERNELS = {("qkv_int8_linear", False): "int8_linear",
            ("qkv_int8_linear", True): "int8_linear_portable",
            ("qkv_int8_vnni", False): "int8_vnni", ("qkv_int8_vnni", True): "int8_vnni_portable"}


def disabled() -> bool:
    """True when ``QKV_INT8_KERNEL=0`` (or "false"/"off") turns the fused kernel off."""
    return kernel_registry.disabled("int8_linear")


def load():
    """The raw C function ``qkv_int8_linear(x, m, k, w, n, s127, bias, res, y, xq, acc, a)``
    (ctypes; int pointers, nothing checked; the arguments are described in
    ``kernels/int8.c`` and declared in ``kernel_registry``), or None when the kernel is
    turned off or cannot be built or loaded here. Built once per process."""
    return kernel_registry.load("int8_linear")


def _load(symbol: str, *, portable: bool = False):
    """``symbol`` (``qkv_int8_linear``, or ``qkv_int8_vnni``: 1 when the VNNI branch was
    compiled) of the build for this CPU, or with ``portable`` of the build that keeps the
    plain C loops whatever the CPU (``-DQKV_PORTABLE``; for the tests); None when it cannot
    be built or loaded (or, for ``qkv_int8_linear`` of the native build, turned off: the
    switch is ``load()``'s). Each built once per process."""
    if (symbol, portable) not in _KERNELS:
        raise ValueError(f"int8_kernel._load: no symbol {symbol!r}")
    return kernel_registry.load(_KERNELS[symbol, portable])
