"""``qkv.attention``: validate, pick a backend, explain refusals.

Shapes: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), N query length,
S key length, D head dim, Dv value dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .bias import BiasProducer
from .checks import check_qkv, shape_of
from .chunked import chunked_attention
from .masks import And, Causal, Mask, Padding, as_mask
from .reference import reference_attention
from .sdpa import MAX_MATERIALISED, sdpa_attention, sdpa_refusal

__all__ = ["BACKENDS", "NoBackendError", "attention", "explain"]

BACKENDS = ("sdpa", "chunked", "reference")
REFERENCE_MAX_ELEMENTS = 1 << 28  # (B, H, N, S) scores the reference backend will materialise


class NoBackendError(ValueError):
    """No backend can serve the request; the message lists each backend's reason."""


def _validate(q: Tensor, k: Tensor, v: Tensor, bias, scale, dropout_p, backend,
              softcap=None) -> None:
    check_qkv("attention", q, k, v)
    b, h, d = q.shape[0], q.shape[1], q.shape[3]
    if k.shape[2] == 0 or d == 0:
        raise ValueError(f"attention: empty keys or head dim: k {shape_of(k)}")
    if isinstance(bias, Tensor):
        if not bias.dtype.is_floating_point:
            raise TypeError(f"attention: bias must be a float tensor (additive), got "
                            f"{bias.dtype}; pass boolean masks as mask= (True = may attend)")
        if bias.dim() > 4 or any(
                g not in (1, w) for g, w in zip(bias.shape[::-1], (k.shape[2], q.shape[2], h, b),
                                                strict=False)):
            raise ValueError(f"attention: bias shape {shape_of(bias)} is not broadcastable to "
                             f"(B, H, N, S) = {(b, h, q.shape[2], k.shape[2])}")
    elif isinstance(bias, BiasProducer):
        if bias.num_heads is not None and bias.num_heads != h:
            raise ValueError(f"attention: bias producer {type(bias).__name__} is built for "
                             f"{bias.num_heads} heads, q has H={h}")
    elif bias is not None:
        raise TypeError(f"attention: bias must be a float tensor or a qkv BiasProducer, got "
                        f"{type(bias).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"attention: scale must be a Python float, got "
                            f"{type(scale).__name__} {scale!r}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"attention: scale must be a positive finite number, got {scale!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"attention: softcap must be a Python float or None, got "
                            f"{type(softcap).__name__} {softcap!r}")
        if not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"attention: softcap must be a positive finite number or None, "
                             f"got {softcap!r}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p!r}")
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"attention: backend must be one of {('auto', *BACKENDS)}, "
                         f"got {backend!r}")


def _full_mask(mask, causal: bool, q: Tensor, k: Tensor) -> Mask | None:
    """The user's ``mask`` with ``causal`` folded in, validated against (B, H, N, S)."""
    mask = as_mask(mask)
    if causal:
        mask = Causal() if mask is None else Causal() & mask
    if mask is not None:
        mask.validate(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return mask


def _clear_padding(k: Tensor, v: Tensor, mask: Mask | None) -> tuple[Tensor, Tensor]:
    """Zero the keys/values past each sequence's end (``Padding``) when that memory holds a
    non-finite value, so that it cannot reach the result: 0 · NaN is NaN in weights @ V, and a
    NaN or inf logit stays NaN under an additive -inf mask.

    Zero-copy unless needed: nothing padded, or every element of k and v finite (one
    read-only sum of each, accumulated in fp32 for half inputs: a NaN or ±inf anywhere makes
    it non-finite; a finite sum that overflows only costs the copy), returns k and v
    themselves. Only memory that really holds NaN/inf is copied with the padding zeroed."""
    parts = mask.parts if isinstance(mask, And) else (mask,)
    pads = [p for p in parts if isinstance(p, Padding)]
    if not pads:
        return k, v
    keep = pads[0].block(0, 1, 0, k.shape[2], 1, k.shape[2], k.device)  # (B|1, 1, 1, S)
    for p in pads[1:]:
        keep = keep & p.block(0, 1, 0, k.shape[2], 1, k.shape[2], k.device)
    if bool(keep.all()):  # nothing is padded: no copy
        return k, v
    acc = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else None
    with torch.no_grad():
        total = k.detach().sum(dtype=acc) + v.detach().sum(dtype=acc)
    if bool(torch.isfinite(total)):  # padded memory is finite: it gets weight 0 exactly
        return k, v
    keep = keep[:, :, 0, :, None]  # (B|1, 1, S, 1)
    return k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0)


