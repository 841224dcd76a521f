"""``TransformerConfig``, the encoder-decoder's presets, and the one place where the config's
``positions`` string becomes parts (a position module or a relative bias producer).

Shapes: B batch, S source length, N target length, C width (``dim``), H heads, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from ..modules.feedforward import ACTIVATIONS, GATED_ACTIVATIONS
from ..modules.positions import SINUSOIDAL_LAYOUTS, Learned, Sinusoidal
from ..modules.relative import ALiBi, ShawRelative, T5Bias
from .config import ModelConfig, check_norm_eps

__all__ = ["ABSOLUTE_POSITIONS", "POSITIONS", "RELATIVE_POSITIONS", "PositionParts",
           "TransformerConfig", "build_positions", "embedding_scale"]

#: Absolute schemes: an encoding added to the (scaled) token embeddings.
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")
#: Relative schemes: bias producers on the encoder and decoder self-attentions.
RELATIVE_POSITIONS = ("alibi", "t5", "shaw")
POSITIONS = ABSOLUTE_POSITIONS + RELATIVE_POSITIONS

_VOCAB_WMT = 37000  # the paper's shared source-target BPE vocabulary (WMT 2014 en-de)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"TransformerConfig: {name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ModelConfig):
    """Configuration of ``qkv.models.Transformer`` (Vaswani et al. 2017).

    Presets (``TransformerConfig.from_name(name, **overrides)``): "vaswani-base" (C 512,
    6+6 layers, 8 heads, FFN 2048, dropout 0.1), "vaswani-big" (C 1024, 6+6, 16 heads, FFN
    4096, dropout 0.3) — both with the paper's shared 37000-token BPE vocabulary, shared
    embeddings and tied output — and CPU-sized "transformer-tiny" and "transformer-small".

    Args:
        src_vocab_size, tgt_vocab_size: V of the source and target vocabularies.
        dim: C, the model width (d_model).
        num_encoder_layers, num_decoder_layers: stack depths.
        num_heads: H; ``dim % num_heads == 0``.
        ffn_hidden: the feed-forward hidden width (d_ff).
        activation: FFN activation: "relu" (paper), "gelu", "gelu_tanh", "silu", or a gated
            FFN ``GATED_ACTIVATIONS``: "swiglu", "geglu_tanh" (T5 v1.1 / Flan-T5's gated-gelu),
            "geglu".
        norm_first: False: post-norm, x = norm(x + f(x)) (paper); True: pre-norm.
        norm_eps: epsilon of the norms, in [1e-38, 1].
        dropout: on embeddings + positions, after each sublayer, and inside the FFN unless
            ``ffn_dropout`` is set.
        attn_dropout: on the attention weights.
        ffn_dropout: inside the FFN, after its activation (BART/Marian's
            ``activation_dropout``); None: ``dropout``.
        max_len: the longest source or target sequence. Enforced for "sinusoidal" and
            "learned" positions (a ValueError beyond it); the relative schemes have no table.
        positions: "sinusoidal" (paper), "learned" (separate source/target tables), or a
            relative scheme on the self-attentions: "alibi", "t5" (buckets; one table per
            stack, bidirectional in the encoder, causal in the decoder, as T5) or "shaw"
            (Shaw et al. 2018, one per layer as in tensor2tensor).
        share_embeddings: one token table for source and target (needs equal vocabularies).
        tie_output: the output projection is the target embedding table (paper).
        scale_embeddings: multiply token embeddings by sqrt(C) (paper).
        pad_id, bos_id, eos_id: special token ids (each < both vocab sizes).
        final_norm: a norm after each stack's last layer; None (default) means
            ``norm_first`` (pre-norm stacks need one; torch.nn.Transformer always has one).
        norm: "layernorm" or "rmsnorm".
        bias: biases in the linear layers and LayerNorms.
        relative_num_buckets: T5 buckets.
        relative_max_distance: T5's max distance (default 128) or Shaw's clip distance
            (default 16).

    Variants of pretrained encoder-decoders (defaults: the paper's model):
        attention_head_dim: D when H·D != C (Flan-T5-small: 6 heads of 64 at C = 512); None:
            C / H.
        attention_scale: the factor on q·k in every attention; None: 1/sqrt(D). T5: 1.0 (its
            initialisation folds the scale into the query weights).
        head_bias: the output projection has a bias (HF BART/Marian's ``final_logits_bias``).
        head_scale: the decoder output is multiplied by it before the output projection
            (T5 with tied embeddings: C^-0.5).
        embed_norm: a norm on each stack's embeddings (after scale and positions; BART's
            ``layernorm_embedding``), modules ``src_embed_norm`` / ``tgt_embed_norm``.
        position_offset: "learned" positions read table row ``position + offset``; the table
            has ``max_len + offset`` rows (BART's offset of 2).
        sinusoidal_layout: "interleaved" (the paper) or "halves" (Marian's [sin | cos]).
        freeze_pad_row: the ``pad_id`` row of the token tables starts at zero and gets no
            gradient (``nn.Embedding(padding_idx=)``, as BART / Marian); False: it is trained
            like any row (T5, whose decoder starts from the pad token).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "vaswani-base": dict(src_vocab_size=_VOCAB_WMT, tgt_vocab_size=_VOCAB_WMT, dim=512,
                             num_encoder_layers=6, num_decoder_layers=6, num_heads=8,
                             ffn_hidden=2048, dropout=0.1, share_embeddings=True),
        "vaswani-big": dict(src_vocab_size=_VOCAB_WMT, tgt_vocab_size=_VOCAB_WMT, dim=1024,
                            num_encoder_layers=6, num_decoder_layers=6, num_heads=16,
                            ffn_hidden=4096, dropout=0.3, share_embeddings=True),
        "transformer-tiny": dict(src_vocab_size=32, tgt_vocab_size=32, dim=32,
                                 num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
                                 ffn_hidden=64, dropout=0.0, max_len=64),
        "transformer-small": dict(src_vocab_size=8000, tgt_vocab_size=8000, dim=256,
                                  num_encoder_layers=3, num_decoder_layers=3, num_heads=4,
                                  ffn_hidden=1024, dropout=0.1, max_len=256,
                                  share_embeddings=True),
    }
    MODEL_TYPE: ClassVar[str] = "qkv-transformer"
    LAYER_KEYS: ClassVar[dict[str, str]] = {
        "num_encoder_layers": r"encoder_layers\.(\d+)\.",
        "num_decoder_layers": r"decoder_layers\.(\d+)\."}

    src_vocab_size: int
    tgt_vocab_size: int
    dim: int = 512
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    num_heads: int = 8
    ffn_hidden: int = 2048
    activation: str = "relu"
    norm_first: bool = False
    norm_eps: float = 1e-5
    dropout: float = 0.1
    attn_dropout: float = 0.0
    ffn_dropout: float | None = None
    max_len: int = 1024
    positions: str = "sinusoidal"
    share_embeddings: bool = False
    tie_output: bool = True
    scale_embeddings: bool = True
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    final_norm: bool | None = None
    norm: str = "layernorm"
    bias: bool = True
    relative_num_buckets: int = 32
    relative_max_distance: int | None = None
    attention_head_dim: int | None = None
    attention_scale: float | None = None
    head_bias: bool = False
    head_scale: float = 1.0
    embed_norm: bool = False
    position_offset: int = 0
    sinusoidal_layout: str = "interleaved"
    freeze_pad_row: bool = True

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "dim", "num_encoder_layers",
                     "num_decoder_layers", "num_heads", "ffn_hidden", "max_len",
                     "relative_num_buckets"):
            _positive_int(name, getattr(self, name))
        for name in ("relative_max_distance", "attention_head_dim"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.attention_head_dim is None and self.dim % self.num_heads:
            raise ValueError(f"TransformerConfig: dim={self.dim} is not divisible by "
                             f"num_heads={self.num_heads} (set attention_head_dim for "
                             f"H·D != C)")
        if self.activation not in (*ACTIVATIONS, *GATED_ACTIVATIONS):
            raise ValueError(f"TransformerConfig: activation must be one of "
                             f"{sorted((*ACTIVATIONS, *GATED_ACTIVATIONS))}, "
                             f"got {self.activation!r}")
        for name in ("attention_scale", "head_scale"):
            value = getattr(self, name)
            if value is None and name == "attention_scale":
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"TransformerConfig: {name} must be a finite number > 0"
                                 + (" or None" if name == "attention_scale" else "")
                                 + f", got {value!r}")
        if (not isinstance(self.position_offset, int) or isinstance(self.position_offset, bool)
                or self.position_offset < 0):
            raise ValueError(f"TransformerConfig: position_offset must be an int >= 0, "
                             f"got {self.position_offset!r}")
        if self.position_offset and self.positions != "learned":
            raise ValueError(f"TransformerConfig: position_offset={self.position_offset} is for "
                             f"\"learned\" positions, got positions={self.positions!r}")
        if self.sinusoidal_layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(f"TransformerConfig: sinusoidal_layout must be one of "
                             f"{SINUSOIDAL_LAYOUTS}, got {self.sinusoidal_layout!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"TransformerConfig: positions must be one of {POSITIONS}, "
                             f"got {self.positions!r}")
        if self.positions == "sinusoidal" and self.dim % 2:
            raise ValueError(f"TransformerConfig: sinusoidal positions need an even dim, "
                             f"got {self.dim}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"TransformerConfig: norm must be 'layernorm' or 'rmsnorm', "
                             f"got {self.norm!r}")
        for name in ("dropout", "attn_dropout", "ffn_dropout"):
            p = getattr(self, name)
            if p is None and name == "ffn_dropout":
                continue
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"TransformerConfig: {name} must be in [0, 1), got {p!r}")
        check_norm_eps("TransformerConfig", self.norm_eps)
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(f"TransformerConfig: share_embeddings needs equal vocabularies, "
                             f"got src_vocab_size={self.src_vocab_size}, "
                             f"tgt_vocab_size={self.tgt_vocab_size}")
        vocab = min(self.src_vocab_size, self.tgt_vocab_size)
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
                raise ValueError(f"TransformerConfig: {name} must be an int in [0, {vocab}) "
                                 f"(the smaller vocabulary), got {value!r}")
        if self.final_norm is None:
            object.__setattr__(self, "final_norm", bool(self.norm_first))
        for name in ("norm_first", "share_embeddings", "tie_output", "scale_embeddings",
                     "final_norm", "bias", "head_bias", "embed_norm", "freeze_pad_row"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TransformerConfig: {name} must be a bool, "
                                 f"got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        """D: ``attention_head_dim``, else dim // num_heads."""
        return self.attention_head_dim or self.dim // self.num_heads

    @property
    def absolute_positions(self) -> bool:
        """True for "sinusoidal"/"learned" (bounded by ``max_len``)."""
        return self.positions in ABSOLUTE_POSITIONS


class PositionParts(NamedTuple):
    """What a ``positions`` string becomes.

    Attributes:
        src, tgt: modules adding an absolute encoding to (B, S|N, C) embeddings, or None.
        encoder_bias, decoder_bias: a bias producer shared by every layer of the stack, an
            ``nn.ModuleList`` with one per layer, or None.
    """

    src: nn.Module | None
    tgt: nn.Module | None
    encoder_bias: nn.Module | None
    decoder_bias: nn.Module | None


def build_positions(config: TransformerConfig, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> PositionParts:
    """The one place where ``config.positions`` becomes parts (see ``PositionParts``)."""
    c = config
    factory = {"device": device, "dtype": dtype}
    if c.positions == "sinusoidal":
        pe = Sinusoidal(c.dim, max_len=c.max_len, layout=c.sinusoidal_layout)  # no state: one
        # module serves both sides
        return PositionParts(pe, pe, None, None)
    if c.positions == "learned":
        rows = c.max_len + c.position_offset
        return PositionParts(Learned(rows, c.dim, **factory), Learned(rows, c.dim, **factory),
                             None, None)
    if c.positions == "alibi":
        return PositionParts(None, None, ALiBi(c.num_heads), ALiBi(c.num_heads))
    if c.positions == "t5":
        dist = 128 if c.relative_max_distance is None else c.relative_max_distance

        def t5(bidirectional: bool) -> T5Bias:
            t = T5Bias(c.num_heads, num_buckets=c.relative_num_buckets, max_distance=dist,
                       bidirectional=bidirectional, **factory)
            nn.init.normal_(t.embedding.weight, std=c.dim ** -0.5)  # HF T5's init scale
            return t

        return PositionParts(None, None, t5(True), t5(False))
    # "shaw": one producer per layer (tensor2tensor's relative attention)
    dist = 16 if c.relative_max_distance is None else c.relative_max_distance

    def shaw(layers: int) -> nn.ModuleList:
        return nn.ModuleList(ShawRelative(c.head_dim, max_distance=dist, **factory)
                             for _ in range(layers))

    return PositionParts(None, None, shaw(c.num_encoder_layers), shaw(c.num_decoder_layers))


def embedding_scale(config: TransformerConfig) -> float:
    """sqrt(C) with ``scale_embeddings``, else 1."""
    return math.sqrt(config.dim) if config.scale_embeddings else 1.0
