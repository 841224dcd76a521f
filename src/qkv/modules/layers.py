"""Transformer layers: ``EncoderLayer`` (self-attention + FFN) and ``DecoderLayer``
(causal self-attention + cross-attention + FFN), residual connections and norms.

Shapes: B batch, N length of x, S length of the memory (encoder output), C model width,
H heads. Inputs and outputs are batch-first (B, N, C).

The parts are handed in (an attention module, an FFN, norms); ``build`` makes the common
ones. ``norm_first=False`` is the original paper's post-norm, x = norm(x + sublayer(x));
``norm_first=True`` is pre-norm, x = x + sublayer(norm(x)) (GPT-2 and most modern models).
A decoder-only model (GPT) uses ``EncoderLayer`` with ``causal=True``.

Token rows (T real tokens of a padded (B, N) batch, packed (T, C)): ``TokenRows`` packs and
unpacks them, ``EncoderLayer.forward_rows`` runs a layer on them — every token-wise op
(norms, projections, FFN: ~90 % of a layer's time) sees only the T real tokens; attention
alone runs in the padded (B, H, N, D) layout, with the same mask/bias/causal as ``forward``.
The real positions get exactly ``forward``'s math (padded keys/values are zeros and must be
masked by the caller's mask, as they are by ``Padding(keep=...)``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import attention
from .attention import MultiHeadAttention
from .cache import KVCache
from .feedforward import FeedForward, SwiGLU
from .linear_call import apply_linear, has_hooks
from .norms import make_norm

__all__ = ["DecoderLayer", "EncoderLayer", "TokenRows"]


class TokenRows:
    """Where the T real tokens of a padded (B, N) batch sit, to pack them into (T, C) rows.

    Args:
        keep: (B, N) bool, True = real token (any padding pattern, left or right); None:
            nothing is padded (give ``batch`` and ``length``: T = B·N, packing is a view).

    Attributes: ``index`` (T,) flat positions of the real tokens in B·N (ascending), or None
    when nothing is padded; ``batch`` B; ``length`` N.
    """

    def __init__(self, keep: Tensor | None, *, batch: int | None = None,
                 length: int | None = None) -> None:
        if keep is None:
            if batch is None or length is None:
                raise ValueError("TokenRows: without keep, give batch and length")
            self.batch, self.length, self.index = batch, length, None
            return
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
            got = (f"shape {tuple(keep.shape)} dtype {keep.dtype}"
                   if isinstance(keep, Tensor) else type(keep).__name__)
            raise ValueError(f"TokenRows: keep must be a (B, N) bool tensor, got {got}")
        self.batch, self.length = keep.shape
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (T,)

    def pack(self, x: Tensor) -> Tensor:
        """x (B, N, ...) -> the real tokens' rows (T, ...)."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])  # (B·N, ...)
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, h: Tensor, *, out: Tensor | None = None) -> Tensor:
        """Rows h (T, ...) -> (B, N, ...) with zeros at padded positions (or written into
        ``out`` (B·N, ...), whose padded rows are left as they are)."""
        shape = (self.batch, self.length, *h.shape[1:])
        if self.index is None:
            return h.view(shape)
        if out is None:
            return h.new_zeros(self.batch * self.length, *h.shape[1:]).index_copy(
                0, self.index, h).view(shape)
        return out.index_copy_(0, self.index, h).view(shape)


