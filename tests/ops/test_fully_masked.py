"""Query rows with nothing to attend to (Checklist 4): output exactly 0, dQ exactly 0,
dK/dV (and d bias) finite, on every backend, in fp32/fp16/bf16.

Shapes: B batch, H query heads, N query length, S key length, D head dim.

The other (live) rows must still be right: in fp32 every row, output and gradients, is
compared with the fp64 ``oracle_attention`` (conftest) over a keep matrix built here from
the masks' documented meaning, not from qkv.masks, at atol 5e-5, rtol 5e-6 (Checklist 1);
half precision accuracy is tested in test_half_precision.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import qkv
from conftest import (
    ALL_DTYPES,
    TOL,
    assert_close_to,
    dtype_id,
    fp64,
    grads_of,
    oracle_attention,
    oracle_weights,
    randn,
)
from qkv.masks import Causal, Padding
from qkv.ops.chunked import chunked_attention

BACKENDS = ("sdpa", "chunked", "reference")
B, H, D = 2, 2, 16


@dataclass
class Case:
    n: int
    s: int
    kwargs: dict
    empty: Tensor  # (B, H, N) bool: rows that must come out empty
    bias: Tensor | None = None
    keep: Tensor | None = None  # broadcastable to (B, H, N, S), built without qkv.masks


def _causal_keep(n: int, s: int) -> Tensor:
    """Bottom-right causal, from its documented meaning: key j <= query i + S - N."""
    return torch.tensor([[j <= i + s - n for j in range(s)] for i in range(n)])  # (N, S)


def _pad_keep(lengths: list[int], s: int) -> Tensor:
    """Key j of batch row b is real when j < lengths[b]: (B, 1, 1, S)."""
    return torch.tensor([[j < length for j in range(s)] for length in lengths])[:, None, None]


def _bool_rows(dtype):
    n, s = 7, 9
    keep = torch.rand(B, H, n, s) < 0.7
    keep[..., 0] = True
    keep[0, :, 2] = False  # a row in every head
    keep[1, 1, 5] = False  # a row in one head only
    keep[1, :, 6, :] = False
    empty = ~keep.any(-1)
    return Case(n, s, {"mask": keep}, empty, keep=keep)


def _bool_broadcast(dtype):
    n, s = 7, 9
    keep = torch.ones(1, H, n, 1, dtype=torch.bool)  # (1, H, N, 1): whole rows per head
    keep[0, 0, 3] = False
    keep[0, 1, 0] = False
    empty = (~keep[..., 0]).expand(B, H, n)
    return Case(n, s, {"mask": keep}, empty, keep=keep)


def _bias_rows(dtype):
    n, s = 7, 9
    bias = randn(B, 1, n, s, dtype=dtype)
    bias[0, 0, 1] = -torch.inf
    bias[1, 0, 4] = -torch.inf
    bias.requires_grad_()
    empty = torch.zeros(B, H, n, dtype=torch.bool)
    empty[0, :, 1] = empty[1, :, 4] = True
    return Case(n, s, {"bias": bias}, empty, bias)


def _bias_and_bool(dtype):
    """-inf bias covers the first half of the keys, the bool mask the rest: row 3 empty."""
    n, s = 7, 10
    bias = torch.zeros(n, s, dtype=dtype)
    bias[3, :5] = -torch.inf
    keep = torch.ones(n, s, dtype=torch.bool)
    keep[3, 5:] = False
    bias.requires_grad_()
    empty = torch.zeros(B, H, n, dtype=torch.bool)
    empty[:, :, 3] = True
    return Case(n, s, {"bias": bias, "mask": keep}, empty, bias, keep=keep)


def _causal_n_gt_s(dtype):
    """Bottom-right causal with N=9 > S=4: the first N - S = 5 rows see no key."""
    n, s = 9, 4
    empty = torch.zeros(B, H, n, dtype=torch.bool)
    empty[:, :, : n - s] = True
    return Case(n, s, {"mask": Causal()}, empty, keep=_causal_keep(n, s))


def _causal_flag_n_gt_s(dtype):
    case = _causal_n_gt_s(dtype)
    return Case(case.n, case.s, {"causal": True}, case.empty, keep=case.keep)


def _causal_padding_zero(dtype):
    """Causal & padding where batch 1 has length 0: all its rows are empty."""
    n, s = 6, 6
    empty = torch.zeros(B, H, n, dtype=torch.bool)
    empty[1] = True
    return Case(n, s, {"mask": Causal() & Padding(torch.tensor([6, 0]))}, empty,
                keep=_causal_keep(n, s) & _pad_keep([6, 0], s))


def _causal_padding_partial(dtype):
    """N=6 > S=3 bottom-right, with a dense bias: rows 0..2 empty everywhere."""
    n, s = 6, 3
    bias = randn(1, H, n, s, dtype=dtype).requires_grad_()
    empty = torch.zeros(B, H, n, dtype=torch.bool)
    empty[:, :, :3] = True
    empty[1] = True
    return Case(n, s, {"mask": Causal() & Padding(torch.tensor([3, 0])), "bias": bias},
                empty, bias, keep=_causal_keep(n, s) & _pad_keep([3, 0], s))


def _padding_zero(dtype):
    n, s = 5, 6
    empty = torch.zeros(B, H, n, dtype=torch.bool)
    empty[0] = True
    return Case(n, s, {"mask": Padding(torch.tensor([0, 4]))}, empty,
                keep=_pad_keep([0, 4], s))


CASES = {
    "bool-rows": _bool_rows,
    "bool(1,H,N,1)": _bool_broadcast,
    "bias-inf-rows": _bias_rows,
    "bias-inf&bool": _bias_and_bool,
    "causal-N>S": _causal_n_gt_s,
    "causal=True-N>S": _causal_flag_n_gt_s,
    "causal&padding-len0": _causal_padding_zero,
    "causal&padding+bias-N>S": _causal_padding_partial,
    "padding-len0": _padding_zero,
}


def _reduce_all(flags: Tensor, shape: torch.Size) -> Tensor:
    """(B, H, N, S) flags -> ``shape`` (a broadcast shape): True where every broadcast
    source element is True."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    for dim, size in enumerate(padded):
        if size == 1:
            flags = flags.all(dim=dim, keepdim=True)
    return flags.reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case_id", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows(backend, case_id, dtype, gen):
    case = CASES[case_id](dtype)
    assert case.empty.any()
    q = randn(B, H, case.n, D, gen=gen, dtype=dtype).requires_grad_()
    k = randn(B, H, case.s, D, gen=gen, dtype=dtype).requires_grad_()
    v = randn(B, H, case.s, D, gen=gen, dtype=dtype).requires_grad_()
    d_out = randn(B, H, case.n, D, gen=gen)
    out, (dq, dk, dv, dbias) = grads_of(
        lambda: qkv.attention(q, k, v, backend=backend, **case.kwargs),
        [q, k, v, case.bias], d_out)
    empty = case.empty
    assert out.dtype == dtype
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), "output of empty rows"
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty])), "dQ of empty rows"
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert t is None or torch.isfinite(t).all(), name
    if dbias is not None:  # logits of empty rows get no gradient
        dead = _reduce_all(empty[..., None].expand(B, H, case.n, case.s), dbias.shape)
        assert torch.equal(dbias[dead], torch.zeros_like(dbias[dead])), "dbias of empty rows"
    if dtype == torch.float32:  # every row: fp32 vs the fp64 oracle, atol 5e-5, rtol 5e-6
        q64, k64, v64, b64 = fp64(q), fp64(k), fp64(v), fp64(case.bias)
        ref, ref_grads = grads_of(
            lambda: oracle_attention(q64, k64, v64, keep=case.keep, bias=b64),
            [q64, k64, v64, b64], d_out.double())
        ref_empty = oracle_weights(q64.detach(), k64.detach(), keep=case.keep,
                                   bias=None if b64 is None else b64.detach()).sum(-1) == 0
        assert torch.equal(ref_empty.expand(B, H, case.n), empty), "case's empty rows"
        atol, rtol = TOL[torch.float32]
        assert_close_to(out, ref, atol=atol, rtol=rtol, what="out")
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), ref_grads,
                              strict=True):
            if r is not None:
                assert_close_to(g, r, atol=atol, rtol=rtol, what=name)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_everything_masked(backend, dtype):
    """No row attends anything: all-zero output and all-zero gradients (nothing was used)."""
    q = torch.randn(B, H, 5, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, 7, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, 7, D, dtype=dtype, requires_grad=True)
    out = qkv.attention(q, k, v, mask=torch.zeros(5, 7, dtype=torch.bool), backend=backend)
    out.float().backward(torch.randn(out.shape))
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_chunked_lse_of_empty_rows_is_minus_inf(dtype):
    q = torch.randn(1, 2, 9, D, dtype=dtype)
    k = torch.randn(1, 2, 4, D, dtype=dtype)
    out, lse = chunked_attention(q, k, k, mask=Causal(), scale=0.25, block_q=2, block_k=3)
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_of_empty_rows_are_zero(backend, dtype):
    q = torch.randn(B, H, 9, D, dtype=dtype)
    k = torch.randn(B, H, 4, D, dtype=dtype)
    _, w = qkv.attention(q, k, k, mask=Causal(), return_weights=True, backend=backend)
    assert w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(w[:, :, :5], torch.zeros_like(w[:, :, :5]))
    sums = w[:, :, 5:].sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-6, rtol=0)  # fp32 sums
