"""The decode plan of an encoder-decoder ``qkv.models.Transformer``: its decoder as named
per-layer weight records (``seq2seq_plan``), the counterpart of ``qkv.generation.plan``'s
``DecodePlan`` for decoder-only models, built of the same ``LinearPlan`` / ``NormPlan``
records so that every weight form of ``qkv.generation.linears`` serves it.

Shapes: C width, H heads, D head dim (H·D may differ from C), F feed-forward width (a gated
FFN's input projection is 2F wide: gate, up), V target vocab size, L decoder layers.

Per decoder layer: the self-attention's fused q/k/v projection (3·H·D, C) and its output
projection; the cross-attention's query rows (H·D, C) and key/value rows (2·H·D, C) of its
fused projection (the key/value rows run once per source, on the encoder's output) and its
output projection; the feed-forward in (and gate) and out; three norms, applied before each
sublayer (pre-norm, T5) or after each residual add (post-norm, Marian / BART). Around the
layers: the target token table and its scale, absolute positions (a sinusoidal table in
either layout, or a learned table read at position + ``position_offset``) or a relative bias
producer on the self-attention (T5's causal buckets, ALiBi), the norm after the embedding
(BART's ``layernorm_embedding``), the decoder's final norm, and the head (its bias, the scale
of its input). The encoder, which runs once per source, has a plan of its own
(``EncoderPlan``: the decoder-only plan's ``LayerPlan`` records), used by the backends whose
weight form pays there (int8); a hook on an encoder module leaves the encoder to its modules
(``Seq2SeqPlan.why_no_encoder``) and the decoder planned.

The plan holds the model's live parameters (views of them for the rows of a fused
projection, never copies); the backends make their copies when a stepper is built.
A model the plan cannot describe raises ``Unplannable`` with the reason, and decodes through
its modules (``qkv.generation.steppers.Seq2SeqStepper``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models.transformer import Transformer, TransformerConfig
from ..models.transformer_config import embedding_scale
from ..modules.attention import MultiHeadAttention
from ..modules.feedforward import GATED_ACTIVATIONS, FeedForward, SwiGLU
from ..modules.layers import DecoderLayer, EncoderLayer
from ..modules.linear_call import has_hooks
from ..modules.norms import LayerNorm, RMSNorm
from ..modules.positions import Learned, Sinusoidal
from ..modules.quantized import QuantizedLinear, scale127
from ..modules.relative import ALiBi, T5Bias
from .plan import LayerPlan, LinearPlan, NormPlan, Unplannable, planned_activation

__all__ = ["SEQ2SEQ_DTYPES", "EncoderPlan", "Seq2SeqLayerPlan", "Seq2SeqPlan", "seq2seq_plan"]

# TransformerConfig fields the plan describes (any value); another field with a value other
# than its default (a variant added later) is refused: the model decodes on the module path
_KNOWN = {"src_vocab_size", "tgt_vocab_size", "dim", "num_encoder_layers",
          "num_decoder_layers", "num_heads", "ffn_hidden", "activation", "norm_first",
          "norm_eps", "dropout", "attn_dropout", "ffn_dropout", "max_len", "positions",
          "share_embeddings", "tie_output", "scale_embeddings", "pad_id", "bos_id", "eos_id",
          "final_norm", "norm", "bias", "relative_num_buckets", "relative_max_distance",
          # the HF Marian / BART / T5 fields
          "attention_head_dim", "attention_scale", "head_bias", "head_scale", "embed_norm",
          "position_offset", "sinusoidal_layout"}

SEQ2SEQ_DTYPES = (torch.float32, torch.float64)
"""The weight dtypes the plan describes (int8 projections keep fp32 embeddings)."""


@dataclass(frozen=True)
class Seq2SeqLayerPlan:
    """One decoder layer. Post-norm (``Seq2SeqPlan.norm_first`` False):
    x = self_norm(x + out(self_attn(qkv(x)))); x = cross_norm(x + cross_out(cross_attn(
    cross_q(x), memory))); x = ffn_norm(x + ffn_out(act(ffn_in(x)))). Pre-norm: each norm
    feeds its sublayer instead, x = x + out(self_attn(qkv(self_norm(x)))) and so on.
    ``cross_kv`` (2·H·D, C): the memory's keys then values, projected once per source."""

    self_norm: NormPlan
    qkv: LinearPlan
    out: LinearPlan
    cross_norm: NormPlan
    cross_q: LinearPlan
    cross_kv: LinearPlan
    cross_out: LinearPlan
    ffn_norm: NormPlan
    ffn_in: LinearPlan
    ffn_out: LinearPlan