def _non_finite_guard(q: Tensor, k: Tensor, v: Tensor, out: Tensor, bias, dropout_p: float,
                      run) -> Tensor:
    """Make every backend agree on non-finite inputs: NaN in, NaN out; masked memory is inert.

    The contract (the reference math's, without its two accidents): a query row holding a NaN
    gives a NaN row if it may attend to at least one key (zeros if it may attend to none); a
    key holding one makes NaN every row that may attend to it; a value element makes NaN that
    dimension of every row that may attend to its key. What a row may not attend to (the
    mask) never reaches it. (±inf inputs are treated as NaN once they make some output
    non-finite; an inf that only sends logits to -inf acts as a mask, as in plain softmax.)
    The two accidents: torch's CPU flash kernel skips NaN logits in its row maximum and
    returns zeros when they are all NaN, and 0 · NaN = NaN lets a masked NaN value (or a
    masked NaN logit under SDPA's additive -inf) leak into the row.

    Cheap on finite inputs: one reduction of the output (BENCHMARKS.md, "The Padding NaN
    guard"). Any non-finite value a row may see shows in its output as NaN/inf or, through
    the kernel's accident, as an all-zero row; so only when the smallest row norm of ``out``
    is 0 or not finite are q, k, v inspected (rows with nothing to attend to, legitimately 0,
    cost that look). If they hold
    non-finite values the attention is recomputed with them zeroed (gradients stay finite;
    the zeroed entries get none), plus one run of the same backend on indicators with q = k = 0
    (uniform weights over exactly the keys each row may attend to) to place the NaNs.
    ``run(q, k, v, bias, dropout_p)`` is the chosen backend, mask and scale bound. Skipped
    under ``torch.compile`` and tracing (no data-dependent branch there), and off the CPU:
    the accidents are the CPU kernels', and on an accelerator the look would cost a device
    sync on every call (CUDA's kernels are not checked here: no GPU in the test machine).
    """
    if (out.numel() == 0 or out.device.type != "cpu" or torch.compiler.is_compiling()
            or torch.jit.is_tracing()):
        return out
    with torch.no_grad():
        smallest = float(torch.linalg.vector_norm(out.detach(), dim=-1).amin())  # NaN wins
        if smallest > 0 and math.isfinite(smallest):
            return out
        bad = [~torch.isfinite(t.detach()) for t in (q, k, v)]
        if not any(bool(b.any()) for b in bad):
            return out  # rows with nothing to attend to (or an overflow): nothing to fix
    bad_q, bad_k, bad_v = bad
    clean = [t.masked_fill(b, 0.0) if bool(b.any()) else t for t, b in zip((q, k, v), bad,
                                                                            strict=True)]
    out = run(*clean, bias, dropout_p)
    with torch.no_grad():
        ind = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, h, n, _ = q.shape
        hkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
        marks = torch.cat([(bad_v | bad_k.any(dim=-1, keepdim=True)).to(ind),
                           torch.ones(b, hkv, s, 1, dtype=ind, device=v.device)], dim=-1)
        # (q and k as wide as the marks: torch's flash kernel wants one head size)
        seen = run(torch.zeros(b, h, n, dv + 1, dtype=ind, device=q.device),
                   torch.zeros(b, hkv, s, dv + 1, dtype=ind, device=k.device), marks, None,
                   0.0)  # (B, H, N, Dv + 1)
        live = seen[..., -1:] > 0  # (B, H, N, 1): the row may attend to some key
        poison = (seen[..., :-1] > 0) | (bad_q.any(dim=-1, keepdim=True) & live)
    return out.masked_fill(poison, float("nan"))


def _refusal(name: str, q, k, v, mask, bias, softcap: float | None = None) -> str | None:
    if name == "sdpa":
        return sdpa_refusal(q, k, v, mask, bias, softcap=softcap)
    if name == "reference":
        size = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if size > REFERENCE_MAX_ELEMENTS:
            return f"would materialise {size} scores (limit {REFERENCE_MAX_ELEMENTS})"
    return None


