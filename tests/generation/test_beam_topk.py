"""Beam search's step without processors (``qkv.generation.search``): ``top_rows`` (two-level
top-m), ``logsumexp_rows`` (through a cached buffer) and the step they make, each against
torch's one-call ops or fp64 math written here. Tolerances: values exact (same floats
gathered); logsumexp 3e-7 relative (2.5 fp32 ulps) against fp64."""

from __future__ import annotations

import pytest
import torch

from qkv.generation.search import (
    ARGMAX_BLOCK,
    LSE_MIN_VOCAB,
    _top_continuations,
    logsumexp_rows,
    top_rows,
)

VOCABS = [97, 16 * ARGMAX_BLOCK, 16 * ARGMAX_BLOCK + 45, 32128, 65001]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("m", [1, 8, 12])
def test_top_rows_equals_topk(vocab, m):
    gen = torch.Generator().manual_seed(vocab + m)
    logits = torch.randn(7, vocab, generator=gen) * 4
    values, cols = top_rows(logits, m)
    want_values, want_cols = logits.topk(m, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(cols, want_cols)


def test_top_rows_finds_values_in_the_tail_in_one_block_and_among_infinities():
    """The best values past the last whole block, all m best in one block, rows with -inf
    everywhere but a few columns: the same as topk (no column twice)."""
    vocab, m = 40 * ARGMAX_BLOCK + 77, 8
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, -5:] = torch.arange(10.0, 15.0)  # in the tail
    logits[1, 3 * ARGMAX_BLOCK:3 * ARGMAX_BLOCK + m] = torch.arange(20.0, 20.0 + m)  # one block
    logits[2] = -torch.inf
    logits[2, torch.tensor([5, 900, vocab - 1])] = torch.tensor([1.0, 3.0, 2.0])
    logits[3, 17] = torch.inf
    values, cols = top_rows(logits, m)
    want_values, want_cols = logits.topk(m, dim=-1)
    assert torch.equal(values, want_values)
    assert torch.equal(cols[:, :3], want_cols[:, :3])  # the finite (or +inf) leaders
    assert torch.equal(cols[[0, 1, 3]], want_cols[[0, 1, 3]])
    assert all(len(set(r.tolist())) == m for r in cols)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("vocab", [100, LSE_MIN_VOCAB, 65001])
def test_logsumexp_rows_against_fp64(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 10
    got = logsumexp_rows(logits, logits.amax(dim=-1, keepdim=True))
    want = torch.logsumexp(logits.double(), dim=-1, keepdim=True)
    assert got.shape == (rows, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=3e-7, atol=1e-7)


def test_logsumexp_rows_with_infinite_rows():
    """A row of -inf gives -inf, a row holding +inf gives +inf (torch.logsumexp's results)."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1))
    logits[0] = -torch.inf
    logits[1, 7] = torch.inf
    got = logsumexp_rows(logits, logits.amax(dim=-1, keepdim=True))
    assert torch.equal(got[:2, 0], torch.tensor([-torch.inf, torch.inf]))
    torch.testing.assert_close(got[2], torch.logsumexp(logits[2:], dim=-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("vocab", [5, 97, 65001])
def test_top_continuations_equal_the_full_sums(vocab):
    """Of the K·V sums run_scores + log_softmax (fp64, here), the m best: the same scores
    (1e-5), source beams and tokens; beams at HF's -1e9 (first step) give none; a vocabulary
    smaller than m (5 < 8) gives its whole rows."""
    batch, beams, m = 5, 4, 8
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch * beams, vocab, generator=gen) * 3
    run_scores = torch.randn(batch, beams, generator=gen)
    if vocab >= m:  # else item 0 needs those beams: -1e9 + logp is fp32 (ulp 64)
        run_scores[0, 1:] = -1.0e9
    sums = (torch.log_softmax(logits.double(), dim=-1).view(batch, beams, vocab)
            + run_scores.double()[:, :, None]).view(batch, beams * vocab)
    want_scores, idx = sums.topk(m, dim=-1)
    scores, src, tokens = _top_continuations(logits, run_scores, m)
    torch.testing.assert_close(scores.double(), want_scores, rtol=0, atol=1e-5)
    assert torch.equal(src, idx // vocab) and torch.equal(tokens, idx % vocab)
    if vocab >= m:
        assert bool((src[0] == 0).all())
