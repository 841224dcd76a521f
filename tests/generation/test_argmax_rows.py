"""``qkv.generation.search.argmax_rows`` (the greedy loop's argmax: two levels, block maxima
then inside the first block holding the largest, from 4 rows on CPU) == ``torch.argmax(dim=-1)``
exactly: ties (the first index wins, also across blocks and into the columns past the last
whole block), -inf rows, NaN (the largest; the first NaN wins), +inf, non-contiguous logits,
1-20 rows, vocabularies with and without a partial last block, fp32 / fp64 / bf16.
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation.search import ARGMAX_BLOCK, argmax_rows

# 97: too few columns (torch's argmax); 8192: whole blocks; 300 and 50257: a partial last block
VOCABS = [97, 2 * ARGMAX_BLOCK + 44, 8192, 50257]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 20])
def test_equals_torch_argmax_with_ties(rows, dtype):
    torch.manual_seed(rows)
    for vocab in VOCABS:
        logits = torch.randint(-3, 4, (rows, vocab)).to(dtype)  # many ties per row
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), vocab
        wide = torch.randn(rows, vocab, dtype=dtype)
        assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1)), vocab


@pytest.mark.parametrize("vocab", VOCABS)
def test_special_values(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(10, vocab)
    last = vocab - 1  # in the partial last block where there is one
    logits[0] = float("-inf")  # all -inf: index 0
    logits[1, 7] = float("inf")
    logits[1, last] = float("inf")  # first +inf wins, the later one is in another block
    logits[2, last] = float("nan")  # NaN is the largest, even in the last columns
    logits[3, :] = 0.0
    logits[3, 5] = -0.0  # -0.0 == 0.0: index 0
    logits[4, [last, 2]] = 100.0  # a tie between the first block and the last
    logits[5, last] = 100.0  # the largest in the last columns alone
    logits[6, [3, last]] = float("nan")  # the first NaN
    logits[7, vocab // 2] = float("nan")  # NaN in a middle block
    logits[7, last] = float("inf")
    logits[8] = float("nan")
    want = logits.argmax(dim=-1)
    assert want[2] == last and want[4] == 2 and want[5] == last and want[6] == 3
    assert want[7] == vocab // 2 and want[8] == 0
    assert torch.equal(argmax_rows(logits), want)
    four = logits[[2, 4, 5, 9]]  # four rows: the two-level path
    assert torch.equal(argmax_rows(four), four.argmax(dim=-1))


def test_non_contiguous_logits():
    torch.manual_seed(0)
    base = torch.randn(16, 8192 + 500)
    for logits in (base[:, 100:8292], base[:, :300], base.t()[:300].t()[::2]):
        assert not logits.is_contiguous()
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
