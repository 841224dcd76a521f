"""qkv ``Transformer`` (encoder-decoder) -> HuggingFace T5 / BART / Marian: the config.json
and generation_config.json dicts and the weights that ``T5ForConditionalGeneration``,
``BartForConditionalGeneration`` and ``MarianMTModel`` load with the model's logits
(``hf_export.to_hf`` writes them; this module is its encoder-decoder half).

Shapes: V vocab (V_src, V_tgt), C width (d_model), H heads, D head dim (d_kv), F FFN width,
P positions (``max_len``).

The family follows the positions (``choose_seq2seq_type``): T5's relative buckets are T5,
learned positions BART, sinusoidal ones Marian; ALiBi and Shaw's relative positions have no
HF encoder-decoder. Each family's weights are the inverse of its loader's key map
(``hf_t5.t5_key_map``, ``hf_bart.seq2seq_key_map``) with what transformers 5 stores:

- T5: one ``shared`` table (encoder / decoder copies are tied, not stored), ``lm_head.weight``
  only when the head is not tied; ``tie_word_embeddings`` = ``tie_output`` and
  ``scale_decoder_outputs`` = (``head_scale`` = C^-0.5): v1.0 tied and scaled, v1.1 /
  Flan-T5 untied and unscaled (transformers 4 reads these two as well). qkv's gated FFN
  ``fc_in`` (2F, C) is ``wi_0`` (gate) and ``wi_1`` (up); ``feed_forward_proj`` names the
  activation ("gated-gelu" is the tanh GELU, so the erf one is "gated-gelu_python").
- BART / Marian: ``final_logits_bias`` (1, V_tgt) is ``lm_head.bias``, zeros without a head
  bias (``head_bias=False``: qkv reads the file back with a zero bias). With an untied head
  (``tie_word_embeddings=False``) transformers 5 ties no table, so ``model.shared`` and both
  stacks' ``embed_tokens`` are all stored (``model.shared``, read by neither stack, holds the
  encoder's table). BART's position tables (P + 2, C) are read at position + 2: a qkv table at
  another ``position_offset`` is re-indexed (rows before it are zeros, never read). Marian's
  sinusoids are computed, not stored, in [sin | cos] halves; a qkv model with the paper's
  interleaved sinusoids is written in the channel order that makes them halves (channel 2i
  -> i, 2i + 1 -> C/2 + i, applied to every tensor with a C axis; LayerNorm and attention do
  not depend on the order), the same function in another basis -- it reads back as a
  ``sinusoidal_layout="halves"`` model with permuted weights.

What a family does not compute is refused, every reason in one line (``seq2seq_refusals``):
T5 with ``attention_scale`` != 1, biases or LayerNorm; BART/Marian pre-norm, gated FFNs,
another norm eps than 1e-5, a scaled head; separate vocabularies in BART... The loaders are
the oracle of the round trip: ``qkv.models.from_pretrained`` reads every written field.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .hf_bart import BART
from .hf_load import HFMapping
from .hf_marian import MARIAN
from .hf_t5 import T5
from .hf_unmap import unmap_state
from .quantized import is_quantized
from .transformer import Transformer
from .transformer_config import TransformerConfig

__all__ = ["SEQ2SEQ_EXPORT_TYPES", "SEQ2SEQ_TOKEN_FIELDS", "choose_seq2seq_type",
           "seq2seq_config_for", "seq2seq_generation_config", "seq2seq_refusals",
           "seq2seq_state_dict", "seq2seq_token_ids"]


@dataclasses.dataclass(frozen=True)
class _Family:
    """One HF encoder-decoder family: its loader mapping (key map, name), the class
    transformers builds, the prefix of its base-model keys."""

    mapping: HFMapping
    architecture: str
    prefix: str

    @property
    def name(self) -> str:
        """The family in messages ("Marian")."""
        return self.mapping.name

    def rename(self, name: str) -> str:
        """A key-map HF name -> as the class saves it (head and logits bias unprefixed)."""
        return name if name in ("lm_head.weight", "final_logits_bias") else self.prefix + name


_FAMILIES = {f.mapping.model_type: f for f in (
    _Family(T5, "T5ForConditionalGeneration", ""),
    _Family(BART, "BartForConditionalGeneration", "model."),
    _Family(MARIAN, "MarianMTModel", "model."),
)}

#: the HF model types a ``Transformer`` exports as
SEQ2SEQ_EXPORT_TYPES = tuple(_FAMILIES)
#: the token ids ``token_ids=`` may name (the config holds pad, eos and the decoder's start)
SEQ2SEQ_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id",
                        "decoder_start_token_id")

#: qkv's plain FFN activation -> the HF name written (BART / Marian ``activation_function``,
#: T5 ``feed_forward_proj``)
_PLAIN = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}
#: qkv's gated FFN -> T5's ``feed_forward_proj`` (its ``dense_act_fn`` after the dash)
_T5_GATED = {"swiglu": "gated-silu", "geglu_tanh": "gated-gelu", "geglu": "gated-gelu_python"}
_LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default, which BART and Marian build


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * abs(b)


# --- choosing the family ----------------------------------------------------------------------
def choose_seq2seq_type(config: TransformerConfig) -> str:
    """The HF ``model_type`` a ``TransformerConfig`` exports as: "t5" for T5 positions,
    "bart" for learned ones, "marian" for sinusoidal ones (``seq2seq_refusals`` then says
    whether that family computes the rest).

    Raises:
        ValueError: ALiBi or Shaw positions, which no HF encoder-decoder computes."""
    p = config.positions
    if p in ("alibi", "shaw"):
        what = "ALiBi's linear biases" if p == "alibi" else "Shaw's relative embeddings"
        raise ValueError(f"hf_config_for: this TransformerConfig cannot be exported to HF: "
                         f"positions={p!r}: no HF encoder-decoder computes {what} (T5's "
                         f"buckets export as T5, learned positions as BART, sinusoidal ones "
                         f"as Marian)")
    return {"t5": "t5", "learned": "bart"}.get(p, "marian")


def _t5_refusals(c: TransformerConfig) -> list[str]:
    why = []
    if c.positions != "t5":
        why.append(f"positions={c.positions!r}: T5 has bucketed relative positions (learned "
                   f"ones export as BART, sinusoidal ones as Marian)")
    for field, want, what in (
            ("norm_first", True, "T5's layers are pre-norm"),
            ("final_norm", True, "T5 norms each stack's output"),
            ("bias", False, "T5 has no biases"),
            ("scale_embeddings", False, "T5 does not scale its embeddings"),
            ("embed_norm", False, "T5 has no embedding norm"),
            ("head_bias", False, "T5's head has no bias"),
            ("share_embeddings", True, "T5 has one token table for both stacks")):
        if getattr(c, field) != want:
            why.append(f"{field}={getattr(c, field)}: {what}")
    if c.norm != "rmsnorm":
        why.append(f"norm={c.norm!r}: T5 uses RMSNorm")
    if c.attention_scale is None or not _close(c.attention_scale, 1.0):
        why.append(f"attention_scale={c.attention_scale!r}: T5 does not scale q·k (1.0; None "
                   f"is 1/√D)")
    if not (_close(c.head_scale, 1.0) or _close(c.head_scale, c.dim ** -0.5)):
        why.append(f"head_scale={c.head_scale!r}: T5 multiplies the decoder output by "
                   f"d_model^-0.5 = {c.dim ** -0.5!r} (scale_decoder_outputs) or by 1")
    if c.activation not in _PLAIN and c.activation not in _T5_GATED:
        why.append(f"activation={c.activation!r}: T5's FFN with a name qkv reads back is one "
                   f"of {sorted(_PLAIN) + sorted(_T5_GATED)}")
    return why


def _bart_style_refusals(c: TransformerConfig, fam: str) -> list[str]:
    name = _FAMILIES[fam].name
    why = []
    want = "learned" if fam == "bart" else "sinusoidal"
    if c.positions != want:
        other = "sinusoidal ones as Marian" if fam == "bart" else "learned ones as BART"
        why.append(f"positions={c.positions!r}: {name} has {want} positions (T5's buckets "
                   f"export as T5, {other})")
    for field, value, what in (
            ("norm_first", False, f"{name}'s layers are post-norm"),
            ("final_norm", False, f"{name} has no norm after each stack"),
            ("bias", True, f"{name} has biases in every linear layer and norm"),
            ("embed_norm", fam == "bart", "BART norms its embeddings (layernorm_embedding)"
             if fam == "bart" else "Marian has no embedding norm")):
        if getattr(c, field) != value:
            why.append(f"{field}={getattr(c, field)}: {what}")
    if c.norm != "layernorm":
        why.append(f"norm={c.norm!r}: {name} uses LayerNorm")
    if c.norm == "layernorm" and not _close(c.norm_eps, _LAYERNORM_EPS):
        why.append(f"norm_eps={c.norm_eps!r}: {name}'s LayerNorms have eps 1e-5")
    if c.activation not in _PLAIN:
        why.append(f"activation={c.activation!r}: {name}'s FFN computes one of "
                   f"{sorted(_PLAIN)} (not gated)")
    if c.attention_head_dim not in (None, c.dim // c.num_heads):
        why.append(f"attention_head_dim={c.attention_head_dim}: {name}'s head dim is "
                   f"d_model / heads = {c.dim // c.num_heads}")
    elif c.attention_scale is not None and not _close(c.attention_scale, c.head_dim ** -0.5):
        why.append(f"attention_scale={c.attention_scale!r}: {name} scales q·k by 1/√D = "
                   f"{c.head_dim ** -0.5!r}")
    if not _close(c.head_scale, 1.0):
        why.append(f"head_scale={c.head_scale!r}: {name} does not scale the decoder output")
    if fam == "bart" and c.src_vocab_size != c.tgt_vocab_size:
        why.append(f"src_vocab_size={c.src_vocab_size}, tgt_vocab_size={c.tgt_vocab_size}: "
                   f"BART has one vocabulary (Marian has two)")
    elif fam == "bart" and not c.share_embeddings and c.tie_output:
        why.append("share_embeddings=False with tie_output=True: BART's tie_word_embeddings "
                   "ties both tables and the head together (separate tables need an untied "
                   "head)")
    return why


def seq2seq_refusals(config: TransformerConfig, model_type: str) -> list[str]:
    """Why HF ``model_type`` ("t5", "bart", "marian") cannot compute a ``Transformer`` of
    ``config`` exactly (empty: it can)."""
    if model_type == "t5":
        return _t5_refusals(config)
    return _bart_style_refusals(config, model_type)


def _resolve(config: Any, model_type: str | None) -> tuple[str, bool]:
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"hf_config_for: config must be a TransformerConfig, got "
                        f"{type(config).__name__}")
    if model_type is None:
        fam = choose_seq2seq_type(config)
    elif model_type not in _FAMILIES:
        raise ValueError(f"hf_config_for: model_type={model_type!r}: a TransformerConfig "
                         f"exports as one of {list(SEQ2SEQ_EXPORT_TYPES)}")
    else:
        fam = model_type
    why = seq2seq_refusals(config, fam)
    if why:
        how = "asked for" if model_type is not None else "chosen from the config"
        raise ValueError(f"hf_config_for: this TransformerConfig cannot be exported as HF "
                         f"{_FAMILIES[fam].name} (model_type {fam!r}, {how}): "
                         + "; ".join(why))
    return fam, model_type is not None


# --- token ids and config dicts ---------------------------------------------------------------
def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def seq2seq_token_ids(config: TransformerConfig, token_ids: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The HF token ids of a ``Transformer``: ``pad_token_id`` / ``eos_token_id`` /
    ``decoder_start_token_id`` from the config (``pad_id`` / ``eos_id`` / ``bos_id``, where
    qkv starts the decoder), ``bos_token_id`` (a tokenizer id, e.g. BART's ``<s>``) only
    from ``token_ids``, else None. ``token_ids`` may also repeat the config's ids, and give
    ``eos_token_id`` as a list (more stop ids) whose first is ``eos_id``.

    Raises:
        ValueError: a key outside ``SEQ2SEQ_TOKEN_FIELDS``, a value that is no id, or an id
            that differs from the config's."""
    c = config
    ids: dict[str, Any] = {"bos_token_id": None, "eos_token_id": c.eos_id,
                           "pad_token_id": c.pad_id, "decoder_start_token_id": c.bos_id}
    if token_ids is None:
        return ids
    if not isinstance(token_ids, dict) or set(token_ids) - set(SEQ2SEQ_TOKEN_FIELDS):
        raise ValueError(f"hf_config_for: token_ids must be a dict with keys among "
                         f"{list(SEQ2SEQ_TOKEN_FIELDS)}, got {token_ids!r}")
    own = {"eos_token_id": ("eos_id", c.eos_id), "pad_token_id": ("pad_id", c.pad_id),
           "decoder_start_token_id": ("bos_id", c.bos_id)}
    for key, value in token_ids.items():
        if value is None:
            continue
        many = key == "eos_token_id" and isinstance(value, list)
        if not (all(map(_is_id, value)) and value if many else _is_id(value)):
            raise ValueError(f"hf_config_for: token_ids[{key!r}] must be a non-negative int"
                             f"{' (or a non-empty list of them)' if key == 'eos_token_id' else ''}"
                             f" or None, got {value!r}")
        first = value[0] if many else value
        if key in own and first != own[key][1]:
            raise ValueError(f"hf_config_for: token_ids[{key!r}]={value!r} differs from the "
                             f"TransformerConfig's {own[key][0]}={own[key][1]}")
        ids[key] = value
    return ids


