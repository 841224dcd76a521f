"""HuggingFace BART checkpoints -> ``qkv.models.transformer.Transformer``: the ``BART``
mapping, and the pieces every BART-style seq2seq mapping shares (``hf_marian`` reuses them):
the audit entries, the config reading, the token-table normalisation and the key map.

Shapes: V vocab size (V_src, V_tgt with separate vocabularies), C model width (``d_model``),
H heads, D = C / H, F feed-forward width, P positions (``max_position_embeddings``).

- HF keeps separate q/k/v projections (C, C) / (C,) for each attention; qkv's ``in_proj``
  fuses them into (3C, C) / (3C,), rows q, k, v — for the self-attentions and for the
  decoder's cross-attention (``encoder_attn`` -> ``cross_attn``: qkv's cross-attention holds
  one fused ``in_proj`` too when the memory has the model's width; q reads rows 0..C, k and v
  the rest).
- Norms, post-norm layers: encoder ``self_attn_layer_norm`` / ``final_layer_norm`` ->
  ``norm1`` / ``norm2``; decoder ``self_attn_layer_norm`` / ``encoder_attn_layer_norm`` /
  ``final_layer_norm`` -> ``norm1`` / ``norm2`` / ``norm3``; ``fc1`` / ``fc2`` -> the FFN's
  ``fc_in`` / ``fc_out``. BART's ``layernorm_embedding`` -> ``src_embed_norm`` /
  ``tgt_embed_norm`` (``embed_norm``).
- Positions: BART's learned tables (P + 2, C), read at position + 2 (``position_offset=2``).
  HF counts positions 0..N-1 whatever the padding; qkv counts from each row's first real
  token, which is the same for right-padded sources (the convention of both) and for the
  decoder, which is never left-padded here.
- Token tables: ``model.shared`` and its tied copies ``model.encoder.embed_tokens`` /
  ``model.decoder.embed_tokens`` (and ``lm_head`` with ``tie_word_embeddings``): stored
  copies must be equal and load as one table (``share_embeddings``); with
  ``tie_word_embeddings=False`` transformers 5 ties nothing, so stored encoder / decoder
  tables load apart and ``lm_head.weight`` is the separate head (``tie_output=False``).
- ``final_logits_bias`` (1, V) -> ``lm_head.bias`` (V,) (``head_bias``, set when the
  checkpoint holds one).

``BART_FIELDS`` classifies every field of transformers' ``BartConfig`` (5.x, 4.x and the
3.x fields still found in Hub checkpoints, such as ``extra_pos_embeddings`` and
``normalize_before``). This module never imports the model (docs/ARCHITECTURE.md: Adding a
model family).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..files import CheckpointError
from .hf_config import COMMON_FIELDS, HF_ACTIVATIONS, Check, audit_hf_config, only
from .hf_load import HFMapping
from .hf_state import Fused, KeyMap, layer_field
from .weights import same_values

__all__ = ["BART", "BART_DEFAULTS", "BART_FIELDS", "DECODER_LAYER_KEY", "ENCODER_LAYER_KEY",
           "SEQ2SEQ_FIELDS", "bart_fields", "normalise_bias", "seq2seq_fields",
           "seq2seq_key_map", "seq2seq_layer_counts", "seq2seq_state_fields", "strip_prefix",
           "token_tables"]

#: the layer index in the names of the encoder's / decoder's layer tensors
ENCODER_LAYER_KEY = r"(?:model\.)?encoder\.layers\.(\d+)\."
DECODER_LAYER_KEY = r"(?:model\.)?decoder\.layers\.(\d+)\."

#: transformers' attribute_map: alias -> the field it names
_ALIASES = {"hidden_size": "d_model", "num_attention_heads": "encoder_attention_heads",
            "num_hidden_layers": "encoder_layers"}

#: BartConfig's defaults for the fields a config.json may leave out
BART_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50265, "max_position_embeddings": 1024, "encoder_layers": 12,
    "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12,
    "decoder_ffn_dim": 4096, "decoder_attention_heads": 16, "activation_function": "gelu",
    "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
    "scale_embedding": False, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
    "decoder_start_token_id": 2, "tie_word_embeddings": True}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _known_activation(value: Any, _data: dict[str, Any]) -> bool:
    return isinstance(value, str) and value in HF_ACTIVATIONS


def _eos_ok(value: Any, _data: dict[str, Any]) -> bool:
    return _int(value) or (isinstance(value, list) and bool(value) and all(map(_int, value)))


def _zero(value: Any, _data: dict[str, Any]) -> bool:
    return value in (0, 0.0, None)


_LAYERDROP = Check(_zero, "qkv's Transformer has no LayerDrop: training differs (skipped "
                   "layers); eval outputs are the same", warn=True)

#: the fields of a BART-style seq2seq config (BART, Marian); each family adds its own
SEQ2SEQ_FIELDS: dict[str, str | Check] = {
    **COMMON_FIELDS,
    "vocab_size": "used", "max_position_embeddings": "used", "d_model": "used",
    "encoder_layers": "used", "decoder_layers": "used",
    "encoder_attention_heads": "used: equal to decoder_attention_heads (qkv's Transformer "
                               "has one head count)",
    "decoder_attention_heads": "used: equal to encoder_attention_heads",
    "encoder_ffn_dim": "used: equal to decoder_ffn_dim (qkv's Transformer has one FFN "
                       "width)",
    "decoder_ffn_dim": "used: equal to encoder_ffn_dim",
    "hidden_size": "used (alias of d_model)",
    "num_attention_heads": "used (alias of encoder_attention_heads)",
    "num_hidden_layers": "used (alias of encoder_layers)",
    "activation_function": Check(_known_activation, f"qkv computes {sorted(HF_ACTIVATIONS)}",
                                 used=True),
    "dropout": "used", "attention_dropout": "used",
    "activation_dropout": "used (ffn_dropout)",
    "encoder_layerdrop": _LAYERDROP, "decoder_layerdrop": _LAYERDROP,
    "scale_embedding": "used",
    "tie_word_embeddings": "used",
    "pad_token_id": Check(lambda v, _d: _int(v), "an int (qkv's pad_id)", used=True),
    "eos_token_id": Check(_eos_ok, "an int or a list of ints (qkv's eos_id: the first)",
                          used=True),
    "decoder_start_token_id": "used: qkv's bos_id, where generate starts the decoder",
    "bos_token_id": "used: the decoder's start when decoder_start_token_id is null; "
                    "otherwise a tokenizer id",
    "is_decoder": only(False, None, why="a decoder alone (*ForCausalLM) is not an "
                                        "encoder-decoder"),
    "add_cross_attention": "ignored: the decoder always cross-attends; not read",
    "init_std": "ignored: initialisation only; the weights are loaded",
    "use_cache": "ignored: a key/value cache never changes outputs",
    "output_past": "ignored: 3.x name of use_cache",
    "classif_dropout": "ignored: 3.x name of classifier_dropout (a task head)",
    "_num_labels": "ignored: 3.x task-head size",
    "force_bos_token_to_be_generated": "ignored: a 3.x generation default "
                                       "(forced_bos_token_id)",
    "normalize_before": only(False, why="pre-norm layers (mBART's) are not mapped; BART "
                                        "and Marian are post-norm"),
    "add_final_layer_norm": only(False, why="final stack norms (mBART's) are not mapped"),
    "do_blenderbot_90_layernorm": only(False, why="Blenderbot-90M's norm order is not "
                                                  "mapped"),
    "add_bias_logits": only(False, why="3.x logits bias variant; final_logits_bias is "
                                       "read from the weights"),
}

BART_FIELDS: dict[str, str | Check] = {
    **SEQ2SEQ_FIELDS,
    "model_type": only("bart", why="the BART mapping reads 'bart' checkpoints"),
    "extra_pos_embeddings": only(2, why="transformers reads position + 2 (the 3.x offset)"),
    "normalize_embedding": only(True, why="BART norms its embeddings (layernorm_embedding)"),
    "static_position_embeddings": only(False, why="BART's positions are learned"),
}


def _resolve_aliases(hf: dict[str, Any], source: str) -> dict[str, Any]:
    hf = dict(hf)
    for alias, name in _ALIASES.items():
        if alias in hf:
            value = hf.pop(alias)
            if name in hf and hf[name] != value:
                raise CheckpointError(f"{source}: config.json {alias}={value!r} and {name}="
                                      f"{hf[name]!r} disagree (transformers reads them as "
                                      f"one field)")
            hf[name] = value
    return hf


def seq2seq_fields(hf: dict[str, Any], defaults: dict[str, Any], source: str, name: str
                   ) -> dict[str, Any]:
    """``TransformerConfig`` fields shared by BART-style configs (already audited), a field
    left out taking ``defaults``: widths, depths, heads, FFN, activation, dropouts, positions'
    ``max_len``, embedding scale, pad / eos / start ids, ``tie_output``; post-norm
    LayerNorms (eps 1e-5) with biases everywhere.

    Raises:
        CheckpointError (one line): encoder and decoder head counts or FFN widths that
        differ, an alias that disagrees with its field, a missing pad or start id, a bad
        value."""
    raw = _resolve_aliases(hf, source)
    hf = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    for enc, dec, what in (("encoder_attention_heads", "decoder_attention_heads", "head count"),
                           ("encoder_ffn_dim", "decoder_ffn_dim", "FFN width")):
        if hf[enc] != hf[dec]:
            raise CheckpointError(f"{source}: config.json {enc}={hf[enc]!r} but {dec}="
                                  f"{hf[dec]!r}: qkv's Transformer has one {what} for both "
                                  f"stacks")
    eos = hf["eos_token_id"]
    start = raw.get("decoder_start_token_id", defaults.get("decoder_start_token_id"))
    if start is None:  # transformers' generate then starts from bos_token_id
        start = raw.get("bos_token_id", defaults.get("bos_token_id"))
    if start is None:
        raise CheckpointError(f"{source}: config.json sets neither decoder_start_token_id nor "
                              f"bos_token_id: the decoder's first token is unknown")
    try:
        return dict(
            src_vocab_size=int(hf["vocab_size"]), tgt_vocab_size=int(hf["vocab_size"]),
            dim=int(hf["d_model"]), num_encoder_layers=int(hf["encoder_layers"]),
            num_decoder_layers=int(hf["decoder_layers"]),
            num_heads=int(hf["encoder_attention_heads"]), ffn_hidden=int(hf["encoder_ffn_dim"]),
            activation=HF_ACTIVATIONS[hf["activation_function"]], norm_first=False,
            final_norm=False, norm="layernorm", norm_eps=1e-5, bias=True,
            dropout=float(hf["dropout"]), attn_dropout=float(hf["attention_dropout"]),
            ffn_dropout=float(hf["activation_dropout"]),
            max_len=int(hf["max_position_embeddings"]),
            scale_embeddings=bool(hf["scale_embedding"]), pad_id=int(hf["pad_token_id"]),
            eos_id=int(eos[0] if isinstance(eos, list) else eos), bos_id=int(start),
            tie_output=bool(hf["tie_word_embeddings"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: not a valid {name} config: {err!r}") from err


def bart_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``TransformerConfig`` fields from an HF BART config.json (audited by ``BART_FIELDS``
    first: refused options raise a ``CheckpointError``, unknown fields warn): the shared
    reading (``seq2seq_fields``) with learned positions at offset 2 and
    ``layernorm_embedding`` (``embed_norm``)."""
    audit_hf_config(hf, BART_FIELDS, source)
    return {**seq2seq_fields(hf, BART_DEFAULTS, source, "BART"), "positions": "learned",
            "position_offset": 2, "embed_norm": True}


