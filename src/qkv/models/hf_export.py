"""qkv models -> HuggingFace directories that ``transformers`` loads with the same outputs:
``to_hf(model, directory)`` writes config.json (+ generation_config.json when token ids are
known) and model.safetensors; ``hf_config_for(config)`` is the config.json dict alone.

Shapes: V vocab size, C model width, H heads, Hkv kv heads, D head dim, F FFN width. The
weights are the inverse of the loaders' key maps (``hf_state``): every qkv tensor goes to the
HF key (or keys) its family's ``HFMapping.key_map`` names; a ``Fused`` value or a tuple is
split along dim 0 by its row blocks (q (H·D, C), k and v (Hkv·D, C); gate and up (F, C)), a
head tied to the embeddings is written once (as transformers saves it), GPT-2's Conv1D
weights are transposed back to (in, out) -- the one exception, named by ``hf_gpt2.is_conv1d_weight``
(``hf_gpt2`` keeps its transpose table private).

A loaded model remembers nothing of where it came from, so the HF family is chosen from the
qkv config (``choose_model_type``): a ``GPTConfig`` with learned positions is a GPT-2; one with
RoPE is, in this order, Qwen3 (``qk_norm``), Gemma 2 (``rmsnorm_plus_one`` + ``post_norms``),
Gemma (``rmsnorm_plus_one``), Qwen2 (q/k/v biases without an output bias), Mistral (a window
on every layer), else Llama; a ``BERTConfig`` is a BERT; a ``TransformerConfig`` (the
encoder-decoder) is T5, BART or Marian by its positions (``hf_export_seq2seq``, which writes
their config, generation config and weights). ``model_type=`` asks for one family
instead (Phi-3, say, whose fused tensors differ from Mistral's only in layout). What the
chosen family cannot compute exactly is refused, every reason in one ``ValueError``
(linear attention, a window on layers the family does not window, biases it does not have,
interleaved RoPE...). Residual dropout only Phi-3 and GPT-2 apply: elsewhere it is dropped
with a warning (a training-time difference; the forward pass in eval mode is the same).

The loader is the oracle of the round trip: ``qkv.models.from_pretrained`` of the written
directory reads every field back (none unknown to its audit tables).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ..files import CONFIG_NAME, WEIGHTS_NAME, atomic_write
from ..modules.positions import RoPE
from .bert import BERT, BERTConfig
from .gpt import GPT
from .gpt_config import GPTConfig
from .hf_bert import BERT_HF
from .hf_export_seq2seq import (
    SEQ2SEQ_EXPORT_TYPES,
    choose_seq2seq_type,
    seq2seq_config_for,
    seq2seq_generation_config,
    seq2seq_state_dict,
)
from .hf_gemma import GEMMA, GEMMA2
from .hf_gpt2 import GPT2, is_conv1d_weight
from .hf_llama import LLAMA, MISTRAL, QWEN2, QWEN3
from .hf_load import HFMapping
from .hf_phi3 import PHI3
from .hf_rope import rope_to_hf
from .hf_unmap import unmap_state
from .quantized import is_quantized
from .transformer import Transformer
from .transformer_config import TransformerConfig

__all__ = ["EXPORT_MODEL_TYPES", "GENERATION_CONFIG_NAME", "TOKENIZER_FILES",
           "choose_model_type", "copy_tokenizer_files", "hf_config_for", "hf_state_dict",
           "to_hf"]

GENERATION_CONFIG_NAME = "generation_config.json"

#: the files of an HF directory that describe its tokenizer and generation defaults, copied
#: as they are by ``copy_tokenizer_files``
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   GENERATION_CONFIG_NAME, "chat_template.jinja", "vocab.txt", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json",
                   # T5's and Marian's SentencePiece files (qkv.data.seq2seq_tokenizer)
                   "spiece.model", "source.spm", "target.spm", "target_vocab.json")

#: qkv's plain activation -> the HF name written (GPT-2's own "gelu_new" for the tanh GELU)
_PLAIN = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
#: qkv's gated FFN -> the HF activation of its gate
_GATED = {"swiglu": "silu", "geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu"}
#: Gemma 1 reads hidden_act "gelu" as the tanh GELU; "gelu_python" is the erf one
_GEMMA_GATED = {**_GATED, "geglu": "gelu_python"}


@dataclasses.dataclass(frozen=True)
class _Family:
    """One HF family qkv exports: its mapping (whose key map is inverted; its
    ``model_type`` and ``name`` are the family's), the class transformers builds, the
    prefix of its base-model keys."""

    mapping: HFMapping
    architecture: str
    prefix: str

    @property
    def name(self) -> str:
        """The family in messages ("Llama")."""
        return self.mapping.name


_FAMILIES = {f.mapping.model_type: f for f in (
    _Family(GPT2, "GPT2LMHeadModel", "transformer."),
    _Family(LLAMA, "LlamaForCausalLM", "model."),
    _Family(MISTRAL, "MistralForCausalLM", "model."),
    _Family(QWEN2, "Qwen2ForCausalLM", "model."),
    _Family(QWEN3, "Qwen3ForCausalLM", "model."),
    _Family(GEMMA, "GemmaForCausalLM", "model."),
    _Family(GEMMA2, "Gemma2ForCausalLM", "model."),
    _Family(PHI3, "Phi3ForCausalLM", "model."),
    _Family(BERT_HF, "BertForMaskedLM", "bert."),
)}

_GPT_TYPES = tuple(t for t in _FAMILIES if t != "bert")
#: the HF model types ``to_hf`` writes (decoders, BERT, then the encoder-decoders)
EXPORT_MODEL_TYPES = (*_FAMILIES, *SEQ2SEQ_EXPORT_TYPES)
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


# --- choosing the family ----------------------------------------------------------------------
def choose_model_type(config: GPTConfig | BERTConfig | TransformerConfig) -> str:
    """The HF ``model_type`` a qkv config is exported as (the module docstring's order; a
    ``TransformerConfig`` by ``hf_export_seq2seq.choose_seq2seq_type``); ``hf_config_for``
    then says whether that family computes it exactly.

    Raises:
        TypeError: not a ``GPTConfig`` / ``BERTConfig`` / ``TransformerConfig``.
        ValueError: a ``TransformerConfig`` with positions no HF encoder-decoder has."""
    if isinstance(config, BERTConfig):
        return "bert"
    if isinstance(config, TransformerConfig):
        return choose_seq2seq_type(config)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"choose_model_type: config must be a GPTConfig, BERTConfig or "
                        f"TransformerConfig, got {type(config).__name__}")
    c = config
    if c.positions == "learned":
        return "gpt2"
    if c.qk_norm:
        return "qwen3"
    if c.norm == "rmsnorm_plus_one":
        return "gemma2" if c.post_norms else "gemma"
    qkv_bias, out_bias, _ = c.biases()
    if qkv_bias and not out_bias:
        return "qwen2"
    if c.attention_window is not None and len(_windows(c)) == c.num_layers:
        return "mistral"
    return "llama"


def _windows(c: GPTConfig) -> tuple[int, ...]:
    return tuple(i for i in range(c.num_layers) if c.is_windowed(i))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * abs(b)


def _gpt_refusals(c: GPTConfig, fam: str) -> list[str]:
    """Why the HF family ``fam`` cannot compute a ``GPT`` of ``c`` exactly (empty: it can)."""
    why: list[str] = []
    name = _FAMILIES[fam].name
    if c.attention == "linear":
        return [f"attention='linear': no HF class computes kernelised linear attention "
                f"(feature_map={c.feature_map!r})"]
    qkv_bias, out_bias, ffn_bias = c.biases()
    default_scale = c.attention_scale is None or _close(c.attention_scale, c.head_dim ** -0.5)
    if fam == "gpt2":
        if c.positions != "learned":
            why.append(f"positions={c.positions!r}: GPT-2 has learned absolute positions "
                       f"(RoPE models export as Llama-style families)")
        if c.norm != "layernorm":
            why.append(f"norm={c.norm!r}: GPT-2 uses LayerNorm")
        if c.activation not in _PLAIN:
            why.append(f"activation={c.activation!r}: GPT-2's MLP computes one of "
                       f"{sorted(_PLAIN)}, not gated")
        if not (qkv_bias and out_bias and ffn_bias):
            why.append(f"biases (q/k/v, out, FFN) = {(qkv_bias, out_bias, ffn_bias)}: GPT-2 "
                       f"has every bias")
        if c.num_kv_heads not in (None, c.num_heads):
            why.append(f"num_kv_heads={c.num_kv_heads}: GPT-2 has no grouped-query attention")
        if c.attention_head_dim not in (None, c.dim // c.num_heads):
            why.append(f"attention_head_dim={c.attention_head_dim}: GPT-2's head dim is "
                       f"n_embd // n_head = {c.dim // c.num_heads}")
        for field in ("qk_norm", "embed_scale", "post_norms"):
            if getattr(c, field):
                why.append(f"{field}=True: GPT-2 has none")
    else:
        gemma = fam in ("gemma", "gemma2")
        if c.positions != "rope":
            why.append(f"positions={c.positions!r}: {name} has rotary positions (learned "
                       f"ones export as GPT-2)")
        want_norm = "rmsnorm_plus_one" if gemma else "rmsnorm"
        if c.norm != want_norm:
            why.append(f"norm={c.norm!r}: {name} uses {want_norm!r}")
        if c.activation not in _GATED:
            why.append(f"activation={c.activation!r}: {name}'s MLP is gated "
                       f"({sorted(_GATED)})")
        if c.embed_scale != gemma:
            why.append(f"embed_scale={c.embed_scale}: {name} "
                       f"{'scales' if gemma else 'does not scale'} the embeddings by √C")
        if c.post_norms != (fam == "gemma2"):
            why.append(f"post_norms={c.post_norms}: {name} "
                       f"{'has' if fam == 'gemma2' else 'has no'} norms on the sublayer "
                       f"outputs")
        if c.qk_norm != (fam == "qwen3"):
            why.append(f"qk_norm={c.qk_norm}: {name} "
                       f"{'has' if fam == 'qwen3' else 'has no'} q/k norms")
        if fam == "phi3" and c.rope_scaling is not None:
            why.append(f"rope_scaling={c.rope_scaling!r}: transformers' Phi3Config reads only "
                       f"rope_type 'default' or 'longrope'")
        why.extend(_bias_refusals(fam, name, qkv_bias, out_bias, ffn_bias))
        why.extend(_window_refusals(c, fam, name))
    if fam == "gemma2":
        scale = c.attention_scale if c.attention_scale is not None else c.head_dim ** -0.5
        if not _close(float(round(scale ** -2)) ** -0.5, scale):
            why.append(f"attention_scale={scale!r}: Gemma 2's query_pre_attn_scalar is an int "
                       f"q (scale q^-0.5)")
    else:
        if not default_scale:
            why.append(f"attention_scale={c.attention_scale!r}: {name} scales q·k by "
                       f"1/√D = {c.head_dim ** -0.5!r} (Gemma 2 has query_pre_attn_scalar)")
        for field in ("attn_softcap", "logit_softcap"):
            if getattr(c, field) is not None:
                why.append(f"{field}={getattr(c, field)!r}: {name} has no soft-capping "
                           f"(Gemma 2 has)")
    return why


def _bias_refusals(fam: str, name: str, qkv_bias: bool, out_bias: bool,
                   ffn_bias: bool) -> list[str]:
    got = f"biases (q/k/v, out, FFN) = {(qkv_bias, out_bias, ffn_bias)}"
    if fam in ("mistral", "phi3") and (qkv_bias or out_bias or ffn_bias):
        return [f"{got}: {name} has no biases"]
    if fam == "qwen2" and (qkv_bias, out_bias, ffn_bias) != (True, False, False):
        return [f"{got}: Qwen2 has biases on q/k/v only"]
    if fam in ("llama", "qwen3", "gemma", "gemma2") and qkv_bias != out_bias:
        return [f"{got}: {name}'s attention_bias is on q, k, v and o together (Qwen2 has "
                f"q/k/v biases only)"]
    if fam in ("qwen3", "gemma", "gemma2") and ffn_bias:
        return [f"{got}: {name}'s MLP has no biases"]
    return []


def _window_refusals(c: GPTConfig, fam: str, name: str) -> list[str]:
    if c.attention_window is None:
        return []
    layers = _windows(c)
    where = "every layer" if len(layers) == c.num_layers else f"layers {list(layers)}"
    hint = ("Mistral and Phi-3 window every layer; Qwen2, Qwen3 and Gemma 2 window chosen "
            "layers")
    if fam in ("llama", "gemma"):
        return [f"attention_window={c.attention_window} on {where}: {name} has no sliding "
                f"window ({hint})"]
    if fam in ("mistral", "phi3") and len(layers) != c.num_layers:
        return [f"attention_window={c.attention_window} on {where}: {name} windows every "
                f"layer or none ({hint})"]
    return []


# --- the config.json dicts ------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gpt2_fields(c: GPTConfig) -> dict[str, Any]:
    return {"vocab_size": c.vocab_size, "n_positions": c.max_len, "n_embd": c.dim,
            "n_layer": c.num_layers, "n_head": c.num_heads, "n_inner": c.ffn_hidden,
            "activation_function": _PLAIN[c.activation], "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout, "attn_pdrop": c.attn_dropout,
            "layer_norm_epsilon": c.norm_eps, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "tie_word_embeddings": c.tie_embeddings}


def _decoder_fields(c: GPTConfig, fam: str) -> dict[str, Any]:
    qkv_bias, _, ffn_bias = c.biases()
    layers = _windows(c)
    window = c.attention_window
    act = (_GEMMA_GATED if fam == "gemma" else _GATED)[c.activation]
    hf: dict[str, Any] = {
        "vocab_size": c.vocab_size, "hidden_size": c.dim,
        "intermediate_size": c.ffn_hidden or 4 * c.dim, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads or c.num_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_len, "rms_norm_eps": c.norm_eps,
        "hidden_act": act, "attention_dropout": c.attn_dropout,
        "tie_word_embeddings": c.tie_embeddings}
    types = ["sliding_attention" if i in layers else "full_attention"
             for i in range(c.num_layers)]
    if fam == "llama":
        hf.update(attention_bias=qkv_bias, mlp_bias=ffn_bias)
    elif fam in ("mistral", "phi3"):
        hf["sliding_window"] = window
    elif fam in ("qwen2", "qwen3"):
        suffix = list(layers) == list(range(c.num_layers - len(layers), c.num_layers))
        hf.update(use_sliding_window=window is not None, sliding_window=window,
                  max_window_layers=(c.num_layers - len(layers) if suffix and layers
                                     else c.num_layers),
                  layer_types=types)
        if fam == "qwen3":
            hf["attention_bias"] = qkv_bias
    elif fam == "gemma":
        hf["attention_bias"] = qkv_bias
    elif fam == "gemma2":
        scale = c.attention_scale if c.attention_scale is not None else c.head_dim ** -0.5
        del hf["hidden_act"]
        hf.update(hidden_activation=act, attention_bias=qkv_bias,
                  query_pre_attn_scalar=round(scale ** -2),
                  # transformers builds the sliding mask whatever the layer types: without a
                  # window, one as long as the context (and every layer "full_attention")
                  sliding_window=window if window is not None else c.max_len,
                  layer_types=types, attn_logit_softcapping=c.attn_softcap,
                  final_logit_softcapping=c.logit_softcap)
    if fam == "phi3":
        hf.update(resid_pdrop=c.dropout, embd_pdrop=0.0)
    elif c.dropout:
        warnings.warn(f"hf_config_for: dropout={c.dropout} dropped: HF's "
                      f"{_FAMILIES[fam].name} has no residual dropout (training-time only; "
                      f"eval outputs are the same)", UserWarning, stacklevel=3)
    hf.update(rope_to_hf(c.rope_base, c.rope_scaling))  # last: "dynamic" sets the length
    return hf


def _bert_fields(c: BERTConfig) -> dict[str, Any]:
    return {"vocab_size": c.vocab_size, "hidden_size": c.dim,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "intermediate_size": c.ffn_hidden, "hidden_act": _PLAIN[c.activation],
            "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attn_dropout,
            "max_position_embeddings": c.max_len, "type_vocab_size": c.type_vocab_size,
            "layer_norm_eps": c.norm_eps, "pad_token_id": c.pad_token_id,
            "tie_word_embeddings": True, "is_decoder": False, "add_cross_attention": False}


def _bert_architecture(c: BERTConfig) -> str:
    return "BertForMaskedLM" if c.with_mlm_head else "BertModel"


def _check_token_ids(token_ids: Any) -> dict[str, Any]:
    if token_ids is None:
        return {}
    if not isinstance(token_ids, dict) or set(token_ids) - set(_TOKEN_FIELDS):
        raise ValueError(f"hf_config_for: token_ids must be a dict with keys among "
                         f"{list(_TOKEN_FIELDS)}, got {token_ids!r}")
    for key, value in token_ids.items():
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool)
                                         and i >= 0 for i in ids):
            raise ValueError(f"hf_config_for: token_ids[{key!r}] must be a non-negative int "
                             f"or None{' (or a list of them)' if key == 'eos_token_id' else ''}"
                             f", got {value!r}")
    return dict(token_ids)


def _resolve(config: Any, model_type: str | None) -> str:
    if not isinstance(config, (GPTConfig, BERTConfig)):
        raise TypeError(f"hf_config_for: config must be a GPTConfig, BERTConfig or "
                        f"TransformerConfig, got {type(config).__name__}")
    if model_type is None:
        return choose_model_type(config)
    allowed = ("bert",) if isinstance(config, BERTConfig) else _GPT_TYPES
    if model_type not in allowed:
        raise ValueError(f"hf_config_for: model_type={model_type!r}: a "
                         f"{type(config).__name__} exports as one of {list(allowed)}")
    return model_type


def _refuse(config: GPTConfig, fam: str, *, asked: bool) -> None:
    why = _gpt_refusals(config, fam)
    if why:
        how = "asked for" if asked else "chosen from the config"
        raise ValueError(f"hf_config_for: this GPTConfig cannot be exported as HF "
                         f"{_FAMILIES[fam].name} (model_type {fam!r}, {how}): "
                         + "; ".join(why))


def hf_config_for(config: GPTConfig | BERTConfig | TransformerConfig, *,
                  model_type: str | None = None, token_ids: dict[str, Any] | None = None,
                  dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF config.json dict of a qkv model with ``config``; a ``TransformerConfig`` is
    ``hf_export_seq2seq.seq2seq_config_for``'s (T5, BART or Marian; its token ids come from
    the config, ``token_ids`` may add ``bos_token_id``).

    Args:
        config: a ``GPTConfig``, ``BERTConfig`` or ``TransformerConfig``.
        model_type: the HF family to write (one of ``EXPORT_MODEL_TYPES``); None:
            ``choose_model_type(config)``.
        token_ids: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` to record (what
            the tokenizer uses); those not given are written as null, so no family's
            defaults (ids of its own vocabulary) are implied. BERT's ``pad_token_id`` is its
            config's, and a different one here is refused.
        dtype: the weights' dtype, written as ``dtype``.

    Raises:
        ValueError: the family cannot compute this config exactly, every reason listed
            (``attention='linear'``, a window on layers it does not window, biases or norms
            it does not have...); a ``model_type`` that is not a family of this config; bad
            ``token_ids``.
        TypeError: another config class.

    Warns:
        UserWarning: residual ``dropout`` dropped for a family without it (training only).
    """
    if isinstance(config, TransformerConfig):
        return seq2seq_config_for(config, model_type=model_type, token_ids=token_ids,
                                  dtype=dtype)
    fam = _resolve(config, model_type)
    ids = _check_token_ids(token_ids)
    if fam == "bert":
        if config.activation not in _PLAIN:
            raise ValueError(f"hf_config_for: this BERTConfig cannot be exported as HF BERT: "
                             f"activation={config.activation!r} (HF BERT with a name qkv reads "
                             f"back: {sorted(_PLAIN)})")
        pad = ids.pop("pad_token_id", None)
        if pad is not None and pad != config.pad_token_id:
            raise ValueError(f"hf_config_for: token_ids pad_token_id={pad} differs from the "
                             f"BERTConfig's pad_token_id={config.pad_token_id}")
        body = _bert_fields(config)
        arch = _bert_architecture(config)
    else:
        _refuse(config, fam, asked=model_type is not None)
        body = _gpt2_fields(config) if fam == "gpt2" else _decoder_fields(config, fam)
        arch = _FAMILIES[fam].architecture
    head = {"model_type": fam, "architectures": [arch], "dtype": _dtype_name(dtype)}
    tokens = {k: ids.get(k) for k in _TOKEN_FIELDS if k != "pad_token_id" or fam != "bert"}
    return {**head, **tokens, **body}


# --- the weights ----------------------------------------------------------------------------
def _check_model(model: Any) -> None:
    if not isinstance(model, (GPT, BERT, Transformer)):
        raise TypeError(f"to_hf: model must be a qkv Transformer, GPT or BERT, got "
                        f"{type(model).__name__}")
    if is_quantized(model):
        raise ValueError("to_hf: the model is quantized with qkv.quantize (int8 layers); no HF "
                         "class reads qkv's int8 format: export the float model")
    for r in model.modules():
        if isinstance(r, RoPE) and r.interleaved:
            raise ValueError("to_hf: the model's RoPE has interleaved=True (adjacent pairs, "
                             "GPT-J's); HF's Llama-style families rotate half-split pairs "
                             "(rotate_half)")


def _prefixed(name: str, fam: str, config: Any) -> str:
    """The HF key as the family's model class saves it (base-model keys prefixed)."""
    f = _FAMILIES[fam]
    if fam == "bert":
        if not config.with_mlm_head or name.startswith("cls."):
            return name  # BertModel keys have no prefix
        return f.prefix + name
    return name if name == "lm_head.weight" else f.prefix + name


def hf_state_dict(model: nn.Module, *, model_type: str | None = None) -> dict[str, Tensor]:
    """The HF state dict of a qkv ``GPT`` / ``BERT`` / ``Transformer`` (CPU tensors of the
    model's dtype, owning their memory): the inverse of the family's key map (a
    ``Transformer``: ``hf_export_seq2seq.seq2seq_state_dict``).

    Each qkv tensor (e.g. ``in_proj`` ((H + 2·Hkv)·D, C)) is split along dim 0 into the HF
    tensors its key-map value names (q (H·D, C), k, v (Hkv·D, C)); several qkv keys on one HF
    key (a tied head) must hold equal values and give it once; GPT-2's Conv1D weights are
    transposed to (in, out); keys carry the prefix the family's class saves
    (``model.``, ``transformer.``, ``bert.`` with an MLM head).

    Raises:
        ValueError: a state-dict key the family's layout has no place for (adapters, added
            modules), a key it expects that the model lacks, or what ``hf_config_for``
            refuses; TypeError: not a GPT, BERT or Transformer.
    """
    _check_model(model)
    if isinstance(model, Transformer):
        return seq2seq_state_dict(model, model_type=model_type)
    config = model.config
    fam = _resolve(config, model_type)
    if isinstance(config, GPTConfig):
        _refuse(config, fam, asked=model_type is not None)  # what the family cannot compute
    out = unmap_state(model.state_dict(), _FAMILIES[fam].mapping.key_map(config),
                      family=_FAMILIES[fam].name, rename=lambda n: _prefixed(n, fam, config))
    if fam == "gpt2":
        for name in [n for n in out if is_conv1d_weight(n)]:
            out[name] = out[name].t().contiguous()  # Linear (out, in) -> Conv1D (in, out)
    return out


def to_hf(model: nn.Module, directory: str | os.PathLike, *, model_type: str | None = None,
          token_ids: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (a qkv ``GPT``, ``BERT`` or ``Transformer``) as a HuggingFace
    directory: config.json (``hf_config_for``), model.safetensors (``hf_state_dict``) and
    generation_config.json (a GPT / BERT: when ``token_ids`` names any id, with them; a
    ``Transformer``: always, ``hf_export_seq2seq.seq2seq_generation_config``). Every write is
    atomic; the directory is created if needed, and nothing is written before every check
    has passed.

    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` (a GPT),
    ``BertForMaskedLM`` / ``BertModel`` (a BERT with / without its MLM head; its pooler
    under ``bert.pooler``) or ``AutoModelForSeq2SeqLM`` (a Transformer: T5, BART or Marian)
    then computes the model's logits; ``qkv.models.from_pretrained`` reads it back.

    Args:
        model: the model (any device; its dtype is kept).
        directory: where to write.
        model_type, token_ids: as ``hf_config_for``.

    Returns:
        ``directory`` as a Path.

    Raises:
        TypeError / ValueError: what ``hf_config_for`` and ``hf_state_dict`` refuse, a
            quantized model, interleaved RoPE.
    """
    _check_model(model)
    seq2seq = isinstance(model, Transformer)
    fam = choose_model_type(model.config) if model_type is None else model_type
    state = hf_state_dict(model, model_type=model_type)  # refuses what fam cannot compute
    table = (model.embed if isinstance(model, GPT) else model.src_embed if seq2seq
             else model.word_embeddings)
    hf = hf_config_for(model.config, model_type=fam, token_ids=token_ids,
                       dtype=table.weight.dtype)
    if seq2seq:
        ids = seq2seq_generation_config(model.config, model_type=fam, token_ids=token_ids)
    else:
        ids = {k: v for k, v in (token_ids or {}).items() if v is not None}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / WEIGHTS_NAME,
                 lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    text = json.dumps(hf, indent=2, sort_keys=True)
    atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    if ids:
        gen = json.dumps(ids, indent=2, sort_keys=True)
        atomic_write(directory / GENERATION_CONFIG_NAME, lambda tmp: Path(tmp).write_text(gen))
    return directory


def copy_tokenizer_files(source: str | os.PathLike, directory: str | os.PathLike,
                         names: tuple[str, ...] = TOKENIZER_FILES) -> list[str]:
    """Copy the files of ``names`` (default ``TOKENIZER_FILES``) that ``source`` holds into
    ``directory`` (each write atomic, over a file of that name); returns the names copied."""
    source, directory = Path(source), Path(directory)
    copied = []
    for name in names:
        src = source / name
        if src.is_file():
            atomic_write(directory / name, lambda tmp, s=src: shutil.copyfile(s, tmp))
            copied.append(name)
    return copied