def _build_ffn(dim: int, hidden: int, activation: str, bias: bool, dropout: float, factory):
    if activation == "swiglu":
        return SwiGLU(dim, hidden, bias=bias, dropout=dropout, **factory)
    return FeedForward(dim, hidden, activation=activation, bias=bias, dropout=dropout,
                       **factory)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each with a residual connection and a norm.

    Args:
        attn: a ``MultiHeadAttention`` (self-attention).
        ffn: a module (B, N, C) -> (B, N, C).
        norm1, norm2: norms around attention and FFN.
        norm_first: pre-norm (True) or post-norm (False, Vaswani et al.).
        dropout: residual dropout after each sublayer.
    """

    def __init__(self, attn: MultiHeadAttention, ffn: nn.Module, norm1: nn.Module,
                 norm2: nn.Module, *, norm_first: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn, self.ffn, self.norm1, self.norm2 = attn, ffn, norm1, norm2
        self.norm_first = norm_first
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def build(cls, dim: int, num_heads: int, *, ffn_hidden: int | None = None,
              activation: str = "relu", norm: str = "layernorm", norm_eps: float | None = None,
              norm_first: bool = False, dropout: float = 0.0, attn_dropout: float = 0.0,
              ffn_dropout: float | None = None, bias: bool = True,
              num_kv_heads: int | None = None, rope=None, device=None,
              dtype=None) -> EncoderLayer:
        """The common layer: ``activation`` in FeedForward's list or "swiglu";
        ``ffn_hidden`` defaults to 4·dim. ``dropout`` is the residual dropout;
        ``ffn_dropout`` (default: ``dropout``, as torch's Transformer layers) the dropout
        after the FFN activation — GPT-2 and BERT have none (0.0)."""
        factory = {"device": device, "dtype": dtype}
        attn = MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads, bias=bias,
                                  dropout=attn_dropout, rope=rope, **factory)
        ffn = _build_ffn(dim, ffn_hidden or 4 * dim, activation, bias,
                         dropout if ffn_dropout is None else ffn_dropout, factory)
        return cls(attn, ffn, make_norm(norm, dim, eps=norm_eps, **factory),
                   make_norm(norm, dim, eps=norm_eps, **factory), norm_first=norm_first,
                   dropout=dropout)

    def forward(self, x: Tensor, *, mask=None, causal: bool = False, bias=None,
                need_weights: bool = False, cache: KVCache | None = None,
                positions: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, N, C) -> (B, N, C); with ``need_weights`` also (B, H, N, S) weights.

        ``mask``/``causal``/``bias``/``cache``/``positions`` go to the attention module.
        """
        h = self.norm1(x) if self.norm_first else x
        a = self.attn(h, mask=mask, causal=causal, bias=bias, need_weights=need_weights,
                      cache=cache, positions=positions)
        weights = None
        if need_weights:
            a, weights = a
        if self.norm_first:
            x = x + self.dropout(a)
            x = x + self.dropout(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout(a))
            x = self.norm2(x + self.dropout(self.ffn(x)))
        return (x, weights) if need_weights else x

    def rows_are_direct(self, cache: KVCache | None = None) -> bool:
        """True when ``forward_rows`` runs this layer's parts directly (a
        ``MultiHeadAttention`` without hooks, with a fused ``in_proj`` and ``nn.Linear``
        projections, no cache or a plain ``KVCache``); otherwise it unpacks and calls
        ``forward``. (Hooks on the projections themselves are honoured either way:
        ``qkv.modules.linear_call.apply_linear``.)"""
        attn = self.attn
        return (type(attn) is MultiHeadAttention and not has_hooks(attn)
                and attn.in_proj is not None
                and type(attn.in_proj) is nn.Linear and type(attn.out_proj) is nn.Linear
                and (cache is None or type(cache) is KVCache))

    def forward_rows(self, h: Tensor, rows: TokenRows, *, mask=None, causal: bool = False,
                     bias=None, need_weights: bool = False, cache: KVCache | None = None,
                     positions: Tensor | None = None, bufs: dict[str, Tensor] | None = None
                     ) -> Tensor | tuple[Tensor, Tensor]:
        """``forward`` on token rows: h (T, C), the real tokens ``rows.pack(x)`` of a padded
        (B, N, C) batch -> (T, C) (with ``need_weights`` also (B, H, N, S) weights).

        The real rows equal ``rows.pack(self(x, ...))`` for the same ``mask`` / ``causal``
        / ``bias`` / ``cache`` / ``positions`` (which ``forward`` would get for x), provided
        ``mask`` masks every padded key (the padded keys/values here are zeros, not
        projections of padded inputs; a cache stores those zeros). ``bufs``: a dict shared
        by the layers of one forward, only without gradients: the padded (B·N, ...) layout
        of the projections is a buffer reused from layer to layer and the FFN activation
        runs in place. The projections go through ``qkv.modules.linear_call.apply_linear``
        (oneDNN for plain ``nn.Linear``s; measured faster here than MKL's GEMM writing into
        reused buffers).
        """
        if not self.rows_are_direct(cache):  # parts swapped in (adapters...): forward itself
            out = self(rows.unpack(h), mask=mask, causal=causal, bias=bias,
                       need_weights=need_weights, cache=cache, positions=positions)
            x, weights = out if need_weights else (out, None)
            return (rows.pack(x), weights) if need_weights else rows.pack(x)
        attn = self.attn
        b, n = rows.batch, rows.length
        a_in = self.norm1(h) if self.norm_first else h
        proj = apply_linear(attn.in_proj, a_in)  # (T, (H + 2·Hkv)·D)
        if bufs is None or rows.index is None:
            full = None
        else:  # padded rows stay zero from layer to layer
            full = bufs.get("full")
            if (full is None or full.shape != (b * n, proj.shape[-1])
                    or full.dtype != proj.dtype or full.device != proj.device):
                full = bufs["full"] = proj.new_zeros(b * n, proj.shape[-1])
        proj = rows.unpack(proj, out=full)  # (B, N, (H + 2·Hkv)·D)
        q, k, v = proj.split(attn._splits, dim=-1)  # (B, N, H·D), (B, N, Hkv·D) x2
        q = attn._heads(q, attn.num_heads)  # (B, H, N, D)
        k = attn._heads(k, attn.num_kv_heads)  # (B, Hkv, N, D)
        v = attn._heads(v, attn.num_kv_heads)  # (B, Hkv, N, D)
        if attn.rope is not None:
            start = 0 if cache is None else cache.length
            pos = attn._positions(positions, start, b, n, h.device)
            q, k = attn.rope.rotate(q, pos), attn.rope.rotate(k, pos)
        elif positions is not None:
            raise ValueError("EncoderLayer: positions given but the attention module has no "
                             "rope module")
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, S, D)
        out = attention(q, k, v, mask=mask, bias=bias, causal=causal,
                        dropout_p=attn.dropout if attn.training else 0.0,
                        return_weights=need_weights, backend=attn.backend)
        weights = None
        if need_weights:
            out, weights = out
        out = rows.pack(out.transpose(1, 2))  # (T, H, D)
        a = self.dropout(apply_linear(attn.out_proj, out.reshape(out.shape[0], -1)))  # (T, C)
        if self.norm_first:
            h = a.add_(h)
            f = self._ffn_rows(self.norm2(h), bufs)
            h = f.add_(h)
        else:
            h = self.norm1(a.add_(h))
            h = self.norm2(self._ffn_rows(h, bufs).add_(h))
        return (h, weights) if need_weights else h

    def rows_at_direct(self) -> bool:
        """True when ``forward_rows_at`` may stand in for a call of this layer: it is a plain
        ``EncoderLayer`` (``rows_are_direct()``, no rope) whose calls nothing wraps — no
        hooks (``has_hooks``: its own or global), no FSDP (``fully_shard`` changes the
        class), no activation checkpointing (which replaces ``forward`` / ``forward_rows``
        on the instance)."""
        return (type(self) is EncoderLayer and self.rows_are_direct()
                and self.attn.rope is None and not has_hooks(self)
                and "forward_rows" not in vars(self))

    def forward_rows_at(self, h: Tensor, rows: TokenRows, at: Tensor, *, mask=None,
                        bufs: dict[str, Tensor] | None = None) -> Tensor:
        """The layer's output at one query row per sequence only (a last layer whose other
        rows nobody reads: a class token, an end-of-text token).

        Args:
            h: (T, C) token rows, as for ``forward_rows``; every row is a key/value.
            rows: their ``TokenRows`` (B sequences of length N).
            at: (B,) integer, the row of h (0 ≤ at[b] < T) that is sequence b's query.
            mask: True = may attend, broadcastable to (B, H, 1, N): each query's keys in the
                padded (B, N) layout, where padded keys are zeros and must be masked (e.g.
                real keys at positions ≤ the query's for a causal layer); None: all N keys.
            bufs: as for ``forward_rows`` (no grad only).

        Returns:
            (B, C): row b equals ``forward_rows(h, rows, ...)[at[b]]`` for the full mask
            whose query row is ``mask``; only the key/value projections see all T rows, the
            query projection, attention, output projection, norms and FFN see the B queries.

        Raises:
            ValueError when the layer is not ``rows_are_direct()`` or has rope (positions of
            the queries would be needed): run ``forward_rows`` and pick the rows instead.
        """
        attn = self.attn
        if not self.rows_are_direct() or attn.rope is not None:
            raise ValueError("EncoderLayer.forward_rows_at: needs a plain MultiHeadAttention "
                             "with a fused in_proj and no rope; use forward_rows")
        b = rows.batch
        dq = attn._splits[0]
        a_in = self.norm1(h) if self.norm_first else h  # (T, C)
        proj = apply_linear(attn.in_proj, a_in)  # (T, (H + 2·Hkv)·D)
        q = proj.index_select(0, at)[:, :dq]  # (B, H·D)
        q = q.reshape(b, 1, attn.num_heads, attn.head_dim).transpose(1, 2)  # (B, H, 1, D)
        kv = rows.unpack(proj[:, dq:])  # (B, N, 2·Hkv·D), zeros at padded positions
        k, v = kv.split(attn._splits[1:], dim=-1)  # (B, N, Hkv·D) each
        k = attn._heads(k, attn.num_kv_heads)  # (B, Hkv, N, D)
        v = attn._heads(v, attn.num_kv_heads)  # (B, Hkv, N, D)
        out = attention(q, k, v, mask=mask, dropout_p=attn.dropout if attn.training else 0.0,
                        backend=attn.backend)  # (B, H, 1, D)
        a = apply_linear(attn.out_proj, out.transpose(1, 2).reshape(b, dq))  # (B, C)
        a = self.dropout(a)
        x = h.index_select(0, at)  # (B, C)
        if self.norm_first:
            x = a.add_(x)
            return self._ffn_rows(self.norm2(x), None).add_(x)
        x = self.norm1(a.add_(x))
        return self.norm2(self._ffn_rows(x, None).add_(x))

    def _ffn_rows(self, h: Tensor, bufs: dict[str, Tensor] | None) -> Tensor:
        """The feed-forward on rows (T, C), then the residual dropout; a plain
        ``FeedForward`` (no hooks) runs its activation in place when ``bufs`` is given (no
        grad)."""
        ffn = self.ffn
        if type(ffn) is not FeedForward or has_hooks(ffn):
            return self.dropout(ffn(h))
        return self.dropout(ffn.run(h, inplace=bufs is not None))  # (T, C)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the memory, feed-forward; each with a
    residual connection and a norm (Vaswani et al.'s decoder layer).

    Args:
        self_attn, cross_attn: ``MultiHeadAttention`` modules.
        ffn: a module (B, N, C) -> (B, N, C).
        norm1, norm2, norm3: norms around self-attention, cross-attention and FFN.
        norm_first: pre-norm (True) or post-norm (False).
        dropout: residual dropout after each sublayer.
    """

    def __init__(self, self_attn: MultiHeadAttention, cross_attn: MultiHeadAttention,
                 ffn: nn.Module, norm1: nn.Module, norm2: nn.Module, norm3: nn.Module, *,
                 norm_first: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
        self.norm1, self.norm2, self.norm3 = norm1, norm2, norm3
        self.norm_first = norm_first
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def build(cls, dim: int, num_heads: int, *, ffn_hidden: int | None = None,
              activation: str = "relu", norm: str = "layernorm", norm_eps: float | None = None,
              norm_first: bool = False, dropout: float = 0.0, attn_dropout: float = 0.0,
              ffn_dropout: float | None = None, bias: bool = True,
              num_kv_heads: int | None = None, memory_dim: int | None = None,
              rope=None, device=None, dtype=None) -> DecoderLayer:
        """The common layer (see ``EncoderLayer.build``); ``memory_dim`` is the encoder width
        (default dim)."""
        factory = {"device": device, "dtype": dtype}
        self_attn = MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads, bias=bias,
                                       dropout=attn_dropout, rope=rope, **factory)
        cross_attn = MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads,
                                        kv_dim=memory_dim, bias=bias, dropout=attn_dropout,
                                        **factory)
        ffn = _build_ffn(dim, ffn_hidden or 4 * dim, activation, bias,
                         dropout if ffn_dropout is None else ffn_dropout, factory)
        norms = [make_norm(norm, dim, eps=norm_eps, **factory) for _ in range(3)]
        return cls(self_attn, cross_attn, ffn, *norms, norm_first=norm_first, dropout=dropout)

    def forward(self, x: Tensor, memory: Tensor | None = None, *,
                memory_kv: tuple[Tensor, Tensor] | None = None, self_mask=None,
                causal: bool = True, self_bias=None, memory_mask=None,
                need_weights: bool = False, cache: KVCache | None = None,
                positions: Tensor | None = None):
        """x (B, N, C), memory (B, S, C) (or its ``memory_kv = cross_attn.project_kv(memory)``,
        computed once for generation) -> (B, N, C).

        With ``need_weights`` returns ``(x, (self_weights (B, H, N, N'), cross_weights
        (B, H, N, S)))``. ``cache`` is the self-attention KV cache.
        """
        if (memory is None) == (memory_kv is None):
            raise ValueError("DecoderLayer: give exactly one of memory (B, S, C) or memory_kv")
        h = self.norm1(x) if self.norm_first else x
        a = self.self_attn(h, mask=self_mask, causal=causal, bias=self_bias,
                           need_weights=need_weights, cache=cache, positions=positions)
        w_self = w_cross = None
        if need_weights:
            a, w_self = a
        x = x + self.dropout(a) if self.norm_first else self.norm1(x + self.dropout(a))
        h = self.norm2(x) if self.norm_first else x
        c = self.cross_attn(h, memory, kv=memory_kv, mask=memory_mask,
                            need_weights=need_weights)
        if need_weights:
            c, w_cross = c
        x = x + self.dropout(c) if self.norm_first else self.norm2(x + self.dropout(c))
        if self.norm_first:
            x = x + self.dropout(self.ffn(self.norm3(x)))
        else:
            x = self.norm3(x + self.dropout(self.ffn(x)))
        return (x, (w_self, w_cross)) if need_weights else x
