"""HuggingFace Marian checkpoints (opus-mt) -> ``qkv.models.transformer.Transformer``: the
``MARIAN`` mapping, BART's shared pieces (``hf_bart``) with what Marian does differently.

Shapes: V_src / V_tgt vocab sizes (``vocab_size`` / ``decoder_vocab_size``), C model width
(``d_model``), P positions (``max_position_embeddings``).

- Positions: fixed sinusoids, sin and cos in halves ([sin | cos], ``sinusoidal_layout=
  "halves"``), not stored by transformers 5; an older checkpoint's
  ``model.encoder/decoder.embed_positions.weight`` (P, C) is checked against the table qkv
  computes (within the stored dtype's resolution) and dropped; another table is refused.
  As for BART, HF counts positions 0..N-1 whatever the padding, qkv from each row's first
  real token: the same on right-padded sources.
- No embedding norm; post-norm layers as BART's (``hf_bart``); ``scale_embedding`` (√C).
- Token tables: ``share_encoder_decoder_embeddings`` (default True) ties ``model.shared``
  and the encoder / decoder tables (one ``share_embeddings`` table); False keeps the
  encoder's (V_src) and the decoder's (V_tgt = ``decoder_vocab_size``) apart, the head tied
  to the decoder's with ``tie_word_embeddings``.
- ``final_logits_bias`` (1, V_tgt) -> ``lm_head.bias`` when the checkpoint holds one.
- The decoder starts from ``decoder_start_token_id`` (the pad id in opus-mt): qkv's bos_id.

``MARIAN_FIELDS`` classifies every field of transformers' ``MarianConfig`` (5.x, 4.x and
the 3.x BART-derived fields opus-mt config.json files still carry, such as
``static_position_embeddings`` and ``normalize_embedding``). This module never imports the
model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..files import CheckpointError
from ..modules.positions import Sinusoidal
from .hf_bart import (
    SEQ2SEQ_FIELDS,
    normalise_bias,
    seq2seq_fields,
    seq2seq_key_map,
    seq2seq_layer_counts,
    seq2seq_state_fields,
    strip_prefix,
    token_tables,
)
from .hf_config import Check, audit_hf_config, only
from .hf_load import HFMapping

__all__ = ["MARIAN", "MARIAN_DEFAULTS", "MARIAN_FIELDS", "check_positions", "marian_fields"]

#: MarianConfig's defaults for the fields a config.json may leave out
MARIAN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 58101, "decoder_vocab_size": None, "max_position_embeddings": 1024,
    "encoder_layers": 12, "encoder_ffn_dim": 4096, "encoder_attention_heads": 16,
    "decoder_layers": 12, "decoder_ffn_dim": 4096, "decoder_attention_heads": 16,
    "activation_function": "gelu", "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "scale_embedding": False, "pad_token_id": 58100,
    "bos_token_id": None, "eos_token_id": 0, "decoder_start_token_id": 58100,
    "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True}


def _vocab(value: Any, _data: dict[str, Any]) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value > 0)


MARIAN_FIELDS: dict[str, str | Check] = {
    **SEQ2SEQ_FIELDS,
    "model_type": only("marian", why="the Marian mapping reads 'marian' checkpoints"),
    "decoder_vocab_size": Check(_vocab, "a positive int or null (= vocab_size)", used=True),
    "share_encoder_decoder_embeddings": "used",
    "normalize_embedding": only(False, why="Marian has no embedding norm"),
    "static_position_embeddings": only(True, why="Marian's positions are sinusoidal"),
    "extra_pos_embeddings": "ignored: a 3.x offset of learned positions; Marian's are "
                            "sinusoidal and read at the position itself",
}


def _shared(hf: dict[str, Any]) -> bool:
    return hf.get("share_encoder_decoder_embeddings", True) is not False


def marian_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``TransformerConfig`` fields from an HF Marian config.json (audited by
    ``MARIAN_FIELDS`` first): the shared reading (``hf_bart.seq2seq_fields``) with
    sinusoidal [sin | cos] positions, no embedding norm, and the decoder's vocabulary
    (``decoder_vocab_size`` when the tables are not shared; transformers reads
    ``vocab_size`` for both when they are)."""
    audit_hf_config(hf, MARIAN_FIELDS, source)
    fields = seq2seq_fields(hf, MARIAN_DEFAULTS, source, "Marian")
    if not _shared(hf):
        fields["tgt_vocab_size"] = int(hf.get("decoder_vocab_size") or fields["src_vocab_size"])
    return {**fields, "positions": "sinusoidal", "sinusoidal_layout": "halves",
            "embed_norm": False}


def check_positions(state: dict[str, Tensor], hf: dict[str, Any], source: str
                    ) -> dict[str, Tensor]:
    """``state`` without the stored sinusoid tables (``encoder/decoder.embed_positions.
    weight``, (P, C)), each checked against qkv's [sin | cos] table: equal within
    ``max(1e-5, eps of its dtype)`` (meta tensors: by shape).

    Raises:
        CheckpointError (one line): a table of another shape or other values (another
        position layout, which qkv does not compute)."""
    keys = [k for k in ("encoder.embed_positions.weight", "decoder.embed_positions.weight")
            if k in state]
    if not keys:
        return state
    dim = int(hf.get("d_model", hf.get("hidden_size", MARIAN_DEFAULTS["d_model"])))
    rows = int(hf.get("max_position_embeddings", MARIAN_DEFAULTS["max_position_embeddings"]))
    state = dict(state)
    table = None
    for key in keys:
        t = state.pop(key)
        if tuple(t.shape) != (rows, dim):
            raise CheckpointError(f"{source}: {key} has shape {tuple(t.shape)}, not the "
                                  f"(max_position_embeddings, d_model) = ({rows}, {dim}) "
                                  f"sinusoid table Marian uses")
        if t.is_meta or dim % 2:  # values checked on the real load; odd C: refused by config
            continue
        if table is None:
            pe = Sinusoidal(dim, max_len=rows, layout="halves")
            table = pe(torch.zeros(1, rows, dim))[0]  # (P, C) fp32
        tol = max(1e-5, torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0)
        diff = float((t.float() - table).abs().max())
        if not diff <= tol:
            raise CheckpointError(f"{source}: {key} is not the sinusoidal [sin | cos] table "
                                  f"qkv computes for Marian (max |difference| {diff:.3g} > "
                                  f"{tol:.3g}): another position layout, which qkv does not "
                                  f"compute")
    return state


def _normalise(state: dict[str, Tensor], hf: dict[str, Any], source: str
               ) -> dict[str, Tensor]:
    tied = hf.get("tie_word_embeddings", MARIAN_DEFAULTS["tie_word_embeddings"]) is not False
    state = check_positions(strip_prefix(state, source), hf, source)
    state = token_tables(state, shared=_shared(hf), tied=tied, source=source)
    return normalise_bias(state)


#: HF Marian (``MarianMTModel`` / ``MarianModel``) -> ``Transformer``
MARIAN = HFMapping(model_type="marian", name="Marian", config_fields=marian_fields,
                   layer_counts=seq2seq_layer_counts, key_map=seq2seq_key_map,
                   normalise=_normalise, state_fields=seq2seq_state_fields)
