"""Relative position schemes (ALiBi, T5 buckets, Shaw) against plain dense implementations
written here from the papers, on every path that serves them: the fused fast path (no mask
or causal), the explicit tiles (any other mask), sdpa (materialised, small) and reference.

Tolerances: fp64 paths vs the fp64 oracle at 1e-10; fp32 paths vs the fp64 oracle at
atol 5e-5, rtol 5e-6 (PyTorch's bar for SDPA).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv.masks import Causal, Padding
from qkv.ops.chunked import chunked_attention
from qkv.positions import ALiBi, ShawRelative, T5Bias, alibi_slopes


# ----------------------------------------------------------------------------- oracles
def plain_t5_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one relative position (key - query), written from the paper's code."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            bucket += num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def dense_oracle(q, k, v, scheme, *, causal, scale, keep=None):
    """softmax(q·k·scale + relative terms) v with plain loops over (i, j) for the bias."""
    b, h, n, _ = q.shape
    s = k.shape[2]
    scores = torch.einsum("bhnd,bhsd->bhns", q, k) * scale
    offset = s - n
    extra_v = torch.zeros(b, h, n, s, v.shape[-1], dtype=q.dtype)
    for i in range(n):
        for j in range(s):
            rel = j - (i + offset)
            if isinstance(scheme, ALiBi):
                scores[:, :, i, j] -= scheme.slopes.double() * abs(rel)
            elif isinstance(scheme, T5Bias):
                bucket = plain_t5_bucket(rel, scheme.bidirectional, scheme.num_buckets,
                                         scheme.max_distance)
                scores[:, :, i, j] += scheme.embedding.weight[bucket].double()
            else:
                r = max(-scheme.max_distance, min(scheme.max_distance, rel))
                a_k = scheme.key_embedding[r + scheme.max_distance].double()
                scores[:, :, i, j] += (q[:, :, i] @ a_k) * scale
                if scheme.value_embedding is not None:
                    extra_v[:, :, i, j] = scheme.value_embedding[r + scheme.max_distance].double()
    allowed = torch.ones(n, s, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed, diagonal=offset)
    allowed = allowed[None, None].expand(b, h, n, s)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhns,bhsd->bhnd", p, v) + torch.einsum("bhns,bhnsd->bhnd", p, extra_v)


def make_scheme(name: str, heads: int, head_dim: int, causal: bool):
    torch.manual_seed(3)
    if name == "alibi":
        return ALiBi(heads)
    if name == "t5":
        scheme = T5Bias(heads, num_buckets=8, max_distance=12, bidirectional=not causal)
        torch.nn.init.normal_(scheme.embedding.weight)
        return scheme
    return ShawRelative(head_dim, max_distance=3)


SCHEMES = ["alibi", "t5", "shaw"]


def rand_qkv(b, h, n, s, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, length, d, generator=g, dtype=dtype).requires_grad_()
                 for length in (n, s, s))


# ----------------------------------------------------------------------------- tests
def test_alibi_slopes_match_paper():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)],
                                                        dtype=torch.float64))
    twelve = [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(h + 0.5) for h in range(4)]
    assert torch.allclose(alibi_slopes(12), torch.tensor(twelve, dtype=torch.float64))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bucket_matches_plain(bidirectional):
    scheme = T5Bias(2, num_buckets=32, max_distance=128, bidirectional=bidirectional)
    rel = torch.arange(-300, 301)
    got = scheme.bucket(torch.zeros(1, dtype=torch.long), rel)[0]
    want = torch.tensor([plain_t5_bucket(int(r), bidirectional, 32, 128) for r in rel])
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("n,s", [(1, 1), (2, 7), (17, 17), (23, 40), (40, 23)])
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_matches_dense_oracle_fp64(name, causal, n, s, backend):
    """fp64, outputs and gradients of q, k, v and the scheme's parameters: atol 1e-10."""
    heads, d = 2, 8
    scheme = make_scheme(name, heads, d, causal).double()
    q, k, v = rand_qkv(2, heads, n, s, d)
    out = qkv.attention(q, k, v, causal=causal, bias=scheme, scale=0.4, backend=backend)
    want = dense_oracle(q, k, v, scheme, causal=causal, scale=0.4)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    params = [q, k, v, *scheme.parameters()]
    g_out = torch.randn_like(out)
    got = torch.autograd.grad(out, params, g_out)
    ref = torch.autograd.grad(want, params, g_out)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_explicit_tiles_with_padding(name, causal):
    """Padding disables the fused path: the explicit tiles serve, same oracle (1e-10)."""
    heads, d, n = 2, 8, 29
    scheme = make_scheme(name, heads, d, causal).double()
    q, k, v = rand_qkv(2, heads, n, n, d)
    lengths = torch.tensor([29, 11])
    out = qkv.attention(q, k, v, causal=causal, mask=Padding(lengths), bias=scheme, scale=0.4,
                        backend="chunked")
    keep = torch.arange(n)[None, :] < lengths[:, None]
    want = dense_oracle(q, k, v, scheme, causal=causal, scale=0.4, keep=keep)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_fp32_against_fp64_oracle(name, causal):
    """fp32 fused path vs the fp64 oracle: atol 5e-5, rtol 5e-6; ALiBi at N=300 exercises
    two row blocks of the folded key-linear term."""
    heads, d, n = 4, 16, 300
    scheme = make_scheme(name, heads, d, causal)
    q, k, v = rand_qkv(1, heads, n, n, d, dtype=torch.float32)
    out = qkv.attention(q, k, v, causal=causal, bias=scheme, backend="chunked")
    s64 = make_scheme(name, heads, d, causal).double()
    s64.load_state_dict(scheme.state_dict())
    want = chunked_attention(q.double(), k.double(), v.double(), mask=Causal() if causal else None,
                             bias=s64, scale=d ** -0.5, block_q=64, block_k=64)[0]
    torch.testing.assert_close(out.double(), want, atol=5e-5, rtol=5e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_alibi_fold_keeps_fp32_accuracy_over_row_blocks(causal):
    """N = 2100 spans three blocks of the folded key-linear term (ALIBI_ROWS = 1024): fp32
    fused output and gradients vs explicit fp64 tiles at atol 5e-5, rtol 5e-6."""
    heads, d, n = 2, 16, 2100
    scheme = ALiBi(heads, slopes=torch.tensor([0.5, 2.0 ** -8]))
    q, k, v = rand_qkv(1, heads, n, n, d, dtype=torch.float32)
    mask = Causal() if causal else None
    out = qkv.attention(q, k, v, mask=mask, bias=scheme, backend="chunked")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = chunked_attention(q64, k64, v64, mask=mask, bias=scheme, scale=d ** -0.5,
                             block_q=256, block_k=512)[0]
    torch.testing.assert_close(out.double(), want, atol=5e-5, rtol=5e-6)
    g = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), g.float())
    ref = torch.autograd.grad(want, (q64, k64, v64), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-6)