@dataclass(frozen=True)
class Seq2SeqPlan:
    """A ``Transformer``'s decoder as decode steps see it.

    Attributes:
        model: the Transformer (its encoder runs through its modules).
        layers: one ``Seq2SeqLayerPlan`` per decoder layer.
        heads, head_dim: H, D (every attention has H query and H key/value heads).
        width, ffn, vocab: C, F, V (the target vocabulary).
        activation: the name in ``qkv.modules.activations.ACTIVATION_TABLE`` (a gated FFN's
            gate activation).
        gated: the FFN is act(gate)·up.
        norm_kind: "layernorm" or "rmsnorm".
        norm_first: pre-norm layers (T5) or post-norm (False: Marian, BART).
        attention_scale: the logit scale of every decoder attention (1/√D, or T5's 1.0).
        embed: (V, C) target token table; ``embed_scale`` its factor (√C or 1.0).
        pos_table: (P, C) rows of the absolute positions (a sinusoidal table computed from
            the model's module, or the learned table itself), or None.
        position_offset: position p reads ``pos_table[p + position_offset]`` (BART's 2).
        self_bias: the bias producer of the self-attention (T5's causal buckets, ALiBi),
            shared by the layers, or None.
        embed_norm: the norm after embedding·scale + positions (BART), or None.
        norm: the decoder's final norm, or None.
        head: the LM head (V, C), with its bias or none; ``head_scale`` multiplies its input.
        int8: every projection and the head are int8 (``qkv.quantize``).
        dtype, device: of the target embedding (the activations').
        encoder: the encoder's ``EncoderPlan``, or None (it then runs through its modules:
            ``why_no_encoder`` says why).
    """

    model: Transformer
    layers: tuple[Seq2SeqLayerPlan, ...]
    heads: int
    head_dim: int
    width: int
    ffn: int
    vocab: int
    activation: str
    gated: bool
    norm_kind: str
    norm_first: bool
    attention_scale: float
    embed: Tensor
    embed_scale: float
    pos_table: Tensor | None
    position_offset: int
    self_bias: nn.Module | None
    embed_norm: NormPlan | None
    norm: NormPlan | None
    head: LinearPlan
    head_scale: float
    int8: bool
    dtype: torch.dtype
    device: torch.device
    encoder: EncoderPlan | None = None
    why_no_encoder: str | None = None

    def linears(self) -> list[LinearPlan]:
        """Every projection in the order the weight forms keep them (``linear_index``):
        per layer qkv, out, cross_q, cross_out, ffn_in, ffn_out (6·L); the head; then each
        layer's cross_kv (6·L + 1 + L in all)."""
        per_layer = [lin for lp in self.layers for lin in (
            lp.qkv, lp.out, lp.cross_q, lp.cross_out, lp.ffn_in, lp.ffn_out)]
        return per_layer + [self.head] + [lp.cross_kv for lp in self.layers]

    @property
    def head_index(self) -> int:
        """The head's index in ``linears()``."""
        return 6 * len(self.layers)

    def kv_index(self, layer: int) -> int:
        """Layer ``layer``'s cross_kv index in ``linears()``."""
        return 6 * len(self.layers) + 1 + layer

    def describe(self) -> str:
        """One line: the plan's layer form."""
        pos = self.model.config.positions
        ffn = f"gated {self.activation}" if self.gated else self.activation
        return (f"{len(self.layers)} decoder layers, width {self.width}, {self.heads} heads "
                f"of {self.head_dim}, {'pre' if self.norm_first else 'post'}-norm "
                f"{self.norm_kind}, {ffn}, {pos} positions, "
                f"{'int8' if self.int8 else str(self.dtype).replace('torch.', '')} weights")


