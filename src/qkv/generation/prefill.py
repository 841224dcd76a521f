"""The prompt of a padded batch through the model's own layers on its real tokens only
(``prefill_rows``): the prefill of the decode engine's fp32 steppers.

Shapes: R rows, N prompt length, T real tokens in all, C width.

A left-padded batch without gradients runs the layers on the packed (T, C) token rows
(``EncoderLayer.forward(x, rows=...)``: norms, projections and feed-forwards see the T real
tokens; attention alone runs in the padded layout), and the last layer at each row's last
token only (``at=``) (``BENCHMARKS.md``, generation: prefill).
"""

from __future__ import annotations

from torch import Tensor

from ..models.gpt import GPT
from ..models.inputs import check_token_ids
from ..modules.cache import KVCache
from ..modules.layers import TokenRows
from ..modules.positions import positions_from_mask

__all__ = ["prefill_rows"]


def prefill_rows(model: GPT, ids: Tensor, keep: Tensor, cache: list[KVCache]) -> Tensor:
    """``GPT.hidden_states(ids, attention_mask=keep, cache=cache)[0][:, -1]`` of a left-padded
    batch, computed on its T real tokens only (no gradients): final-normed hidden states
    (R, C) of every row's last position.

    The layers run on the packed (T, C) token rows (``EncoderLayer.forward(x, rows=...)``):
    norms, projections and feed-forwards see the T real tokens; attention alone runs in the
    padded (R, H, N, D) layout with ``hidden_states``' mask (``GPT.layer_mask``: key
    padding, causal). Positions count from each row's first real token
    (``positions_from_mask``), as ``hidden_states``. The caches (empty, from
    ``model.new_cache``) get the real tokens' keys/values and zeros at the padded positions,
    which every later step masks (``keep``). The last layer runs at each row's last token
    only (``at=``: every token's key/value is projected and cached; the query, attention,
    output projection, norm and feed-forward run for the R last tokens), and so does the
    final norm.

    Args:
        model: an ``eligible`` GPT.
        ids: (R, N) token ids, left-padded.
        keep: (R, N) bool, True = real token; every row's last column is real.
        cache: the model's ``new_cache(R, capacity)``, empty; filled with N positions.

    Raises:
        ValueError when a row's last column is padding (not left-padded), a token id is
        outside [0, V), or a position exceeds the learned table.
    """
    check_token_ids("GPT", "input_ids", ids, model.config.vocab_size, "vocab_size")
    if not bool(keep[:, -1].all()):
        raise ValueError("prefill_rows: keep must be left-padded (every row's last column a "
                         f"real token), got last column {keep[:, -1].tolist()}")
    n = ids.shape[1]
    rows = TokenRows(keep)
    pos = positions_from_mask(keep)  # (R, N)
    x = model.embed_tokens(rows.pack(ids))  # (T, C)
    if model.positions is not None:
        x = x + model.positions.encoding(rows.pack(pos))  # (T, C)
    masks = model.layer_masks(keep, cache, n)
    rope_pos = pos if model.rope is not None else None
    bufs: dict[str, Tensor] = {}
    last = keep.sum(dim=1).cumsum(dim=0) - 1  # (R,) each row's last real token in T
    *body, top = model.layers
    for layer, kc, (mask, causal) in zip(body, cache, masks, strict=False):
        x = layer(x, rows=rows, mask=mask, causal=causal, cache=kc, positions=rope_pos,
                  bufs=bufs)  # (T, C)
    mask, causal = masks[-1]
    x = top(x, rows=rows, at=last, mask=mask, causal=causal, cache=cache[-1],
            positions=rope_pos, bufs=bufs)  # (R, C)
    return model.norm(x)  # (R, C)
