"""fp16 / bf16 accuracy (Checklist 2, FlashAttention's bar).

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim.

For inputs already rounded to the half dtype, the oracle is ``oracle_attention`` (conftest,
plain fp64 math) on fp64 copies, over a keep matrix built here from the masks' documented
meaning (causal ``j <= i + S - N``, padding ``j < length``), not from qkv.masks.
A backend passes when its max abs error is at most HALF_FACTOR_OUT = 2x (outputs)
and HALF_FACTOR_GRAD = 3x (gradients of q, k, v, dense bias) the max abs error of a naive
implementation in the same dtype (``naive_attention`` below: plain matmul / softmax /
matmul, everything in the half dtype, autograd for the gradients).
Sizes are tiny: bf16 matmul is slow on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import qkv
from conftest import (
    HALF_DTYPES,
    HALF_FACTOR_GRAD,
    HALF_FACTOR_OUT,
    dtype_id,
    fp64,
    grads_of,
    make_qkv,
    max_err,
    oracle_attention,
    randn,
)
from qkv.masks import Causal, Padding

BACKENDS = ("sdpa", "chunked", "reference")


def naive_attention(q: Tensor, k: Tensor, v: Tensor, *, keep: Tensor | None,
                    bias: Tensor | None) -> Tensor:
    """The same-dtype baseline: no fp32 anywhere. Rows must keep at least one key."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(group, dim=1)  # (B, H, S, Dv)
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, N, S)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, H, N, Dv)


CASES = {
    # id: (B, H, Hkv, N, S, D, Dv, mask kind, bias?)
    "N64-S64-none": (1, 2, 2, 64, 64, 32, 32, None, False),
    "N64-S64-causal": (1, 2, 2, 64, 64, 32, 32, "causal", False),
    "N33-S65-gqa-causal": (1, 4, 2, 33, 65, 24, 24, "causal", False),
    "N65-S33-Dv40-padding": (2, 2, 1, 65, 33, 24, 40, "padding", False),
    "N48-S80-bias+causal": (1, 2, 2, 48, 80, 32, 32, "causal", True),
}


def _mask(kind: str | None, b: int, n: int, s: int):
    """(mask for qkv, keep matrix for the naive code); no row is left empty."""
    if kind is None:
        return None, None
    if kind == "causal":
        if n > s:
            raise ValueError("bottom-right causal with N > S leaves rows empty")
        keep = torch.arange(s)[None, :] <= torch.arange(n)[:, None] + (s - n)
        return Causal(), keep
    lengths = torch.tensor([s, s // 2, 3, 1][:b])
    keep = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    return Padding(lengths), keep


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case_id", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_error_within_factor_of_naive(backend, case_id, dtype, gen):
    b, h, hkv, n, s, d, dv, kind, with_bias = CASES[case_id]
    q, k, v = make_qkv(b, h, n, s, d, hkv=hkv, dv=dv, dtype=dtype, gen=gen)
    bias = randn(1, h, n, s, gen=gen, dtype=dtype).requires_grad_() if with_bias else None
    mask, keep = _mask(kind, b, n, s)
    d_out = randn(b, h, n, dv, gen=gen)
    kw = {"mask": mask} if mask is not None else {}

    out, grads = grads_of(lambda: qkv.attention(q, k, v, bias=bias, backend=backend, **kw),
                          [q, k, v, bias], d_out.to(dtype))
    naive, naive_grads = grads_of(lambda: naive_attention(q, k, v, keep=keep, bias=bias),
                                  [q, k, v, bias], d_out.to(dtype))
    q64, k64, v64, b64 = fp64(q), fp64(k), fp64(v), fp64(bias)
    ref, ref_grads = grads_of(  # fp64 oracle over the keep matrix built above, not qkv.masks
        lambda: oracle_attention(q64, k64, v64, keep=keep, bias=b64),
        [q64, k64, v64, b64], d_out.to(dtype).double())

    assert out.dtype == dtype and torch.isfinite(out).all()
    ours, base = max_err(out, ref), max_err(naive, ref)
    assert ours <= HALF_FACTOR_OUT * base, f"out: {ours:.3g} > 2 x naive {base:.3g}"
    for name, g, gn, gr in zip(("dq", "dk", "dv", "dbias"), grads, naive_grads, ref_grads,
                               strict=True):
        if gr is None:
            continue
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        ours, base = max_err(g, gr), max_err(gn, gr)
        assert ours <= HALF_FACTOR_GRAD * base, f"{name}: {ours:.3g} > 3 x naive {base:.3g}"


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_weights_are_fp32(backend, dtype):
    q, k, v = make_qkv(1, 2, 5, 6, 8, dtype=dtype)
    out, w = qkv.attention(q, k, v, return_weights=True, backend=backend)
    assert out.dtype == dtype and w.dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_large_logits_stay_finite(backend, dtype):
    """Logits far beyond the half range before the softmax's max subtraction (|q.k| up to
    ~1e5): outputs and grads finite — the softmax must not be computed naively in half."""
    q = torch.full((1, 1, 4, 16), 60.0, dtype=dtype).requires_grad_()
    k = torch.full((1, 1, 6, 16), 60.0, dtype=dtype)
    k[0, 0, 3] = -60.0
    k.requires_grad_()
    v = torch.randn(1, 1, 6, 16).to(dtype).requires_grad_()
    out = qkv.attention(q, k, v, scale=2.0, backend=backend)  # logits ±115200
    out.float().sum().backward()
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t).all(), name
    # five keys share the top logit: the output is their mean
    keep = torch.ones(6, dtype=torch.bool)
    keep[3] = False
    want = v.detach().double()[0, 0, keep].mean(0)
    torch.testing.assert_close(out[0, 0].double(), want.expand(4, 16),
                               atol=2e-2, rtol=0)  # half rounding of a mean of 5 values
