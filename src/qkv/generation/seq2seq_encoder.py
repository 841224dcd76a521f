"""The encoder of a ``Transformer`` run on an ``EncoderPlan`` over one of the weight forms of
``qkv.generation.linears`` (the int8 backends' C products), once per source: what
``Transformer.encode`` computes through the modules.

Shapes: B sources, S source length, T real source tokens (the packed rows), C width, H heads,
D head dim.

The token table · scale + the absolute positions (from each row's first real token), the
embedding norm; then per layer the fused q/k/v projection of the T real tokens' rows, the
bidirectional attention on the padded (B, H, S, D) layout (``qkv.attention`` with the
padding mask and the relative bias, as the modules call it), the out projection + residual,
the feed-forward + residual, each norm before its sublayer or after its residual add; the
rows back to (B, S, C) (zeros at padded positions) and the final norm. The projections see
the T real rows only, as the modules' token rows (``qkv.modules.token_rows``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.inputs import check_token_ids
from ..modules.positions import positions_from_mask
from ..modules.token_rows import TokenRows
from ..ops import attention
from ..ops.masks import Padding
from .seq2seq_plan import EncoderPlan

__all__ = ["encode"]


def encode(plan: EncoderPlan, linears, src: Tensor, src_mask: Tensor | None
           ) -> tuple[Tensor, Tensor]:
    """``Transformer.encode(src, src_mask=src_mask)`` on ``plan`` with the weight form
    ``linears`` (built on ``plan``): src (B, S) ids, src_mask (B, S) bool (True = real token)
    or None (``src != pad_id``). Returns ``(memory (B, S, C), keep (B, S) bool)``."""
    check_token_ids("Transformer", "src", src, plan.embed.shape[0], "src_vocab_size")
    b, s = src.shape
    keep = src != plan.pad_id if src_mask is None else src_mask
    padded = not bool(keep.all())
    x = plan.embed.index_select(0, src.reshape(-1)).view(b, s, -1)  # (B, S, C)
    if plan.embed_scale != 1.0:
        x = x * plan.embed_scale
    if plan.pos_table is not None:
        pos = positions_from_mask(keep) if padded else torch.arange(s, device=src.device)
        x = x + plan.pos_table[pos + plan.position_offset].to(x.dtype)
    if plan.embed_norm is not None:
        x = plan.embed_norm(x)
    rows = TokenRows(keep) if padded else TokenRows(None, batch=b, length=s)
    mask = Padding(keep=keep) if padded else None
    x = rows.pack(x)  # (T, C)
    h, d, pre = plan.heads, plan.head_dim, plan.norm_first
    for i, lp in enumerate(plan.layers):
        proj = rows.unpack(linears.linear(lp.norm1(x) if pre else x, 4 * i))  # (B, S, 3·H·D)
        q, k, v = proj.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, S, D)
        a = attention(q, k, v, mask=mask, bias=plan.bias, scale=plan.attention_scale)
        a = rows.pack(a.transpose(1, 2)).reshape(rows.count, h * d)  # (T, H·D)
        x = linears.add(a, 4 * i + 1, x) if pre else lp.norm1(linears.add(a, 4 * i + 1, x))
        f = linears.act(lp.norm2(x) if pre else x, 4 * i + 2)
        x = linears.add(f, 4 * i + 3, x) if pre else lp.norm2(linears.add(f, 4 * i + 3, x))
    memory = rows.unpack(x)  # (B, S, C), zeros at padded positions
    if plan.norm is not None:
        memory = plan.norm(memory)
    return memory, keep
