"""The modules of LoRA (Hu et al. 2021): ``LoraUpdate`` (one adapter's low-rank update of
some output rows of a projection), ``LoraState`` (the adapters of one projection, by name,
and which one is active) and ``LoraLinear`` (a projection with its ``LoraState``). Finding
the projections of a model, adding, switching and merging adapters: ``qkv.peft.lora``.

Shapes: In input features, Rows output rows an update covers, r rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fast_linear import fast_linear
from .config import LoraConfig
from .lora_function import LoraLinearFunction, fusable

__all__ = ["LoraLinear", "LoraState", "LoraUpdate"]


class LoraUpdate(nn.Module):
    """One adapter's update of one projection: for each segment (role, lo, hi) parameters
    ``A_<role>`` (r, In), Kaiming-uniform (a = √5, as HF PEFT), and ``B_<role>``
    (hi - lo, r), zeros. ``delta(x)`` is scale · B A dropout(x) on the rows asked for.

    Args:
        config: the adapter's ``LoraConfig`` (r, scale, dropout).
        segments: ((role, lo, hi), ...) sorted, disjoint row ranges of the projection.
        in_features: In.
        device, dtype: of the parameters (the base weight's).
    """

    def __init__(self, config: LoraConfig, segments: Sequence[tuple[str, int, int]],
                 in_features: int, *, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.segments = tuple(sorted(segments, key=lambda s: s[1]))
        self.r, self.scale, self.dropout = config.r, config.scale, config.dropout
        for role, lo, hi in self.segments:
            a = nn.Parameter(torch.empty(config.r, in_features, device=device, dtype=dtype))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            b = nn.Parameter(torch.zeros(hi - lo, config.r, device=device, dtype=dtype))
            self.register_parameter(f"A_{role}", a)  # (r, In)
            self.register_parameter(f"B_{role}", b)  # (Rows, r)

    def factors(self, start: int, stop: int) -> tuple[Tensor, Tensor] | None:
        """(A_cat (S·r, In), scale · B_blockdiag (stop - start, S·r)) for output rows
        [start, stop), or None when no segment meets them."""
        segs = [s for s in self.segments if s[1] < stop and s[2] > start]
        if not segs:
            return None
        r, cols = self.r, self.r * len(segs)
        a_parts = [getattr(self, f"A_{role}") for role, _, _ in segs]
        a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts)  # (S·r, In)
        pieces, cur = [], start
        for j, (role, lo, hi) in enumerate(segs):
            lo2, hi2 = max(lo, start), min(hi, stop)
            if lo2 > cur:
                pieces.append(a.new_zeros(lo2 - cur, cols))  # untargeted rows
            b = getattr(self, f"B_{role}")[lo2 - lo:hi2 - lo]  # (rows, r)
            if len(segs) > 1:
                b = F.pad(b, (j * r, cols - (j + 1) * r))  # (rows, S·r), its own columns
            pieces.append(b)
            cur = hi2
        if cur < stop:
            pieces.append(a.new_zeros(stop - cur, cols))
        b = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # (stop - start, S·r)
        return a, b * self.scale

    def _hidden(self, x: Tensor, start: int, stop: int, training: bool
                ) -> tuple[Tensor, Tensor] | None:
        f = self.factors(start, stop)
        if f is None:
            return None
        a, b = f
        if self.dropout and training:
            x = F.dropout(x, self.dropout, training=True)
        return F.linear(x, a), b  # h (..., S·r), scale · B (stop - start, S·r)

    def delta(self, x: Tensor, start: int, stop: int, training: bool) -> Tensor | None:
        """scale · dropout(x) Aᵀ Bᵀ on rows [start, stop): x (..., In) -> (..., stop - start),
        or None when no segment meets those rows."""
        hb = self._hidden(x, start, stop, training)
        return None if hb is None else F.linear(*hb)

    def add_to(self, out: Tensor, x: Tensor, start: int, stop: int, training: bool) -> Tensor:
        """out (..., stop - start) + ``delta(x, start, stop)`` in one addmm; x (..., In)."""
        hb = self._hidden(x, start, stop, training)
        if hb is None:
            return out
        h, b = hb
        shape = out.shape
        out2 = torch.addmm(out.reshape(-1, shape[-1]), h.reshape(-1, h.shape[-1]), b.t())
        return out2.view(shape)  # (..., stop - start)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, start: int, stop: int,
               training: bool) -> Tensor:
        """The base rows plus this update: ``F.linear(x, weight, bias)`` + ``delta(x, start,
        stop)``, with ``weight`` (stop - start, In) and ``bias`` (stop - start,) or None the
        base layer's rows [start, stop). x (..., In) -> (..., stop - start).

        One ``LoraLinearFunction`` where ``fusable``; otherwise the composed ops."""
        segs = [s for s in self.segments if s[1] < stop and s[2] > start]
        params = [getattr(self, f"{k}_{role}") for role, _, _ in segs for k in "AB"]
        if not segs or not fusable(x, weight, bias, *params):
            return self.add_to(fast_linear(x, weight, bias), x, start, stop, training)
        spans, ab = [], []
        for role, lo, hi in segs:
            lo2, hi2 = max(lo, start), min(hi, stop)
            spans.append((lo2 - start, hi2 - start))
            b = getattr(self, f"B_{role}")
            ab += [getattr(self, f"A_{role}"), b if (lo2, hi2) == (lo, hi)
                   else b[lo2 - lo:hi2 - lo]]  # A (r, In), B (hi2 - lo2, r)
        x2 = x.reshape(-1, x.shape[-1])  # (M, In)
        xd = (F.dropout(x2, self.dropout, training=True) if self.dropout and training
              else None)
        y = LoraLinearFunction.apply(x2, xd, weight, bias, self.scale, tuple(spans), *ab)
        return y.view(*x.shape[:-1], stop - start)  # (..., stop - start)

    def delta_weight(self, out_features: int) -> Tensor:
        """scale · B A over all Out rows (zeros outside the segments), (Out, In), computed in
        at least fp32."""
        a, b = self.factors(0, out_features)
        cdt = torch.promote_types(a.dtype, torch.float32)
        return b.detach().to(cdt) @ a.detach().to(cdt)

    def extra_repr(self) -> str:
        roles = "+".join(role for role, _, _ in self.segments)
        return f"r={self.r}, scale={self.scale:g}, roles={roles}"


class LoraState(nn.ModuleDict):
    """The ``lora`` submodule of a targeted projection: adapter name -> ``LoraUpdate``, and
    the model-wide switches every projection mirrors: ``active`` (adapter name or None),
    ``merged`` (the adapter folded into the weight, or None), ``disabled`` and ``rows`` (the
    per-row adapter names of ``adapter_rows``, or None)."""

    ADAPTER_KIND = "lora"  # what ``qkv.peft.saving`` reads

    def __init__(self, roles: dict[str, tuple[int, int]], out_features: int) -> None:
        super().__init__()
        self.roles = dict(roles)
        self.out_features = out_features
        self.active: str | None = None
        self.merged: str | None = None
        self.disabled = False
        self.rows: tuple[str, ...] | None = None
        self._row_index: dict[str, Tensor] = {}

    def engaged(self) -> bool:
        """True when this projection must compute an update (a ``LoraLinear`` in place)."""
        if self.disabled:
            return False
        if self.rows is not None:
            return any(name in self for name in set(self.rows))
        return self.merged is None and self.active is not None and self.active in self

    def set_rows(self, rows: tuple[str, ...] | None) -> None:
        self.rows = rows
        self._row_index = {}
        if rows is not None:
            for name in dict.fromkeys(rows):
                if name in self:
                    self._row_index[name] = torch.tensor(
                        [i for i, n in enumerate(rows) if n == name])  # (b,)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, start: int, stop: int,
               training: bool) -> Tensor:
        """``F.linear(x, weight, bias)`` (the base rows [start, stop)) plus the engaged
        update(s): x (B, ..., In) -> (B, ..., stop - start)."""
        if self.rows is None:
            return self[self.active].linear(x, weight, bias, start, stop, training)
        return self.add_to(fast_linear(x, weight, bias), x, start, stop, training)

    def add_to(self, out: Tensor, x: Tensor, start: int, stop: int, training: bool) -> Tensor:
        """out (B, ..., stop - start) plus the engaged update(s) of x (B, ..., In)."""
        if self.rows is None:
            return self[self.active].add_to(out, x, start, stop, training)
        if x.dim() < 2 or x.shape[0] != len(self.rows):
            raise ValueError(f"adapter_rows: {len(self.rows)} row names, but a projection got "
                             f"input of shape {tuple(x.shape)} (batch first; generation with "
                             f"beams or a changed batch is not supported per row)")
        for name, idx in self._row_index.items():
            idx = idx.to(x.device)
            delta = self[name].delta(x.index_select(0, idx), start, stop,
                                     training)  # (b, ..., stop - start)
            if delta is not None:
                out = out.index_add(0, idx, delta)
        return out


class LoraLinear(nn.Module):
    """A linear layer with its LoRA updates: ``weight`` (Out, In) and ``bias`` (Out,) are the
    base layer's own Parameters (same state-dict keys), ``lora`` its ``LoraState``.

    forward: x (..., In) -> (..., Out) = F.linear(x, weight, bias) + the engaged update (one
    ``LoraLinearFunction`` where it may; see the module docstring).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 lora: LoraState) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.lora = lora

    def forward(self, x: Tensor) -> Tensor:
        """x (..., In) -> (..., Out)."""
        return self.lora.linear(x, self.weight, self.bias, 0, self.out_features, self.training)

    def project_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output rows [start, stop) only: x (..., In) -> (..., stop - start)."""
        b = None if self.bias is None else self.bias[start:stop]
        return self.lora.linear(x, self.weight[start:stop], b, start, stop, self.training)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
