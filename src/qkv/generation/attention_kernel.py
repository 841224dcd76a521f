"""An optional C kernel for the decode engine's one-query attention (``torch_layer``'s
``TorchLayers`` on fp32 at one thread; the C layer calls it too): one query per row and head
against the cache, in one call per layer, where the torch path is baddbmm -> softmax -> bmm
over R·Hkv tiny batched products.

Shapes: R rows, H query heads, Hkv key/value heads, g = H / Hkv, D head dim, S keys (the
cache's filled part), cap the cache's capacity.

With many rows the keys and values of a step come from memory, not cache (the weights
streamed in between evict them), and MKL's batched product for one query row per batch reads
them slowly (BENCHMARKS.md, "Batch-16 greedy vs HF"). This kernel walks each (row, kv head)
block once for the scores and once for the values,
computes the g queries of a kv head together (GQA reads each key once), and skips the key
positions whose padding bias is -inf (a left-padded prompt's pads: never read). The math is
torch's — scores = q·k · scale + bias, softmax as exp(x - max) / sum, then p @ v — in another
summation order (|diff| ~1e-7 relative, fp32).

The C code is ``kernels/attention.c``, declared as the ``"attention"`` kernel of
``kernel_registry`` (its arguments, and what ``kernel_registry.call("attention", ...)`` checks
of each tensor, are there), compiled on first use (``cc -O3 -march=native -Wall -Werror``,
cached per source, compiler and CPU flags; ``c_kernels``) and loaded with ``ctypes``. Any
failure leaves ``load()`` returning None and the caller on the torch ops.
``QKV_ATTN_KERNEL=0`` turns it off. fp32 only; single-threaded (the torch layer uses it when
torch runs on one thread).
"""

from __future__ import annotations

from . import kernel_registry

__all__ = ["MAX_GROUP", "disabled", "load"]

MAX_GROUP = 64
"""The most query heads per key/value head (g) the kernel takes (``QKV_MAX_GROUP`` of
``kernels/qkv_kernels.h``)."""


def disabled() -> bool:
    """True when ``QKV_ATTN_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return kernel_registry.disabled("attention")


def load():
    """The raw C function ``qkv_decode_attention(q, qr, k, v, kb, nbh, hkv, g, s, d, bias, bb,
    scale, out, scratch)`` (ctypes; int pointers, nothing checked; the arguments are
    described in ``kernels/attention.c`` and declared in ``kernel_registry``), or None when
    the kernel is turned off or cannot be built or loaded here. Built once per process."""
    return kernel_registry.load("attention")
