"""HuggingFace GPT-2 checkpoints -> ``qkv.models.gpt.GPT``: the ``GPT2`` mapping
(``hf_load.HFMapping``): config fields, key map and the state conversion.

Shapes: V vocab size, C model width, F feed-forward width, P positions (n_positions),
L layers.

HF GPT-2 keeps its linear layers as ``Conv1D`` with weights stored (in, out); qkv's
``nn.Linear`` stores (out, in), so every Conv1D weight is transposed. ``c_attn`` is the fused
query/key/value projection with output columns ordered q, k, v — the row order of qkv's
``in_proj``. Keys may carry the ``transformer.`` prefix (``GPT2LMHeadModel``) or not
(``GPT2Model``); ``lm_head.weight`` is tied to ``wte`` (and usually absent from the file).
The non-persistent causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` of old
checkpoints are ignored. Anything else that does not map is reported (in qkv's names, by
``check_and_load``), never dropped. This module reads ``GPTConfig`` (``gpt_config``), never
the model.
"""

from __future__ import annotations

import re
from typing import Any

from torch import Tensor

from ..files import CheckpointError
from .gpt_config import GPTConfig
from .hf_config import GPT2_FIELDS, HF_ACTIVATIONS, audit_hf_config
from .hf_load import HFMapping, make_config
from .hf_state import KeyMap, layer_field, rename_hf_state
from .weights import check_tied_head

__all__ = ["GPT2", "LAYER_KEY", "config_fields", "config_from_hf", "convert_hf_state_dict",
           "gpt2_key_map", "is_conv1d_weight"]

#: the layer index in the names of HF GPT-2's block tensors (n_layer counts them)
LAYER_KEY = r"(?:transformer\.)?h\.(\d+)\."

# HF layer suffix -> (qkv suffix, is a Conv1D weight to transpose)
_LAYER_MAP = {
    "ln_1.weight": ("norm1.weight", False), "ln_1.bias": ("norm1.bias", False),
    "ln_2.weight": ("norm2.weight", False), "ln_2.bias": ("norm2.bias", False),
    "attn.c_attn.weight": ("attn.in_proj.weight", True),
    "attn.c_attn.bias": ("attn.in_proj.bias", False),
    "attn.c_proj.weight": ("attn.out_proj.weight", True),
    "attn.c_proj.bias": ("attn.out_proj.bias", False),
    "mlp.c_fc.weight": ("ffn.fc_in.weight", True), "mlp.c_fc.bias": ("ffn.fc_in.bias", False),
    "mlp.c_proj.weight": ("ffn.fc_out.weight", True),
    "mlp.c_proj.bias": ("ffn.fc_out.bias", False),
}
_TOP_MAP = {"wte.weight": "embed.weight", "wpe.weight": "positions.weight",
            "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}
_LAYER_KEY = re.compile(r"h\.(\d+)\.(.+)")


def is_conv1d_weight(key: str) -> bool:
    """Whether an HF GPT-2 key (with or without "transformer.") names a ``Conv1D`` weight,
    stored (in, out) where qkv's ``nn.Linear`` holds (out, in)."""
    m = _LAYER_KEY.fullmatch(key.removeprefix("transformer."))
    return bool(m and m.group(2) in _LAYER_MAP and _LAYER_MAP[m.group(2)][1])
_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


#: transformers' GPT2Config.attribute_map: alias -> canonical field
_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
            "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
#: GPT2Config's defaults for the fields a config.json may leave out
_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
             "resid_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
             "tie_word_embeddings": True}


