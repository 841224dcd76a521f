"""The decode plan: what one decoding step of a model computes, as named per-layer weight
records, derived from the model's modules and config in one place (``decode_plan``).

Shapes: C width, H heads, Hkv key/value heads, D head dim, P = (H + 2·Hkv)·D the fused
q/k/v width, F feed-forward width (a gated FFN's input projection is 2F wide: gate, up),
V vocab size.

A plan describes a pre-norm decoder (``qkv.models.GPT``): per layer a norm, the fused q/k/v
projection and its split, the output projection, a norm, the feed-forward in (and gate),
its activation, the feed-forward out; then the token embedding with learned positions or
RoPE, the final norm and the LM head. It holds the model's live parameters (no copies):
the backends (``qkv.generation.backends``) make whatever transposed, packed or rounded copy
they need when a stepper is built, i.e. once per ``generate`` call, from the weights as they
are then, and drop it with the stepper. No copy outlives the call an in-place edit could
leave stale (an edit through ``.data`` or numpy bumps no version counter), so none is
checked for staleness.

A model the plan cannot describe is refused with the reason (``Unplannable``): the engine
then decodes it on the generic module path, which calls the modules (and their hooks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models.gpt import GPT, GPTConfig
from ..modules.activations import ACTIVATION_TABLE
from ..modules.attention import MultiHeadAttention
from ..modules.feedforward import GATED_ACTIVATIONS, FeedForward, SwiGLU
from ..modules.layers import EncoderLayer
from ..modules.linear_call import has_hooks
from ..modules.norms import LayerNorm, RMSNorm
from ..modules.positions import RoPE
from ..modules.quantized import QuantizedLinear, scale127

__all__ = ["PLAN_DTYPES", "DecodePlan", "LayerPlan", "LinearPlan", "NormPlan", "Unplannable",
           "apply_norm", "decode_plan", "plan_check", "planned_activation"]

# GPTConfig fields a plan describes (any value); another field with a non-default value
# (a variant added later) is refused, so the model decodes on the module path
_KNOWN = {"vocab_size", "max_len", "dim", "num_layers", "num_heads", "num_kv_heads",
          "ffn_hidden", "activation", "norm", "norm_eps", "positions", "dropout",
          "attn_dropout", "bias", "tie_embeddings", "attention_head_dim", "rope_base",
          "rope_scaling", "qkv_bias", "out_bias", "ffn_bias", "qk_norm", "embed_scale"}
# the window fields, planned only for caches no longer than the window (``decode_plan``)
_WINDOW = {"attention_window", "windowed_layers"}


PLAN_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
"""The weight dtypes a plan describes (int8 projections keep fp32 embeddings)."""


class Unplannable(ValueError):
    """The model has a part no decode plan describes; the message says which."""


@dataclass(frozen=True)
class NormPlan:
    """One norm: ``kind`` "layernorm" ((x - mean)/sqrt(var + eps)·w + b), "rmsnorm"
    (x/sqrt(mean(x²) + eps)·w) or "rmsnorm_plus_one" (x/sqrt(mean(x²) + eps)·(1 + w),
    Gemma); ``weight`` (C,) or None, ``bias`` (C,) or None."""

    kind: str
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., C) -> (..., C) in x's dtype (bf16 accumulates in fp32, as the modules)."""
        return apply_norm(x, self.weight, self.bias, self.kind, self.eps)


