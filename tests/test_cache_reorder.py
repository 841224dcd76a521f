"""Caches reorder through an explicit protocol: ``reorder(idx)``.

Beam search asks every cache to ``reorder(idx)`` (row r becomes what row ``idx[r]`` was): a
custom cache that implements it is honoured (beam search with it == beam search recomputing
the whole sequence, no cache involved); one without it is refused with a TypeError naming the
method — nothing is reordered by guessing which tensors are batch-first. qkv's caches
implement it (oracle: plain tensor indexing). ``KVCache.truncate`` (prompt lookup's rollback):
forgotten positions are rewritten, and a ring buffer refuses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv
from qkv.generation import reorder_cache
from qkv.modules.cache import KVCache, LinearCache, WindowKVCache

F64 = torch.float64


class RunningSum:
    """A recurrent cache: per row the sum of the embeddings seen so far (B, C)."""

    def __init__(self, batch: int, dim: int) -> None:
        self.total = torch.zeros(batch, dim, dtype=F64)  # (B, C): batch-first
        self.length = 0
        self.reorders = 0

    def reorder(self, idx: torch.Tensor) -> None:
        self.total = self.total.index_select(0, idx)
        self.reorders += 1


class NoReorder(RunningSum):
    reorder = None  # a cache object without the method


class BagDecoder(nn.Module):
    """Next-token logits from the running mean of the token embeddings (a causal bag of words):
    ``forward(ids, attention_mask=, cache=)`` and ``new_cache`` as ``qkv.generate`` needs."""

    def __init__(self, vocab: int = 30, dim: int = 16, cache_type: type = RunningSum) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim, dtype=F64)
        self.head = nn.Linear(dim, vocab, dtype=F64)
        with torch.no_grad():
            self.embed.weight.normal_(0, 2.0)
            self.head.weight.normal_(0, 2.0)
        self.cache_type = cache_type
        self.caches: list[RunningSum] = []

    def new_cache(self, batch: int, capacity: int) -> list[RunningSum]:
        self.caches = [self.cache_type(batch, self.embed.embedding_dim)]
        return self.caches

    def forward(self, ids: torch.Tensor, *, attention_mask=None, cache=None) -> torch.Tensor:
        assert attention_mask is None  # the tests pass unpadded prompts
        e = self.embed(ids)  # (B, N, C)
        n = ids.shape[1]
        past = 0 if cache is None else cache[0].length
        sums = e.cumsum(dim=1)  # (B, N, C)
        if cache is not None:
            sums = sums + cache[0].total[:, None]
            cache[0].total = sums[:, -1]
            cache[0].length += n
        counts = torch.arange(past + 1, past + n + 1, dtype=F64)[:, None]  # (N, 1)
        return self.head(torch.tanh(sums / counts))  # (B, N, V)


@pytest.mark.parametrize("beams, eos", [(2, None), (3, 5), (4, None)])
def test_custom_cache_reorder_is_honoured(beams, eos):
    model = BagDecoder()
    torch.manual_seed(1)
    ids = torch.randint(0, 30, (3, 4))
    kw = dict(max_new_tokens=10, num_beams=beams, eos_token_id=eos, pad_token_id=0)
    cached = qkv.generate(model, ids, **kw)
    assert model.caches[0].reorders > 0
    uncached = qkv.generate(model, ids, use_cache=False, **kw)
    assert torch.equal(cached, uncached)


def test_custom_cache_reorder_matters():
    """The equality above is not vacuous: a cache whose reorder does nothing gives other
    beams on these inputs."""

    class Ignores(RunningSum):
        def reorder(self, idx):
            self.reorders += 1

    torch.manual_seed(1)
    ids = torch.randint(0, 30, (3, 4))
    kw = dict(max_new_tokens=10, num_beams=3)
    right = qkv.generate(BagDecoder(), ids, **kw)
    wrong = qkv.generate(BagDecoder(cache_type=Ignores), ids, **kw)
    assert not torch.equal(right, wrong)


def test_cache_without_reorder_is_refused():
    model = BagDecoder(cache_type=NoReorder)
    ids = torch.randint(0, 30, (2, 4))
    with pytest.raises(TypeError, match=r"NoReorder.*reorder\(idx\)"):
        qkv.generate(model, ids, max_new_tokens=5, num_beams=2)
    assert torch.equal(qkv.generate(model, ids, max_new_tokens=5),  # greedy needs no reorder
                       qkv.generate(model, ids, max_new_tokens=5, use_cache=False))


def test_reorder_cache_refuses_before_touching_any_cache():
    good, bad = RunningSum(2, 3), NoReorder(2, 3)
    good.total = torch.arange(6, dtype=F64).view(2, 3)
    with pytest.raises(TypeError, match=r"layer 1.*reorder\(idx\)"):
        reorder_cache([good, bad], torch.tensor([1, 0]))
    assert good.reorders == 0 and good.total[0, 0] == 0
    with pytest.raises(TypeError, match=r"reorder\(idx\)"):
        reorder_cache(object(), torch.tensor([0]))


# --- qkv's caches ------------------------------------------------------------------------
def test_kv_cache_reorder_equals_indexing():
    torch.manual_seed(2)
    cache = KVCache(4, 2, 10, 3, value_dim=5, dtype=F64)
    k, v = torch.randn(4, 2, 6, 3, dtype=F64), torch.randn(4, 2, 6, 5, dtype=F64)
    cache.append(k, v)
    tail = cache.keys[:, :, 6:].clone()
    idx = torch.tensor([3, 3, 0, 1])
    reorder_cache([cache], idx)
    assert torch.equal(cache.get()[0], k[idx]) and torch.equal(cache.get()[1], v[idx])
    assert torch.equal(cache.keys[:, :, 6:], tail)  # only the filled part moves
    assert cache.length == 6


@pytest.mark.parametrize("idx", [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 4]),
                                 torch.tensor([[0, 1, 2, 3]]), torch.tensor([0.0, 1, 2, 3]),
                                 torch.tensor([-1, 0, 1, 2]), [0, 1, 2, 3]],
                         ids=["short", "out-of-range", "2d", "float", "negative", "list"])
@pytest.mark.parametrize("make", [lambda: KVCache(4, 2, 8, 3),
                                  lambda: WindowKVCache(4, 2, 3, 3),
                                  lambda: LinearCache(4, 2, 3, 3)],
                         ids=["kv", "window", "linear"])
def test_bad_reorder_index_is_refused(make, idx):
    with pytest.raises(ValueError, match="reorder idx"):
        make().reorder(idx)


def test_window_and_linear_caches_reorder_equals_indexing():
    torch.manual_seed(3)
    win = WindowKVCache(3, 1, 3, 2, dtype=F64)  # keeps the last 2 positions
    k = torch.randn(3, 1, 5, 2, dtype=F64)
    win.append(k, k + 1)
    idx = torch.tensor([2, 0, 0])
    win.reorder(idx)
    assert torch.equal(win.get()[0], k[idx][:, :, -2:])
    assert torch.equal(win.get()[1], k[idx][:, :, -2:] + 1)
    lin = LinearCache(3, 2, 4, 4)
    state = qkv.LinearState(torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4), None)
    lin.update(state, 5)
    lin.reorder(idx)
    assert torch.equal(lin.state.kv, state.kv[idx]) and torch.equal(lin.state.z, state.z[idx])
    assert lin.state.log_scale is None


def test_kv_cache_truncate_forgets_and_rewrites():
    torch.manual_seed(4)
    cache = KVCache(2, 1, 8, 2, dtype=F64)
    a, b = torch.randn(2, 1, 5, 2, dtype=F64), torch.randn(2, 1, 2, 2, dtype=F64)
    cache.append(a, a)
    cache.truncate(3)
    assert cache.length == 3 and torch.equal(cache.get()[0], a[:, :, :3])
    keys, _ = cache.append(b, b)  # written at 3, 4
    assert torch.equal(keys, torch.cat((a[:, :, :3], b), dim=2))
    for bad in (-1, 6, 2.0, True):
        with pytest.raises(ValueError, match="truncate length"):
            cache.truncate(bad)
    win = WindowKVCache(2, 1, 3, 2, dtype=F64)
    with pytest.raises(TypeError, match="cannot truncate"):
        win.truncate(0)