def config_fields(data: dict[str, Any], source: str = "HF GPT-2 config") -> dict[str, Any]:
    """``GPTConfig`` fields from the dict of an HF GPT-2 config.json (model_type "gpt2").

    Every field is classified in ``qkv.models.hf_config.GPT2_FIELDS`` (``audit_hf_config``):
    maps n_embd, n_layer, n_head, n_positions (or their aliases hidden_size,
    num_hidden_layers, num_attention_heads, max_position_embeddings), vocab_size, n_inner
    (None: 4·C), layer_norm_epsilon, activation_function ("gelu_new" -> "gelu_tanh"),
    resid_pdrop (-> dropout), attn_pdrop, tie_word_embeddings; a field left out takes
    GPT2Config's default. Raises ``CheckpointError`` naming each option qkv's model does not
    compute (cross-attention, unscaled or per-layer-scaled attention, an unknown
    activation...); warns for fields it does not know.
    """
    if data.get("model_type") != "gpt2":
        raise CheckpointError(f"{source}: not an HF GPT-2 config: model_type "
                              f"{data.get('model_type')!r} (expected 'gpt2')")
    audit_hf_config(data, GPT2_FIELDS, source)
    hf = dict(data)
    for alias, name in _ALIASES.items():
        if alias in hf:
            if name in hf and hf[name] != hf[alias]:
                raise CheckpointError(f"{source}: {alias}={hf[alias]!r} and {name}="
                                      f"{hf[name]!r} disagree (transformers reads them as "
                                      f"one field)")
            hf[name] = hf.pop(alias)
    hf = {**_DEFAULTS, **hf}
    try:
        return dict(
            vocab_size=hf["vocab_size"], max_len=hf["n_positions"], dim=hf["n_embd"],
            num_layers=hf["n_layer"], num_heads=hf["n_head"], ffn_hidden=hf["n_inner"],
            activation=HF_ACTIVATIONS[hf["activation_function"]],
            norm_eps=float(hf["layer_norm_epsilon"]), positions="learned",
            dropout=float(hf["resid_pdrop"]), attn_dropout=float(hf["attn_pdrop"]),
            bias=True, tie_embeddings=bool(hf["tie_word_embeddings"]))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: not a valid GPT-2 config: {err}") from err


def config_from_hf(data: dict[str, Any], source: str = "HF GPT-2 config",
                   config_class: type = GPTConfig) -> Any:
    """A ``config_class`` (``GPTConfig``) from the dict of an HF GPT-2 config.json: the
    fields of ``config_fields`` (which lists what is read, refused and warned about).
    Raises ``CheckpointError`` for a config qkv cannot read or an invalid one."""
    return make_config(config_class, config_fields(data, source), source, "GPT-2")


def gpt2_key_map(config: Any) -> KeyMap:
    """qkv ``GPT`` keys -> HF GPT-2 keys (without "transformer."); with tied embeddings
    ``lm_head.weight`` reads ``wte.weight``."""
    m: KeyMap = {ours: theirs for theirs, ours in _TOP_MAP.items()}
    for i in range(config.num_layers):
        for theirs, (ours, _) in _LAYER_MAP.items():
            m[f"layers.{i}.{ours}"] = f"h.{i}.{theirs}"
    m["lm_head.weight"] = "wte.weight" if config.tie_embeddings else "lm_head.weight"
    return m


def _normalise(state: dict[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """HF names without "transformer.", the causal-mask buffers dropped, Conv1D weights
    transposed to (out, in) (views, no copy); with ``tied`` an ``lm_head.weight`` equal to
    ``wte.weight`` is dropped (one that differs is refused)."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        k = key.removeprefix("transformer.")
        if _IGNORED.fullmatch(k):
            continue
        if k == "lm_head.weight" and tied:
            check_tied_head(state, t, "wte.weight", "transformer.", "HF GPT-2 checkpoint")
            continue
        if is_conv1d_weight(k) and t.dim() == 2:
            t = t.t()  # Conv1D (in, out) -> Linear (out, in)
        out[k] = t
    return out


def convert_hf_state_dict(state: dict[str, Tensor], config: Any) -> dict[str, Tensor]:
    """HF GPT-2 tensors (``GPT2LMHeadModel`` or ``GPT2Model`` keys) -> qkv ``GPT`` keys (the
    ``GPT2`` mapping's normalisation and key map, unchecked).

    Conv1D weights (in, out) are transposed to (out, in) (views, no copy). Keys that do not
    map keep their name, so ``check_and_load`` reports them as unexpected; with tied
    embeddings ``lm_head.weight`` is dropped (it is ``wte``) and re-added as the tied key.

    Raises:
        CheckpointError when the config ties the embeddings but the file holds an
        ``lm_head.weight`` that differs from ``wte.weight`` (transformers 5 then keeps the
        two apart; qkv would silently use ``wte``).
    """
    return rename_hf_state(None, gpt2_key_map(config),
                           _normalise(state, bool(config.tie_embeddings)))


def _layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
    return [(layer_field(hf, "n_layer", "num_hidden_layers"), fields["num_layers"], LAYER_KEY)]


def _normalise_hf(state: dict[str, Tensor], hf: dict[str, Any], source: str):
    return _normalise(state, bool(hf.get("tie_word_embeddings",
                                         _DEFAULTS["tie_word_embeddings"])))


#: HF GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``) -> ``GPT``; errors name qkv's keys
GPT2 = HFMapping(model_type="gpt2", name="GPT-2", config_fields=config_fields,
                 layer_counts=_layer_counts, key_map=gpt2_key_map, normalise=_normalise_hf,
                 map_state=rename_hf_state)
