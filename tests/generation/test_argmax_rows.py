"""``qkv.generation.search.argmax_rows`` (the greedy loop's argmax, vectorised from 4 rows on
CPU) == ``torch.argmax(dim=-1)``: ties (the first index wins), -inf rows, NaN rows (NaN is
the largest), +inf, 1-20 rows, fp32 / fp64 / bf16.
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation.search import argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 20])
def test_equals_torch_argmax_with_ties(rows, dtype):
    torch.manual_seed(rows)
    logits = torch.randint(-3, 4, (rows, 97)).to(dtype)  # many ties per row
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    wide = torch.randn(rows, 8192, dtype=dtype)
    assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))


def test_special_values():
    logits = torch.randn(8, 50)
    logits[0] = float("-inf")  # all -inf: index 0
    logits[1, 7] = float("inf")
    logits[1, 30] = float("inf")  # first +inf
    logits[2, 11] = float("nan")  # NaN is the largest
    logits[3, :] = 0.0
    logits[3, 5] = -0.0
    logits[4, [2, 40]] = 100.0
    want = logits.argmax(dim=-1)
    assert want[2] == 11
    assert torch.equal(argmax_rows(logits), want)
    clean = logits[[0, 1, 3, 4, 5, 6]]  # no NaN: the vectorised path
    assert torch.equal(argmax_rows(clean), clean.argmax(dim=-1))
