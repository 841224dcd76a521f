"""``F.linear`` through oneDNN's matmul on CPU fp32 where that is faster than MKL's GEMM.

Shapes: M rows (all leading dims of x together), K input width, N output width.

oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op torch's own inductor emits
for CPU linear layers) runs encoder GEMMs and batched decode projections faster than
``F.linear`` on this CPU and is not faster at one row (a decode step for one row has its own
path, ``qkv.generation.linears``); ``benchmarks/bench_fast_linear.py`` measures it, with the
figures in BENCHMARKS.md ("Linear layers through oneDNN"). With gradients, ``fast_linear``
is one autograd Function whose forward and input gradient go through oneDNN and whose weight
gradient is ``mm``.

Each call costs a fixed set-up more than ``F.linear`` (oneDNN sets up its primitive),
which small GEMMs do not earn back: below ``MIN_ROWS`` rows or ``MIN_MACS`` multiply-adds
(M·K·N; the measured crossover is in BENCHMARKS.md) this is ``F.linear``. The two differ
only in summation order (|diff| ~1e-6 relative).

The op is private to torch, so it is used only after a one-time check that it exists and
agrees with ``F.linear`` on a small input. Anything else is ``F.linear``: no oneDNN in this
build, another device or dtype, autocast on, a tensor subclass (FSDP's DTensor), functorch
transforms (vmap, grad), and double backward is not supported (the Function is
once-differentiable) — use ``onednn_linear(False)`` for that. ``onednn_linear(False)`` also
gives back MKL's exact rounding for a block.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = ["MIN_MACS", "MIN_ROWS", "fast_linear", "onednn_linear", "onednn_linear_active",
           "onednn_op"]

MIN_ROWS = 4
"""Fewest rows (M) worth oneDNN's per-call set-up."""
MIN_MACS = 1 << 24
"""Fewest multiply-adds (M·K·N) worth oneDNN's per-call set-up."""

_PLAIN = (Tensor, nn.Parameter)
_state = threading.local()
_checked: dict[str, object] = {}


def _op():
    """The oneDNN linear op when this torch build has a working one, else None (checked
    once per process)."""
    if "op" not in _checked:
        _checked["op"] = None
        try:
            op = torch.ops.mkldnn._linear_pointwise.default
            if torch.backends.mkldnn.is_available():
                g = torch.Generator().manual_seed(0)
                x = torch.randn(5, 3, 16, generator=g)
                w = torch.randn(24, 16, generator=g)
                b = torch.randn(24, generator=g)
                with torch.no_grad():
                    got = op(x, w, b, "none", [], "")
                    want = F.linear(x, w, b)
                if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    _checked["op"] = op
        except (AttributeError, RuntimeError):  # no such op / no oneDNN in this build
            pass
    return _checked["op"]


def onednn_op():
    """oneDNN's linear op (``torch.ops.mkldnn._linear_pointwise.default``: ``op(x, weight,
    bias, "none", [], "")`` = x @ weight.T + bias, weight (N, K) dense or packed by
    ``torch.ops.mkldnn._reorder_linear_weight``) when this torch build has a working one
    (checked once against ``F.linear``), else None. For callers with their own dispatch
    (``qkv.generation.linears``); they must honour ``onednn_linear_active()`` too."""
    return _op()


def onednn_linear_active() -> bool:
    """True when ``fast_linear`` may use oneDNN in this thread (the op works in this torch
    build and ``onednn_linear(False)`` is not in force)."""
    return getattr(_state, "enabled", True) and _op() is not None


@contextlib.contextmanager
def onednn_linear(enabled: bool) -> Iterator[None]:
    """Within the block, ``fast_linear`` uses oneDNN where it pays (True, the default where
    it works) or is always ``F.linear`` (False). Thread-local; nests."""
    if not isinstance(enabled, bool):
        raise TypeError(f"onednn_linear: enabled must be a bool, got {enabled!r}")
    before = getattr(_state, "enabled", True)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = before


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ w.T + b; forward and grad_x through oneDNN, grad_w / grad_b through mm / sum."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _op()(x, weight, bias, "none", [], "")  # (..., N)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _op()(grad, weight.t(), None, "none", [], "")  # (..., K)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            g2 = grad.reshape(-1, grad.shape[-1])  # (M, N)
            if ctx.needs_input_grad[1]:
                grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))  # (N, K)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0)  # (N,)
        return grad_x, grad_w, grad_b


def _eligible(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (x.dtype is torch.float32 and x.dim() >= 2 and x.device.type == "cpu"
            and type(x) in _PLAIN and type(weight) in _PLAIN
            and weight.dtype is torch.float32 and weight.dim() == 2
            and (bias is None or (type(bias) in _PLAIN and bias.dtype is torch.float32))
            and x.numel() >= MIN_ROWS * x.shape[-1] > 0
            and x.numel() * weight.shape[0] >= MIN_MACS
            and not torch.is_autocast_enabled("cpu")
            and not torch._C._are_functorch_transforms_active()
            and onednn_linear_active())


def fast_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN when that is safe and faster.

    Args:
        x: (..., K).
        weight: (N, K).
        bias: (N,) or None.

    Returns:
        (..., N), equal to ``F.linear`` up to summation order, gradients included. oneDNN
        is used only for CPU fp32 plain tensors of at least ``MIN_ROWS`` rows and
        ``MIN_MACS`` multiply-adds, outside autocast and functorch transforms; otherwise
        this is ``F.linear``, so a caller may use it on any path.
    """
    if not _eligible(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _op()(x, weight, bias, "none", [], "")
