"""What the Llama-style HuggingFace decoders share (Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3),
mapped onto ``qkv.models.gpt.GPT``: the config fields every one of them has, their audit
table, the key map and the state normalisation. Each family's own file (``hf_llama``,
``hf_gemma``, ``hf_phi3``) adds only what differs, through a ``Family``.

Shapes: V vocab size, C model width (hidden_size), H heads, Hkv kv heads, D head dim, F FFN
width (intermediate_size), L layers. HF keeps q/k/v as separate (H·D, C), (Hkv·D, C),
(Hkv·D, C) projections (Phi-3: one fused ``qkv_proj``, rows q, k, v) and the gated FFN as
``gate_proj`` / ``up_proj`` (F, C) (Phi-3: ``gate_up_proj`` (2F, C), rows gate, up);
qkv fuses them into ``in_proj`` ((H + 2·Hkv)·D, C) and ``fc_in`` (2F, C) in the same row
order, so no weight is transposed or permuted (RoPE is HF's ``rotate_half`` pairing, qkv's
default). This module reads ``GPTConfig`` (``gpt_config``), never the model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..files import CheckpointError
from ..modules.feedforward import GATED_ACTIVATIONS
from .hf_config import COMMON_FIELDS, HF_ACTIVATIONS, NORM_EPS_CHECK, Check, audit_hf_config, only
from .hf_load import HFMapping
from .hf_rope import rope_from_hf
from .hf_state import Fused, KeyMap, layer_field
from .weights import check_tied_head

__all__ = ["DECODER_FIELDS", "LAYER_KEY", "LAYER_TYPES_FIELD", "WINDOW_FIELD", "Family",
           "decoder_fields", "decoder_key_map", "decoder_mapping", "gated_activation",
           "windowed_layers"]

#: the layer index in the names of the decoder layers' tensors (num_hidden_layers counts them)
LAYER_KEY = r"(?:model\.)?layers\.(\d+)\."

#: qkv's gate activation -> its gated FFN (``GPTConfig.activation``): the inverse of
#: ``GATED_ACTIVATIONS``
_GATED = {act: gated for gated, act in GATED_ACTIVATIONS.items()}

_INIT = "ignored: initialisation only; the weights are loaded"
#: fields whose explicit null means "none" to transformers (not its default): no window,
#: no soft cap, D from the width
_NULL_MEANS_NONE = ("head_dim", "sliding_window", "attn_logit_softcapping",
                    "final_logit_softcapping")
_ROPE = "used (qkv.models.hf_rope.rope_from_hf: the base and the scaling)"


def gated_activation(name: Any, source: str, field: str = "hidden_act") -> str:
    """qkv's gated FFN (``GPTConfig.activation``) for an HF activation name.

    Raises:
        CheckpointError: an activation qkv does not compute exactly."""
    act = HF_ACTIVATIONS.get(name) if isinstance(name, str) else None
    if act not in _GATED:
        known = sorted(k for k, v in HF_ACTIVATIONS.items() if v in _GATED)
        raise CheckpointError(f"{source}: config.json {field}={name!r}: qkv computes gated "
                              f"FFNs of {known}")
    return _GATED[act]


def _activation_ok(value: Any, _data: dict[str, Any]) -> bool:
    return isinstance(value, str) and HF_ACTIVATIONS.get(value) in _GATED


def _window_ok(value: Any, _data: dict[str, Any]) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value > 0)


def _layer_types_ok(value: Any, _data: dict[str, Any]) -> bool:
    return value is None or (isinstance(value, list) and all(
        t in ("full_attention", "sliding_attention") for t in value))


#: ``sliding_window``: a positive int or null (used)
WINDOW_FIELD = Check(_window_ok, "a positive int or null", used=True)
#: transformers 5's ``layer_types`` (used: which layers attend in the window)
LAYER_TYPES_FIELD = Check(_layer_types_ok, "'full_attention' / 'sliding_attention' entries",
                          used=True)

#: the fields every Llama-style config has; a family adds its own (``Family.fields``)
DECODER_FIELDS: dict[str, str | Check] = {
    **COMMON_FIELDS,
    "vocab_size": "used", "hidden_size": "used", "intermediate_size": "used",
    "num_hidden_layers": "used", "num_attention_heads": "used",
    "num_key_value_heads": "used", "head_dim": "used", "max_position_embeddings": "used",
    "rms_norm_eps": NORM_EPS_CHECK, "tie_word_embeddings": "used",
    "hidden_act": Check(_activation_ok, f"a gated FFN of {sorted(_GATED)}", used=True),
    "rope_theta": _ROPE, "rope_scaling": _ROPE, "rope_parameters": _ROPE,
    "original_max_position_embeddings": _ROPE,
    "attention_dropout": "used",
    "initializer_range": _INIT,
    "use_cache": "ignored: a key/value cache never changes outputs",
    "pad_token_id": "ignored: HF only keeps that embedding row's gradient at zero; the "
                    "forward pass is the same",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One Llama-style HF family, as it differs from the shared mapping.

    Attributes:
        model_type: HF's config.json ``model_type`` ("llama").
        name: the family in messages ("Llama").
        fields: its audit-table entries beyond ``DECODER_FIELDS`` (a field may override).
        defaults: transformers' defaults for fields a config.json may leave out.
        extra: ``(hf config dict, source) -> GPTConfig fields`` that differ from the shared
            reading (biases, norms, windows, soft caps...).
        fused_qkv: HF holds one ``qkv_proj`` (Phi-3) rather than q/k/v projections.
        fused_gate_up: HF holds one ``gate_up_proj`` (Phi-3).
        sandwich_norms: Gemma 2's four norms per layer (``post_attention_layernorm`` is the
            attention output's norm; ``pre_feedforward_layernorm`` the FFN input's).
    """

    model_type: str
    name: str
    fields: dict[str, str | Check]
    defaults: dict[str, Any]
    extra: Callable[[dict[str, Any], str], dict[str, Any]]
    fused_qkv: bool = False
    fused_gate_up: bool = False
    sandwich_norms: bool = False

    def table(self) -> dict[str, str | Check]:
        """The whole audit table: ``DECODER_FIELDS``, this family's entries and its
        ``model_type`` check."""
        return {**DECODER_FIELDS, **self.fields,
                "model_type": only(self.model_type, why=f"the {self.name} mapping reads "
                                                        f"{self.model_type!r} checkpoints")}


