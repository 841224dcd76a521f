"""HuggingFace GPT-2 checkpoints -> ``qkv.models.gpt.GPT``: config and weight conversion.

Shapes: V vocab size, C model width, F feed-forward width, P positions (n_positions),
L layers.

HF GPT-2 keeps its linear layers as ``Conv1D`` with weights stored (in, out); qkv's
``nn.Linear`` stores (out, in), so every Conv1D weight is transposed. ``c_attn`` is the fused
query/key/value projection with output columns ordered q, k, v — the row order of qkv's
``in_proj``. Keys may carry the ``transformer.`` prefix (``GPT2LMHeadModel``) or not
(``GPT2Model``); ``lm_head.weight`` is tied to ``wte`` (and usually absent from the file).
The non-persistent causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` of old
checkpoints are ignored. Anything else that does not map is reported, never dropped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from .hub import CheckpointError, check_and_load, load_state_dict_file, read_json

__all__ = ["config_from_hf", "convert_hf_state_dict", "load_hf_gpt2"]

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu", "silu": "silu",
                "swish": "silu"}

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
_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def config_from_hf(data: dict[str, Any]):
    """A ``GPTConfig`` from the dict of an HF GPT-2 config.json (model_type "gpt2").

    Maps n_embd, n_layer, n_head, n_positions, vocab_size, n_inner (None: 4·C),
    layer_norm_epsilon, activation_function ("gelu_new" -> "gelu_tanh"), resid_pdrop
    (-> dropout), attn_pdrop, tie_word_embeddings. Refuses (CheckpointError) options qkv's
    model does not compute: cross-attention, unscaled or per-layer-scaled attention.
    """
    from .gpt import GPTConfig

    if data.get("model_type") != "gpt2":
        raise CheckpointError(f"not an HF GPT-2 config: model_type {data.get('model_type')!r} "
                              f"(expected 'gpt2')")
    act = data.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"HF GPT-2 config: activation_function {act!r} is not supported "
                              f"(known: {sorted(_ACTIVATIONS)})")
    if data.get("add_cross_attention", False):
        raise CheckpointError("HF GPT-2 config: add_cross_attention=True is not supported")
    if not data.get("scale_attn_weights", True):
        raise CheckpointError("HF GPT-2 config: scale_attn_weights=False is not supported")
    if data.get("scale_attn_by_inverse_layer_idx", False):
        raise CheckpointError("HF GPT-2 config: scale_attn_by_inverse_layer_idx=True is not "
                              "supported")
    try:
        return GPTConfig(
            vocab_size=data["vocab_size"], max_len=data["n_positions"], dim=data["n_embd"],
            num_layers=data["n_layer"], num_heads=data["n_head"],
            ffn_hidden=data.get("n_inner"), activation=_ACTIVATIONS[act],
            norm_eps=float(data.get("layer_norm_epsilon", 1e-5)), positions="learned",
            dropout=float(data.get("resid_pdrop", 0.0)),
            attn_dropout=float(data.get("attn_pdrop", 0.0)), bias=True,
            tie_embeddings=bool(data.get("tie_word_embeddings", True)))
    except KeyError as err:
        raise CheckpointError(f"HF GPT-2 config: missing field {err}") from err
    except ValueError as err:
        raise CheckpointError(f"HF GPT-2 config: {err}") from err


def convert_hf_state_dict(state: dict[str, Tensor], config) -> dict[str, Tensor]:
    """HF GPT-2 tensors (``GPT2LMHeadModel`` or ``GPT2Model`` keys) -> qkv ``GPT`` keys.

    Conv1D weights (in, out) are transposed to (out, in) (views, no copy). Keys that do not
    map keep their name, so ``check_and_load`` reports them as unexpected; with tied
    embeddings ``lm_head.weight`` is dropped (it is ``wte``) and re-added as the tied key.
    """
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        k = key.removeprefix("transformer.")
        if _IGNORED.fullmatch(k):
            continue
        if k == "lm_head.weight":
            if not config.tie_embeddings:
                out["lm_head.weight"] = t
            continue
        if k in _TOP_MAP:
            out[_TOP_MAP[k]] = t
            continue
        m = _LAYER_KEY.fullmatch(k)
        if m and m.group(2) in _LAYER_MAP:
            name, transpose = _LAYER_MAP[m.group(2)]
            out[f"layers.{m.group(1)}.{name}"] = t.t() if transpose and t.dim() == 2 else t
            continue
        out[key] = t  # unknown: reported by check_and_load
    if config.tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def load_hf_gpt2(cls, directory: Path, *, allow_pickle: bool = False, **kwargs: Any):
    """``cls.from_hf``: read config.json and the weights of an HF GPT-2 directory, convert,
    check every key and shape (``CheckpointError``, nothing loaded half-way); eval mode."""
    directory = Path(directory)
    config = config_from_hf(read_json(directory / "config.json"))
    state = load_state_dict_file(directory, allow_pickle=allow_pickle)
    model = cls(config, **kwargs)
    converted = convert_hf_state_dict(state, config)
    check_and_load(model, converted, f"HF GPT-2 checkpoint {directory} (keys as renamed to "
                                     f"qkv's)")
    return model.eval()
