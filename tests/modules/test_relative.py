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
from torch import Tensor
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


# ------------------------------------------------- independent dense oracle, fp32 vs fp64
# Built from the papers' formulas alone: no qkv helper (alibi_slopes, t5_bucket, .bucket,
# .index, .slopes, .dense) is called; only the learned tables are read, as fp64 leaves.
# Query i sits at position i + S - N (bottom-right, qkv.ops.bias), key j at j; rel = j - pos.


def paper_alibi_slopes(h: int) -> list[float]:
    """Press et al. 2022, sec. 3: for H a power of two the geometric sequence starting at
    2^(-8/H) with that ratio; otherwise the 2^k = largest power of two below H slopes, then
    the odd-indexed (1st, 3rd, ...) slopes of the 2^(k+1) sequence."""
    def geometric(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    p = 1
    while p * 2 <= h:
        p *= 2
    return geometric(p) + [geometric(2 * p)[i] for i in range(0, 2 * (h - p), 2)]


def independent_bias(scheme_name: str, n: int, s: int, heads: int, *, causal: bool,
                     table: Tensor | None, t5_cfg=None) -> Tensor:
    """(H, N, S) fp64 additive bias of ALiBi / T5 from the formulas (Shaw: see below)."""
    pos = torch.arange(n, dtype=torch.long)[:, None] + (s - n)  # (N, 1)
    rel = torch.arange(s, dtype=torch.long)[None, :] - pos  # (N, S): key - query
    if scheme_name == "alibi":
        m = torch.tensor(paper_alibi_slopes(heads), dtype=torch.float64)  # (H,)
        return -m[:, None, None] * rel.abs().double()[None]  # (H, N, S)
    num_buckets, max_distance = t5_cfg
    lo = -(s - 1) - max(0, n - s)
    values = list(range(lo, n))  # every rel that occurs
    bucket_of = torch.tensor([plain_t5_bucket(r, not causal, num_buckets, max_distance)
                              for r in values])
    buckets = bucket_of[rel - lo]  # (N, S)
    return table[buckets].permute(2, 0, 1)  # (num_buckets, H)[.] -> (H, N, S)


def independent_attention(q, k, v, scheme_name, *, causal, params, keep_len=None):
    """softmax(q kᵀ/sqrt(D) + bias) v (+ Shaw's value term), fp64, empty rows -> 0.
    ``params``: fp64 leaves of the scheme's tables; ``keep_len`` (B,) optional padding."""
    b, h, n, d = q.shape
    s = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    scores = torch.einsum("bhnd,bhsd->bhns", q, k) * scale  # (B, H, N, S)
    extra = None
    if scheme_name == "shaw":
        clip = params["max_distance"]
        pos = torch.arange(n)[:, None] + (s - n)
        rel = (torch.arange(s)[None, :] - pos).clamp(-clip, clip) + clip  # (N, S) row index
        a_k = params["key_embedding"][rel]  # (N, S, D)
        scores = scores + torch.einsum("bhnd,nsd->bhns", q, a_k) * scale
        if "value_embedding" in params:
            extra = params["value_embedding"][rel]  # (N, S, Dv)
    else:
        scores = scores + independent_bias(scheme_name, n, s, h, causal=causal,
                                           table=params.get("weight"),
                                           t5_cfg=params.get("t5_cfg"))[None]
    allowed = torch.ones(b, 1, n, s, dtype=torch.bool)
    for i in range(n):  # causal, bottom-right: key j <= query position i + S - N
        allowed[:, :, i, i + s - n + 1:] = not causal
        if i + s - n + 1 <= 0 and causal:
            allowed[:, :, i, :] = False
    if keep_len is not None:
        for bi, length in enumerate(keep_len):
            allowed[bi, :, :, length:] = False
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(~allowed, 0.0)
    out = torch.einsum("bhns,bhsd->bhnd", p, v)
    if extra is not None:
        out = out + torch.einsum("bhns,nsd->bhnd", p, extra)
    return out


def _fp32_scheme(name: str, heads: int, d: int, causal: bool):
    """The module under test (fp32) with non-trivial tables, and its fp64 oracle leaves."""
    g = torch.Generator().manual_seed(11)
    if name == "alibi":
        return ALiBi(heads), {}
    if name == "t5":
        scheme = T5Bias(heads, num_buckets=32, max_distance=128, bidirectional=not causal)
        with torch.no_grad():
            scheme.embedding.weight.copy_(torch.randn(32, heads, generator=g))
        leaves = {"weight": scheme.embedding.weight.detach().double().requires_grad_(),
                  "t5_cfg": (32, 128)}
        return scheme, leaves
    scheme = ShawRelative(d, max_distance=5)
    with torch.no_grad():
        scheme.key_embedding.copy_(torch.randn(11, d, generator=g))
        scheme.value_embedding.copy_(torch.randn(11, d, generator=g))
    leaves = {"key_embedding": scheme.key_embedding.detach().double().requires_grad_(),
              "value_embedding": scheme.value_embedding.detach().double().requires_grad_(),
              "max_distance": 5}
    return scheme, leaves


def _check_fp32_vs_independent(name, n, s, causal, backend, *, heads=3, d=16, b=1,
                               lengths=None):
    scheme, leaves = _fp32_scheme(name, heads, d, causal)
    q, k, v = rand_qkv(b, heads, n, s, d, dtype=torch.float32, seed=n * 1000 + s)
    d_out = torch.randn(b, heads, n, d, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64)
    mask = Padding(lengths) if lengths is not None else None
    out = qkv.attention(q, k, v, causal=causal, mask=mask, bias=scheme, backend=backend)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = independent_attention(q64, k64, v64, name, causal=causal, params=leaves,
                                 keep_len=None if lengths is None else lengths.tolist())
    # fp32 vs the fp64 oracle: atol 5e-5, rtol 5e-6 (outputs and every gradient)
    torch.testing.assert_close(out.double(), want, atol=5e-5, rtol=5e-6)
    tables = [t for t in leaves.values() if isinstance(t, Tensor)]
    got = torch.autograd.grad(out, [q, k, v, *scheme.parameters()], d_out.float())
    ref = torch.autograd.grad(want, [q64, k64, v64, *tables], d_out)
    names = ["dq", "dk", "dv", *(f"d{n_}" for n_, _ in scheme.named_parameters())]
    for what, a, r in zip(names, got, ref, strict=True):
        torch.testing.assert_close(a.double(), r, atol=5e-5, rtol=5e-6,
                                   msg=lambda m, what=what: f"{what}: {m}")


INDEPENDENT_SIZES = (1, 17, 113, 203)


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", SCHEMES)
def test_fp32_matches_independent_fp64_oracle(name, causal, backend):
    """Every (N, S) in {1, 17, 113, 203}² (N != S and N > S with empty causal rows
    included), fp32 outputs and gradients of q, k, v and the scheme's tables vs the fp64
    oracle written from the papers: atol 5e-5, rtol 5e-6. ALiBi with H = 3 uses the
    non-power-of-two slopes."""
    for n in INDEPENDENT_SIZES:
        for s in INDEPENDENT_SIZES:
            _check_fp32_vs_independent(name, n, s, causal, backend)


@pytest.mark.parametrize("n,s", [(600, 520), (1, 530)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", SCHEMES)
def test_fp32_matches_independent_fp64_oracle_long(name, causal, n, s):
    """Lengths >= 513 on the default (chunked) backend: T5 past its saturation distance,
    Shaw far beyond its clip; same oracle and tolerances."""
    _check_fp32_vs_independent(name, n, s, causal, "auto", heads=2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", SCHEMES)
def test_fp32_with_padding_matches_independent_fp64_oracle(name, causal):
    """Padding sends the chunked backend to its explicit tiles; B = 2, one short row."""
    _check_fp32_vs_independent(name, 113, 203, causal, "chunked", b=2,
                               lengths=torch.tensor([203, 40]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_sdpa_materialised_bias_matches_independent_fp64_oracle(name, causal):
    for n, s in ((17, 113), (113, 17), (203, 203)):
        _check_fp32_vs_independent(name, n, s, causal, "sdpa")


def test_paper_slopes_oracle_on_paper_values():
    """The oracle's own slopes: H=8 -> 1/2 .. 1/256; H=12 -> those and 2^-0.5, 2^-1.5, ..."""
    assert paper_alibi_slopes(8) == [2.0 ** -(h + 1) for h in range(8)]
    assert paper_alibi_slopes(12) == ([2.0 ** -(h + 1) for h in range(8)]
                                      + [2.0 ** -(h + 0.5) for h in range(4)])
    assert paper_alibi_slopes(3) == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]


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
