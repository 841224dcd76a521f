"""Tile loops of the online-softmax (FlashAttention-style) algorithm, forward and backward.

Shapes: B batch, H heads (keys/values already expanded to H), N query length, S key length,
D head dim, Dv value dim; a tile covers queries i0:i1 (n = i1 - i0) and keys j0:j1 (s).

Forward keeps, per query row, a running maximum m, a running sum l and an accumulator; it
returns the output and the log-sum-exp (LSE) of each row, never an N×S tensor. Backward
recomputes each tile's probabilities from the LSE, P = exp(S - LSE), and uses
dS = P ∘ (dP - rowsum(dO ∘ O)) (FlashAttention-2), so it stores nothing of size N×S either.
Bias producers' parameters get their gradients through a small local autograd graph per tile.
All tile math runs in fp32 for half-precision inputs. Logit soft-capping (``softcap``, Gemma 2)
caps q kᵀ · scale as ``softcap · tanh(· / softcap)`` before the bias and the mask; backward
multiplies the logits' gradient by ``1 - tanh²`` on its way to dQ and dK (the bias and the
producer see the capped logits' gradient unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .bias import BiasProducer, query_positions
from .masks import Mask
from .reference import compute_dtype

__all__ = ["TileProblem", "tiles_backward", "tiles_forward"]


@dataclass
class TileProblem:
    """Everything the tile loops need besides q, k, v (keys/values already at H heads)."""

    n: int
    s: int
    scale: float
    mask: Mask | None = None
    bias: Tensor | None = None  # broadcastable to (B, H, N, S)
    producer: BiasProducer | None = None
    dropout_p: float = 0.0
    seed: int = 0
    block_q: int = 256
    block_k: int = 512
    softcap: float | None = None  # logit soft-capping before the bias and the mask
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def query_blocks(self):
        """Yields (i0, i1) over the queries."""
        for i0 in range(0, self.n, self.block_q):
            yield i0, min(self.n, i0 + self.block_q)

    def key_blocks(self, i0: int, i1: int):
        """Yields (keys, key_positions, tile_mask, j0) over the live key tiles of queries
        i0:i1; ``keys`` is a slice, or for block-sparse masks (``mask.tile``) one index
        tensor gathering every live key block of the query block into a single tile."""
        lo, hi = (0, self.s) if self.mask is None else self.mask.key_range(i0, i1, self.n, self.s)
        live = []
        candidates = [(j0, min(hi, j0 + self.block_k)) for j0 in range(lo, hi, self.block_k)]
        lister = getattr(self.mask, "live_key_tiles", None)
        listed = (lister(i0, i1, self.n, self.s)
                  if lister is not None and self.block_k == self.mask.tile else None)
        if listed is not None:  # block-sparse: dead blocks are never visited
            candidates = [(j0, j1) for j0, j1 in listed if j0 < hi and j1 > lo]
        for j0, j1 in candidates:
            blk = True if self.mask is None else self.mask.block(
                i0, i1, j0, j1, self.n, self.s, self.device)
            if blk is False:
                continue
            if self.mask is None or self.mask.tile is None:
                yield slice(j0, j1), torch.arange(j0, j1, device=self.device), blk, j0
            else:
                live.append((j0, j1, blk))
        if len(live) == 1:
            j0, j1, blk = live[0]
            yield slice(j0, j1), torch.arange(j0, j1, device=self.device), blk, j0
        elif live:
            idx = torch.cat([torch.arange(j0, j1, device=self.device) for j0, j1, _ in live])
            yield idx, idx, _cat_blocks(live, i1 - i0), live[0][0]


def _cat_blocks(live: list, n: int):
    """Concatenate tile masks (True or bool tensors) along the keys."""
    if all(blk is True for _, _, blk in live):
        return True
    tensors = [blk for _, _, blk in live if blk is not True]
    b = max(t.shape[0] for t in tensors)
    h = max(t.shape[1] for t in tensors)
    device = tensors[0].device
    parts = [torch.ones(b, h, n, j1 - j0, dtype=torch.bool, device=device) if blk is True
             else blk.expand(b, h, n, j1 - j0) for j0, j1, blk in live]
    return torch.cat(parts, dim=-1)


def _bias_cols(bias: Tensor, i0: int, i1: int, keys) -> tuple[slice, slice | Tensor]:
    rows = slice(i0, i1) if bias.shape[-2] != 1 else slice(None)
    return rows, keys if bias.shape[-1] != 1 else slice(None)


def _bias_tile(bias: Tensor, i0: int, i1: int, keys) -> Tensor:
    rows, cols = _bias_cols(bias, i0, i1, keys)
    return bias[..., rows, :][..., cols]


def _dropout_keep(prob: TileProblem, i0: int, j0: int, shape, device) -> Tensor:
    """Deterministic dropout mask of one tile: the same in forward and backward."""
    gen = torch.Generator(device=device)
    gen.manual_seed(prob.seed * 1_000_003 + i0 * 65_537 + j0)
    return torch.rand(shape, generator=gen, device=device) >= prob.dropout_p


def _scores(prob: TileProblem, qt: Tensor, kt: Tensor, i0, i1, keys, blk,
            producer_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Logits of one tile, (B, H, n, s), -inf where masked, and the derivative of the soft
    cap with respect to q kᵀ · scale, ``1 - tanh²`` (B, H, n, s) (None without a cap)."""
    scores = torch.matmul(qt, kt.transpose(-2, -1)) * prob.scale  # (B, H, n, s)
    slope = None
    if prob.softcap is not None:
        capped = torch.tanh(scores / prob.softcap)  # (B, H, n, s)
        slope = 1.0 - capped * capped
        scores = capped * prob.softcap
    if prob.bias is not None:
        scores = scores + _bias_tile(prob.bias, i0, i1, keys).to(scores.dtype)
    if producer_bias is not None:
        scores = scores + producer_bias
    if blk is not True:
        scores = scores.masked_fill(~blk, float("-inf"))
    return scores, slope


