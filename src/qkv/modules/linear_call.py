"""Calling a projection: ``apply_linear(lin, x)`` is ``lin(x)``, through ``qkv.ops.fast_linear``
(oneDNN's matmul on CPU fp32 where that is faster) when ``lin`` is a plain ``nn.Linear``.

Shapes: M rows (all leading dims of x together), K = ``in_features``, N = ``out_features``.

The one rule every projection of ``qkv.modules`` follows: a module that is exactly
``nn.Linear`` (not a subclass), with no hooks (its own or global) and no ``forward`` set on
the instance, computes nothing but ``x @ weight.T + bias``, so its weight may be handed to
``fast_linear``. Anything else — an adapter wrapper (LoRA), a quantized linear, FSDP's
(class-swapped) module, a module with hooks or parametrizations — is called as a module,
unchanged. Under TorchScript tracing and ``torch.compile`` the module is called too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _nn_module

from ..ops.fast_linear import fast_linear

__all__ = ["apply_linear", "has_hooks", "is_plain_linear"]

_GLOBAL_HOOKS = tuple(getattr(_nn_module, name, {}) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks"))


def has_hooks(m: nn.Module) -> bool:
    """True when calling ``m`` does more than ``type(m).forward``: forward/backward hooks on
    it or global ones, or a ``forward`` set on the instance (activation checkpointing
    wrappers and the like)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or any(_GLOBAL_HOOKS) or "forward" in m.__dict__)


def is_plain_linear(lin: nn.Module) -> bool:
    """True when calling ``lin`` computes ``F.linear(x, lin.weight, lin.bias)`` and nothing
    else: ``type(lin) is nn.Linear``, no hooks (``has_hooks``), not under TorchScript
    tracing or ``torch.compile``.
    """
    return (type(lin) is nn.Linear and not has_hooks(lin)
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


def apply_linear(lin: nn.Module, x: Tensor) -> Tensor:
    """``lin(x)``: x (..., K) -> (..., N); through ``qkv.ops.fast_linear`` (the same values
    up to summation order, gradients included) when ``is_plain_linear(lin)``, else the
    module call itself."""
    if is_plain_linear(lin):
        return fast_linear(x, lin.weight, lin.bias)
    return lin(x)
