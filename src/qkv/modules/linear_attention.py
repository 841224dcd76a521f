"""``LinearAttention``: multi-head self-attention on ``qkv.linear_attention``.

Shapes: B batch, N query length, S key length (cached + new), C model width (``dim``),
H heads, Hkv kv heads (H % Hkv == 0), D head dim (= C // H), D' feature dim (D for "elu",
m for "favor").

A drop-in for ``MultiHeadAttention`` as the self-attention of a layer (same projections:
``in_proj`` C -> (H + 2·Hkv)·D, rows q, k, v; ``out_proj`` H·D -> C), whose attention is
kernelised: out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j), over j <= i (causal, in
the chunkwise form: O(N·C + N·D'·D) time, no N×N tensor) or all j. Decoding carries a
``LinearCache`` (the constant-size ``LinearState``) instead of growing keys/values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import FEATURE_MAPS, FavorFeatures, linear_attention, linear_attention_step
from ..ops.masks import Mask, Padding
from .cache import LinearCache

__all__ = ["LinearAttention", "default_num_features"]


def default_num_features(head_dim: int) -> int:
    """FAVOR+ feature count used when none is given: round(D·ln D) (Performer's choice),
    at least D."""
    return max(head_dim, round(head_dim * math.log(head_dim))) if head_dim > 1 else 1


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


class LinearAttention(nn.Module):
    """Multi-head linear self-attention (Katharopoulos et al. 2020; FAVOR+, Choromanski et
    al. 2021). Batch-first: (B, N, C) in, (B, N, C) out.

    Args:
        dim: C; ``dim % num_heads == 0``.
        num_heads: H.
        num_kv_heads: Hkv (default H), grouped-query keys/values.
        bias: biases in the projections.
        feature_map: "elu" (φ(x) = elu(x) + 1) or "favor" (positive random features).
        num_features: m, the FAVOR+ feature count (default ``default_num_features(D)``);
            only with "favor".
        chunk_size: chunk length of the causal chunkwise form.
        rope: optional rotary module (``qkv.positions.RoPE(D)``), applied to q and k before
            the feature map, at absolute positions (continuing from ``cache.length``).
        device, dtype: of the parameters.

    Attributes:
        in_proj, out_proj: as ``MultiHeadAttention``'s (same names and shapes).
        feature_projection: "favor" only, the (m, D) random projection, a buffer (saved in
            the state dict, so a loaded model computes the same features);
            ``redraw_features()`` draws a new one.

    Example::

        attn = LinearAttention(256, 8)
        y = attn(x, causal=True)                      # (B, N, 256), O(N) in N
        cache = attn.new_cache(B)
        y = attn(prompt, causal=True, cache=cache)    # prefill: the state sums the prompt
        y = attn(x_t, causal=True, cache=cache)       # one step, constant memory
    """

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 bias: bool = True, feature_map: str = "elu", num_features: int | None = None,
                 chunk_size: int = 64, rope: Any = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("dim", dim), ("num_heads", num_heads),
                          ("num_kv_heads", num_kv_heads), ("chunk_size", chunk_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"LinearAttention: {name} must be a positive int, got {val!r}")
        if dim % num_heads:
            raise ValueError(f"LinearAttention: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"LinearAttention: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"LinearAttention: feature_map must be one of {FEATURE_MAPS}, "
                             f"got {feature_map!r}")
        head_dim = dim // num_heads
        if feature_map == "elu" and num_features is not None:
            raise ValueError(f"LinearAttention: num_features={num_features!r} is for "
                             f"feature_map='favor' (elu has D' = D = {head_dim})")
        if feature_map == "favor":
            num_features = default_num_features(head_dim) if num_features is None \
                else num_features
            if not isinstance(num_features, int) or isinstance(num_features, bool) \
                    or num_features <= 0:
                raise ValueError(f"LinearAttention: num_features must be a positive int, "
                                 f"got {num_features!r}")
        if rope is not None:
            if not callable(getattr(rope, "rotate", None)):
                raise TypeError(f"LinearAttention: rope must have a rotate(x, positions) "
                                f"method, got {type(rope).__name__}")
            if getattr(rope, "head_dim", head_dim) != head_dim:
                raise ValueError(f"LinearAttention: rope is built for head_dim="
                                 f"{rope.head_dim}, this module has D = {head_dim}")
        self.dim, self.num_heads, self.num_kv_heads = dim, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.feature_map = feature_map
        self.num_features = num_features if feature_map == "favor" else head_dim
        self.chunk_size = chunk_size
        self.rope = rope
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        self._splits = (q_width, kv_width, kv_width)
        factory = {"device": device, "dtype": dtype}
        self.in_proj = nn.Linear(dim, q_width + 2 * kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(q_width, dim, bias=bias, **factory)
        self._features = None
        if feature_map == "favor":
            self._features = FavorFeatures(head_dim, num_features)  # global RNG, like init
            self.register_buffer("feature_projection",
                                 self._features.projection.to(device=device))  # (m, D)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``MultiHeadAttention``'s initialisation (Xavier-uniform ``in_proj``, zero biases).
        The FAVOR+ projection is left as drawn (``redraw_features`` draws anew)."""
        nn.init.xavier_uniform_(self.in_proj.weight)
        if self.in_proj.bias is not None:
            nn.init.zeros_(self.in_proj.bias)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Draw a new FAVOR+ projection in place (Performer redraws during training);
        ValueError for "elu", which has no random features."""
        if self._features is None:
            raise ValueError("LinearAttention.redraw_features: feature_map='elu' has no "
                             "random features")
        self._favor().redraw(generator)  # in place: its projection is the buffer itself

    def _favor(self) -> FavorFeatures | None:
        if self._features is None:
            return None
        self._features.projection = self.feature_projection  # follows .to() and loading
        return self._features

    # --- inputs -----------------------------------------------------------------------------
    def _keep(self, mask: Any, batch: int, n: int, total: int, device) -> Tensor | None:
        """The (B, N) real-key flags of the N new positions, from a ``Padding`` mask over
        all ``total`` positions (cached + new); None when nothing is padded."""
        if mask is None:
            return None
        if not isinstance(mask, Padding):
            got = mask.describe() if isinstance(mask, Mask) else type(mask).__name__
            raise ValueError(f"LinearAttention: mask must be None or qkv.masks.Padding (key "
                             f"padding; causality is causal=True), got {got}")
        mask.validate(batch, self.num_heads, n, total)
        keep = mask.block(0, 1, 0, total, 1, total, device)  # (B|1, 1, 1, S)
        keep = keep[:, 0, 0, total - n:].expand(batch, n)  # (B, N)
        return None if bool(keep.all()) else keep.contiguous()

    # --- forward ----------------------------------------------------------------------------
    def forward(self, x: Tensor, context: Tensor | None = None, *,
                mask: Mask | None = None, causal: bool = False, bias: Any = None,
                need_weights: bool = False, cache: LinearCache | None = None,
                kv: Any = None, positions: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """Linear self-attention of ``x``.

        Args:
            x: (B, N, C).
            context, kv, bias: not supported (ValueError): self-attention only, no bias.
            mask: None or ``qkv.masks.Padding`` over the S = cached + N positions (True =
                real token); padded keys contribute nothing. Other masks raise ValueError.
            causal: position i sees keys <= i (required with a cache).
            need_weights: also return the (B, H, N, S) weights φ(q_i)·φ(k_j) / Σ_j, built
                quadratically (inspection only; not with a cache).
            cache: a ``LinearCache`` (``new_cache``): the state continues from it and is
                updated; decode under ``torch.no_grad()``/``torch.inference_mode()``.
            positions: with ``rope``, the absolute positions (N,) or (B, N); default
                ``cache.length + arange(N)``.

        Returns:
            out (B, N, C), or ``(out, weights)``.
        """
        if context is not None or kv is not None:
            raise ValueError("LinearAttention: self-attention only (no context/kv)")
        if bias is not None:
            raise ValueError("LinearAttention: an additive bias has no linear form; use "
                             "positions (rope=) instead")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = _shape(x) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"LinearAttention: x must have shape (B, N, C={self.dim}), "
                             f"got {got}")
        if cache is not None:
            if not isinstance(cache, LinearCache):
                raise TypeError(f"LinearAttention: cache must be a LinearCache "
                                f"(new_cache()), got {type(cache).__name__}")
            if not causal:
                raise ValueError("LinearAttention: a cache sums the past, which only causal "
                                 "attention sees; pass causal=True")
            if need_weights:
                raise ValueError("LinearAttention: need_weights needs the keys, which a "
                                 "LinearCache does not keep; call without a cache")
            if cache.batch != x.shape[0] or cache.num_heads != self.num_heads:
                raise ValueError(f"LinearAttention: cache is for batch {cache.batch}, "
                                 f"{cache.num_heads} heads; x has batch {x.shape[0]}, "
                                 f"module {self.num_heads} heads")
            cache.check_room(x.shape[1])
        batch, n, _ = x.shape
        past = 0 if cache is None else cache.length
        keep = self._keep(mask, batch, n, past + n, x.device)
        q, k, v = self.in_proj(x).split(self._splits, dim=-1)
        q = q.view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)
        k = k.view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, N, D)
        v = v.view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, N, D)
        if self.rope is not None:
            pos = torch.arange(past, past + n, device=x.device) if positions is None \
                else positions
            q, k = self.rope.rotate(q, pos), self.rope.rotate(k, pos)
        elif positions is not None:
            raise ValueError("LinearAttention: positions given but this module has no rope")
        kw = {"feature_map": self.feature_map, "features": self._favor(), "keep": keep}
        if cache is None:
            out = linear_attention(q, k, v, causal=causal, chunk_size=self.chunk_size, **kw)
        elif n == 1:
            out, state = linear_attention_step(q, k, v, cache.state, **kw)
            cache.update(state, n)
        else:
            out, state = linear_attention(q, k, v, causal=True, chunk_size=self.chunk_size,
                                          state=cache.state, return_state=True, **kw)
            cache.update(state, n)
        weights = self._weights(q, k, keep, causal) if need_weights else None
        out = out.transpose(1, 2).reshape(batch, n, self._splits[0])  # (B, N, H·D)
        out = self.out_proj(out)  # (B, N, C)
        return (out, weights) if need_weights else out

    def _weights(self, q: Tensor, k: Tensor, keep: Tensor | None, causal: bool) -> Tensor:
        """(B, H, N, S) normalised kernel scores (fp32 or fp64), rows of no key zero."""
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (B, H, S, D)
        if self._features is None:
            fq, fk = F.elu(q.to(cdt)) + 1, F.elu(k.to(cdt)) + 1  # (B, H, ·, D)
        else:
            feats = self._favor()
            lq, lk = feats.log_features(q.to(cdt)), feats.log_features(k.to(cdt))
            fq = torch.exp(lq - lq.amax(dim=-1, keepdim=True))  # per-row shift cancels
            fk = torch.exp(lk - lk.amax(dim=(2, 3), keepdim=True))  # per-head shift cancels
        scores = fq @ fk.transpose(-1, -2)  # (B, H, N, S)
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, None, :], 0.0)
        if causal:
            scores = scores.tril()
        total = scores.sum(dim=-1, keepdim=True)
        return scores / torch.where(total > 0, total, torch.ones_like(total))

    def new_cache(self, batch: int, capacity: int | None = None) -> LinearCache:
        """An empty ``LinearCache`` (state (B, H, D', D), constant size); ``capacity`` only
        bounds the positions it accepts."""
        return LinearCache(batch, self.num_heads, self.num_features, self.head_dim,
                           capacity=capacity)

    def extra_repr(self) -> str:
        parts = [f"dim={self.dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"feature_map={self.feature_map!r}")
        if self.feature_map == "favor":
            parts.append(f"num_features={self.num_features}")
        return ", ".join(parts)