_ENC, _DEC, _SHARED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                       "shared.weight")


def _same_or_refuse(state: dict[str, Tensor], keys: list[str], source: str, why: str) -> None:
    first = keys[0]
    for key in keys[1:]:
        if not same_values(state[first], state[key]):
            raise CheckpointError(f"{source}: {key} differs from {first}, but {why}; qkv "
                                  f"will not pick one")


def token_tables(state: dict[str, Tensor], *, shared: bool, tied: bool, source: str
                 ) -> dict[str, Tensor]:
    """The token tables and head of a BART-style state (keys without "model.") in the key
    map's names: ``shared.weight`` for one table (source = target), else
    ``encoder.embed_tokens.weight`` / ``decoder.embed_tokens.weight``; ``lm_head.weight``
    only when untied.

    ``shared``: the family ties the encoder's and decoder's tables (BART;
    Marian's ``share_encoder_decoder_embeddings``); ``tied``: ``tie_word_embeddings``
    (transformers 5 ties nothing without it: the stored encoder / decoder tables, else
    ``shared``, as transformers 4 read them).

    Raises:
        CheckpointError: tied copies that differ.
    """
    out = dict(state)
    if tied:
        group = [_SHARED, _ENC, _DEC, "lm_head.weight"] if shared else [_DEC, "lm_head.weight"]
        present = [k for k in group if k in out]
        if present:
            _same_or_refuse(out, present, source, "config.json ties them "
                            "(tie_word_embeddings=True" + (")" if not shared else
                                                           ", one shared table)"))
            keep = out[present[0]]
            for k in present:
                del out[k]
            out[_SHARED if shared else _DEC] = keep
        return out
    if not shared:
        return out
    src = _ENC if _ENC in out else _SHARED
    tgt = _DEC if _DEC in out else _SHARED
    if src == tgt:
        return out
    tables = {k: out[k] for k in (src, tgt) if k in out}
    out.pop(_SHARED, None)  # read by neither stack once both tables are stored
    for ours, theirs in ((_ENC, src), (_DEC, tgt)):
        out.pop(theirs, None)
        if theirs in tables:
            out[ours] = tables[theirs]
    return out


