"""Relative position schemes as bias producers: ALiBi, T5 buckets, Shaw et al. 2018.

Shapes: B batch, H heads, N query length, S key length, D head dim, Dv value dim; a block
covers n query positions ``q_pos`` (n,) and s key positions ``k_pos`` (s,).
Relative position ``r = key_pos - query_pos`` (negative: the key is in the past).

Each is passed as ``bias=`` to ``qkv.attention`` or ``MultiHeadAttention``; the chunked
backend computes one block at a time, so no N×S tensor is ever built, and each declares the
structure that lets the fused path send the bulk of the work to torch's flash kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..ops.bias import BiasProducer, FarField

__all__ = ["ALiBi", "ShawRelative", "T5Bias", "alibi_slopes", "t5_bucket"]


def _relative(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    return k_pos[None, :] - q_pos[:, None]  # (n, s)


def alibi_slopes(num_heads: int) -> Tensor:
    """Press et al. 2022 head slopes (H,): geometric 2^(-8/H·h); for H not a power of two,
    the slopes of the nearest lower power of two plus every other slope of the next one."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    if num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be positive, got {num_heads}")
    low = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(low)
    if low != num_heads:
        slopes += power_of_two(2 * low)[0::2][: num_heads - low]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBi(BiasProducer):
    """Attention with Linear Biases (Press et al. 2022): bias = -slope[h] · |key - query|.

    Causal use sees only the past, where the bias is slope·(key - query); bidirectional use
    gets the symmetric form. ``slopes`` (H,) overrides the paper's geometric slopes.
    No parameters. Folds exactly into the fused kernel (one extra q/k dimension).
    """

    def __init__(self, num_heads: int, *, slopes: Tensor | None = None) -> None:
        super().__init__()
        s = alibi_slopes(num_heads) if slopes is None else torch.as_tensor(slopes).double()
        if s.shape != (num_heads,):
            raise ValueError(f"ALiBi: slopes must have shape ({num_heads},), got "
                             f"{tuple(s.shape)}")
        self._heads = num_heads
        self.register_buffer("slopes", s.float(), persistent=False)

    @property
    def num_heads(self) -> int:
        return self._heads

    def score_bias(self, q_pos, k_pos, *, q=None, scale=1.0):
        rel = _relative(q_pos, k_pos).abs().to(self.slopes.dtype)  # (n, s)
        return -(self.slopes[:, None, None] * rel)[None]  # (1, H, n, s)

    def key_linear_slopes(self) -> Tensor:
        return self.slopes

    def extra_repr(self) -> str:
        return f"num_heads={self._heads}"


