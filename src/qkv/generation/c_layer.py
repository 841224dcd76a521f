"""The decode layer as one C call per layer (``row_step_kernel``), for the plans it can
compute: a runner for ``qkv.generation.stepper.PlanStepper``.

Shapes: R rows, C width, V vocab size, cap the caches' capacity.

fp32 weights: one row (the C layer multiplies by (in, out) copies through ``gemv_kernel``'s
products; the head one ``gemv_kernel`` call). int8 weights: any number of rows (the products
``int8_kernel``'s, each row quantized on its own; the head one ``int8_kernel`` call). The
kernel feeds one token per call: ``run(n)`` feeds n tokens one after another, which computes
what n steps would.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.cache import KVCache
from . import kernel_registry
from .linears import Int8KernelLinears
from .plan import DecodePlan
from .row_step_kernel import RowLayers

__all__ = ["CLayers"]


class CLayers:
    """The layers of ``plan`` as ``RowLayers`` over ``cache`` (contiguous ``KVCache``s) with the
    additive key bias ``bias`` (R·Hkv, 1, cap) or None; ``gemv`` (fp32) or ``int8`` (int8
    plans) the loaded head kernel. Build with ``CLayers.build`` (None when the layer kernel
    cannot be used)."""

    one_token_only = True

    def __init__(self, plan: DecodePlan, row_layers: RowLayers, head) -> None:
        self.plan, self.row_layers, self._head = plan, row_layers, head

    @classmethod
    def build(cls, plan: DecodePlan, cache: list[KVCache], bias: Tensor | None, *,
              gemv=None, int8=None) -> CLayers | None:
        """The runner, or None when ``RowLayers.build`` refuses (no C form, not loadable)."""
        lins = plan.linears()
        if plan.int8:
            linears = [(lin.weight_int8, lin.scale127, lin.bias) for lin in lins[:-1]]
            head_kind = Int8KernelLinears(plan, int8)
            n_layers = len(plan.layers)

            def head(h: Tensor) -> Tensor:
                return head_kind.linear(h, 4 * n_layers)
        else:
            wt = [lin.weight.detach().t().contiguous() for lin in lins]  # (in, out)
            linears = [(w, None, lin.bias) for w, lin in zip(wt[:-1], lins, strict=False)]
            head_w = wt[-1]  # (C, V)
            width, vocab = head_w.shape
            kernel_registry.check("gemv", x=torch.empty(width, dtype=torch.float32), w=head_w,
                                  b=None, res=None, y=torch.empty(vocab, dtype=torch.float32),
                                  k=width, n=vocab)  # checked once

            def head(h: Tensor) -> Tensor:
                h = h.contiguous()
                out = torch.empty(h.shape[0], head_w.shape[1], dtype=h.dtype)  # (1, V)
                gemv(h.data_ptr(), head_w.data_ptr(), None, None, out.data_ptr(),
                     *head_w.shape)
                return out
        rows = RowLayers.build(plan, linears, cache, bias)
        return None if rows is None else cls(plan, rows, head)

    def head(self, h: Tensor) -> Tensor:
        """Logits (R, V) of final-normed rows h (R, C)."""
        return self._head(h)

    def layers(self, x: Tensor, t: int, n: int, pos: Tensor | None) -> Tensor:
        """x (R, C) of one new token per row (n = 1) at slot t; ``pos`` (1,) or (R, 1) RoPE
        positions or None. Returns the residual stream (R, C) (x, updated in place)."""
        if n != 1:
            raise ValueError(f"CLayers: one token per row per call, got {n}")
        x = x.contiguous()
        self.row_layers(x, t, pos)
        return x
