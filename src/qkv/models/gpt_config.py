"""``GPTConfig``: the configuration of a ``qkv.models.gpt.GPT`` (frozen, with named presets),
in its own module so that the HF GPT-2 mapping (``hf_gpt2``) reads it without importing
the model.

Shapes: V vocab size, C model width, H heads, D head dim (C // H), L layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from ..modules.feedforward import ACTIVATIONS, GATED_ACTIVATIONS
from ..modules.norms import NORMS
from ..modules.rope_scaling import RopeScaling
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

    The variants of the Llama-style families (HF Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3;
    each default is GPT-2's behaviour):

        attention_head_dim: D when it is not C // H (Qwen3, Gemma: H·D may differ from C).
        rope_base: RoPE's θ base (HF ``rope_theta``).
        rope_scaling: RoPE scaling as ``qkv.modules.rope_scaling.RopeScaling.to_dict()``
            ("linear", "dynamic", "llama3", "yarn"), or None.
        qkv_bias, out_bias, ffn_bias: biases of the fused q/k/v projection, the attention
            output projection and the FFN projections; None = ``bias`` (Qwen2: q/k/v only).
        qk_norm: an RMSNorm over each head's D dims of the queries and of the keys, after
            the projection and before RoPE (Qwen3), eps ``norm_eps``.
        embed_scale: the token embeddings are multiplied by √C rounded to the weight dtype
            (Gemma).
        post_norms: a norm on each sublayer's output before its residual add as well
            (Gemma 2's four norms per layer).
        attention_scale: the q·k scale; None = 1/√D (Gemma 2: query_pre_attn_scalar^-0.5).
        attn_softcap: attention logits soft-capped to cap·tanh(logits / cap) (Gemma 2).
        logit_softcap: the LM head's logits soft-capped alike (Gemma 2).
        windowed_layers: with ``attention_window``, the indices of the layers that attend
            in the window (Gemma 2 alternates local and global layers); None = every layer.

    ``activation`` may also be a gated FFN: "swiglu" (SiLU gate), "geglu_tanh" (Gemma's
    tanh-GELU gate) or "geglu"; ``norm`` also "rmsnorm_plus_one" (Gemma: x/rms(x)·(1 + w)).

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
    attention_head_dim: int | None = None
    rope_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    ffn_bias: bool | None = None
    qk_norm: bool = False
    embed_scale: bool = False
    post_norms: bool = False
    attention_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    windowed_layers: tuple[int, ...] | None = None

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
        check_positive_int_or_none("GPTConfig", "attention_head_dim", self.attention_head_dim)
        if self.attention_head_dim is None and self.dim % self.num_heads:
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
        if self.activation not in (*ACTIVATIONS, *GATED_ACTIVATIONS):
            raise ValueError(f"GPTConfig: activation must be one of "
                             f"{sorted((*ACTIVATIONS, *GATED_ACTIVATIONS))}, "
                             f"got {self.activation!r}")
        if self.norm not in NORMS:
            raise ValueError(f"GPTConfig: norm must be one of {list(NORMS)}, "
                             f"got {self.norm!r}")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"GPTConfig: positions must be 'learned' or 'rope', "
                             f"got {self.positions!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rope needs an even head dim, got {self.head_dim}")
        for name in ("dropout", "attn_dropout"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not 0.0 <= val < 1.0:
                raise ValueError(f"GPTConfig: {name} must be in [0, 1), got {val!r}")
        check_norm_eps("GPTConfig", self.norm_eps)
        self._check_attention()
        self._check_variants()

    def _check_variants(self) -> None:
        """The Llama-family fields (see the class docstring)."""
        base = self.rope_base
        if isinstance(base, bool) or not isinstance(base, (int, float)) \
                or not math.isfinite(base) or base <= 1:
            raise ValueError(f"GPTConfig: rope_base must be a finite number > 1, got {base!r}")
        if self.rope_scaling is not None:
            if self.positions != "rope":
                raise ValueError("GPTConfig: rope_scaling is for positions='rope'")
            RopeScaling.from_dict(self.rope_scaling)  # ValueError naming what is wrong
        for name in ("qkv_bias", "out_bias", "ffn_bias"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"GPTConfig: {name} must be a bool or None, "
                                 f"got {getattr(self, name)!r}")
        for name in ("qk_norm", "embed_scale", "post_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig: {name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        for name in ("attention_scale", "attn_softcap", "logit_softcap"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))
                                    or not math.isfinite(val) or val <= 0):
                raise ValueError(f"GPTConfig: {name} must be a positive finite number or "
                                 f"None, got {val!r}")
        if self.attention == "linear" and (self.qk_norm or self.attention_scale is not None
                                           or self.attn_softcap is not None):
            raise ValueError("GPTConfig: qk_norm, attention_scale and attn_softcap are for "
                             "softmax attention")
        layers = self.windowed_layers
        if layers is not None:
            if isinstance(layers, list):
                layers = tuple(layers)
                object.__setattr__(self, "windowed_layers", layers)
            ok = (isinstance(layers, tuple) and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers
                for i in layers) and list(layers) == sorted(set(layers)))
            if not ok:
                raise ValueError(f"GPTConfig: windowed_layers must be increasing layer "
                                 f"indices in [0, {self.num_layers}), got {layers!r}")
            if self.attention_window is None:
                raise ValueError("GPTConfig: windowed_layers needs attention_window (the "
                                 "window those layers attend in)")

    def is_windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` attends in ``attention_window`` (False without one)."""
        if self.attention_window is None:
            return False
        return self.windowed_layers is None or layer in self.windowed_layers

    def biases(self) -> tuple[bool, bool, bool]:
        """(q/k/v, attention output, FFN) biases: each field, or ``bias`` where None."""
        return tuple(self.bias if v is None else v
                     for v in (self.qkv_bias, self.out_bias, self.ffn_bias))

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
        """D: ``attention_head_dim``, else C // H."""
        if self.attention_head_dim is not None:
            return self.attention_head_dim
        return self.dim // self.num_heads
