"""``EncoderLayer.forward(h, rows=...)`` (token rows) with a non-empty ``KVCache`` and no
explicit ``positions`` equals the padded ``forward`` (its docstring: the real rows equal
``rows.pack(self(x, ...))`` for the same mask / causal / cache / positions, provided the mask
masks every padded key): a sequence prefilled in part through the padded ``forward`` with a
cache, the rest fed in chunks as token rows with no positions, equals the full uncached
``forward`` of the fp64 layer, row for row. RoPE is on, so that a chunk rotated at the wrong
positions (counted from 0 instead of the cache's length) shows.

Shapes: B batch, N length, P prefilled, T real tokens of a chunk, C width, H heads,
Hkv kv heads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qkv.modules.attention import MultiHeadAttention
from qkv.modules.layers import EncoderLayer, TokenRows
from qkv.modules.positions import RoPE

C, H, N = 16, 4, 9
F32 = dict(atol=5e-5, rtol=5e-6)  # fp32 vs the fp64 forward (PyTorch's SDPA bar)
CHUNKS = (4, 3, 1, 1)  # prefill 4 through forward, then 3, 1, 1 as token rows


def _layer(*, norm_first: bool, num_kv_heads: int | None) -> EncoderLayer:
    torch.manual_seed(0)
    layer = EncoderLayer.build(C, H, ffn_hidden=24, activation="gelu", norm_first=norm_first,
                               num_kv_heads=num_kv_heads, rope=RoPE(C // H))
    with torch.no_grad():  # non-trivial norms
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return layer.eval()


# key padding: none; left padding inside the prefilled part; and padded positions inside
# the chunks fed as token rows (rows of different lengths, as prompt lookup's drafts)
KEEPS = {
    "unpadded": torch.ones(3, N, dtype=torch.bool),
    "left-padded": torch.tensor([[1] * 9, [0, 0, 1, 1, 1, 1, 1, 1, 1],
                                 [0, 0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool),
    "padded-chunks": torch.tensor([[1] * 9, [0, 1, 1, 1, 1, 0, 0, 1, 1],
                                   [1, 1, 1, 1, 1, 1, 0, 1, 0]], dtype=torch.bool),
}


def _chunked(layer: EncoderLayer, x: torch.Tensor, keep: torch.Tensor, *,
             bufs: dict | None, positions_from_zero: bool = False) -> list[torch.Tensor]:
    """The first chunk through the padded ``forward`` with a cache, the others as token rows
    with no positions (or, with ``positions_from_zero``, the wrong ones: from 0); the real
    rows (T, C) of every chunk after the first."""
    b = x.shape[0]
    cache = layer.attn.new_cache(b, N)
    start, out = 0, []
    for i, n in enumerate(CHUNKS):
        stop = start + n
        mask = keep[:, None, None, :stop]  # (B, 1, 1, S) every padded key masked
        if i == 0:
            layer(x[:, :stop], mask=mask, causal=True, cache=cache)
        else:
            rows = TokenRows(keep[:, start:stop])
            positions = torch.arange(n) if positions_from_zero else None
            out.append(layer(rows.pack(x[:, start:stop]), rows=rows, mask=mask, causal=True,
                             cache=cache, positions=positions, bufs=bufs))
            assert cache.length == stop
        start = stop
    return out


def _full(layer: EncoderLayer, x: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    """The real rows of each chunk after the first, from one uncached fp64 forward over all
    N positions (RoPE at 0..N-1)."""
    wide = copy.deepcopy(layer).double()
    with torch.no_grad():
        y = wide(x.double(), mask=keep[:, None, None, :], causal=True)  # (B, N, C)
    out, start = [], CHUNKS[0]
    for n in CHUNKS[1:]:
        out.append(TokenRows(keep[:, start:start + n]).pack(y[:, start:start + n]))
        start += n
    return out


@pytest.mark.parametrize("keep", list(KEEPS), ids=list(KEEPS))
@pytest.mark.parametrize("norm_first, num_kv_heads", [(True, None), (True, 2), (False, 1)],
                         ids=["pre-norm", "pre-norm-gqa", "post-norm-mqa"])
@pytest.mark.parametrize("mode", ["no-grad-bufs", "no-grad", "inference-mode"])
def test_rows_after_a_cache_prefill_equal_forward(keep, norm_first, num_kv_heads, mode,
                                                  monkeypatch):
    """(A cache is for decoding: without gradients, with and without the rows' shared
    buffers.) The chunks run the rows' own path: the attention module gets the (T, C) rows
    (``rows=``), not an unpacked padded batch."""
    keep = KEEPS[keep]
    layer = _layer(norm_first=norm_first, num_kv_heads=num_kv_heads)
    x = torch.randn(3, N, C, generator=torch.Generator().manual_seed(1))  # (B, N, C)
    want = _full(layer, x, keep)
    plain, took_rows = MultiHeadAttention.forward, []

    def spy(self, *args, **kwargs):
        took_rows.append(kwargs.get("rows") is not None)
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(MultiHeadAttention, "forward", spy)
    with torch.inference_mode() if mode == "inference-mode" else torch.no_grad():
        got = _chunked(layer, x, keep, bufs={} if mode == "no-grad-bufs" else None)
    assert took_rows == [False, True, True, True]  # the padded prefill, then three chunks
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **F32)


def test_positions_counted_from_zero_would_show():
    """The check above can see a position error: the same chunks rotated from position 0
    (what token rows ignoring the cache's length would do) are far off."""
    layer = _layer(norm_first=True, num_kv_heads=None)
    keep = KEEPS["unpadded"]
    x = torch.randn(3, N, C, generator=torch.Generator().manual_seed(1))
    want = _full(layer, x, keep)
    with torch.no_grad():
        wrong = _chunked(layer, x, keep, bufs={}, positions_from_zero=True)
    assert all((g.double() - w).abs().max() > 1e-2 for g, w in zip(wrong, want, strict=True))