def _t5_fields(c: TransformerConfig) -> dict[str, Any]:
    proj = _T5_GATED.get(c.activation) or _PLAIN[c.activation]
    act = "gelu_new" if proj == "gated-gelu" else proj.removeprefix("gated-")  # T5Config's
    for field in ("attn_dropout", "ffn_dropout"):
        value = getattr(c, field)
        if value is not None and value != c.dropout:
            warnings.warn(f"hf_config_for: {field}={value} dropped: T5's one dropout_rate "
                          f"({c.dropout}) drops the attention weights and the FFN's hidden "
                          f"units too (training-time only; eval outputs are the same)",
                          UserWarning, stacklevel=4)
    return {"vocab_size": c.src_vocab_size, "d_model": c.dim, "d_kv": c.head_dim,
            "d_ff": c.ffn_hidden, "num_layers": c.num_encoder_layers,
            "num_decoder_layers": c.num_decoder_layers, "num_heads": c.num_heads,
            "relative_attention_num_buckets": c.relative_num_buckets,
            "relative_attention_max_distance": (128 if c.relative_max_distance is None
                                                else c.relative_max_distance),
            "dropout_rate": c.dropout, "layer_norm_epsilon": c.norm_eps,
            "feed_forward_proj": proj, "dense_act_fn": act,
            "is_gated_act": proj.startswith("gated-"),
            "tie_word_embeddings": c.tie_output,
            "scale_decoder_outputs": not _close(c.head_scale, 1.0),
            "n_positions": c.max_len, "is_encoder_decoder": True, "use_cache": True}