@dataclass(frozen=True)
class EncoderPlan:
    """A ``Transformer``'s encoder as the weight forms see it: ``LayerPlan`` records of the
    decoder-only plan (norm1, the fused q/k/v projection, out, norm2, ffn_in, ffn_out), each
    norm before its sublayer (``norm_first``) or after its residual add.

    Attributes:
        layers: one ``LayerPlan`` per encoder layer.
        heads, head_dim, attention_scale, activation, gated, norm_first: as the decoder's.
        embed: (V_src, C) source token table; ``embed_scale`` its factor.
        pos_table, position_offset: the absolute positions, as the decoder's, or None.
        bias: the self-attention's bias producer (T5's bidirectional buckets, ALiBi), or None.
        embed_norm: the norm after the embedding (BART), or None; ``norm``: the encoder's
            final norm, or None.
        pad_id: the source pad id (a source without a mask is ``src != pad_id``).
    """

    layers: tuple[LayerPlan, ...]
    heads: int
    head_dim: int
    attention_scale: float
    activation: str
    gated: bool
    norm_first: bool
    embed: Tensor
    embed_scale: float
    pos_table: Tensor | None
    position_offset: int
    bias: nn.Module | None
    embed_norm: NormPlan | None
    norm: NormPlan | None
    pad_id: int

    def linears(self) -> list[LinearPlan]:
        """qkv, out, ffn_in, ffn_out per layer (4·L), the order the weight forms keep."""
        return [lin for lp in self.layers for lin in (lp.qkv, lp.out, lp.ffn_in, lp.ffn_out)]


def _norm(m: nn.Module | None, kind: str, where: str) -> NormPlan:
    want = LayerNorm if kind == "layernorm" else RMSNorm
    if type(m) is not want or getattr(m, "unit_offset", False):
        raise Unplannable(f"{where} is a {type(m).__name__}, not the config's {kind}")
    return NormPlan(kind, m.weight, getattr(m, "bias", None), float(m.eps))


def _rows(lin: LinearPlan, start: int, stop: int) -> LinearPlan:
    """Output rows [start, stop) of a projection, as views of its live tensors."""
    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[start:stop]
    return LinearPlan(cut(lin.weight), cut(lin.bias), cut(lin.weight_int8),
                      cut(lin.scale127))


def _linear(m: nn.Module, where: str) -> LinearPlan:
    if type(m) is nn.Linear:
        return LinearPlan(m.weight, m.bias)
    if type(m) is QuantizedLinear:
        return LinearPlan(None, m.bias, m.weight_int8, scale127(m.weight_scale))
    # an unmerged qkv.peft LoRA wrapper (or any other module) computes more than a weight
    raise Unplannable(f"{where} is a {type(m).__name__}, not an nn.Linear or QuantizedLinear")


def _attention(attn: nn.Module, where: str, heads: int, head_dim: int, width: int
               ) -> tuple[LinearPlan, float]:
    """The fused projection and the logit scale of a plain decoder attention."""
    if type(attn) is not MultiHeadAttention or attn.in_proj is None:
        raise Unplannable(f"{where} is a {type(attn).__name__} without one fused q/k/v "
                          f"projection")
    if attn.backend not in ("auto", "sdpa"):
        raise Unplannable(f"{where} runs on backend {attn.backend!r} (the plan computes "
                          f"exact softmax attention: 'auto'/'sdpa')")
    if (attn.rope is not None or attn.q_norm is not None or attn.softcap is not None
            or attn.num_kv_heads != attn.num_heads):
        raise Unplannable(f"{where} has RoPE, q/k norms, a soft cap or grouped heads")
    if (attn.num_heads, attn.head_dim, attn.dim) != (heads, head_dim, width):
        raise Unplannable(f"{where} has {attn.num_heads} heads of {attn.head_dim}, not the "
                          f"first layer's {heads} of {head_dim}")
    scale = 1.0 / math.sqrt(head_dim) if attn.scale is None else attn.scale
    return _linear(attn.in_proj, f"{where}'s in_proj"), scale


def _layer(layer: nn.Module, i: int, c: TransformerConfig, heads: int, head_dim: int,
           scale: float) -> Seq2SeqLayerPlan:
    where = f"decoder layer {i}"
    if type(layer) is not DecoderLayer or layer.norm_first != c.norm_first:
        raise Unplannable(f"{where} is a {type(layer).__name__}, not a DecoderLayer of the "
                          f"config's norm_first={c.norm_first}")
    qkv, s1 = _attention(layer.self_attn, f"{where}'s self-attention", heads, head_dim,
                         c.dim)
    cross, s2 = _attention(layer.cross_attn, f"{where}'s cross-attention", heads, head_dim,
                           c.dim)
    if s1 != scale or s2 != scale:
        raise Unplannable(f"{where}'s attention scales {s1}, {s2} differ from {scale}")
    ffn = layer.ffn
    want = SwiGLU if c.activation in GATED_ACTIVATIONS else FeedForward
    if type(ffn) is not want:
        raise Unplannable(f"{where}'s feed-forward is a {type(ffn).__name__}, not a "
                          f"{want.__name__}")
    q_rows = heads * head_dim
    return Seq2SeqLayerPlan(
        _norm(layer.norm1, c.norm, f"{where}'s norm1"),
        qkv, _linear(layer.self_attn.out_proj, f"{where}'s self out_proj"),
        _norm(layer.norm2, c.norm, f"{where}'s norm2"),
        _rows(cross, 0, q_rows), _rows(cross, q_rows, 3 * q_rows),
        _linear(layer.cross_attn.out_proj, f"{where}'s cross out_proj"),
        _norm(layer.norm3, c.norm, f"{where}'s norm3"),
        _linear(ffn.fc_in, f"{where}'s fc_in"), _linear(ffn.fc_out, f"{where}'s fc_out"))