def attention(
    q: Tensor, k: Tensor, v: Tensor, *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasProducer | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: softmax(cap(q kᵀ · scale) + bias, mask) v.

    Args:
        q: queries (B, H, N, D).
        k: keys (B, Hkv, S, D); H % Hkv == 0 gives grouped-/multi-query attention.
        v: values (B, Hkv, S, Dv); Dv may differ from D.
        mask: True = may attend. A ``qkv.masks.Mask`` (``Causal()``, ``Padding(lengths)``,
            combined with ``&``) or a bool tensor broadcastable to (B, H, N, S).
        bias: additive float tensor broadcastable to (B, H, N, S), or a bias producer
            (``qkv.positions.ALiBi``, ``T5Bias``, ``ShawRelative``) computed per block.
        causal: shorthand for ``mask=Causal()`` (bottom-right aligned) combined with ``mask``.
        scale: logit scale, default 1/sqrt(D).
        dropout_p: dropout on the attention weights (apply only while training).
        return_weights: also return the weights (B, H, N, S) (pre-dropout, fp32 for half
            inputs), materialised by the reference math whichever backend computed the output.
        backend: "auto" (fastest that can serve: sdpa, then chunked; the reference math for
            small problems SDPA cannot express), "sdpa", "chunked" or "reference".
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): a positive finite
            float makes cap(x) = softcap · tanh(x / softcap), applied to q kᵀ · scale before
            the bias and the mask (in fp32 for half inputs); None (default): no cap. SDPA
            cannot express it (``auto`` then takes chunked or reference); the chunked
            backend runs it on its explicit tiles, sliding-window and block-sparse masks
            included (only their live key range / blocks are visited).

    Returns:
        out (B, H, N, Dv) in q's dtype, or ``(out, weights)``. A query row with nothing to
        attend to returns zeros (and finite gradients). NaN in, NaN out, alike on every
        backend (on the CPU; see ``_non_finite_guard``): a NaN in a query row, a key or a
        value reaches (as NaN) exactly the rows that may attend to it; what the mask hides
        from a row never reaches it.

    Raises:
        TypeError / ValueError naming the offending argument; ``NoBackendError`` listing each
        backend's reason when none can serve.
    """
    _validate(q, k, v, bias, scale, dropout_p, backend, softcap)
    mask = _full_mask(mask, causal, q, k)
    softcap = None if softcap is None else float(softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    k, v = _clear_padding(k, v, mask)

    candidates = (backend,)
    if backend == "auto":
        # Small problems that SDPA cannot express run fastest materialised (reference math).
        small = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= MAX_MATERIALISED
        candidates = ("sdpa", "reference", "chunked") if small else BACKENDS
    reasons = {}
    chosen = None
    for name in candidates:
        reason = _refusal(name, q, k, v, mask, bias, softcap)
        if reason is None:
            chosen = name
            break
        reasons[name] = reason
    if chosen is None:
        lines = "; ".join(f"{n}: {r}" for n, r in reasons.items())
        raise NoBackendError(f"attention: no backend can serve this request — {lines}")

    first_weights = []  # the reference backend's weights of the call on the inputs as given

    def run(q, k, v, bias, dropout_p):
        if chosen == "sdpa":
            return sdpa_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                  dropout_p=dropout_p)
        if chosen == "chunked":
            return chunked_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                     dropout_p=dropout_p, softcap=softcap)[0]
        out, weights = reference_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                           dropout_p=dropout_p, softcap=softcap)
        first_weights.append(weights)
        return out

    out = _non_finite_guard(q, k, v, run(q, k, v, bias, dropout_p), bias, dropout_p, run)
    if return_weights:
        if first_weights:
            return out, first_weights[0]
        _, weights = reference_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                         softcap=softcap)
        return out, weights
    return out


def explain(q: Tensor, k: Tensor, v: Tensor, *, mask=None, bias=None, causal: bool = False,
            softcap: float | None = None) -> dict[str, str | None]:
    """For each backend, why it would refuse this request (None: it can serve).

    Arguments as for ``attention``; invalid requests raise as ``attention`` would."""
    _validate(q, k, v, bias, None, 0.0, "auto", softcap)
    mask = _full_mask(mask, causal, q, k)
    softcap = None if softcap is None else float(softcap)
    return {name: _refusal(name, q, k, v, mask, bias, softcap) for name in BACKENDS}

