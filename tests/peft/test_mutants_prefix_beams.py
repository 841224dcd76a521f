"""Beam search on a prefix-tuned GPT: the cached path equals the uncached one, and the prefix
cache's beam reorder moves every real position (the prefix positions come on top).

Shapes: B batch, K beams, Hkv kv heads, P prefix length, L real positions, D head dim.
The oracle of the first test is plain tensor indexing of what was written; of the second,
``generate(use_cache=False)``, which recomputes every step from the tokens (no cache, no
reorder). Tokens compared exactly.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.models import GPT, GPTConfig
from qkv.peft.prefix import PrefixAttention, PrefixConfig, PrefixKVCache, add_prefix


def test_reorder_moves_prefix_and_every_real_position():
    g = torch.Generator().manual_seed(0)
    b, hkv, p, d = 3, 2, 4, 5
    pk, pv = torch.randn(hkv, p, d, generator=g), torch.randn(hkv, p, d, generator=g)
    cache = PrefixKVCache(b, hkv, 16, d, prefix_keys=pk, prefix_values=pv)
    ks, vs = torch.randn(b, hkv, 9, d, generator=g), torch.randn(b, hkv, 9, d, generator=g)
    cache.write(ks[:, :, :6], vs[:, :, :6], 0)
    idx = torch.tensor([2, 0, 0])
    cache.reorder(idx)
    ks, vs = ks[idx], vs[idx]
    cache.write(ks[:, :, 6:9], vs[:, :, 6:9], 6)
    cache.reorder(torch.tensor([1, 2, 0]))
    ks, vs = ks[[1, 2, 0]], vs[[1, 2, 0]]
    k, v = cache.get()
    assert k.shape == (b, hkv, p + 9, d)
    assert torch.equal(k[:, :, :p], pk.expand(b, -1, -1, -1))
    assert torch.equal(v[:, :, :p], pv.expand(b, -1, -1, -1))
    assert torch.equal(k[:, :, p:], ks) and torch.equal(v[:, :, p:], vs)


@pytest.mark.parametrize("num_tokens", [2, 5])
def test_prefix_gpt_beam_search_cached_equals_uncached(num_tokens):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt-tiny", num_kv_heads=2)).eval()
    add_prefix(model, PrefixConfig(num_tokens=num_tokens))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, PrefixAttention):
                for t in m.prefixes.parameters():
                    t.copy_(torch.randn(t.shape, generator=g) * 1.5)
    ids = torch.randint(0, 256, (3, 5), generator=g)
    kw = dict(max_new_tokens=12, num_beams=4)
    with torch.no_grad():
        cached = qkv.generate(model, ids, **kw)
        uncached = qkv.generate(model, ids, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
