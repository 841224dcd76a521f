"""Transformer layers: ``EncoderLayer`` (self-attention + FFN) and ``DecoderLayer``
(causal self-attention + cross-attention + FFN), residual connections and norms.

Shapes: B batch, N length of x, S length of the memory (encoder output), C model width,
H heads. Inputs and outputs are batch-first (B, N, C).

The parts are handed in (an attention module, an FFN, norms); ``build`` makes the common
ones. ``norm_first=False`` is the original paper's post-norm, x = norm(x + sublayer(x));
``norm_first=True`` is pre-norm, x = x + sublayer(norm(x)) (GPT-2 and most modern models).
A decoder-only model (GPT) uses ``EncoderLayer`` with ``causal=True``.

Token rows (T real tokens of a padded (B, N) batch, packed (T, C); ``TokenRows``, from
``qkv.modules.token_rows``): ``EncoderLayer.forward(h, rows=rows)`` runs a layer on them —
every token-wise op (norms, projections, FFN: ~90 % of a layer's time) sees only the T real
tokens; attention alone runs in the padded (B, H, N, D) layout, with the same mask/bias/causal
as on the padded batch. The real positions get exactly the padded call's math (padded
keys/values are zeros and must be masked by the caller's mask, as they are by
``Padding(keep=...)``). ``at=`` (with rows) keeps one row per sequence (a class token, the
last token of a prompt): the layer's output (B, C) at those rows only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .cache import KVCache
from .feedforward import GATED_ACTIVATIONS, FeedForward, SwiGLU
from .linear_call import has_hooks
from .norms import make_norm
from .token_rows import TokenRows

__all__ = ["DecoderLayer", "EncoderLayer", "TokenRows"]


def _build_ffn(dim: int, hidden: int, activation: str, bias: bool, dropout: float, factory):
    if activation in GATED_ACTIVATIONS:
        return SwiGLU(dim, hidden, bias=bias, dropout=dropout,
                      activation=GATED_ACTIVATIONS[activation], **factory)
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
        post_norm1, post_norm2: pre-norm only: norms on the attention's and the FFN's output
            before each residual add (Gemma 2's "sandwich" layer:
            x = x + post_norm1(attn(norm1(x))); x = x + post_norm2(ffn(norm2(x)))), or None.
    """

    def __init__(self, attn: MultiHeadAttention, ffn: nn.Module, norm1: nn.Module,
                 norm2: nn.Module, *, norm_first: bool = False, dropout: float = 0.0,
                 post_norm1: nn.Module | None = None,
                 post_norm2: nn.Module | None = None) -> None:
        super().__init__()
        self.attn, self.ffn, self.norm1, self.norm2 = attn, ffn, norm1, norm2
        self.norm_first = norm_first
        self.dropout = nn.Dropout(dropout)
        if (post_norm1 is None) != (post_norm2 is None) or (post_norm1 is not None
                                                            and not norm_first):
            raise ValueError("EncoderLayer: post_norm1 and post_norm2 come together, on a "
                             "pre-norm layer (norm_first=True)")
        self.post_norm1, self.post_norm2 = post_norm1, post_norm2

    @classmethod
    def build(cls, dim: int, num_heads: int, *, ffn_hidden: int | None = None,
              activation: str = "relu", norm: str = "layernorm", norm_eps: float | None = None,
              norm_first: bool = False, dropout: float = 0.0, attn_dropout: float = 0.0,
              ffn_dropout: float | None = None, bias: bool = True,
              num_kv_heads: int | None = None, rope=None, ffn_bias: bool | None = None,
              post_norms: bool = False, attn_options: dict | None = None, device=None,
              dtype=None) -> EncoderLayer:
        """The common layer: ``activation`` in FeedForward's list or a gated one
        (``GATED_ACTIVATIONS``: "swiglu", "geglu_tanh"...); ``ffn_hidden`` defaults to
        4·dim. ``dropout`` is the residual dropout; ``ffn_dropout`` (default: ``dropout``,
        as torch's Transformer layers) the dropout after the FFN activation — GPT-2 and BERT
        have none (0.0). ``bias`` is every projection's unless ``ffn_bias`` (the FFN's) or
        ``attn_options`` (more ``MultiHeadAttention`` arguments: ``head_dim``, ``out_bias``,
        ``qk_norm``, ``scale``, ``softcap``) say otherwise; ``post_norms`` adds
        ``post_norm1``/``post_norm2`` (pre-norm only)."""
        factory = {"device": device, "dtype": dtype}
        attn = MultiHeadAttention(dim, num_heads, num_kv_heads=num_kv_heads, bias=bias,
                                  dropout=attn_dropout, rope=rope, **(attn_options or {}),
                                  **factory)
        ffn = _build_ffn(dim, ffn_hidden or 4 * dim, activation,
                         bias if ffn_bias is None else ffn_bias,
                         dropout if ffn_dropout is None else ffn_dropout, factory)
        post = [make_norm(norm, dim, eps=norm_eps, **factory) for _ in range(2)] \
            if post_norms else [None, None]
        return cls(attn, ffn, make_norm(norm, dim, eps=norm_eps, **factory),
                   make_norm(norm, dim, eps=norm_eps, **factory), norm_first=norm_first,
                   dropout=dropout, post_norm1=post[0], post_norm2=post[1])

    def forward(self, x: Tensor, *, rows: TokenRows | None = None, at: Tensor | None = None,
                mask=None, causal: bool = False, bias=None, need_weights: bool = False,
                cache: KVCache | None = None, positions: Tensor | None = None,
                bufs: dict[str, Tensor] | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, N, C) -> (B, N, C); with ``need_weights`` also (B, H, N, S) weights.

        ``mask``/``causal``/``bias``/``cache``/``positions`` go to the attention module.

        Token rows: with ``rows`` (a ``TokenRows``), x is (T, C), the real tokens
        ``rows.pack(xp)`` of a padded (B, N, C) batch xp, and the result is (T, C), equal
        to ``rows.pack(self(xp, ...))`` for the same arguments (in the padded layout),
        provided ``mask`` masks every padded key (the padded keys/values are zeros here,
        not projections of padded inputs; a cache stores those zeros). With ``at`` too,
        (B,) integer rows of x (``at[b]`` a token of sequence b): the result is (B, C),
        row b equal to row ``at[b]`` of the rows' result (weights (B, H, 1, S)); every row
        is still a key/value (and cached), the query, attention, output projection, norms
        and FFN run for the B chosen rows only. ``mask``, ``causal`` and a ``bias`` tensor
        keep their meaning for all N queries (``MultiHeadAttention.forward``); a bias
        producer is refused with ``at``.

        The rows run the parts directly when the attention is a plain ``MultiHeadAttention``
        without hooks, with a fused ``in_proj`` and ``nn.Linear`` projections, and the cache
        is None or a plain ``KVCache``; otherwise (adapters swapped in, a hooked or wrapped
        attention, another cache) the rows are unpacked, the layer runs on the padded batch
        and the real rows (or the ``at`` rows) are taken. (Hooks on the projections fire
        either way: ``qkv.modules.linear_call.apply_linear``; hooks on the layer itself and
        wrappers of ``forward`` — FSDP, activation checkpointing — see the call as made:
        (T, C) rows in, (T, C) or (B, C) out.)

        ``bufs`` (with rows, no gradients only): a dict shared by the layers of one forward:
        the padded (B·N, ...) layout of the projections is a buffer reused from layer to
        layer and the FFN activation runs in place. The projections go through
        ``qkv.modules.linear_call.apply_linear`` (oneDNN for plain ``nn.Linear``s; measured
        faster here than MKL's GEMM writing into reused buffers).
        """
        kw = dict(mask=mask, causal=causal, bias=bias, need_weights=need_weights, cache=cache,
                  positions=positions)
        if rows is None:
            if at is not None or bufs is not None:
                raise ValueError("EncoderLayer: at and bufs are for token rows; give rows= "
                                 "(a TokenRows) too")
            return self._padded(x, **kw)
        if not isinstance(rows, TokenRows):
            raise TypeError(f"EncoderLayer: rows must be a TokenRows, got {type(rows).__name__}")
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != rows.count:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"EncoderLayer: with rows, x must be the (T, C) token rows, "
                             f"T = {rows.count}; got {got}")
        if not self._rows_direct(cache):  # parts swapped in (adapters...): the padded batch
            cols = None if at is None else rows.columns(at)  # (B,)
            out = self._padded(rows.unpack(x), **kw)
            y, weights = out if need_weights else (out, None)
            y = rows.pack(y)  # (T, C)
            if cols is not None:
                y = y.index_select(0, at)  # (B, C)
                if need_weights:  # (B, H, 1, S)
                    weights = weights[torch.arange(rows.batch, device=cols.device), :,
                                      cols][:, :, None]
            return (y, weights) if need_weights else y
        a_in = self.norm1(x) if self.norm_first else x
        a = self.attn(a_in, rows=rows, at=at, bufs=bufs, **kw)  # (T, C) or (B, C)
        weights = None
        if need_weights:
            a, weights = a
        a = self.dropout(a)
        h = x if at is None else x.index_select(0, at)  # the residual (T, C) or (B, C)
        if self.norm_first:
            h = a.add_(h)
            h = self._ffn(self.norm2(h), bufs).add_(h)
        else:
            h = self.norm1(a.add_(h))
            h = self.norm2(self._ffn(h, bufs).add_(h))
        return (h, weights) if need_weights else h

    def _padded(self, x: Tensor, *, mask, causal: bool, bias, need_weights: bool,
                cache: KVCache | None, positions: Tensor | None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """The layer on the padded batch x (B, N, C) -> (B, N, C) (and weights)."""
        h = self.norm1(x) if self.norm_first else x
        a = self.attn(h, mask=mask, causal=causal, bias=bias, need_weights=need_weights,
                      cache=cache, positions=positions)
        weights = None
        if need_weights:
            a, weights = a
        if self.post_norm1 is not None:  # the sandwich layer (Gemma 2)
            x = x + self.dropout(self.post_norm1(a))
            x = x + self.dropout(self.post_norm2(self.ffn(self.norm2(x))))
        elif self.norm_first:
            x = x + self.dropout(a)
            x = x + self.dropout(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout(a))
            x = self.norm2(x + self.dropout(self.ffn(x)))
        return (x, weights) if need_weights else x

    def _rows_direct(self, cache: KVCache | None) -> bool:
        """Whether token rows run this layer's parts directly (see ``forward``)."""
        attn = self.attn
        return (type(attn) is MultiHeadAttention and not has_hooks(attn)
                and self.post_norm1 is None
                and attn.in_proj is not None
                and type(attn.in_proj) is nn.Linear and type(attn.out_proj) is nn.Linear
                and (cache is None or type(cache) is KVCache))

    def _ffn(self, h: Tensor, bufs: dict[str, Tensor] | None) -> Tensor:
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