_DECODER = ("tgt_embed", "tgt_positions", "tgt_embed_norm", "decoder_bias", "decoder_layers",
            "decoder_norm", "lm_head")
_ENCODER = ("src_embed", "src_positions", "src_embed_norm", "encoder_bias", "encoder_layers",
            "encoder_norm")


def _modules(model: Transformer, names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module under the model's attributes ``names`` (the modules
    a decode step, or the encoder, calls on the module path)."""
    out = []
    for name in names:
        m = getattr(model, name, None)
        if isinstance(m, nn.Module):
            out += [(f"{name}.{sub}" if sub else name, s) for sub, s in m.named_modules()]
    return out


def _positions(model: Transformer, c: TransformerConfig, dtype: torch.dtype, side: str = "tgt"
               ) -> tuple[Tensor | None, nn.Module | None]:
    """(the absolute position table, the self-attention bias producer) of the decoder
    (``side`` "tgt") or the encoder ("src")."""
    pos = model.tgt_positions if side == "tgt" else model.src_positions
    bias = model.decoder_bias if side == "tgt" else model.encoder_bias
    if c.positions == "sinusoidal" and type(pos) is Sinusoidal:
        rows = torch.arange(c.max_len, device=model.tgt_embed.weight.device)
        return pos.encoding(rows).to(dtype), None  # (max_len, C), the module's own values
    if c.positions == "learned" and type(pos) is Learned:
        return pos.weight, None
    if c.positions in ("t5", "alibi") and type(bias) in (T5Bias, ALiBi):
        return None, bias
    raise Unplannable(f"positions {c.positions!r} as {type(pos).__name__}/"
                      f"{type(bias).__name__} (the plan describes sinusoidal, learned, t5 and "
                      f"alibi positions)")


def _encoder_plan(model: Transformer, c: TransformerConfig, heads: int, head_dim: int,
                  scale: float, activation: str, int8: bool) -> EncoderPlan:
    """The encoder's plan; ``Unplannable`` naming the first part it does not describe."""
    hooked = next((name for name, m in _modules(model, _ENCODER) if has_hooks(m)), None)
    if hooked is not None:  # the encoder would run without its hook
        raise Unplannable(f"{hooked} has hooks")
    layers = []
    for i, layer in enumerate(model.encoder_layers):
        where = f"encoder layer {i}"
        if (type(layer) is not EncoderLayer or layer.norm_first != c.norm_first
                or layer.post_norm1 is not None):
            raise Unplannable(f"{where} is not a plain EncoderLayer of the config's "
                              f"norm_first={c.norm_first}")
        qkv, s = _attention(layer.attn, f"{where}'s attention", heads, head_dim, c.dim)
        ffn = layer.ffn
        want = SwiGLU if c.activation in GATED_ACTIVATIONS else FeedForward
        if s != scale or type(ffn) is not want:
            raise Unplannable(f"{where}'s attention scale {s} or feed-forward "
                              f"{type(ffn).__name__} differs from the decoder's")
        lp = LayerPlan(_norm(layer.norm1, c.norm, f"{where}'s norm1"), qkv,
                       _linear(layer.attn.out_proj, f"{where}'s out_proj"),
                       _norm(layer.norm2, c.norm, f"{where}'s norm2"),
                       _linear(ffn.fc_in, f"{where}'s fc_in"),
                       _linear(ffn.fc_out, f"{where}'s fc_out"))
        if any((lin.weight is None) != int8 for lin in (lp.qkv, lp.out, lp.ffn_in,
                                                         lp.ffn_out)):
            raise Unplannable(f"{where} is {'not ' if int8 else ''}int8 unlike the decoder")
        layers.append(lp)
    pos_table, bias = _positions(model, c, model.src_embed.weight.dtype, "src")
    emb_norm, final = model.src_embed_norm, model.encoder_norm
    return EncoderPlan(
        layers=tuple(layers), heads=heads, head_dim=head_dim, attention_scale=scale,
        activation=activation, gated=c.activation in GATED_ACTIVATIONS,
        norm_first=c.norm_first, embed=model.src_embed.weight, embed_scale=embedding_scale(c),
        pos_table=pos_table, position_offset=c.position_offset, bias=bias,
        embed_norm=None if emb_norm is None else _norm(emb_norm, c.norm, "src_embed_norm"),
        norm=None if final is None else _norm(final, c.norm, "encoder_norm"), pad_id=c.pad_id)


