"""The ``sdpa`` backend: torch.nn.functional.scaled_dot_product_attention (fused kernels).

Shapes: B batch, H query heads, Hkv key/value heads, N queries, S keys, D head dim, Dv value.

Plain causal (N == S, or top-left) becomes ``is_causal=True`` so torch's kernel skips the
masked half; other masks are materialised as one bool tensor (B|1, H|1, N, S); a dense
bias becomes a float mask with -inf where the mask forbids. Bias producers are materialised
only when small (``MAX_MATERIALISED`` elements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .bias import BiasProducer
from .masks import Causal, Mask, split_causal

__all__ = ["MAX_DENSE_SPARSE", "MAX_MATERIALISED", "sdpa_attention", "sdpa_refusal"]

MAX_MATERIALISED = 1 << 22  # elements of a (B, H, N, S) bias the sdpa backend will build
MAX_DENSE_SPARSE = 1 << 20  # N·S above which a sparse mask goes to the chunked backend


def sdpa_refusal(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias, *,
                 softcap: float | None = None) -> str | None:
    """Why the sdpa backend cannot serve this request (None: it can)."""
    if softcap is not None:
        return (f"logit soft-capping (softcap={softcap!r}) transforms q kᵀ · scale before the "
                f"bias and the mask, which SDPA cannot express")
    if mask is not None and mask.sparse and q.shape[2] * k.shape[2] > MAX_DENSE_SPARSE:
        return (f"sparse mask {mask.describe()}: a dense kernel would compute all "
                f"{q.shape[2]}×{k.shape[2]} pairs (the chunked backend computes live blocks)")
    if isinstance(bias, BiasProducer):
        if bias.needs_query:
            return f"{type(bias).__name__} depends on the queries, which SDPA cannot express"
        if bias.has_value_term:
            return f"{type(bias).__name__} adds a value term, which SDPA cannot express"
        size = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if size > MAX_MATERIALISED:
            return (f"bias producer would materialise a (B, H, N, S) bias of {size} elements "
                    f"(limit {MAX_MATERIALISED})")
    return None


def _bias_in(bias: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast a bias to SDPA's dtype without creating infinities: finite values are clamped to
    the dtype's range (an fp32 ``finfo.min`` stays a very negative finite logit, as in the
    fp32 math of the other backends); -inf stays -inf."""
    if bias.dtype == dtype:
        return bias
    info = torch.finfo(dtype)
    clamped = bias.clamp(info.min, info.max)
    return torch.where(bias == float("-inf"), bias, clamped).to(dtype)


def _is_plain_causal(causal: Causal | None, n: int, s: int) -> bool:
    return causal is not None and (n == s or causal.alignment == "top_left")


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None,
                   bias: Tensor | BiasProducer | None, scale: float,
                   dropout_p: float = 0.0) -> Tensor:
    """Attention through torch's SDPA. q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv).

    Returns (B, H, N, Dv) in q's dtype; fully masked rows give zeros (torch's safe softmax).
    """
    n, s = q.shape[2], k.shape[2]
    causal, rest = split_causal(mask)
    if causal is not None and causal.allows_all(n, s):
        causal = None  # e.g. a decode step (N=1, bottom-right): every key is visible
        mask = rest
    is_causal = _is_plain_causal(causal, n, s) and bias is None
    if is_causal:
        keep = None if rest is None else rest.dense(n, s, q.device)
        if keep is not None:  # is_causal cannot combine with attn_mask: fold it in
            keep = keep & causal.dense(n, s, q.device)
            is_causal = False
    else:
        keep = None if mask is None else mask.dense(n, s, q.device)
    attn_mask = keep
    if isinstance(bias, BiasProducer):
        bias = bias.dense(n, s, q=None, scale=scale, device=q.device)
    # A full-precision bias with half inputs runs in fp32, as in the other backends, rather
    # than being rounded into the half dtype.
    work = q.dtype
    if bias is not None and q.dtype.itemsize == 2 and bias.dtype.itemsize > 2:
        work = torch.float32
    if bias is not None:
        attn_mask = _bias_in(bias, work)
        if keep is not None:
            attn_mask = torch.where(keep, attn_mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.to(work), k.to(work), v.to(work), attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.to(q.dtype)