def _bart_style_fields(c: TransformerConfig, fam: str) -> dict[str, Any]:
    hf = {"vocab_size": c.src_vocab_size, "d_model": c.dim,
          "encoder_layers": c.num_encoder_layers, "decoder_layers": c.num_decoder_layers,
          "encoder_attention_heads": c.num_heads, "decoder_attention_heads": c.num_heads,
          "encoder_ffn_dim": c.ffn_hidden, "decoder_ffn_dim": c.ffn_hidden,
          "activation_function": _PLAIN[c.activation], "dropout": c.dropout,
          "attention_dropout": c.attn_dropout,
          "activation_dropout": c.dropout if c.ffn_dropout is None else c.ffn_dropout,
          "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
          "max_position_embeddings": c.max_len, "scale_embedding": c.scale_embeddings,
          "tie_word_embeddings": c.tie_output, "is_encoder_decoder": True, "use_cache": True,
          "forced_eos_token_id": c.eos_id}
    if fam == "marian":
        hf.update(share_encoder_decoder_embeddings=c.share_embeddings,
                  decoder_vocab_size=c.tgt_vocab_size)
    return hf


def seq2seq_config_for(config: TransformerConfig, *, model_type: str | None = None,
                       token_ids: dict[str, Any] | None = None,
                       dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF config.json dict of a ``Transformer`` with ``config`` (``hf_export.
    hf_config_for`` for a ``TransformerConfig``).

    Args:
        config: the ``TransformerConfig``.
        model_type: "t5", "bart" or "marian"; None: ``choose_seq2seq_type(config)``.
        token_ids: as ``seq2seq_token_ids``.
        dtype: the weights' dtype, written as ``dtype``.

    Raises:
        ValueError: the family cannot compute this config exactly (every reason in one
            line), ALiBi / Shaw positions, another ``model_type``, bad ``token_ids``.
        TypeError: not a ``TransformerConfig``.

    Warns:
        UserWarning: T5 with ``attn_dropout`` or ``ffn_dropout`` != ``dropout`` (T5 has one
            dropout rate; training only).
    """
    fam, _ = _resolve(config, model_type)
    ids = seq2seq_token_ids(config, token_ids)
    body = _t5_fields(config) if fam == "t5" else _bart_style_fields(config, fam)
    head = {"model_type": fam, "architectures": [_FAMILIES[fam].architecture],
            "dtype": str(dtype).removeprefix("torch.")}
    return {**head, **ids, **body}


def seq2seq_generation_config(config: TransformerConfig, *, model_type: str | None = None,
                              token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """The generation_config.json dict: ``decoder_start_token_id``, ``eos_token_id``,
    ``pad_token_id`` (and ``bos_token_id`` when known); BART and Marian also force eos at the
    length limit (``forced_eos_token_id``, as their configs do) and Marian bans the pad token
    (``bad_words_ids=[[pad]]``), as transformers' conversion of Marian models writes them.

    Raises: as ``seq2seq_config_for``."""
    fam, _ = _resolve(config, model_type)
    gen = {k: v for k, v in seq2seq_token_ids(config, token_ids).items() if v is not None}
    if fam != "t5":
        gen["forced_eos_token_id"] = config.eos_id
    if fam == "marian":
        gen["bad_words_ids"] = [[config.pad_id]]
    return gen


# --- the weights --------------------------------------------------------------------------------
def _channel_axes(name: str) -> tuple[int, ...]:
    """The C axes of a Marian tensor (HF name): dim 1 of token tables, the head and the
    input projections (q/k/v, fc1); dim 0 of output projections (out_proj, fc2: weight and
    bias) and of LayerNorm weights and biases; none of q/k/v and fc1 biases and
    final_logits_bias."""
    if name.endswith("embed_tokens.weight") or name in ("model.shared.weight",
                                                          "lm_head.weight"):
        return (1,)
    if name == "final_logits_bias":
        return ()
    module, param = name.split(".")[-2:]
    if module in ("q_proj", "k_proj", "v_proj", "fc1"):
        return (1,) if param == "weight" else ()
    if module in ("out_proj", "fc2") or module.endswith("layer_norm"):
        return (0,)
    raise ValueError(f"to_hf: no channel axis known for Marian tensor {name}")


def _halves_basis(state: dict[str, Tensor], dim: int) -> dict[str, Tensor]:
    """The state in the channel order that turns interleaved sinusoids into [sin | cos]
    halves: new channel i is old channel 2i, new C/2 + i is old 2i + 1."""
    perm = torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))  # (C,)
    out = {}
    for name, t in state.items():
        for axis in _channel_axes(name):
            t = t.index_select(axis, perm)
        out[name] = t.contiguous()
    return out


def _bart_positions(t: Tensor, offset: int) -> Tensor:
    """A (P + offset, C) table read at position + offset -> BART's (P + 2, C) read at
    position + 2 (rows 0..1 zeros, never read, when offset < 2)."""
    if offset >= 2:
        return t[offset - 2:].clone()
    return torch.cat((t.new_zeros(2 - offset, t.shape[1]), t))


def seq2seq_state_dict(model: nn.Module, *, model_type: str | None = None
                       ) -> dict[str, Tensor]:
    """The HF state dict of a qkv ``Transformer`` (CPU tensors of the model's dtype): the
    inverse of the family's key map, with the tables, biases and positions transformers
    stores (the module docstring).

    Raises:
        ValueError: what ``seq2seq_config_for`` refuses, a quantized model, a state-dict
            key the family has no place for (adapters, added modules).
        TypeError: not a ``Transformer``.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"to_hf: model must be a qkv Transformer, got {type(model).__name__}")
    if is_quantized(model):
        raise ValueError("to_hf: the model is quantized with qkv.quantize (int8 layers); no HF "
                         "class reads qkv's int8 format: export the float model")
    c = model.config
    fam, _ = _resolve(c, model_type)
    f = _FAMILIES[fam]
    out = unmap_state(model.state_dict(), f.mapping.key_map(c), family=f.name,
                      rename=f.rename)
    if fam == "t5":
        return out
    bias = out.pop("final_logits_bias", None)
    dtype = model.lm_head.weight.dtype
    out["final_logits_bias"] = (bias.reshape(1, -1) if bias is not None  # (1, V_tgt)
                                else torch.zeros(1, c.tgt_vocab_size, dtype=dtype))
    if not c.tie_output:  # transformers 5 then ties no table: every one is stored
        shared, enc, dec = (f"model.{n}.weight" for n in ("shared", "encoder.embed_tokens",
                                                          "decoder.embed_tokens"))
        if shared in out:
            out.setdefault(enc, out[shared].clone())
            out.setdefault(dec, out[shared].clone())
        elif fam == "bart":
            out[shared] = out[enc].clone()  # read by neither stack
    if fam == "bart" and c.position_offset != 2:
        for stack in ("encoder", "decoder"):
            key = f"model.{stack}.embed_positions.weight"
            out[key] = _bart_positions(out[key], c.position_offset)
    if fam == "marian" and c.sinusoidal_layout == "interleaved":
        out = _halves_basis(out, c.dim)
    return out
