"""``MultiHeadAttention``: self- and cross-attention on ``qkv.attention``.

Shapes: B batch, N query length, S key length, C model width (``dim``), Ckv context width
(``kv_dim``), H heads, Hkv kv heads (H % Hkv == 0), D head dim (= C // H).

Inputs and outputs are batch-first (B, N, C); heads run in the internal (B, H, N, D) layout.
Self-attention uses one fused projection (C -> (H + 2·Hkv)·D); the (B, H, N, D) query/key/
value tensors are strided views of its output (no copies: torch's SDPA takes them as they
are). Cross-attention projects queries from ``x`` and keys/values from ``context``.

Token rows (``rows=``, a ``TokenRows``: T real tokens of a padded batch packed (T, C)): the
projections see the T rows, attention alone the padded (B, H, N, D) layout; ``at=`` keeps
one query row per sequence (B of them), every row still a key/value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import BACKENDS, BiasProducer, attention
from ..ops.fast_linear import fast_linear
from ..ops.masks import Mask
from .cache import KVCache
from .linear_call import apply_linear, is_plain_linear
from .norms import RMSNorm
from .token_rows import TokenRows, chosen_queries

__all__ = ["MultiHeadAttention", "project_rows"]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def project_rows(proj: nn.Module, x: Tensor, start: int, stop: int) -> Tensor:
    """Output rows [start, stop) of a fused projection: x (..., Cin) -> (..., stop - start),
    ``x @ W[start:stop]ᵀ + b[start:stop]`` without computing the other rows.

    ``proj`` is an ``nn.Linear``, or a module standing in for one (an adapter wrapper such
    as a LoRA linear) that defines its own ``project_rows(x, start, stop)``: every row-block
    use of a fused projection goes through here, so such a module sees all of them.
    A plain ``nn.Linear`` (``is_plain_linear``) goes through ``qkv.ops.fast_linear``.
    """
    own = getattr(proj, "project_rows", None)
    if own is not None:
        return own(x, start, stop)
    b = None if proj.bias is None else proj.bias[start:stop]
    if is_plain_linear(proj):
        return fast_linear(x, proj.weight[start:stop], b)
    return F.linear(x, proj.weight[start:stop], b)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017) with grouped-/multi-query heads, a KV cache
    and optional rotary positions. Batch-first: (B, N, C) in, (B, N, C) out.

    Args:
        dim: C, the model width of ``x`` and of the output; ``dim % num_heads == 0``.
        num_heads: H; the head dim is D = dim // num_heads.
        num_kv_heads: Hkv key/value heads (default H). ``H % Hkv == 0``; Hkv < H is grouped-
            query attention (query head h uses kv head ``h // (H // Hkv)``), Hkv = 1 is
            multi-query attention.
        kv_dim: Ckv, the width of ``context`` for cross-attention (default C). When it
            differs from C the module has a query projection ``q_proj`` (C -> H·D) and a fused
            key/value projection ``kv_proj`` (Ckv -> 2·Hkv·D) and serves cross-attention only;
            otherwise one fused ``in_proj`` (C -> (H + 2·Hkv)·D, rows ordered q, k, v) serves
            both (cross-attention uses its row blocks).
        bias: add biases to the input and output projections.
        head_dim: D, when it is not dim // num_heads (then ``dim % num_heads`` may be
            non-zero and H·D may differ from C: Qwen3, Gemma).
        out_bias: the output projection's bias (default: ``bias``; Qwen2 has q/k/v biases
            and none on the output).
        qk_norm: an RMSNorm over the D dims of every query and key head after the
            projection and before RoPE (Qwen3), as ``q_norm`` / ``k_norm`` (weight (D,)),
            with eps ``qk_norm_eps``.
        scale: the logit scale, default 1/√D (Gemma 2: query_pre_attn_scalar^-0.5).
        softcap: attention logits soft-capped to softcap·tanh(logits / softcap) before the
            mask (Gemma 2); None = none.
        dropout: dropout probability on the attention weights, applied in training mode only.
        backend: ``qkv.attention`` backend: "auto", "sdpa", "chunked" or "reference".
        rope: optional rotary position module with ``rotate(x, positions)`` for x
            (B, H|Hkv, N, D) and positions (N,) or (B, N) (``qkv.positions.RoPE(head_dim)``).
            It rotates the queries and keys of self-attention at their absolute positions
            (continuing from ``cache.length`` with a cache); cross-attention is not rotated.
        device, dtype: of the parameters.

    Attributes:
        in_proj: fused (H + 2·Hkv)·D x C projection, or None when ``kv_dim != dim``.
        q_proj, kv_proj: the cross-attention projections when ``kv_dim != dim``, else None.
        out_proj: H·D -> C output projection.

    Example::

        mha = MultiHeadAttention(512, 8, num_kv_heads=2)
        y = mha(x, causal=True)                       # (B, N, 512)
        y, w = mha(x, context, need_weights=True)     # w: (B, H, N, S) per head
    """

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 kv_dim: int | None = None, bias: bool = True, dropout: float = 0.0,
                 backend: str = "auto", rope: Any = None, head_dim: int | None = None,
                 out_bias: bool | None = None, qk_norm: bool = False,
                 qk_norm_eps: float = 1e-6, scale: float | None = None,
                 softcap: float | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kv_dim = dim if kv_dim is None else kv_dim
        for name, val in (("dim", dim), ("num_heads", num_heads),
                          ("num_kv_heads", num_kv_heads), ("kv_dim", kv_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"MultiHeadAttention: {name} must be a positive int, "
                                 f"got {val!r}")
        if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)
                                     or head_dim <= 0):
            raise ValueError(f"MultiHeadAttention: head_dim must be a positive int or None, "
                             f"got {head_dim!r}")
        if head_dim is None and dim % num_heads != 0:
            raise ValueError(f"MultiHeadAttention: dim={dim} is not divisible by "
                             f"num_heads={num_heads} (head dim D = dim // num_heads)")
        for name, val in (("scale", scale), ("softcap", softcap)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))
                                    or not val > 0 or val == float("inf")):
                raise ValueError(f"MultiHeadAttention: {name} must be a positive finite "
                                 f"number or None, got {val!r}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"MultiHeadAttention: num_heads={num_heads} must be a multiple "
                             f"of num_kv_heads={num_kv_heads}")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout!r}")
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"MultiHeadAttention: backend must be one of "
                             f"{('auto', *BACKENDS)}, got {backend!r}")
        head_dim = dim // num_heads if head_dim is None else head_dim
        if rope is not None:
            if not callable(getattr(rope, "rotate", None)):
                raise TypeError(f"MultiHeadAttention: rope must have a rotate(x, positions) "
                                f"method, got {type(rope).__name__}")
            rope_dim = getattr(rope, "head_dim", head_dim)
            if rope_dim != head_dim:
                raise ValueError(f"MultiHeadAttention: rope is built for head_dim={rope_dim}, "
                                 f"this module has D = {head_dim}")
        self.dim = dim
        self.kv_dim = kv_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.has_bias = bool(bias)
        self.dropout = float(dropout)
        self.backend = backend
        self.rope = rope
        self.scale = None if scale is None else float(scale)
        self.softcap = None if softcap is None else float(softcap)
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        self._splits = (q_width, kv_width, kv_width)
        factory = {"device": device, "dtype": dtype}
        if kv_dim == dim:
            self.in_proj = nn.Linear(dim, q_width + 2 * kv_width, bias=bias, **factory)
            self.q_proj = self.kv_proj = None
        else:
            self.in_proj = None
            self.q_proj = nn.Linear(dim, q_width, bias=bias, **factory)
            self.kv_proj = nn.Linear(kv_dim, 2 * kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(q_width, dim, bias=bias if out_bias is None else out_bias,
                                  **factory)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps, **factory)
            self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps, **factory)
        else:
            self.q_norm = self.k_norm = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's initialisation: Xavier-uniform input projections,
        zero biases, the default Linear init for the output projection."""
        for lin in (self.in_proj, self.q_proj, self.kv_proj):
            if lin is not None:
                nn.init.xavier_uniform_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)
        for norm in (getattr(self, "q_norm", None), getattr(self, "k_norm", None)):
            if norm is not None:
                norm.reset_parameters()

    # --- projections ------------------------------------------------------------------------
    def _check_input(self, name: str, t: Any, width: int) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"MultiHeadAttention: {name} must be a torch.Tensor, "
                            f"got {type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != width:
            dims = "N, C" if name == "x" else "S, Ckv"
            raise ValueError(f"MultiHeadAttention: {name} must have shape (B, {dims}={width}) "
                             f"(batch-first), got {_shape(t)}")

    def _heads(self, t: Tensor, heads: int) -> Tensor:
        b, length, _ = t.shape
        return t.view(b, length, heads, self.head_dim).transpose(1, 2)  # (B, heads, L, D)

    def _project_q(self, x: Tensor) -> Tensor:
        if self.q_proj is not None:
            q = apply_linear(self.q_proj, x)  # (B, N, H·D)
        else:
            q = project_rows(self.in_proj, x, 0, self._splits[0])  # (B, N, H·D)
        q = self._heads(q, self.num_heads)  # (B, H, N, D)
        return q if self.q_norm is None else self.q_norm(q)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of ``context``, to compute once and reuse.

        Encoder-decoder generation projects the encoder output once and passes the pair to
        every decoding step: ``kv = mha.project_kv(memory)``, then ``mha(x_t, kv=kv)``.

        Args:
            context: (B, S, Ckv).

        Returns:
            ``(k, v)``, each (B, Hkv, S, D) (strided views of one projection).
        """
        self._check_input("context", context, self.kv_dim)
        if self.kv_proj is not None:
            kv = apply_linear(self.kv_proj, context)  # (B, S, 2·Hkv·D)
        else:
            kv = project_rows(self.in_proj, context, self._splits[0],
                              sum(self._splits))  # (B, S, 2·Hkv·D)
        k, v = kv.split(self._splits[1:], dim=-1)  # (B, S, Hkv·D) each
        k = self._heads(k, self.num_kv_heads)
        return (k if self.k_norm is None else self.k_norm(k)), self._heads(v, self.num_kv_heads)

    def _positions(self, positions: Tensor | None, start: int, batch: int, n: int,
                   device: torch.device) -> Tensor:
        if positions is None:
            return torch.arange(start, start + n, device=device)  # (N,)
        if (not isinstance(positions, Tensor) or positions.dtype.is_floating_point
                or positions.dtype == torch.bool
                or _shape(positions) not in ((n,), (batch, n))):
            got = (f"shape {_shape(positions)} dtype {positions.dtype}"
                   if isinstance(positions, Tensor) else type(positions).__name__)
            raise ValueError(f"MultiHeadAttention: positions must be an integer tensor of "
                             f"shape (N,) = ({n},) or (B, N) = ({batch}, {n}), got {got}")
        return positions

    def _check_kv(self, kv: Any, batch: int) -> tuple[Tensor, Tensor]:
        if (not isinstance(kv, Sequence) or len(kv) != 2
                or not all(isinstance(t, Tensor) for t in kv)):
            raise TypeError("MultiHeadAttention: kv must be a (k, v) pair of tensors from "
                            "project_kv()")
        k, v = kv
        want = (batch, self.num_kv_heads, "S", self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if (t.dim() != 4 or t.shape[0] != batch or t.shape[1] != self.num_kv_heads
                    or t.shape[3] != self.head_dim or t.shape[2] != k.shape[2]):
                raise ValueError(f"MultiHeadAttention: kv's {name} must have shape "
                                 f"(B, Hkv, S, D) = {want}, got k {_shape(k)}, v {_shape(v)}")
        return k, v

    # --- forward ----------------------------------------------------------------------------
    def forward(self, x: Tensor, context: Tensor | None = None, *,
                mask: Mask | Tensor | None = None, causal: bool = False,
                bias: Tensor | BiasProducer | None = None, need_weights: bool = False,
                cache: KVCache | None = None, kv: tuple[Tensor, Tensor] | None = None,
                positions: Tensor | None = None, prefix: Any = None,
                rows: TokenRows | None = None, at: Tensor | None = None,
                bufs: dict[str, Tensor] | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to itself (self-attention) or to ``context`` / ``kv`` (cross).

        Args:
            x: queries' input (B, N, C); with ``rows``, token rows (T, C).
            context: cross-attention keys'/values' input (B, S, Ckv); None: self-attention.
            mask: True = may attend; a ``qkv.masks.Mask`` or a bool tensor broadcastable to
                (B, H, N, S). With a cache, S is the cache length after this step's write.
                ``torch.nn.MultiheadAttention``'s ``key_padding_mask`` (True = ignore) becomes
                ``qkv.masks.Padding(keep=~key_padding_mask)``.
            causal: add ``qkv.masks.Causal()`` (bottom-right aligned: with a cache, the N new
                queries are the last N of the S keys).
            bias: additive float tensor broadcastable to (B, H, N, S) or a bias producer.
            need_weights: also return the per-head attention weights (B, H, N, S) (before
                dropout; fp32 for half inputs; rows that attend nothing are zeros).
            cache: a ``KVCache`` (self-attention only): this step's keys/values are appended
                and the queries attend over everything cached. Decode under
                ``torch.no_grad()``/``torch.inference_mode()``.
            kv: precomputed cross-attention ``(k, v)`` from ``project_kv`` (instead of
                ``context``), each (B, Hkv, S, D).
            positions: with ``rope``, the absolute positions of the N queries, (N,) or (B, N)
                integers; default ``cache.length + arange(N)`` (``arange(N)`` without cache).
            prefix: self-attention only: a callable ``(k, v, mask, cache) -> (k, v, mask)``
                applied to the keys/values (B, Hkv, S, D) after the rotation and the cache
                write, just before the attention core; prefix tuning prepends its learned
                keys/values with it (S grows by the prefix length P).
            rows: self-attention on token rows (``qkv.modules.token_rows.TokenRows``): x is
                ``rows.pack(xp)``, the T real tokens of a padded (B, N, C) batch xp, and the
                output is (T, C), equal to ``rows.pack(self(xp, ...))`` for the same other
                arguments (all in the padded layout: mask, bias, positions over N), provided
                ``mask`` masks every padded key (its keys/values are zeros here, not
                projections of padded inputs; a cache stores those zeros). The projections
                see the T rows, the attention core the padded (B, H, N, D) layout.
            at: with ``rows``: (B,) integer rows of x, ``at[b]`` a token of sequence b; only
                these B queries are computed (every row is still a key/value, and cached):
                the output is (B, C) (weights (B, H, 1, S)), row b equal to row ``at[b]`` of
                the ``rows`` output for the same arguments. ``mask``, ``causal`` and a
                ``bias`` tensor keep their meaning for all N queries (each chosen query
                gets its own row of them); a bias producer is refused.
            bufs: with ``rows`` and no gradients: a dict shared by the calls of one forward
                (a model's layers), in which the padded (B·N, (H + 2·Hkv)·D) projection is
                a buffer reused from call to call (its padded rows stay zero).

        Returns:
            out (B, N, C) ((T, C) with ``rows``, (B, C) with ``at``), or ``(out, weights)``
            with weights (B, H, N, S) ((B, H, 1, S) with ``at``) when ``need_weights``.

        Raises:
            TypeError / ValueError naming the offending argument and its shape.
        """
        if rows is None:
            if at is not None or bufs is not None:
                raise ValueError("MultiHeadAttention: at and bufs are for token rows; give "
                                 "rows= (a TokenRows) too")
            self._check_input("x", x, self.dim)
            batch, n, _ = x.shape
        else:
            self._check_rows(x, rows, context, kv)
            batch, n = rows.batch, rows.length
        cols = None if at is None else rows.columns(at)  # (B,) the chosen queries' columns
        if context is not None or kv is not None:
            if context is not None and kv is not None:
                raise ValueError("MultiHeadAttention: give context or kv, not both")
            if cache is not None:
                raise ValueError("MultiHeadAttention: cache is for self-attention; for "
                                 "cross-attention compute kv = project_kv(context) once and "
                                 "pass kv=kv")
            if positions is not None:
                raise ValueError("MultiHeadAttention: positions apply to self-attention "
                                 "(rope); cross-attention is not rotated")
            if prefix is not None:
                raise ValueError("MultiHeadAttention: prefix applies to self-attention only; "
                                 "got context/kv too")
            if context is not None:
                k, v = self.project_kv(context)  # (B, Hkv, S, D) each
                if k.shape[0] != batch:
                    raise ValueError(f"MultiHeadAttention: context has batch {k.shape[0]}, "
                                     f"x has batch {batch}: context {_shape(context)}")
            else:
                k, v = self._check_kv(kv, batch)
            q = self._project_q(x)  # (B, H, N, D)
        else:
            if self.in_proj is None:
                raise ValueError(f"MultiHeadAttention: this module projects keys/values from "
                                 f"kv_dim={self.kv_dim} != dim={self.dim}, so it serves "
                                 f"cross-attention only; pass context (B, S, {self.kv_dim})")
            if cache is not None and not isinstance(cache, KVCache):
                raise TypeError(f"MultiHeadAttention: cache must be a qkv KVCache, "
                                f"got {type(cache).__name__}")
            proj = apply_linear(self.in_proj, x)  # (B, N, (H + 2·Hkv)·D); rows: (T, ...)
            q_at = None
            if rows is not None:
                if at is not None:  # the B chosen queries
                    q_at = proj.index_select(0, at)[:, None, :self._splits[0]]  # (B, 1, H·D)
                proj = rows.unpack(proj, bufs=bufs)  # (B, N, (H + 2·Hkv)·D)
            q, k, v = proj.split(self._splits, dim=-1)  # (B, N, H·D), (B, N, Hkv·D) x2
            q = self._heads(q if q_at is None else q_at, self.num_heads)  # (B, H, N|1, D)
            k = self._heads(k, self.num_kv_heads)  # (B, Hkv, N, D)
            v = self._heads(v, self.num_kv_heads)  # (B, Hkv, N, D)
            if self.q_norm is not None:  # per head, before RoPE (Qwen3)
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rope is not None:
                start = 0 if cache is None else cache.length
                pos = self._positions(positions, start, batch, n, x.device)
                q_pos = pos if cols is None else pos.expand(batch, n).gather(
                    1, cols[:, None])  # (B, 1) the chosen queries' positions
                q, k = self.rope.rotate(q, q_pos), self.rope.rotate(k, pos)
            elif positions is not None:
                raise ValueError("MultiHeadAttention: positions given but this module has no "
                                 "rope module (pass rope= to the constructor)")
            if cache is not None:
                k, v = cache.append(k, v)  # (B, Hkv, S, D), S = cache length
            if prefix is not None:  # prefix tuning: (B, Hkv, P + S, D)
                k, v, mask = prefix(k, v, mask, cache)
        if cols is not None:  # each chosen query's row of the N queries' mask and bias
            mask, bias = chosen_queries(mask, causal, bias, cols, self.num_heads, n,
                                        k.shape[2])
            causal = False
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        out = attention(q, k, v, mask=mask, bias=bias, causal=causal, scale=self.scale,
                        **extra, dropout_p=self.dropout if self.training else 0.0,
                        return_weights=need_weights, backend=self.backend)
        weights = None
        if need_weights:
            out, weights = out
        out = out.transpose(1, 2)  # (B, N|1, H, D)
        if rows is None:
            out = out.reshape(batch, n, self._splits[0])  # (B, N, H·D)
        elif at is None:
            out = rows.pack(out)  # (T, H, D)
            out = out.reshape(out.shape[0], self._splits[0])  # (T, H·D)
        else:
            out = out.reshape(batch, self._splits[0])  # (B, H·D)
        out = apply_linear(self.out_proj, out)  # (B, N, C) / (T, C) / (B, C)
        return (out, weights) if need_weights else out

    def _check_rows(self, x: Any, rows: Any, context: Any, kv: Any) -> None:
        if not isinstance(rows, TokenRows):
            raise TypeError(f"MultiHeadAttention: rows must be a TokenRows, "
                            f"got {type(rows).__name__}")
        if context is not None or kv is not None:
            raise ValueError("MultiHeadAttention: rows (token rows) serve self-attention "
                             "only; got context/kv too")
        if not isinstance(x, Tensor):
            raise TypeError(f"MultiHeadAttention: x must be a torch.Tensor, "
                            f"got {type(x).__name__}")
        if _shape(x) != (rows.count, self.dim):
            raise ValueError(f"MultiHeadAttention: with rows, x must be the (T, C) = "
                             f"({rows.count}, {self.dim}) token rows, got {_shape(x)}")

    def new_cache(self, batch: int, capacity: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """An empty ``KVCache`` for this module: buffers (B, Hkv, capacity, D), in the
        parameters' dtype and device unless given."""
        w = self.out_proj.weight
        return KVCache(batch, self.num_kv_heads, capacity, self.head_dim,
                       dtype=w.dtype if dtype is None else dtype,
                       device=w.device if device is None else device)

    # --- torch.nn.MultiheadAttention interop ------------------------------------------------
    def _split_weights(self) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor | None, ...]]:
        """(Wq (H·D, C), Wk (Hkv·D, Ckv), Wv (Hkv·D, Ckv), (bq, bk, bv) or Nones).

        Raises ValueError when a projection is not a plain ``nn.Linear`` (an unmerged
        adapter wrapper computes more than its ``weight``)."""
        for name in ("in_proj", "q_proj", "kv_proj", "out_proj"):
            proj = getattr(self, name, None)
            if proj is not None and type(proj) is not nn.Linear:
                raise ValueError(f"MultiHeadAttention: {name} is a {type(proj).__name__}, whose "
                                 f"output is not its weight alone (an unmerged adapter); "
                                 f"merge the adapters into the weights first, or export with "
                                 f"them disabled for the base weights")
        if self.in_proj is not None:
            ws = self.in_proj.weight.split(self._splits, dim=0)
            bs = ((None,) * 3 if self.in_proj.bias is None
                  else self.in_proj.bias.split(self._splits, dim=0))
        else:
            ws = (self.q_proj.weight, *self.kv_proj.weight.split(self._splits[1:], dim=0))
            bs = ((None,) * 3 if self.q_proj.bias is None
                  else (self.q_proj.bias, *self.kv_proj.bias.split(self._splits[1:], dim=0)))
        return ws[0], ws[1], ws[2], tuple(bs)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A ``MultiHeadAttention`` with the weights of a ``torch.nn.MultiheadAttention``.

        The outputs are equal for the same inputs, batch-first (if ``m.batch_first`` is False,
        transpose its (N, B, C) inputs to (B, N, C)). Torch's ``key_padding_mask`` (True =
        ignore) becomes ``mask=qkv.masks.Padding(keep=~key_padding_mask)``; a bool
        ``attn_mask`` (True = ignore) becomes ``mask=~attn_mask``; a float one ``bias=``.
        ``kdim == vdim`` maps to ``kv_dim``. Refused (ValueError): ``kdim != vdim``,
        ``add_bias_kv=True``, ``add_zero_attn=True``.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"MultiHeadAttention.from_torch: expected torch.nn.MultiheadAttention, "
                            f"got {type(m).__name__}")
        if m.bias_k is not None or m.bias_v is not None:
            raise ValueError("MultiHeadAttention.from_torch: add_bias_kv=True (a learned extra "
                             "key/value) is not supported")
        if m.add_zero_attn:
            raise ValueError("MultiHeadAttention.from_torch: add_zero_attn=True is not supported")
        if m.kdim != m.vdim:
            raise ValueError(f"MultiHeadAttention.from_torch: kdim={m.kdim} != vdim={m.vdim} is "
                             f"not supported (keys and values project from one context, "
                             f"kv_dim)")
        has_bias = m.in_proj_bias is not None
        if has_bias != (m.out_proj.bias is not None):
            raise ValueError("MultiHeadAttention.from_torch: the input projection and out_proj "
                             "must both have biases or neither")
        w_out = m.out_proj.weight
        new = cls(m.embed_dim, m.num_heads, kv_dim=m.kdim, bias=has_bias, dropout=m.dropout,
                  device=w_out.device, dtype=w_out.dtype)
        e = m.embed_dim
        with torch.no_grad():
            if m.in_proj_weight is not None:
                new.in_proj.weight.copy_(m.in_proj_weight)
                if has_bias:
                    new.in_proj.bias.copy_(m.in_proj_bias)
            else:
                new.q_proj.weight.copy_(m.q_proj_weight)
                new.kv_proj.weight.copy_(torch.cat([m.k_proj_weight, m.v_proj_weight]))
                if has_bias:
                    new.q_proj.bias.copy_(m.in_proj_bias[:e])
                    new.kv_proj.bias.copy_(m.in_proj_bias[e:])
            new.out_proj.weight.copy_(w_out)
            if has_bias:
                new.out_proj.bias.copy_(m.out_proj.bias)
        return new.train(m.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """An equivalent ``torch.nn.MultiheadAttention`` (``batch_first=True``), weights copied.

        Grouped-query heads are expanded (each kv head's weights repeated for its query
        heads), which is exact. Refused (ValueError) with a ``rope`` module, which torch's
        module cannot express, and with an unmerged adapter wrapper (merge it first).
        """
        if self.rope is not None:
            raise ValueError("MultiHeadAttention.to_torch: a module with rope= has no "
                             "torch.nn.MultiheadAttention equivalent")
        extras = [name for name, on in (
            ("head_dim != dim // num_heads", self.head_dim * self.num_heads != self.dim),
            ("qk_norm", self.q_norm is not None), ("scale", self.scale is not None),
            ("softcap", self.softcap is not None),
            ("out_bias != bias", (self.out_proj.bias is not None) != self.has_bias)) if on]
        if extras:
            raise ValueError(f"MultiHeadAttention.to_torch: torch.nn.MultiheadAttention "
                             f"cannot express {', '.join(extras)}")
        wq, wk, wv, (bq, bk, bv) = self._split_weights()  # refuses an unmerged LoRA first
        w_out = self.out_proj.weight
        m = nn.MultiheadAttention(self.dim, self.num_heads, dropout=self.dropout,
                                  bias=self.has_bias, kdim=self.kv_dim, vdim=self.kv_dim,
                                  batch_first=True, device=w_out.device, dtype=w_out.dtype)
        group = self.num_heads // self.num_kv_heads

        def expand(t: Tensor) -> Tensor:  # (Hkv·D, ...) -> (H·D, ...)
            return t.reshape(self.num_kv_heads, self.head_dim, *t.shape[1:]).repeat_interleave(
                group, dim=0).reshape(self.num_heads * self.head_dim, *t.shape[1:])

        with torch.no_grad():
            wk, wv = expand(wk), expand(wv)  # (H·D, Ckv) each
            if m.in_proj_weight is not None:
                m.in_proj_weight.copy_(torch.cat([wq, wk, wv]))
            else:
                m.q_proj_weight.copy_(wq)
                m.k_proj_weight.copy_(wk)
                m.v_proj_weight.copy_(wv)
            if self.has_bias:
                m.in_proj_bias.copy_(torch.cat([bq, expand(bk), expand(bv)]))
                m.out_proj.bias.copy_(self.out_proj.bias)
            m.out_proj.weight.copy_(w_out)
        return m.train(self.training)

    def extra_repr(self) -> str:
        parts = [f"dim={self.dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        if self.kv_dim != self.dim:
            parts.append(f"kv_dim={self.kv_dim}")
        if not self.has_bias:
            parts.append("bias=False")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

