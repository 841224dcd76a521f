"""``GPTConfig``: the configuration of a ``qkv.models.gpt.GPT`` (frozen, with named presets),
in its own module so that the HF GPT-2 mapping (``hf_gpt2``) reads it without importing
the model.

Shapes: V vocab size, C model width, H heads, D head dim (C // H), L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..modules.feedforward import ACTIVATIONS
from .config import ModelConfig, check_norm_eps, check_positive_int_or_none

__all__ = ["GPTConfig"]


@dataclasses.dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """Configuration of a ``GPT`` (frozen; ``GPTConfig.from_name("gpt2")`` for a preset).

    Args:
        vocab_size: V.
        max_len: the context length (the most positions ``Learned`` embeds; with RoPE only
            a documented limit, not enforced).
        dim: C, the model width.
        num_layers: L.
        num_heads: H; ``dim % num_heads == 0``.
        num_kv_heads: key/value heads (grouped-query attention); default H.
        ffn_hidden: the feed-forward width, default 4·C.
        activation: "gelu_tanh" (GPT-2's "gelu_new"), "gelu", "relu", "silu" or "swiglu".
        norm: "layernorm" or "rmsnorm"; ``norm_eps`` its epsilon, in [1e-38, 1].
        positions: "learned" (GPT-2) or "rope".
        dropout: embedding, residual and FFN dropout; ``attn_dropout`` on attention weights.
        bias: biases in the linear layers.
        tie_embeddings: the LM head shares the token embedding's (V, C) weight.
        attention: "softmax" (exact, ``MultiHeadAttention``) or "linear"
            (``LinearAttention``: kernelised, O(N) in N, constant-size decoding state).
        attention_window: W, softmax attention only: each position attends to itself and
            the W - 1 before it (``SlidingWindow(W, causal=True)``); None = full causal.
        feature_map: linear attention's φ: "elu" (elu + 1) or "favor" (FAVOR+).
        num_features: the FAVOR+ feature count m (default round(D·ln D)); "favor" only.

    Presets: "gpt2" (124M), "gpt2-medium" (355M), "gpt-tiny" (tests), "gpt-small-cpu"
    (6 layers, width 384, the CPU training benchmark).
    """

    vocab_size: int
    max_len: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    ffn_hidden: int | None = None
    activation: str = "gelu_tanh"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positions: str = "learned"
    dropout: float = 0.0
    attn_dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    attention: str = "softmax"
    attention_window: int | None = None
    feature_map: str = "elu"
    num_features: int | None = None

    MODEL_TYPE: ClassVar[str] = "qkv-gpt"
    LAYER_KEYS: ClassVar[dict[str, str]] = {"num_layers": r"layers\.(\d+)\."}
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpt2": {"vocab_size": 50257, "max_len": 1024, "dim": 768, "num_layers": 12,
                 "num_heads": 12},
        "gpt2-medium": {"vocab_size": 50257, "max_len": 1024, "dim": 1024, "num_layers": 24,
                        "num_heads": 16},
        "gpt-tiny": {"vocab_size": 256, "max_len": 128, "dim": 128, "num_layers": 2,
                     "num_heads": 4},
        "gpt-small-cpu": {"vocab_size": 8192, "max_len": 256, "dim": 384, "num_layers": 6,
                          "num_heads": 6},
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "dim", "num_layers", "num_heads"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {val!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"GPTConfig: dim={self.dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        kv = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        if not isinstance(kv, int) or kv <= 0 or self.num_heads % kv:
            raise ValueError(f"GPTConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads!r}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int)
                                            or self.ffn_hidden <= 0):
            raise ValueError(f"GPTConfig: ffn_hidden must be a positive int or None, "
                             f"got {self.ffn_hidden!r}")
        if self.activation not in (*ACTIVATIONS, "swiglu"):
            raise ValueError(f"GPTConfig: activation must be one of "
                             f"{sorted((*ACTIVATIONS, 'swiglu'))}, got {self.activation!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"GPTConfig: norm must be 'layernorm' or 'rmsnorm', "
                             f"got {self.norm!r}")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"GPTConfig: positions must be 'learned' or 'rope', "
                             f"got {self.positions!r}")
        if self.positions == "rope" and (self.dim // self.num_heads) % 2:
            raise ValueError(f"GPTConfig: rope needs an even head dim, got "
                             f"{self.dim} // {self.num_heads} = {self.dim // self.num_heads}")
        for name in ("dropout", "attn_dropout"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not 0.0 <= val < 1.0:
                raise ValueError(f"GPTConfig: {name} must be in [0, 1), got {val!r}")
        check_norm_eps("GPTConfig", self.norm_eps)
        self._check_attention()

    def _check_attention(self) -> None:
        if self.attention not in ("softmax", "linear"):
            raise ValueError(f"GPTConfig: attention must be 'softmax' or 'linear', "
                             f"got {self.attention!r}")
        w, m = self.attention_window, self.num_features
        check_positive_int_or_none("GPTConfig", "attention_window", w)
        if self.feature_map not in ("elu", "favor"):
            raise ValueError(f"GPTConfig: feature_map must be 'elu' or 'favor', "
                             f"got {self.feature_map!r}")
        check_positive_int_or_none("GPTConfig", "num_features", m)
        if self.attention == "linear":
            if w is not None:
                raise ValueError(f"GPTConfig: attention_window={w} is for softmax attention; "
                                 f"linear attention sums every past position (use "
                                 f"attention='softmax' or attention_window=None)")
            if self.attn_dropout:
                raise ValueError(f"GPTConfig: attn_dropout={self.attn_dropout} drops "
                                 f"attention weights, which linear attention never forms; "
                                 f"use 0")
            if m is not None and self.feature_map != "favor":
                raise ValueError(f"GPTConfig: num_features={m} is for feature_map='favor', "
                                 f"got feature_map={self.feature_map!r}")
        elif self.feature_map != "elu" or m is not None:
            raise ValueError(f"GPTConfig: feature_map={self.feature_map!r} / num_features="
                             f"{m!r} are for attention='linear', got attention="
                             f"{self.attention!r}")

    @property
    def head_dim(self) -> int:
        """D = C // H."""
        return self.dim // self.num_heads