def t5_bucket(rel: Tensor, *, bidirectional: bool, num_buckets: int,
              max_distance: int) -> Tensor:
    """T5's relative position bucket of ``rel = key - query`` (any shape, int64 result).

    Half of the buckets (per direction when bidirectional) hold exact small distances; the
    rest are log-spaced up to ``max_distance``; everything further shares the last bucket.
    """
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = dist < max_exact
    large = max_exact + (
        torch.log(dist.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, dist, large)


class T5Bias(BiasProducer):
    """T5's learned bucketed relative position bias (Raffel et al. 2020).

    A (num_buckets, H) embedding indexed by ``t5_bucket(key - query)``. ``bidirectional``
    True for encoders, False for causal decoders (the future collapses to bucket 0). T5
    itself uses ``scale=1.0`` in attention. Beyond the distance where the bucket saturates
    the bias is constant per head, which the fused path exploits.
    """

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        half = num_buckets // 2 if bidirectional else num_buckets
        if half < 2 or max_distance <= half // 2:
            raise ValueError(f"T5Bias: need num_buckets >= {4 if bidirectional else 2} and "
                             f"max_distance > exact range, got num_buckets={num_buckets}, "
                             f"max_distance={max_distance}")
        self._heads = num_heads
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.embedding = nn.Embedding(num_buckets, num_heads, device=device, dtype=dtype)
        dist = torch.arange(max_distance + 1)
        last = t5_bucket(-dist, bidirectional=bidirectional, num_buckets=num_buckets,
                         max_distance=max_distance)
        # First distance from which the (left) bucket no longer changes.
        self._saturation = int((last != last[-1]).nonzero().max()) + 1

    @property
    def num_heads(self) -> int:
        return self._heads

    def bucket(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bucket ids (n, s) of a block."""
        return t5_bucket(_relative(q_pos, k_pos), bidirectional=self.bidirectional,
                         num_buckets=self.num_buckets, max_distance=self.max_distance)

    def score_bias(self, q_pos, k_pos, *, q=None, scale=1.0):
        values = self.embedding(self.bucket(q_pos, k_pos))  # (n, s, H)
        return values.permute(2, 0, 1)[None]  # (1, H, n, s)

    def far_field(self) -> FarField:
        return FarField(self._saturation)

    def _far_bucket(self, side: int) -> int:
        rel = torch.tensor([side * (self.max_distance + self._saturation + 1)])
        return int(t5_bucket(rel, bidirectional=self.bidirectional,
                             num_buckets=self.num_buckets, max_distance=self.max_distance))

    def far_row_term(self, q, side, scale):
        return self.embedding.weight[self._far_bucket(side)][None, :, None]  # (1, H, 1)

    def extra_repr(self) -> str:
        return (f"num_heads={self._heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional}")


class ShawRelative(BiasProducer):
    """Relative position representations of Shaw, Uszkoreit & Vaswani (2018).

    Distances are clipped to [-max_distance, max_distance]; each clipped distance r has a
    key embedding a^K_r (D,) and a value embedding a^V_r (Dv,), shared across heads:
    logits e_ij = scale · q_i · (k_j + a^K_{r(i,j)}) and outputs z_i = Σ_j p_ij (v_j + a^V_r).
    ``values=False`` keeps only the key term. Beyond the clip distance both terms are
    constant, so only the band |r| < max_distance needs explicit tiles.
    """

    needs_query = True

    def __init__(self, head_dim: int, *, max_distance: int = 16, value_dim: int | None = None,
                 values: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if max_distance < 1:
            raise ValueError(f"ShawRelative: max_distance must be >= 1, got {max_distance}")
        self.max_distance = max_distance
        self.head_dim = head_dim
        self.has_value_term = values
        n_rel = 2 * max_distance + 1
        self.key_embedding = nn.Parameter(torch.empty(n_rel, head_dim, device=device,
                                                      dtype=dtype))
        self.value_embedding = (nn.Parameter(torch.empty(n_rel, value_dim or head_dim,
                                                         device=device, dtype=dtype))
                                if values else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform initialisation, as Shaw et al.'s tensor2tensor code."""
        nn.init.xavier_uniform_(self.key_embedding)
        if self.value_embedding is not None:
            nn.init.xavier_uniform_(self.value_embedding)

    def index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Embedding rows (n, s) of a block: clip(key - query) + max_distance."""
        k = self.max_distance
        return _relative(q_pos, k_pos).clamp(-k, k) + k

    def score_bias(self, q_pos, k_pos, *, q=None, scale=1.0):
        if q is None:
            raise ValueError("ShawRelative: the key term needs the queries (q=...)")
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"ShawRelative: built for head_dim {self.head_dim}, q has "
                             f"shape {tuple(q.shape)}")
        qr = torch.matmul(q, self.key_embedding.to(q.dtype).t())  # (B, H, n, 2K+1)
        idx = self.index(q_pos, k_pos)
        idx = idx.expand(*qr.shape[:2], *idx.shape)  # (B, H, n, s)
        return torch.gather(qr, -1, idx) * scale

    def value_term(self, p, q_pos, k_pos):
        idx = self.index(q_pos, k_pos).expand(p.shape)  # (B, H, n, s)
        mass = p.new_zeros(*p.shape[:-1], 2 * self.max_distance + 1)
        mass = mass.scatter_add(-1, idx, p)  # (B, H, n, 2K+1): weight per clipped distance
        return torch.matmul(mass, self.value_embedding.to(p.dtype))  # (B, H, n, Dv)

    def far_field(self) -> FarField:
        return FarField(self.max_distance)

    def far_row_term(self, q, side, scale):
        row = self.key_embedding[self.max_distance + side * self.max_distance]
        return torch.matmul(q, row.to(q.dtype)) * scale  # (B, H, n)

    def far_value_vector(self, side):
        if self.value_embedding is None:
            return None
        return self.value_embedding[self.max_distance + side * self.max_distance]  # (Dv,)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, max_distance={self.max_distance}, "
                f"values={self.has_value_term}")