def normalise_bias(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``final_logits_bias`` (1, V) -> (V,) (a view); other shapes left for the shape
    check."""
    bias = state.get("final_logits_bias")
    if bias is not None and bias.dim() == 2 and bias.shape[0] == 1:
        state = {**state, "final_logits_bias": bias.reshape(-1)}  # (V,)
    return state


def strip_prefix(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """HF names without "model." (``*ForConditionalGeneration``; ``*Model`` has none).

    Raises:
        CheckpointError: a key stored both with and without the prefix."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        k = key.removeprefix("model.")
        if k in out:
            raise CheckpointError(f"{source}: key {key!r} appears twice (with and without "
                                  f"the 'model.' prefix)")
        out[k] = t
    return out


def _bart_normalise(state: dict[str, Tensor], hf: dict[str, Any], source: str
                    ) -> dict[str, Tensor]:
    tied = hf.get("tie_word_embeddings", BART_DEFAULTS["tie_word_embeddings"]) is not False
    state = token_tables(strip_prefix(state, source), shared=True, tied=tied, source=source)
    return normalise_bias(state)


def seq2seq_state_fields(state: dict[str, Tensor]) -> dict[str, Any]:
    """The config fields a normalised state decides: one token table (``shared.weight``)
    or two, and the logits bias (``final_logits_bias``)."""
    return {"share_embeddings": _SHARED in state, "head_bias": "final_logits_bias" in state}


def seq2seq_key_map(config: Any) -> KeyMap:
    """qkv ``Transformer`` keys -> HF BART-style keys (without "model."): q/k/v as ``Fused``
    row blocks (H·D each) of ``in_proj``; learned positions and embedding norms when the
    config has them; the head tied to the target table unless ``tie_output`` is False."""
    c = config
    rows = (c.num_heads * c.head_dim,) * 3
    src = _SHARED if c.share_embeddings else _ENC
    tgt = _SHARED if c.share_embeddings else _DEC
    m: KeyMap = {"src_embed.weight": src, "tgt_embed.weight": tgt,
                 "lm_head.weight": tgt if c.tie_output else "lm_head.weight"}
    if c.head_bias:
        m["lm_head.bias"] = "final_logits_bias"
    for ours, stack in (("src", "encoder"), ("tgt", "decoder")):
        if c.positions == "learned":
            m[f"{ours}_positions.weight"] = f"{stack}.embed_positions.weight"
        if c.embed_norm:
            for p in ("weight", "bias"):
                m[f"{ours}_embed_norm.{p}"] = f"{stack}.layernorm_embedding.{p}"

    def attention(ours: str, theirs: str) -> None:
        for p in ("weight", "bias"):
            m[f"{ours}.in_proj.{p}"] = Fused(tuple(f"{theirs}.{n}_proj.{p}" for n in "qkv"),
                                             rows)
            m[f"{ours}.out_proj.{p}"] = f"{theirs}.out_proj.{p}"

    for i in range(c.num_encoder_layers):
        q, h = f"encoder_layers.{i}.", f"encoder.layers.{i}."
        attention(q + "attn", h + "self_attn")
        for ours, theirs in (("norm1", "self_attn_layer_norm"), ("ffn.fc_in", "fc1"),
                             ("ffn.fc_out", "fc2"), ("norm2", "final_layer_norm")):
            for p in ("weight", "bias"):
                m[f"{q}{ours}.{p}"] = f"{h}{theirs}.{p}"
    for i in range(c.num_decoder_layers):
        q, h = f"decoder_layers.{i}.", f"decoder.layers.{i}."
        attention(q + "self_attn", h + "self_attn")
        attention(q + "cross_attn", h + "encoder_attn")
        for ours, theirs in (("norm1", "self_attn_layer_norm"),
                             ("norm2", "encoder_attn_layer_norm"), ("ffn.fc_in", "fc1"),
                             ("ffn.fc_out", "fc2"), ("norm3", "final_layer_norm")):
            for p in ("weight", "bias"):
                m[f"{q}{ours}.{p}"] = f"{h}{theirs}.{p}"
    return m


def seq2seq_layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
    """(field, value, regex) of the encoder and decoder depths, for ``check_layer_counts``."""
    return [(layer_field(hf, "encoder_layers", "num_hidden_layers"),
             fields["num_encoder_layers"], ENCODER_LAYER_KEY),
            (layer_field(hf, "decoder_layers"), fields["num_decoder_layers"],
             DECODER_LAYER_KEY)]


#: HF BART (``BartForConditionalGeneration`` / ``BartModel``) -> ``Transformer``
BART = HFMapping(model_type="bart", name="BART", config_fields=bart_fields,
                 layer_counts=seq2seq_layer_counts, key_map=seq2seq_key_map,
                 normalise=_bart_normalise, state_fields=seq2seq_state_fields)
