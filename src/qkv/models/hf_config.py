"""What qkv does with every field of a HuggingFace GPT-2 / BERT / ViT / CLIP config.json.

No tensors here (no shapes). ``GPT2_FIELDS`` and ``BERT_FIELDS`` (and ``VIT_FIELDS``,
``CLIP_FIELDS`` with its ``CLIP_TEXT_FIELDS`` / ``CLIP_VISION_FIELDS`` for the nested
text_config / vision_config) classify each field a transformers ``GPT2Config`` /
``BertConfig`` (``ViTConfig``, ``CLIPConfig``) writes (the 5.x fields, the 4.x ones still found
in checkpoints on the Hub, and the ``PretrainedConfig`` base fields of both) as one of:

- ``"used"``: the loader maps the field into qkv's config (``GPTConfig`` / ``BERTConfig``);
- ``"ignored: <why>"``: the field cannot change the forward pass of the loaded model
  (tokenizer ids, output flags, generation defaults, task heads qkv does not build...);
- a ``Check``: the field is accepted only with the values qkv computes; any other value is
  refused with a ``CheckpointError`` naming the field and its value (or, for ``warn=True``
  checks, loaded with a warning: a difference that only matters when training).

``audit_hf_config(data, table, source)`` applies a table to a config.json dict. A field the
table does not know (a newer transformers' option) is loaded with a warning naming it: qkv
cannot promise its outputs equal transformers' for an option it has never seen.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from ..files import CheckpointError
from .config import NORM_EPS_RANGE, check_norm_eps

__all__ = ["BERT_FIELDS", "CLIP_ACTIVATIONS", "CLIP_FIELDS", "CLIP_TEXT_FIELDS",
           "CLIP_VISION_FIELDS", "COMMON_FIELDS", "GPT2_FIELDS", "HF_ACTIVATIONS",
           "NORM_EPS_CHECK", "VIT_FIELDS", "Check", "audit_hf_config", "only"]

#: HF activation names (transformers.activations.ACT2FN) -> qkv's ``ACTIVATIONS`` key, for
#: the ones qkv computes exactly (gelu_fast / gelu_python_tanh are the tanh approximation,
#: gelu_python the erf GELU); every other name (quick_gelu, gelu_accurate, mish...) is refused.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu",
                  "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
                  "relu": "relu", "silu": "silu", "swish": "silu"}


@dataclasses.dataclass(frozen=True)
class Check:
    """A config field accepted only when ``ok(value, config_dict)`` is true.

    Attributes:
        ok: the predicate; ``config_dict`` is the whole config.json (for cross-field checks).
        why: what qkv supports, for the error message.
        used: the loader also maps the field into qkv's config.
        warn: a failing value loads with a ``UserWarning`` instead of a ``CheckpointError``.
    """

    ok: Callable[[Any, dict[str, Any]], bool]
    why: str
    used: bool = False
    warn: bool = False


def only(*values: Any, why: str, used: bool = False) -> Check:
    """A ``Check`` accepting exactly ``values`` (type-strict: ``0`` is not ``False``)."""
    def ok(value: Any, _data: dict[str, Any]) -> bool:
        return any(type(value) is type(v) and value == v for v in values)
    return Check(ok, why, used=used)


def audit_hf_config(data: dict[str, Any], table: dict[str, str | Check], source: str) -> None:
    """Apply a field table (``GPT2_FIELDS`` / ``BERT_FIELDS``) to a config.json dict.

    Raises:
        CheckpointError naming every refused field with its value and what qkv supports.

    Warns (``UserWarning``) for fields the table does not know and for ``warn=True`` checks
    that fail; "used" and "ignored" fields pass.
    """
    refused, doubtful, unknown = [], [], []
    for field in sorted(data):
        rule = table.get(field)
        if rule is None:
            unknown.append(field)
        elif isinstance(rule, Check) and not rule.ok(data[field], data):
            (doubtful if rule.warn else refused).append(
                f"{field}={data[field]!r} ({rule.why})")
    if refused:
        raise CheckpointError(f"{source}: config.json sets options qkv does not compute: "
                              + "; ".join(refused))
    if doubtful:
        warnings.warn(f"{source}: config.json: " + "; ".join(doubtful), UserWarning,
                      stacklevel=3)
    if unknown:
        warnings.warn(f"{source}: config.json has fields qkv does not know, ignored: "
                      f"{unknown}; if one of them changes the forward pass, outputs will "
                      f"differ from transformers'", UserWarning, stacklevel=3)


# --- fields every transformers config carries (PretrainedConfig, 4.x and 5.x) -------------
_HEADS = "ignored: task heads (classification, QA...) are not built; their weights would " \
         "be reported as unexpected keys"
_GENERATION = "ignored: a generation default; qkv.generate takes its own arguments"
_FORMAT = "ignored: what transformers returns, not what it computes"

_COMMON: dict[str, str | Check] = {
    "transformers_version": "ignored: the writer's version",
    "_name_or_path": "ignored: where the writer loaded the model from",
    "_commit_hash": "ignored: hub metadata",
    "architectures": "ignored: informational; the weights' keys decide which heads load",
    "output_hidden_states": _FORMAT, "output_attentions": _FORMAT, "return_dict": _FORMAT,
    "output_scores": _FORMAT, "return_dict_in_generate": _FORMAT, "torchscript": _FORMAT,
    "dtype": "ignored: qkv builds fp32 parameters and casts the stored tensors into them "
             "(model.to(dtype) for another dtype)",
    "torch_dtype": "ignored: 4.x name of dtype",
    "use_bfloat16": "ignored: a TensorFlow-era storage flag",
    "tf_legacy_loss": "ignored: TensorFlow only",
    "_attn_implementation": "ignored: which attention kernel; the same math",
    "attn_implementation": "ignored: which attention kernel; the same math",
    "_attn_implementation_internal": "ignored: which attention kernel; the same math",
    "_attn_implementation_autoset": "ignored: which attention kernel; the same math",
    "_experts_implementation": "ignored: mixture-of-experts kernels; these models have none",
    "gradient_checkpointing": "ignored: recomputation in training; the same outputs",
    "chunk_size_feed_forward": "ignored: the feed-forward is per position, so chunking it "
                               "over positions gives the same outputs",
    "is_encoder_decoder": "ignored: only a composite EncoderDecoderModel config uses it; a "
                          "standalone model computes the same",
    "tie_encoder_decoder": "ignored: encoder-decoder composites only",
    "cross_attention_hidden_size": "ignored: read only with add_cross_attention (refused)",
    "pruned_heads": only({}, None, why="pruned attention heads are not supported"),
    "id2label": _HEADS, "label2id": _HEADS, "num_labels": _HEADS, "problem_type": _HEADS,
    "finetuning_task": _HEADS, "classifier_dropout": _HEADS,
    "tokenizer_class": "ignored: tokenizer metadata", "prefix": "ignored: pipeline text prefix",
    "bos_token_id": "ignored: a tokenizer/generation id",
    "eos_token_id": "ignored: a tokenizer/generation id",
    "sep_token_id": "ignored: a tokenizer id",
    "decoder_start_token_id": "ignored: encoder-decoder generation only",
    "task_specific_params": "ignored: pipeline defaults",
    **{name: _GENERATION for name in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens")},
}

#: the fields every transformers config carries, for the family tables of other files
COMMON_FIELDS = _COMMON

_ACTIVATION_CHECK = f"qkv computes {sorted(HF_ACTIVATIONS)}"


def _known_activation(value: Any, _data: dict[str, Any]) -> bool:
    return isinstance(value, str) and value in HF_ACTIVATIONS


def _norm_eps(value: Any, _data: dict[str, Any]) -> bool:
    try:
        check_norm_eps("config", value)
    except ValueError:
        return False
    return True


#: layer_norm_epsilon / layer_norm_eps: what ``hub.check_norm_eps`` accepts
_EPS = Check(_norm_eps, f"a finite number in [{NORM_EPS_RANGE[0]:g}, {NORM_EPS_RANGE[1]:g}]",
             used=True)
#: a norm epsilon field (used), for the family tables of other files
NORM_EPS_CHECK = _EPS


def _one_dropout(value: Any, data: dict[str, Any]) -> bool:
    return value == data.get("resid_pdrop", 0.1)


GPT2_FIELDS: dict[str, str | Check] = {
    **_COMMON,
    "model_type": only("gpt2", why="GPT.from_hf reads 'gpt2' checkpoints"),
    "vocab_size": "used", "n_positions": "used", "n_embd": "used", "n_layer": "used",
    "n_head": "used", "n_inner": "used", "layer_norm_epsilon": _EPS,
    "resid_pdrop": "used", "attn_pdrop": "used", "tie_word_embeddings": "used",
    # transformers' GPT2Config.attribute_map aliases, read when the canonical name is absent
    "hidden_size": "used", "max_position_embeddings": "used", "num_attention_heads": "used",
    "num_hidden_layers": "used",
    "activation_function": Check(_known_activation, _ACTIVATION_CHECK, used=True),
    "embd_pdrop": Check(_one_dropout, "qkv's GPT applies resid_pdrop after the embeddings "
                        "too; outputs in eval mode are unaffected", warn=True),
    "scale_attn_weights": only(True, why="qkv always scales scores by 1/sqrt(head dim)"),
    "scale_attn_by_inverse_layer_idx": only(False, why="per-layer 1/(layer+1) score "
                                                       "scaling is not supported"),
    "add_cross_attention": only(False, why="cross-attention blocks are not supported"),
    "reorder_and_upcast_attn": "ignored: scores in fp32 for half-precision inputs, which "
                               "qkv's attention does anyway; the same math in fp32",
    "n_ctx": "ignored: a legacy copy of n_positions; transformers does not read it",
    "initializer_range": "ignored: initialisation only; the weights are loaded",
    "use_cache": "ignored: a key/value cache never changes outputs",
    "pad_token_id": "ignored: GPT-2's embeddings have no padding row; only task heads read it",
    "is_decoder": "ignored: GPT-2 is always causal",
    **{name: "ignored: GPT2DoubleHeadsModel's multiple-choice head, not built" for name in (
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
        "summary_first_dropout", "summary_last_dropout")},
}

BERT_FIELDS: dict[str, str | Check] = {
    **_COMMON,
    "model_type": only("bert", why="BERT.from_hf reads 'bert' checkpoints"),
    "vocab_size": "used", "hidden_size": "used", "num_hidden_layers": "used",
    "num_attention_heads": "used", "intermediate_size": "used",
    "max_position_embeddings": "used", "type_vocab_size": "used", "layer_norm_eps": _EPS,
    "hidden_dropout_prob": "used", "attention_probs_dropout_prob": "used",
    "pad_token_id": "used",
    # An untied MLM decoder is refused when the weights are read (it must equal the word
    # embeddings); without an MLM head the field changes nothing.
    "tie_word_embeddings": "used",
    "hidden_act": Check(_known_activation, _ACTIVATION_CHECK, used=True),
    "position_embedding_type": only("absolute", why="only absolute position embeddings "
                                                    "(relative_key/relative_key_query are "
                                                    "not supported)"),
    "is_decoder": only(False, why="a causal BERT decoder (BertLMHeadModel) is not "
                                  "supported; qkv's BERT is bidirectional"),
    "add_cross_attention": only(False, why="cross-attention blocks are not supported"),
    "use_cache": "ignored: read only with is_decoder (refused)",
    "initializer_range": "ignored: initialisation only; the weights are loaded",
}


# --- ViT and CLIP ---------------------------------------------------------------------------
#: CLIP's activations: HF_ACTIVATIONS plus OpenAI's quick_gelu (x·sigmoid(1.702x)), which
#: qkv computes for the towers that use it (GPT-2 / BERT checkpoints keep HF_ACTIVATIONS)
CLIP_ACTIVATIONS = {**HF_ACTIVATIONS, "quick_gelu": "quick_gelu"}
_CLIP_ACTIVATION_CHECK = f"qkv computes {sorted(CLIP_ACTIVATIONS)}"


def _clip_activation(value: Any, _data: dict[str, Any]) -> bool:
    return isinstance(value, str) and value in CLIP_ACTIVATIONS


def _square_int(value: Any, _data: dict[str, Any]) -> bool:
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pooler_width(value: Any, data: dict[str, Any]) -> bool:
    return value is None or value == data.get("hidden_size", 768)


_INIT = "ignored: initialisation only; the weights are loaded"
_SQUARE = "a positive int, or a [n, n] pair (square images and patches only)"

VIT_FIELDS: dict[str, str | Check] = {
    **_COMMON,
    "model_type": only("vit", why="ViT.from_hf reads 'vit' checkpoints"),
    "hidden_size": "used", "num_hidden_layers": "used", "num_attention_heads": "used",
    "intermediate_size": "used", "layer_norm_eps": _EPS, "num_channels": "used",
    "hidden_dropout_prob": "used", "attention_probs_dropout_prob": "used",
    "image_size": Check(_square_int, _SQUARE, used=True),
    "patch_size": Check(_square_int, _SQUARE, used=True),
    "hidden_act": Check(_known_activation, _ACTIVATION_CHECK, used=True),
    "qkv_bias": "used: false loads zero query/key/value biases (the same outputs)",
    "pooler_act": only("tanh", why="ViTModel's pooler: tanh only"),
    "pooler_output_size": Check(_pooler_width, "equal to hidden_size (or null)"),
    "encoder_stride": "ignored: ViTForMaskedImageModeling's decoder, not built",
    "initializer_range": _INIT,
    "id2label": "ignored: the head's size is read from classifier.weight",
    "label2id": "ignored: the head's size is read from classifier.weight",
    "num_labels": "ignored: the head's size is read from classifier.weight",
}

_CLIP_TOWER: dict[str, str | Check] = {
    **_COMMON,
    "hidden_size": "used", "num_hidden_layers": "used", "num_attention_heads": "used",
    "intermediate_size": "used", "layer_norm_eps": _EPS,
    "attention_dropout": "used",
    "hidden_act": Check(_clip_activation, _CLIP_ACTIVATION_CHECK, used=True),
    "dropout": "ignored: a 4.x field no CLIP module reads",
    "projection_dim": "ignored: read by CLIP*ModelWithProjection only; CLIPModel uses the "
                      "top-level projection_dim",
    "initializer_range": _INIT, "initializer_factor": _INIT,
}

CLIP_TEXT_FIELDS: dict[str, str | Check] = {
    **_CLIP_TOWER,
    "model_type": only("clip_text_model", why="a CLIP text tower"),
    "vocab_size": "used", "max_position_embeddings": "used",
    "eos_token_id": "used: pooling at the first eos_token_id, or (eos_token_id 2, the "
                    "configs of transformers < 4.31) at the highest token id",
    "pad_token_id": "ignored: the attention_mask marks padding",
}

CLIP_VISION_FIELDS: dict[str, str | Check] = {
    **_CLIP_TOWER,
    "model_type": only("clip_vision_model", why="a CLIP vision tower"),
    "num_channels": "used",
    "image_size": Check(_square_int, _SQUARE, used=True),
    "patch_size": Check(_square_int, _SQUARE, used=True),
}

CLIP_FIELDS: dict[str, str | Check] = {
    **_COMMON,
    "model_type": only("clip", why="CLIP.from_hf reads 'clip' checkpoints"),
    "projection_dim": "used",
    "text_config": "used: audited with CLIP_TEXT_FIELDS",
    "vision_config": "used: audited with CLIP_VISION_FIELDS",
    "text_config_dict": "used: (old configs) merged over text_config, as transformers",
    "vision_config_dict": "used: (old configs) merged over vision_config, as transformers",
    "logit_scale_init_value": "ignored: initialisation only; logit_scale is loaded",
    "initializer_factor": _INIT,
}
