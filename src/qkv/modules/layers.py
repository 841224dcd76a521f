"""Transformer layers: ``EncoderLayer`` (self-attention + FFN) and ``DecoderLayer``
(causal self-attention + cross-attention + FFN), residual connections and norms.

Shapes: B batch, N length of x, S length of the memory (encoder output), C model width,
H heads. Inputs and outputs are batch-first (B, N, C).

The parts are handed in (an attention module, an FFN, norms); ``build`` makes the common
ones. ``norm_first=False`` is the original paper's post-norm, x = norm(x + sublayer(x));
``norm_first=True`` is pre-norm, x = x + sublayer(norm(x)) (GPT-2 and most modern models).
A decoder-only model (GPT) uses ``EncoderLayer`` with ``causal=True``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .attention import MultiHeadAttention
from .cache import KVCache
from .feedforward import FeedForward, SwiGLU
from .norms import make_norm

__all__ = ["DecoderLayer", "EncoderLayer"]


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