def seq2seq_plan(model: object) -> Seq2SeqPlan:
    """The plan of ``model``: a ``qkv.models.Transformer`` whose decoder is of plain parts
    (``DecoderLayer``s of fused-projection ``MultiHeadAttention``s on sdpa/auto, a
    ``FeedForward`` or gated ``SwiGLU``, ``LayerNorm`` or ``RMSNorm``, every projection an
    ``nn.Linear``, or every one and the head a ``QuantizedLinear``), fp32/fp64 weights
    (``SEQ2SEQ_DTYPES``), sinusoidal / learned / T5 / ALiBi positions, no hook on a decoder
    module, no active dropout and no config field the plan does not know.

    Raises:
        Unplannable naming the first part that is not described (the model then decodes
        through its modules).
    """
    if type(model) is not Transformer:
        raise Unplannable(f"a {type(model).__name__}, not a qkv.models.Transformer")
    c = model.config
    for f in dataclasses.fields(TransformerConfig):
        if f.name not in _KNOWN and getattr(c, f.name) != f.default:
            raise Unplannable(f"config.{f.name}={getattr(c, f.name)!r} (no plan for it)")
    hooked = next((name for name, m in _modules(model, _DECODER) if has_hooks(m)), None)
    if hooked is not None:  # a plan calls no decoder module: the hook would not run
        raise Unplannable(f"{hooked} has hooks (forward hooks run only on the module path)")
    if model.training and (c.dropout or c.attn_dropout or c.ffn_dropout):
        raise Unplannable("dropout is active (model.training with dropout > 0)")
    dtype = model.tgt_embed.weight.dtype
    if dtype not in SEQ2SEQ_DTYPES:
        raise Unplannable(f"{dtype} weights (the encoder-decoder plan decodes fp32 and fp64; "
                          f"int8 via qkv.quantize)")
    activation = planned_activation(c.activation)
    first = model.decoder_layers[0].self_attn
    heads, head_dim = first.num_heads, first.head_dim
    scale = 1.0 / math.sqrt(head_dim) if first.scale is None else first.scale
    layers = tuple(_layer(layer, i, c, heads, head_dim, scale)
                   for i, layer in enumerate(model.decoder_layers))
    head = _linear(model.lm_head, "lm_head")
    lins = [lin for lp in layers for lin in (lp.qkv, lp.out, lp.cross_q, lp.cross_kv,
                                               lp.cross_out, lp.ffn_in, lp.ffn_out)]
    kinds = {lin.weight is None for lin in (*lins, head)}
    if len(kinds) > 1:
        raise Unplannable("some projections are int8 and some are not (quantize all or none)")
    pos_table, self_bias = _positions(model, c, dtype)
    embed_norm, final = model.tgt_embed_norm, model.decoder_norm
    try:
        encoder, why_no_encoder = _encoder_plan(model, c, heads, head_dim, scale, activation,
                                                kinds == {True}), None
    except Unplannable as e:
        encoder, why_no_encoder = None, str(e)
    return Seq2SeqPlan(
        model=model, layers=layers, heads=heads, head_dim=head_dim, width=c.dim,
        ffn=layers[0].ffn_out.shape[1], vocab=c.tgt_vocab_size, activation=activation,
        gated=c.activation in GATED_ACTIVATIONS, norm_kind=c.norm, norm_first=c.norm_first,
        attention_scale=scale, embed=model.tgt_embed.weight,
        embed_scale=embedding_scale(c), pos_table=pos_table,
        position_offset=c.position_offset, self_bias=self_bias,
        embed_norm=None if embed_norm is None else _norm(embed_norm, c.norm, "tgt_embed_norm"),
        norm=None if final is None else _norm(final, c.norm, "decoder_norm"), head=head,
        head_scale=float(c.head_scale), int8=kinds == {True}, dtype=dtype,
        device=model.tgt_embed.weight.device, encoder=encoder, why_no_encoder=why_no_encoder)