@pytest.mark.parametrize("name", SCHEMES)
def test_gradcheck_fused_path(name):
    heads, d, n = 2, 4, 7
    scheme = make_scheme(name, heads, d, causal=False).double()
    q, k, v = rand_qkv(1, heads, n, n + 3, d)
    params = list(scheme.parameters())

    def fn(q, k, v, *ps):
        return chunked_attention(q, k, v, bias=scheme, scale=0.5)[0]

    # fast_mode checks a random projection of the Jacobian: same bar, a fraction of the time
    assert torch.autograd.gradcheck(fn, (q, k, v, *params), fast_mode=True)


def test_sdpa_backend_refuses_shaw_and_materialises_t5():
    scheme = make_scheme("shaw", 2, 8, True)
    q, k, v = rand_qkv(1, 2, 5, 5, 8, dtype=torch.float32)
    with pytest.raises(qkv.NoBackendError, match="sdpa"):
        qkv.attention(q, k, v, bias=scheme, backend="sdpa")
    t5 = make_scheme("t5", 2, 8, True)
    a = qkv.attention(q, k, v, causal=True, bias=t5, backend="sdpa")
    b = qkv.attention(q, k, v, causal=True, bias=t5, backend="chunked")
    torch.testing.assert_close(a, b, atol=5e-6, rtol=5e-6)


def test_producer_head_count_checked():
    q, k, v = rand_qkv(1, 4, 5, 5, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="heads"):
        qkv.attention(q, k, v, bias=ALiBi(8))


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEMES)
def test_long_sequence_never_materialises_n_by_s(name):
    """N = S = 16384, causal, forward and backward: no tensor reaches N·S/16 elements."""
    n, heads, d = 16384, 2, 16
    scheme = make_scheme(name, heads, d, causal=True)
    q, k, v = rand_qkv(1, heads, n, n, d, dtype=torch.float32)
    with _LargestTensor() as watch:
        out = qkv.attention(q, k, v, causal=True, bias=scheme)
        out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert watch.largest < n * n // 16, watch.largest
