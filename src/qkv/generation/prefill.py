"""The prompt of a padded batch through the model's own layers on its real tokens only
(``prefill_rows``): the prefill of the decode engine's fp32 steppers.

Shapes: R rows, N prompt length, T real tokens in all, C width.

A left-padded batch without gradients runs the layers' ``EncoderLayer.forward_rows`` on the
packed (T, C) token rows (norms, projections and feed-forwards see the T real tokens;
attention alone runs in the padded layout), and the last layer at each row's last token only
(``BENCHMARKS.md``, generation: prefill).
"""

from __future__ import annotations

from torch import Tensor

from ..models.gpt import GPT
from ..models.inputs import check_token_ids
from ..modules.cache import KVCache
from ..modules.layers import EncoderLayer, TokenRows
from ..modules.linear_call import apply_linear
from ..modules.positions import positions_from_mask
from ..ops import attention

__all__ = ["prefill_rows"]


def prefill_rows(model: GPT, ids: Tensor, keep: Tensor, cache: list[KVCache]) -> Tensor:
    """``GPT.hidden_states(ids, attention_mask=keep, cache=cache)[0][:, -1]`` of a left-padded
    batch, computed on its T real tokens only (no gradients): final-normed hidden states
    (R, C) of every row's last position.

    The layers run on the packed (T, C) token rows (``EncoderLayer.forward_rows``): norms,
    projections and feed-forwards see the T real tokens; attention alone runs in the padded
    (R, H, N, D) layout with ``hidden_states``' mask (key padding, causal). Positions count
    from each row's first real token (``positions_from_mask``), as ``hidden_states``. The
    caches (empty, from ``model.new_cache``) get the real tokens' keys/values and zeros at
    the padded positions, which every later step masks (``keep``). The final norm runs on the
    R last rows only.

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
    x = model.embed(rows.pack(ids))  # (T, C)
    if model.positions is not None:
        x = x + model.positions.encoding(rows.pack(pos))  # (T, C)
    mask, causal = model._layer_mask(keep, cache, n)
    rope_pos = pos if model.rope is not None else None
    bufs: dict[str, Tensor] = {}
    last = keep.sum(dim=1).cumsum(dim=0) - 1  # (R,) each row's last real token in T
    *body, top = model.layers
    for layer, kc in zip(body, cache, strict=False):
        x = layer.forward_rows(x, rows, mask=mask, causal=causal, cache=kc,
                               positions=rope_pos, bufs=bufs)  # (T, C)
    if top.rows_are_direct(cache[-1]) and top.norm_first:
        x = _last_layer_at(top, x, rows, keep, last, cache[-1], rope_pos)  # (R, C)
    else:
        x = top.forward_rows(x, rows, mask=mask, causal=causal, cache=cache[-1],
                             positions=rope_pos, bufs=bufs).index_select(0, last)  # (R, C)
    return model.norm(x)  # (R, C)


def _last_layer_at(layer: EncoderLayer, h: Tensor, rows: TokenRows, keep: Tensor,
                   last: Tensor, cache: KVCache, pos: Tensor | None) -> Tensor:
    """A pre-norm ``layer.forward_rows(h, rows, ...)`` at each row's last token only (the
    prefill's last layer: nobody reads its other rows): every token's key/value is projected
    (and cached, zeros at the padded positions), the query, attention, output projection,
    norm and feed-forward run for the R last tokens. h (T, C) -> (R, C).

    Args:
        keep: (R, N) bool, True = real token; the last query sees every real key.
        last: (R,) the row of h that is each sequence's last (query) token.
        pos: (R, N) RoPE positions, or None without RoPE.
    """
    attn = layer.attn
    b, hd = rows.batch, attn._splits[0]
    proj = apply_linear(attn.in_proj, layer.norm1(h))  # (T, (H + 2·Hkv)·D)
    q = proj.index_select(0, last)[:, :hd].reshape(b, 1, attn.num_heads, attn.head_dim)
    q = q.transpose(1, 2)  # (R, H, 1, D)
    k, v = rows.unpack(proj[:, hd:]).split(attn._splits[1:], dim=-1)  # (R, N, Hkv·D) x2
    k = attn._heads(k, attn.num_kv_heads)  # (R, Hkv, N, D), zeros at padded positions
    v = attn._heads(v, attn.num_kv_heads)  # (R, Hkv, N, D)
    if pos is not None:
        q, k = attn.rope.rotate(q, pos[:, -1:]), attn.rope.rotate(k, pos)
    k, v = cache.append(k, v)  # (R, Hkv, N, D)
    out = attention(q, k, v, mask=keep[:, None, None, :], backend=attn.backend)  # (R, H, 1, D)
    x = apply_linear(attn.out_proj, out.transpose(1, 2).reshape(b, hd))  # (R, C)
    x = x.add_(h.index_select(0, last))
    return layer._ffn_rows(layer.norm2(x), {}).add_(x)  # (R, C)
