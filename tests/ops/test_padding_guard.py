"""The ``Padding`` guard of ``qkv.attention``: memory past a sequence's end that holds NaN or
±inf changes nothing (Checklist 9), a fully masked row returns zeros with finite gradients
(Checklist 4), on every backend — and finite padded memory is not copied.

Shapes: B batch, H heads, N query length, S key length, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import qkv
from conftest import grads_of, make_qkv, randn
from qkv.masks import Causal, Padding
from qkv.ops.attention import _clear_padding

BACKENDS = ("sdpa", "chunked", "reference")
TOL = {torch.float32: dict(atol=5e-5, rtol=5e-6), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _oracle(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
    """fp64 softmax(q kᵀ / sqrt(D)) v over each row's first lengths[b] keys, written apart
    from qkv: only the live keys are ever read; a row with no key returns zeros."""
    b, h, n, d = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for i in range(b):
        m = int(lengths[i])
        if m:
            qq, kk, vv = (t[i].double() for t in (q, k[:, :, :m], v[:, :, :m]))
            out[i] = torch.softmax(qq @ kk.transpose(-1, -2) / math.sqrt(d), dim=-1) @ vv
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")],
                         ids=["+inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_past_end_with_a_fully_masked_row(backend, where, poison, dtype, gen):
    """One kind of poison in one tensor only (k or v), one row with no key at all: the live
    rows equal the fp64 oracle, the empty row is exactly 0, every gradient is finite and
    the padded keys/values get none."""
    b, h, n, s, d = 3, 2, 5, 9, 8
    lengths = torch.tensor([9, 0, 3])
    q, k, v = make_qkv(b, h, n, s, d, dtype=dtype, gen=gen)
    past_end = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, :, None]  # (B,1,S,1)
    with torch.no_grad():
        {"k": k, "v": v}[where].masked_fill_(past_end, poison)
    d_out = randn(b, h, n, d, gen=gen, dtype=dtype)
    out, (dq, dk, dv) = grads_of(
        lambda: qkv.attention(q, k, v, mask=Padding(lengths), backend=backend), [q, k, v],
        d_out)
    assert torch.equal(out[1], torch.zeros_like(out[1])), "fully masked row"
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), name
    assert not dk.masked_select(past_end).any() and not dv.masked_select(past_end).any()
    torch.testing.assert_close(out.double(), _oracle(q.detach(), k.detach(), v.detach(),
                                                      lengths), **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_past_end_under_causal_and_padding(backend, gen):
    """The guard also finds ``Padding`` inside ``Causal() & Padding``."""
    lengths = torch.tensor([4, 6])
    q, k, v = make_qkv(2, 2, 6, 6, 8, gen=gen)
    past_end = (torch.arange(6)[None, :] >= lengths[:, None])[:, None, :, None]
    with torch.no_grad():
        v.masked_fill_(past_end, float("nan"))
        k.masked_fill_(past_end, float("inf"))
    out = qkv.attention(q, k, v, mask=Causal() & Padding(lengths), backend=backend)
    assert torch.isfinite(out).all()


def test_finite_padded_memory_is_not_copied(gen):
    """Zero-copy: with finite k/v the guard hands back the same tensors (padded or not);
    only non-finite memory is copied, and then exactly the padded positions are zeroed."""
    _, k, v = make_qkv(2, 2, 3, 5, 4, gen=gen)
    mask = Padding(torch.tensor([5, 2]))
    kk, vv = _clear_padding(k, v, mask)
    assert kk is k and vv is v
    k2 = k.detach().clone()
    k2[1, :, 3] = float("nan")
    kk, vv = _clear_padding(k2, v.detach(), mask)
    assert torch.equal(kk[:, :, :2], k2[:, :, :2]) and torch.equal(kk[0], k2[0])
    assert torch.equal(kk[1, :, 2:], torch.zeros_like(kk[1, :, 2:]))
    assert torch.equal(vv[1, :, 2:], torch.zeros_like(vv[1, :, 2:]))
