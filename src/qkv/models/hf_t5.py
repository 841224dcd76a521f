"""HuggingFace T5 / T5 v1.1 / Flan-T5 checkpoints (config.json ``model_type`` "t5",
``T5ForConditionalGeneration``) -> ``qkv.models.Transformer``: the ``T5`` mapping, its audit
table ``T5_FIELDS`` and key map ``t5_key_map``. This module never imports the model.

Shapes: V vocab size, C model width (d_model), H heads, D head dim (d_kv; H·D may differ
from C: Flan-T5-small's 6 heads of 64 at C = 512), F FFN width (d_ff), R relative-position
buckets. HF keeps q/k/v as separate (H·D, C) projections (no biases anywhere), qkv fuses
them into ``in_proj`` (3·H·D, C), rows q, k, v; the gated FFN's ``wi_0`` (gate, through the
activation) and ``wi_1`` (up), each (F, C), become ``fc_in`` (2F, C), rows gate, up. Only
block 0 of each stack holds a ``relative_attention_bias`` (R, H): it is the stack's one
``T5Bias`` (bidirectional in the encoder, causal in the decoder; cross-attention has none).

What the config becomes (``TransformerConfig``): RMSNorm pre-norm layers with a final norm,
no biases, no embedding scale, one token table (``shared``), unscaled scores
(``attention_scale=1.0``: T5 folds 1/sqrt(D) into its initialisation), ``positions="t5"``.
The head: T5 v1.0 ties ``lm_head`` to ``shared`` and multiplies the decoder output by C^-0.5
(``head_scale``); v1.1 / Flan-T5 store a separate ``lm_head`` and do not scale. transformers
5 writes ``tie_word_embeddings: true`` for both and says which by ``scale_decoder_outputs``
(and keeps a stored ``lm_head.weight`` that differs from ``shared`` apart); 4.x configs say
it by ``tie_word_embeddings`` alone. So: the head is scaled by ``scale_decoder_outputs`` when
the config has it, else by ``tie_word_embeddings`` (default true); it is tied when the
checkpoint holds no ``lm_head.weight`` or one equal to ``shared``, separate otherwise.

``max_len``: T5 has no position table and its relative buckets bound no length; qkv's
``max_len`` (``n_positions`` of old configs, else 512) is only the default capacity of
``Transformer.new_cache``, not a limit on the source or target length.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..files import CheckpointError
from ..modules.feedforward import ACTIVATIONS, GATED_ACTIVATIONS
from .hf_config import COMMON_FIELDS, HF_ACTIVATIONS, NORM_EPS_CHECK, Check, audit_hf_config, only
from .hf_load import HFMapping
from .hf_state import KeyMap, layer_field
from .weights import same_values

__all__ = ["DECODER_LAYER_KEY", "ENCODER_LAYER_KEY", "T5", "T5_FIELDS", "t5_config_fields",
           "t5_ffn", "t5_key_map"]

#: the layer index in the names of the encoder's / decoder's blocks
ENCODER_LAYER_KEY = r"encoder\.block\.(\d+)\."
DECODER_LAYER_KEY = r"decoder\.block\.(\d+)\."

#: transformers' T5Config defaults for the fields a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
    "num_heads": 8, "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "pad_token_id": 0,
    "eos_token_id": 1}
#: transformers' T5Config.attribute_map: alias -> the field it sets
_ALIASES = {"hidden_size": "d_model", "num_attention_heads": "num_heads",
            "num_hidden_layers": "num_layers", "head_dim": "d_kv"}
#: qkv's gate activation -> its gated FFN (the inverse of ``GATED_ACTIVATIONS``)
_GATED = {act: gated for gated, act in GATED_ACTIVATIONS.items()}
_IGNORED_BIAS = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
_EMBED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _ffn_parts(hf: dict[str, Any]) -> tuple[Any, Any]:
    """(activation name, gated) as transformers reads them: derived from
    ``feed_forward_proj`` ("relu", "gated-gelu" -> gelu_new, "gated-silu"...), each
    overridden by an explicit ``dense_act_fn`` / ``is_gated_act``."""
    proj = hf.get("feed_forward_proj", _DEFAULTS["feed_forward_proj"])
    parts = proj.split("-") if isinstance(proj, str) else []
    if not (len(parts) == 1 or (len(parts) == 2 and parts[0] == "gated")):
        return None, None  # transformers refuses the format too
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    return hf.get("dense_act_fn", act), hf.get("is_gated_act", parts[0] == "gated")


def t5_ffn(hf: dict[str, Any]) -> str | None:
    """qkv's ``TransformerConfig.activation`` for the FFN an HF T5 config describes
    ("relu", "gelu", "geglu_tanh" for T5 v1.1's gated-gelu, "swiglu" for gated-silu...), or
    None when qkv does not compute it (gated-relu, quick_gelu, a malformed
    ``feed_forward_proj``)."""
    act, gated = _ffn_parts(hf)
    ours = HF_ACTIVATIONS.get(act) if isinstance(act, str) else None
    if not isinstance(gated, bool) or ours is None:
        return None
    if gated:
        return _GATED.get(ours)
    return ours if ours in ACTIVATIONS else None


def _ffn_ok(_value: Any, data: dict[str, Any]) -> bool:
    return t5_ffn(data) is not None


_PLAIN = sorted(k for k, v in HF_ACTIVATIONS.items() if v in ACTIVATIONS)
_GATES = sorted(k for k, v in HF_ACTIVATIONS.items() if v in _GATED)
#: one check on the three fields that name the FFN (a refusal lists each one set)
_FFN_CHECK = Check(_ffn_ok, f"the FFN of feed_forward_proj / dense_act_fn / is_gated_act: "
                            f"plain {_PLAIN} or gated {_GATES}", used=True)
_FFN_ALSO = Check(_ffn_ok, "with feed_forward_proj", used=True)
_INIT = "ignored: initialisation only; the weights are loaded"


def _token_id(value: Any, _data: dict[str, Any]) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= 0)


def _token_ids(value: Any, data: dict[str, Any]) -> bool:
    return _token_id(value, data) or (isinstance(value, list) and bool(value) and all(
        value is not None and _token_id(v, data) for v in value))


_ID = Check(_token_id, "a token id >= 0 or null (null: T5's default)", used=True)

#: every field of transformers' T5Config (5.x and 4.x, and the old names of Hub checkpoints)
T5_FIELDS: dict[str, str | Check] = {
    **COMMON_FIELDS,
    "model_type": only("t5", why="the T5 mapping reads 't5' checkpoints"),
    "vocab_size": "used", "d_model": "used", "d_kv": "used", "d_ff": "used",
    "num_layers": "used", "num_decoder_layers": "used", "num_heads": "used",
    **{alias: f"used: transformers' alias of {name}, read when {name} is absent"
       for alias, name in _ALIASES.items()},
    "relative_attention_num_buckets": "used", "relative_attention_max_distance": "used",
    "dropout_rate": "used: dropout and attention dropout (training only)",
    "layer_norm_epsilon": NORM_EPS_CHECK,
    "feed_forward_proj": _FFN_CHECK, "dense_act_fn": _FFN_ALSO, "is_gated_act": _FFN_ALSO,
    "tie_word_embeddings": "used: the head scale C^-0.5 (without scale_decoder_outputs); "
                           "false needs a stored lm_head.weight",
    "scale_decoder_outputs": only(True, False, why="a bool", used=True),
    "pad_token_id": _ID,
    "eos_token_id": Check(_token_ids, "a token id, a list of them (the first is eos_id; pass "
                                      "more to generate), or null", used=True),
    "decoder_start_token_id": Check(_token_id, "a token id >= 0 or null (null: "
                                               "pad_token_id)", used=True),
    "n_positions": "used: max_len, the default cache capacity (T5's relative positions "
                   "bound no length; transformers 5 does not read it)",
    "output_past": "ignored: the 4.x name of use_cache",
    "use_cache": "ignored: a key/value cache never changes outputs",
    "initializer_factor": _INIT,
    "is_decoder": "ignored: T5ForConditionalGeneration sets it per stack (encoder false, "
                  "decoder true)",
    "add_cross_attention": "ignored: T5's decoder blocks always cross-attend; T5Stack does "
                           "not read it",
}


def _int(hf: dict[str, Any], name: str, source: str) -> int:
    value = hf[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: config.json {name}={value!r} must be a positive int")
    return value


def t5_config_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``TransformerConfig`` fields (all but ``tie_output``, read from the weights) from the
    dict of an HF T5 config.json, audited with ``T5_FIELDS`` first (a refused option raises,
    an unknown field warns); a field left out takes T5Config's default.

    Raises:
        CheckpointError: a refused field or a value that does not fit (relative buckets that
            T5's formula cannot use, a non-positive size).
    """
    audit_hf_config(hf, T5_FIELDS, source)
    for alias, name in _ALIASES.items():
        if name not in hf and alias in hf:
            hf = {**hf, name: hf[alias]}
    hf = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    dim, heads, d_kv = (_int(hf, n, source) for n in ("d_model", "num_heads", "d_kv"))
    layers = _int(hf, "num_layers", source)
    buckets = _int(hf, "relative_attention_num_buckets", source)
    distance = _int(hf, "relative_attention_max_distance", source)
    if buckets < 4 or distance <= buckets // 2:
        raise CheckpointError(f"{source}: config.json relative_attention_num_buckets="
                              f"{buckets}, relative_attention_max_distance={distance}: T5's "
                              f"buckets need num_buckets >= 4 and max_distance > "
                              f"num_buckets // 2 (the decoder's exact range)")
    eos = hf["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos  # more stop ids: generate(eos_token_id=)
    pad = hf["pad_token_id"]
    scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    n_positions = hf.get("n_positions")
    return dict(
        src_vocab_size=_int(hf, "vocab_size", source),
        tgt_vocab_size=_int(hf, "vocab_size", source), dim=dim,
        num_encoder_layers=layers,
        num_decoder_layers=_int({"num_decoder_layers": layers, **hf}, "num_decoder_layers",
                                source),
        num_heads=heads, attention_head_dim=d_kv if d_kv * heads != dim else None,
        ffn_hidden=_int(hf, "d_ff", source), activation=t5_ffn(hf), norm="rmsnorm",
        norm_first=True, final_norm=True, norm_eps=float(hf["layer_norm_epsilon"]),
        dropout=float(hf["dropout_rate"]), attn_dropout=float(hf["dropout_rate"]),
        bias=False, scale_embeddings=False, share_embeddings=True, positions="t5",
        freeze_pad_row=False,  # HF's T5 embedding has no padding_idx: its decoder starts there
        relative_num_buckets=buckets, relative_max_distance=distance, attention_scale=1.0,
        head_scale=dim ** -0.5 if scaled else 1.0,
        max_len=n_positions if isinstance(n_positions, int) and n_positions > 0 else 512,
        pad_id=pad, eos_id=eos, bos_id=hf.get("decoder_start_token_id", pad))


def t5_key_map(config: Any) -> KeyMap:
    """Each state-dict key of a ``Transformer`` of ``config`` (a T5 one: rmsnorm, no biases,
    "t5" positions, shared embeddings) -> its HF ``T5ForConditionalGeneration`` key; q/k/v
    as a (q, k, v) triple of equal row blocks, a gated FFN's ``fc_in`` as (wi_0, wi_1); the
    head reads ``shared.weight`` when tied (``config.tie_output``)."""
    c = config
    m: KeyMap = {
        "src_embed.weight": "shared.weight", "tgt_embed.weight": "shared.weight",
        "lm_head.weight": "shared.weight" if c.tie_output else "lm_head.weight",
        "encoder_bias.embedding.weight":
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "decoder_bias.embedding.weight":
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder_norm.weight": "encoder.final_layer_norm.weight",
        "decoder_norm.weight": "decoder.final_layer_norm.weight"}
    gated = c.activation in GATED_ACTIVATIONS

    def attention(ours: str, theirs: str) -> None:
        m[ours + "in_proj.weight"] = tuple(f"{theirs}{n}.weight" for n in "qkv")  # rows q, k, v
        m[ours + "out_proj.weight"] = theirs + "o.weight"

    def ffn(ours: str, theirs: str) -> None:
        m[ours + "fc_in.weight"] = ((theirs + "wi_0.weight", theirs + "wi_1.weight") if gated
                                    else theirs + "wi.weight")  # gated: rows gate, up
        m[ours + "fc_out.weight"] = theirs + "wo.weight"

    for i in range(c.num_encoder_layers):
        q, h = f"encoder_layers.{i}.", f"encoder.block.{i}.layer."
        attention(q + "attn.", h + "0.SelfAttention.")
        m[q + "norm1.weight"] = h + "0.layer_norm.weight"
        ffn(q + "ffn.", h + "1.DenseReluDense.")
        m[q + "norm2.weight"] = h + "1.layer_norm.weight"
    for i in range(c.num_decoder_layers):
        q, h = f"decoder_layers.{i}.", f"decoder.block.{i}.layer."
        attention(q + "self_attn.", h + "0.SelfAttention.")
        m[q + "norm1.weight"] = h + "0.layer_norm.weight"
        attention(q + "cross_attn.", h + "1.EncDecAttention.")
        m[q + "norm2.weight"] = h + "1.layer_norm.weight"
        ffn(q + "ffn.", h + "2.DenseReluDense.")
        m[q + "norm3.weight"] = h + "2.layer_norm.weight"
    return m


def _normalise(state: dict[str, Tensor], hf: dict[str, Any], source: str
               ) -> dict[str, Tensor]:
    """The tied copies ``encoder/decoder.embed_tokens.weight`` checked equal to ``shared``
    and dropped (or one taken as ``shared`` when that is absent); the unused cross-attention
    ``relative_attention_bias`` of old checkpoints dropped (transformers ignores it); an
    ``lm_head.weight`` equal to ``shared`` dropped (the head is then tied).

    Raises:
        CheckpointError: embedding copies that differ from ``shared``; no ``lm_head.weight``
            with ``tie_word_embeddings=false``; a differing ``lm_head.weight`` with
            ``tie_word_embeddings=true`` in a config without ``scale_decoder_outputs``
            (transformers 4 ties it, ignoring the stored head; transformers 5 keeps it).
    """
    out = {k: t for k, t in state.items() if k != _IGNORED_BIAS}
    for key in _EMBED_COPIES:
        copy = out.pop(key, None)
        if copy is None:
            continue
        shared = out.setdefault("shared.weight", copy)
        if not same_values(shared, copy):
            raise CheckpointError(f"{source}: {key} differs from shared.weight; T5's stacks "
                                  f"read the one shared token table")
    tied = hf.get("tie_word_embeddings", True) is not False
    head, shared = out.get("lm_head.weight"), out.get("shared.weight")
    if head is None:
        if not tied:
            raise CheckpointError(f"{source}: config tie_word_embeddings=false but the "
                                  f"checkpoint has no lm_head.weight: the head is undefined")
    elif shared is not None and same_values(shared, head):
        del out["lm_head.weight"]
    elif tied and "scale_decoder_outputs" not in hf:
        raise CheckpointError(f"{source}: lm_head.weight differs from shared.weight but "
                              f"config tie_word_embeddings=true (transformers 4 would tie "
                              f"it, 5 keep it apart); set tie_word_embeddings to false "
                              f"(T5 v1.1 / Flan-T5, an unscaled head) or add "
                              f"scale_decoder_outputs to config.json")
    return out


def _heads(state: dict[str, Tensor]) -> dict[str, Any]:
    """The head is tied unless the (normalised) checkpoint keeps its own ``lm_head``."""
    return {"tie_output": "lm_head.weight" not in state}


def _layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
    enc = layer_field(hf, "num_layers", "num_hidden_layers")
    dec = ("num_decoder_layers" if hf.get("num_decoder_layers") is not None
           else f"num_decoder_layers (not set: {enc.split(' ')[0]})")
    return [(enc, fields["num_encoder_layers"], ENCODER_LAYER_KEY),
            (dec, fields["num_decoder_layers"], DECODER_LAYER_KEY)]


#: HF T5 / T5 v1.1 / Flan-T5 (``T5ForConditionalGeneration``) -> ``Transformer``
T5 = HFMapping(model_type="t5", name="T5", config_fields=t5_config_fields,
               layer_counts=_layer_counts, key_map=t5_key_map, normalise=_normalise,
               state_fields=_heads)
