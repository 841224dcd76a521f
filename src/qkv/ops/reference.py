"""Eager reference attention: plain math, the test oracle, and the source of weights.

Shapes: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), N query length,
S key length, D head dim, Dv value dim.

It materialises the (B, H, N, S) scores, so it is for short sequences, for tests (run it in
fp64), and for returning attention weights. Half-precision inputs are computed in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .bias import BiasProducer
from .masks import Mask

__all__ = ["expand_kv", "reference_attention", "safe_softmax", "soft_cap"]


def expand_kv(x: Tensor, heads: int) -> Tensor:
    """Repeat key/value heads (B, Hkv, S, D) -> (B, H, S, D) for grouped-query attention."""
    hkv = x.shape[1]
    if hkv == heads:
        return x
    return x.repeat_interleave(heads // hkv, dim=1)  # (B, H, S, D)


def safe_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim where a row of all -inf gives zeros (finite gradients)."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    total = e.sum(dim=-1, keepdim=True)
    total = torch.where(total > 0, total, torch.ones_like(total))
    return e / total


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the math runs in: fp32 for half precision, the input dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def soft_cap(scores: Tensor, softcap: float | None) -> Tensor:
    """Logit soft-capping (Gemma 2): ``softcap · tanh(scores / softcap)``, any shape; None
    returns ``scores`` itself. Applied to q kᵀ · scale before the bias and the mask."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None, bias: Tensor | BiasProducer | None,
    scale: float, dropout_p: float = 0.0, training: bool = True, softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(cap(q kᵀ · scale) + bias, masked) v, materialised; cap is ``soft_cap`` with
    ``softcap`` (the identity for None).

    q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv). Returns ``(out, weights)``:
    out (B, H, N, Dv) in q's dtype and weights (B, H, N, S) (before dropout) in the
    compute dtype. Fully masked query rows give zero weights and a zero output.
    """
    heads, n, s = q.shape[1], q.shape[2], k.shape[2]
    cdt = compute_dtype(q.dtype)
    qc, kc, vc = q.to(cdt), expand_kv(k, heads).to(cdt), expand_kv(v, heads).to(cdt)
    scores = torch.matmul(qc, kc.transpose(-2, -1)) * scale  # (B, H, N, S)
    scores = soft_cap(scores, softcap)
    if isinstance(bias, BiasProducer):
        scores = scores + bias.dense(n, s, q=qc, scale=scale, device=q.device).to(cdt)
    elif bias is not None:
        scores = scores + bias.to(cdt)
    if mask is not None:
        keep = mask.dense(n, s, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = safe_softmax(scores)  # (B, H, N, S)
    used = weights
    if dropout_p > 0.0 and training:
        used = torch.nn.functional.dropout(weights, p=dropout_p)
    out = torch.matmul(used, vc)  # (B, H, N, Dv)
    if isinstance(bias, BiasProducer) and bias.has_value_term:
        pos_q = torch.arange(s - n, s, device=q.device)
        out = out + bias.value_term(used, pos_q, torch.arange(s, device=q.device)).to(cdt)
    return out.to(q.dtype), weights