def apply_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str, eps: float
               ) -> Tensor:
    """``kind`` "layernorm", "rmsnorm" or "rmsnorm_plus_one" (``NormPlan``) of x (..., C)
    with weight/bias (C,) or None -> (..., C) (RMSNorm has no bias; the plus-one form is
    computed in at least fp32, as ``qkv.modules.norms.RMSNorm``)."""
    if kind == "layernorm":
        return torch.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if kind == "rmsnorm_plus_one":
        compute = torch.promote_types(x.dtype, torch.float32)
        y = torch.rms_norm(x.to(compute), (x.shape[-1],), None, eps)
        return (y * (1.0 + weight.to(compute))).to(x.dtype)
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass(frozen=True)
class LinearPlan:
    """One projection y = x Wᵀ + b. ``weight`` (out, in) is the live floating-point weight,
    or None for an int8 layer, whose ``weight_int8`` (out, in) and ``scale127`` (out,) (the
    per-channel scale / 127) are set instead; ``bias`` (out,) or None."""

    weight: Tensor | None
    bias: Tensor | None
    weight_int8: Tensor | None = None
    scale127: Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)."""
        w = self.weight if self.weight is not None else self.weight_int8
        return tuple(w.shape)


@dataclass(frozen=True)
class LayerPlan:
    """One pre-norm layer: x += out(attn(split(qkv(norm1(x))))); x += ffn_out(act(ffn_in(
    norm2(x)))) — with ``gated``, ffn_in is 2F wide and act(gate)·up feeds ffn_out;
    ``q_norm`` / ``k_norm`` (Qwen3's per-head RMSNorms over D, before RoPE) or None."""

    norm1: NormPlan
    qkv: LinearPlan
    out: LinearPlan
    norm2: NormPlan
    ffn_in: LinearPlan
    ffn_out: LinearPlan
    q_norm: NormPlan | None = None
    k_norm: NormPlan | None = None


@dataclass(frozen=True)
class DecodePlan:
    """A decoder as decode steps see it.

    Attributes:
        model: the model the plan was derived from (prefill runs its modules).
        layers: one ``LayerPlan`` per layer.
        heads, kv_heads, head_dim: H, Hkv, D; the q/k/v split is (H·D, Hkv·D, Hkv·D).
        width, ffn, vocab: C, F, V.
        activation: the name in ``qkv.modules.activations.ACTIVATION_TABLE``.
        gated: the FFN is act(gate)·up (SwiGLU: activation "silu").
        norm_kind: "layernorm" or "rmsnorm" (every norm of the model).
        embed: (V, C) token embedding.
        pos_table: (max_len, C) learned positions, or None.
        rope: the ``RoPE`` of the attention, or None.
        embed_scale: the factor of the token embeddings (Gemma's √C rounded to the dtype),
            or None.
        qk_norm: the layers norm each query and key head (``LayerPlan.q_norm``).
        norm: the final norm.
        head: the LM head (V, C).
        int8: every projection and the head are int8 (``qkv.quantize``).
        dtype, device: of the embedding (the activations' dtype).
    """

    model: GPT
    layers: tuple[LayerPlan, ...]
    heads: int
    kv_heads: int
    head_dim: int
    width: int
    ffn: int
    vocab: int
    activation: str
    gated: bool
    norm_kind: str
    embed: Tensor
    pos_table: Tensor | None
    rope: RoPE | None
    norm: NormPlan
    head: LinearPlan
    int8: bool
    dtype: torch.dtype
    device: torch.device
    embed_scale: float | None = None
    qk_norm: bool = False

    @property
    def group(self) -> int:
        """g = H / Hkv query heads per key/value head."""
        return self.heads // self.kv_heads

    def linears(self) -> list[LinearPlan]:
        """Every projection in the order backends keep them: qkv, out, ffn_in, ffn_out per
        layer, then the head (4·L + 1)."""
        return [lin for lp in self.layers
                for lin in (lp.qkv, lp.out, lp.ffn_in, lp.ffn_out)] + [self.head]


def _norm(m: nn.Module, kind: str, where: str) -> NormPlan:
    want = LayerNorm if kind == "layernorm" else RMSNorm
    if type(m) is not want or getattr(m, "unit_offset", False) != (kind == "rmsnorm_plus_one"):
        raise Unplannable(f"{where} is a {type(m).__name__}, not the config's {kind}")
    return NormPlan(kind, m.weight, getattr(m, "bias", None), float(m.eps))


def _linear(m: nn.Module, where: str) -> LinearPlan:
    if type(m) is nn.Linear:
        return LinearPlan(m.weight, m.bias)
    if type(m) is QuantizedLinear:
        return LinearPlan(None, m.bias, m.weight_int8, scale127(m.weight_scale))
    # an unmerged qkv.peft LoRA wrapper (or any other module) computes more than a weight
    raise Unplannable(f"{where} is a {type(m).__name__}, not an nn.Linear or QuantizedLinear")


def _layer(layer: nn.Module, i: int, c: GPTConfig, rope: RoPE | None) -> LayerPlan:
    where = f"layer {i}"
    if type(layer) is not EncoderLayer or not layer.norm_first:
        raise Unplannable(f"{where} is not a pre-norm EncoderLayer")
    attn, ffn = layer.attn, layer.ffn
    if type(attn) is not MultiHeadAttention or attn.in_proj is None:
        raise Unplannable(f"{where}'s attention is a {type(attn).__name__} without one fused "
                          f"q/k/v projection")
    if attn.backend not in ("auto", "sdpa"):
        raise Unplannable(f"{where}'s attention runs on backend {attn.backend!r} "
                          f"(the plan computes exact softmax attention: 'auto'/'sdpa')")
    if attn.rope is not rope:
        raise Unplannable(f"{where}'s RoPE is not the model's")
    want_ffn = SwiGLU if c.activation in GATED_ACTIVATIONS else FeedForward
    if type(ffn) is not want_ffn:
        raise Unplannable(f"{where}'s feed-forward is a {type(ffn).__name__}, not a "
                          f"{want_ffn.__name__}")
    qk = None if attn.q_norm is None else (
        _norm(attn.q_norm, "rmsnorm", f"{where}'s q_norm"),
        _norm(attn.k_norm, "rmsnorm", f"{where}'s k_norm"))
    return LayerPlan(_norm(layer.norm1, c.norm, f"{where}'s norm1"),
                     _linear(attn.in_proj, f"{where}'s in_proj"),
                     _linear(attn.out_proj, f"{where}'s out_proj"),
                     _norm(layer.norm2, c.norm, f"{where}'s norm2"),
                     _linear(ffn.fc_in, f"{where}'s fc_in"),
                     _linear(ffn.fc_out, f"{where}'s fc_out"),
                     *(qk or (None, None)))


def decode_plan(model: object, capacity: int | None = None) -> DecodePlan:
    """The plan of ``model``: a ``qkv.models.GPT`` of plain parts (pre-norm ``EncoderLayer``s
    with a fused-QKV ``MultiHeadAttention`` on sdpa/auto, ``FeedForward`` or ``SwiGLU``,
    ``LayerNorm`` or ``RMSNorm``, every projection an ``nn.Linear``, or every one and the head
    a ``QuantizedLinear``), fp32/fp64/bf16 embeddings (``PLAN_DTYPES``), no hooks, no active
    dropout and no config variant the plan does not know. A sliding window
    (``attention_window``, ``windowed_layers``) is planned when ``capacity`` (the positions
    the caches will hold) is at most the window: no key then ever leaves a query's window,
    and the model computes full causal attention.

    Raises:
        Unplannable naming the first part that is not described (the model decodes on the
        module path instead).
    """
    if type(model) is not GPT:
        raise Unplannable(f"a {type(model).__name__}, not a qkv.models.GPT")
    hooked = next((name or "the model" for name, m in model.named_modules() if has_hooks(m)),
                  None)
    if hooked is not None:  # a plan calls no module: the hook would silently not run
        raise Unplannable(f"{hooked} has hooks (forward hooks run only on the module path)")
    c = model.config
    covered = capacity is not None and c.attention_window is not None \
        and capacity <= c.attention_window  # no key ever leaves a window: full causal
    for f in dataclasses.fields(GPTConfig):
        if f.name in _WINDOW and covered:
            continue
        if f.name not in _KNOWN and getattr(c, f.name) != f.default:
            why = (f" beyond a capacity of {capacity}" if f.name in _WINDOW
                   and capacity is not None else "")
            raise Unplannable(f"config.{f.name}={getattr(c, f.name)!r} (no plan for it"
                              f"{why})")
    if model.training and (c.dropout or c.attn_dropout):
        raise Unplannable("dropout is active (model.training with dropout > 0)")
    dtype = model.embed.weight.dtype
    if dtype not in PLAN_DTYPES:
        raise Unplannable(f"{dtype} weights (plans decode fp32, fp64 and bf16; int8 via "
                          f"qkv.quantize)")
    activation = planned_activation(c.activation)
    layers = tuple(_layer(layer, i, c, model.rope) for i, layer in enumerate(model.layers))
    head = _linear(model.lm_head, "lm_head")
    linears = [lin for lp in layers for lin in (lp.qkv, lp.out, lp.ffn_in, lp.ffn_out)]
    kinds = {lin.weight is None for lin in (*linears, head)}
    if len(kinds) > 1:
        raise Unplannable("some projections are int8 and some are not (quantize all or none)")
    ffn = layers[0].ffn_out.shape[1]
    return DecodePlan(
        model=model, layers=layers, heads=c.num_heads, kv_heads=c.num_kv_heads or c.num_heads,
        head_dim=c.head_dim, width=c.dim, ffn=ffn, vocab=c.vocab_size, activation=activation,
        gated=c.activation in GATED_ACTIVATIONS, norm_kind=c.norm, embed=model.embed.weight,
        pos_table=None if model.positions is None else model.positions.weight,
        rope=model.rope, norm=_norm(model.norm, c.norm, "the final norm"), head=head,
        int8=kinds == {True}, dtype=dtype, device=model.embed.weight.device,
        embed_scale=(torch.tensor(c.dim ** 0.5, dtype=dtype).item() if c.embed_scale
                     else None), qk_norm=c.qk_norm)


def plan_check(plan: object, dtype: torch.dtype, device: torch.device, *,
               int8: bool) -> str | None:
    """The reason a plan (a ``DecodePlan`` or a ``Seq2SeqPlan``: anything with ``int8``,
    ``dtype`` and ``device``) does not fit a backend of this weight form, or None."""
    if plan is None:
        return "the model has no decode plan"
    if plan.int8 != int8:
        return "the weights are not int8" if int8 else "the weights are int8"
    if dtype != plan.dtype:
        return f"activations in {dtype}, the plan's are {plan.dtype}"
    if device != plan.device:
        return f"device {device}, the weights are on {plan.device}"
    return None


def planned_activation(name: str) -> str:
    """The activation a plan applies for a config's ``activation``: a gated FFN's gate
    activation ("swiglu" -> "silu"), else the name itself.

    Raises:
        Unplannable: a name the activation table (``qkv.modules.activations``) lacks."""
    activation = GATED_ACTIVATIONS.get(name, name)
    if activation not in ACTIVATION_TABLE:
        raise Unplannable(f"activation {name!r} is not in the activation table")
    return activation
