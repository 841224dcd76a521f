"""Top-p (nucleus) filtering where the cumulative probability lands exactly on ``top_p``:
random logits never do, so these are made to. Two oracles written apart from
``filter_logits``: exact arithmetic (``fractions``) on probabilities that fp32's softmax
gives exactly (the smallest set of most likely tokens whose probability reaches ``top_p``
keeps that many tokens), and HuggingFace's ``TopPLogitsWarper`` on the very same fp32 logits
(the same kept set: the same count, and among tied tokens the same ones).

Shapes: V vocab size; logits (1, V).
"""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import pytest
import torch

from qkv.generation import filter_logits


def _logits(probs) -> torch.Tensor:
    """fp32 logits (1, V) whose softmax is probs (up to fp32 rounding)."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def _kept(scores: torch.Tensor) -> list[int]:
    return (~torch.isinf(scores[0])).nonzero().flatten().tolist()


def _exact_count(probs: list[Fr], top_p: Fr) -> int:
    """How many of the most likely tokens the smallest set reaching top_p holds."""
    mass = Fr(0)
    for n, p in enumerate(sorted(probs, reverse=True), start=1):
        mass += p
        if mass >= top_p:
            return n
    return len(probs)


# probabilities that fp32's softmax of their logs reproduces exactly (powers of two), and a
# top_p that the sorted cumulative sum hits exactly (a boundary), or just misses
EXACT = [
    ([Fr(1, 4)] * 4, Fr(1, 4)), ([Fr(1, 4)] * 4, Fr(1, 2)), ([Fr(1, 4)] * 4, Fr(3, 4)),
    ([Fr(1, 2), Fr(1, 4), Fr(1, 8), Fr(1, 8)], Fr(1, 2)),
    ([Fr(1, 2), Fr(1, 4), Fr(1, 8), Fr(1, 8)], Fr(3, 4)),
    ([Fr(1, 2), Fr(1, 4), Fr(1, 8), Fr(1, 8)], Fr(7, 8)),
    ([Fr(1, 8), Fr(1, 2), Fr(1, 8), Fr(1, 4)], Fr(3, 4)),
    ([Fr(1, 8), Fr(1, 8), Fr(1, 4), Fr(1, 2)], Fr(5, 8)),  # inside: not on a boundary
]


@pytest.mark.parametrize("probs, top_p", EXACT,
                         ids=[f"{'-'.join(str(p) for p in ps)}@{t}" for ps, t in EXACT])
def test_a_boundary_keeps_the_smallest_set_that_reaches_top_p(probs, top_p):
    logits = _logits(probs)
    assert torch.equal(logits.softmax(-1), torch.tensor([[float(p) for p in probs]]))  # exact
    kept = _kept(filter_logits(logits, temperature=1.0, top_k=None, top_p=float(top_p)))
    assert len(kept) == _exact_count(probs, top_p)
    dropped = set(range(len(probs))) - set(kept)
    assert all(probs[k] >= probs[d] for k in kept for d in dropped)  # the most likely ones


# exact-tie cases, as fp32 rounds them: the boundary sits between tied tokens, or on a sum
# that fp32 rounds to either side of top_p (4/9, 2/9, 2/9, 1/9 at 6/9: HF keeps 2 tokens)
TIES = [
    ([4 / 9, 2 / 9, 2 / 9, 1 / 9], 6 / 9), ([2 / 9, 4 / 9, 1 / 9, 2 / 9], 6 / 9),
    ([1 / 9, 2 / 9, 4 / 9, 2 / 9], 6 / 9), ([1 / 3] * 3, 2 / 3), ([0.2] * 5, 0.6),
    ([0.1] * 10, 0.3), ([3 / 8, 3 / 8, 1 / 8, 1 / 8], 0.75), ([0.25] * 4, 0.5),
    ([0.5, 0.25, 0.125, 0.125], 0.875), ([0.25] * 4, 0.25),
]


@pytest.mark.parametrize("probs, top_p", TIES,
                         ids=[f"{'-'.join(f'{p:.3g}' for p in ps)}@{t:.3g}" for ps, t in TIES])
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (1.0, 3), (0.5, None)])
def test_ties_keep_what_hf_keeps(probs, top_p, temperature, top_k):
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = _logits(probs) * 0.5 if temperature == 0.5 else _logits(probs)  # /0.5: exact
    want = logits.clone()
    if temperature != 1.0:
        want = lp.TemperatureLogitsWarper(temperature)(None, want)
    if top_k is not None:
        want = lp.TopKLogitsWarper(top_k)(None, want)
    want = lp.TopPLogitsWarper(top_p)(None, want)
    got = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert _kept(got) == _kept(want)
    assert torch.equal(got, want)


def test_the_issue_case_keeps_two_tokens():
    """4/9, 2/9, 2/9, 1/9 with top_p = 6/9: the first two reach 6/9 (HF keeps 2)."""
    got = filter_logits(_logits([4 / 9, 2 / 9, 2 / 9, 1 / 9]), temperature=1.0, top_k=None,
                        top_p=6 / 9)
    kept = _kept(got)
    assert len(kept) == 2 and 0 in kept