def tiles_forward(prob: TileProblem, q: Tensor, k: Tensor, v: Tensor,
                  rows: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Online-softmax forward. q (B, H, N, D), k (B, H, S, D), v (B, H, S, Dv).

    Returns out (B, H, N, Dv) and lse (B, H, N) in the compute dtype; rows that attend to
    nothing get out = 0 and lse = -inf.
    """
    cdt = compute_dtype(q.dtype)
    batch, heads, n, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    out = torch.zeros(batch, heads, n, dv, dtype=cdt, device=q.device)
    lse = torch.full((batch, heads, n), float("-inf"), dtype=cdt, device=q.device)
    prod = prob.producer
    for i0, i1 in prob.query_blocks():
        qt = q[:, :, i0:i1].to(cdt)  # (B, H, n, D)
        qpos = query_positions(i0, i1, prob.n, prob.s, q.device)
        m = torch.full((batch, heads, i1 - i0), float("-inf"), dtype=cdt, device=q.device)
        total = torch.zeros_like(m)
        acc = torch.zeros(batch, heads, i1 - i0, dv, dtype=cdt, device=q.device)
        for keys, kpos, blk, j0 in prob.key_blocks(i0, i1):
            kt, vt = k[:, :, keys].to(cdt), v[:, :, keys].to(cdt)
            pbias = None
            if prod is not None:
                pbias = prod.score_bias(qpos, kpos, q=qt if prod.needs_query else None,
                                        scale=prob.scale).to(cdt)
            scores, _ = _scores(prob, qt, kt, i0, i1, keys, blk, pbias)
            m_new = torch.maximum(m, scores.amax(dim=-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m - m_safe)  # 0 where m was -inf
            p = torch.exp(scores - m_safe[..., None])  # (B, H, n, s)
            total = total * alpha + p.sum(dim=-1)
            if prob.dropout_p > 0.0:
                keep = _dropout_keep(prob, i0, j0, p.shape, q.device)
                p = p * keep / (1.0 - prob.dropout_p)
            contrib = torch.matmul(p, vt)  # (B, H, n, Dv)
            if prod is not None and prod.has_value_term:
                contrib = contrib + prod.value_term(p, qpos, kpos).to(cdt)
            acc = acc * alpha[..., None] + contrib
            m = m_new
        live = total > 0
        safe_total = torch.where(live, total, torch.ones_like(total))
        out[:, :, i0:i1] = acc / safe_total[..., None]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lse[:, :, i0:i1] = torch.where(live, m_safe + torch.log(safe_total),
                                       torch.full_like(m, float("-inf")))
    return out, lse


def _reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (B, H, n, s) gradient down to a broadcast shape."""
    return grad.sum_to_size(shape) if grad.shape != shape else grad


def tiles_backward(prob: TileProblem, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor,
                   delta: Tensor, lse: Tensor, params: list[Tensor],
                   grads: dict) -> None:
    """Accumulate gradients of the tiles of ``prob`` into ``grads``.

    ``d_out`` (B, H, N, Dv) and ``delta = rowsum(dO ∘ O)`` (B, H, N) and ``lse`` (B, H, N)
    are those of the *whole* attention (which may include work outside these tiles).
    ``grads`` holds fp32/fp64 buffers "q", "k", "v" (full shapes), optionally "bias" (the
    bias tensor's shape) and "params" (a list aligned with ``params``).
    """
    cdt = compute_dtype(q.dtype)
    prod = prob.producer
    want_q_for_prod = prod is not None and prod.needs_query
    want_params = bool(params)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    for i0, i1 in prob.query_blocks():
        qt = q[:, :, i0:i1].to(cdt)
        dot = d_out[:, :, i0:i1].to(cdt)  # (B, H, n, Dv)
        lse_t = lse_safe[:, :, i0:i1, None]
        delta_t = delta[:, :, i0:i1, None]
        qpos = query_positions(i0, i1, prob.n, prob.s, q.device)
        dq_t = torch.zeros_like(qt)
        for keys, kpos, blk, j0 in prob.key_blocks(i0, i1):
            kt, vt = k[:, :, keys].to(cdt), v[:, :, keys].to(cdt)
            pbias = q_leaf = None
            if prod is not None:
                with torch.enable_grad():
                    q_leaf = qt.detach().requires_grad_(want_q_for_prod)
                    pbias = prod.score_bias(qpos, kpos, q=q_leaf if want_q_for_prod else None,
                                            scale=prob.scale).to(cdt)
            scores, slope = _scores(prob, qt, kt, i0, i1, keys, blk,
                                    None if pbias is None else pbias.detach())
            p = torch.exp(scores - lse_t)  # (B, H, n, s), globally normalised
            keep = None
            w = p
            if prob.dropout_p > 0.0:
                keep = _dropout_keep(prob, i0, j0, p.shape, q.device)
                w = p * keep / (1.0 - prob.dropout_p)
            grads["v"][:, :, keys] += torch.matmul(w.transpose(-2, -1), dot)
            dp = torch.matmul(dot, vt.transpose(-2, -1))  # (B, H, n, s)
            if prod is not None and prod.has_value_term:
                with torch.enable_grad():
                    w_leaf = w.detach().requires_grad_(True)
                    term = prod.value_term(w_leaf, qpos, kpos).to(cdt)
                    got = torch.autograd.grad(term, [w_leaf, *params], dot, allow_unused=True)
                dp = dp + got[0]
                _add_param_grads(grads, got[1:])
            if keep is not None:
                dp = dp * keep / (1.0 - prob.dropout_p)
            ds = p * (dp - delta_t)  # (B, H, n, s): gradient of the logits
            ds_qk = ds if slope is None else ds * slope  # through the soft cap
            dq_t += torch.matmul(ds_qk, kt) * prob.scale
            grads["k"][:, :, keys] += torch.matmul(ds_qk.transpose(-2, -1), qt) * prob.scale
            if "bias" in grads:
                rows, cols = _bias_cols(prob.bias, i0, i1, keys)
                tile_shape = _bias_tile(prob.bias, i0, i1, keys).shape
                grads["bias"][..., rows, cols] += _reduce_to(ds, tile_shape)
            if pbias is not None and (want_params or want_q_for_prod):
                inputs = ([q_leaf] if want_q_for_prod else []) + list(params)
                got = torch.autograd.grad(pbias, inputs, _reduce_to(ds, pbias.shape),
                                          allow_unused=True)
                if want_q_for_prod:
                    dq_t += got[0]
                    got = got[1:]
                _add_param_grads(grads, got)
        grads["q"][:, :, i0:i1] += dq_t


def _add_param_grads(grads: dict, got) -> None:
    for buf, g in zip(grads["params"], got, strict=True):
        if g is not None:
            buf += g