def windowed_layers(hf: dict[str, Any], num_layers: int, source: str,
                    default: Callable[[int], bool]) -> tuple[int, ...] | None:
    """The layers that attend in the sliding window: from ``layer_types`` (transformers 5)
    when given, else ``default(i)`` (the family's rule); None when every layer does.

    Raises:
        CheckpointError: ``layer_types`` of another length than the layers."""
    types = hf.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise CheckpointError(f"{source}: config.json layer_types has {len(types)} "
                                  f"entries for num_hidden_layers={num_layers}")
        chosen = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        chosen = tuple(i for i in range(num_layers) if default(i))
    return None if len(chosen) == num_layers else chosen


def decoder_fields(family: Family, hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``GPTConfig`` fields from an HF config dict of ``family`` (audited first: a field
    qkv does not compute is refused, an unknown one warns).

    Raises:
        CheckpointError: a refused field, a bad value, an unknown rope type.
    """
    audit_hf_config(hf, family.table(), source)
    hf = {**family.defaults, **{k: v for k, v in hf.items() if v is not None
                                or k in _NULL_MEANS_NONE}}
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or (dim // heads))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: not a valid {family.name} config: {err!r}") from err
    base, scaling = rope_from_hf(hf, source, head_dim)  # CheckpointError in one line
    try:
        fields = dict(
            vocab_size=int(hf["vocab_size"]), max_len=int(hf["max_position_embeddings"]),
            dim=dim, num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=kv if kv != heads else None, ffn_hidden=int(hf["intermediate_size"]),
            activation=gated_activation(hf.get("hidden_act"), source),
            norm="rmsnorm", norm_eps=float(hf["rms_norm_eps"]), positions="rope",
            rope_base=float(base), rope_scaling=scaling, dropout=0.0,
            attn_dropout=float(hf.get("attention_dropout", 0.0)), bias=False,
            tie_embeddings=bool(hf["tie_word_embeddings"]),
            attention_head_dim=int(head_dim) if head_dim * heads != dim else None)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: not a valid {family.name} config: {err!r}") from err
    fields.update(family.extra(hf, source))
    return fields


def decoder_key_map(family: Family, config: Any) -> KeyMap:
    """qkv ``GPT`` keys -> HF keys (without "model."); q/k/v and gate/up as ``Fused`` row
    blocks (or Phi-3's fused tensors as they are); a tied head reads ``embed_tokens``."""
    c = config
    q, kv, f = c.num_heads * c.head_dim, (c.num_kv_heads or c.num_heads) * c.head_dim, \
        c.ffn_hidden or 4 * c.dim
    qkv_bias, out_bias, ffn_bias = c.biases()
    m: KeyMap = {"embed.weight": "embed_tokens.weight", "norm.weight": "norm.weight",
                 "lm_head.weight": "embed_tokens.weight" if c.tie_embeddings
                 else "lm_head.weight"}
    for i in range(c.num_layers):
        a, p, ours = f"layers.{i}.self_attn.", f"layers.{i}.mlp.", f"layers.{i}."
        m[ours + "norm1.weight"] = f"layers.{i}.input_layernorm.weight"
        if family.sandwich_norms:
            m[ours + "post_norm1.weight"] = f"layers.{i}.post_attention_layernorm.weight"
            m[ours + "norm2.weight"] = f"layers.{i}.pre_feedforward_layernorm.weight"
            m[ours + "post_norm2.weight"] = f"layers.{i}.post_feedforward_layernorm.weight"
        else:
            m[ours + "norm2.weight"] = f"layers.{i}.post_attention_layernorm.weight"
        for kind, on in (("weight", True), ("bias", qkv_bias)):
            if on:
                m[ours + f"attn.in_proj.{kind}"] = (
                    a + f"qkv_proj.{kind}" if family.fused_qkv else
                    Fused((a + f"q_proj.{kind}", a + f"k_proj.{kind}", a + f"v_proj.{kind}"),
                          (q, kv, kv)))
        m[ours + "attn.out_proj.weight"] = a + "o_proj.weight"
        if out_bias:
            m[ours + "attn.out_proj.bias"] = a + "o_proj.bias"
        if c.qk_norm:
            m[ours + "attn.q_norm.weight"] = a + "q_norm.weight"
            m[ours + "attn.k_norm.weight"] = a + "k_norm.weight"
        for kind, on in (("weight", True), ("bias", ffn_bias)):
            if on:
                m[ours + f"ffn.fc_in.{kind}"] = (
                    p + f"gate_up_proj.{kind}" if family.fused_gate_up else
                    Fused((p + f"gate_proj.{kind}", p + f"up_proj.{kind}"), (f, f)))
                m[ours + f"ffn.fc_out.{kind}"] = p + f"down_proj.{kind}"
    return m


_ROTARY = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq|rotary_emb\.inv_freq")


def _normalise(family: Family) -> Callable[..., dict[str, Tensor]]:
    def normalise(state: dict[str, Tensor], hf: dict[str, Any], source: str
                  ) -> dict[str, Tensor]:
        """HF names without "model."; old checkpoints' RoPE ``inv_freq`` buffers dropped
        (qkv computes the angles); with tied embeddings an ``lm_head.weight`` equal to
        ``embed_tokens.weight`` dropped, one that differs refused."""
        tied = bool(hf.get("tie_word_embeddings", family.defaults["tie_word_embeddings"]))
        out: dict[str, Tensor] = {}
        for key, t in state.items():
            k = key.removeprefix("model.")
            if _ROTARY.fullmatch(k):
                continue
            if k == "lm_head.weight" and tied:
                check_tied_head(state, t, "embed_tokens.weight", "model.", source)
                continue
            out[k] = t
        return out
    return normalise


def decoder_mapping(family: Family) -> HFMapping:
    """The ``HFMapping`` of one Llama-style family onto ``GPT`` (errors name HF's keys)."""
    def layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
        return [(layer_field(hf, "num_hidden_layers"), fields["num_layers"], LAYER_KEY)]

    return HFMapping(model_type=family.model_type, name=family.name,
                     config_fields=lambda hf, source: decoder_fields(family, hf, source),
                     layer_counts=layer_counts,
                     key_map=lambda config: decoder_key_map(family, config),
                     normalise=_normalise(family))

