"""Every backend of ``qkv.attention`` against fp64 oracles (Checklist 1, 7, 12, 18).

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim.

Oracle: ``oracle_attention`` (conftest), plain fp64 math on fp64 copies of the inputs, with
the keep matrix of every case built here from the mask's documented meaning (explicit index
comparisons: causal bottom-right ``j <= i + S - N`` / top-left ``j <= i``, padding
``j < length``), never from the mask objects under test (no ``.dense()``); gradients by
autograd through that formula. The reference backend is additionally checked against the
same oracle at fp64 precision. Tolerance for fp32 vs the fp64 oracle, outputs AND gradients
(q, k, v, dense bias): atol 5e-5, rtol 5e-6 (``TOL[torch.float32]``, PyTorch's OpInfo bar
for SDPA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import qkv
from conftest import (
    TOL,
    assert_close_to,
    fp64,
    grads_of,
    make_qkv,
    oracle_attention,
    oracle_weights,
    randn,
)
from qkv.masks import Causal, Padding

BACKENDS = ("sdpa", "chunked", "reference")
ATOL, RTOL = TOL[torch.float32]  # 5e-5, 5e-6


@dataclass(frozen=True)
class Shape:
    id: str
    b: int
    h: int
    hkv: int
    n: int
    s: int
    d: int
    dv: int


SHAPES = [
    Shape("N1-S1-d24", 2, 2, 2, 1, 1, 24, 24),
    Shape("N2-S2-d64", 2, 2, 2, 2, 2, 64, 64),
    Shape("N17-S17-d80", 2, 3, 3, 17, 17, 80, 80),
    Shape("N1-S17-d64", 2, 2, 2, 1, 17, 64, 64),
    Shape("N17-S1-d24", 2, 2, 2, 17, 1, 24, 24),
    Shape("N2-S17-d80", 1, 2, 2, 2, 17, 80, 80),
    Shape("N113-S203-d64", 1, 2, 2, 113, 203, 64, 64),
    Shape("N203-S113-d24", 1, 2, 2, 203, 113, 24, 24),
    Shape("gqa-H8-Hkv2", 1, 8, 2, 17, 29, 24, 24),
    Shape("mqa-H8-Hkv1", 1, 8, 1, 29, 17, 64, 64),
    Shape("Dv40-D24", 2, 2, 2, 17, 23, 24, 40),
    Shape("Dv24-D80-gqa", 1, 4, 2, 23, 17, 80, 24),
    Shape("N1023-S1024-d64", 1, 1, 1, 1023, 1024, 64, 64),
    Shape("N1024-S1023-d80", 1, 1, 1, 1024, 1023, 80, 80),
]


# ------------------------------------------------------------------- mask/bias cases
# Each case builds the attention kwargs and, independently of qkv.masks, the keep matrix
# (bool, broadcastable to (B, H, N, S)) and the dense bias the oracle should use.


@dataclass
class Built:
    kwargs: dict
    keep: Tensor | None
    bias: Tensor | None


def _causal_keep(n: int, s: int, top_left: bool) -> Tensor:
    offset = 0 if top_left else s - n
    i = torch.arange(n)[:, None]
    j = torch.arange(s)[None, :]
    return (j <= i + offset)[None, None]  # (1, 1, N, S)


def _lengths(b: int, s: int, *, allow_zero: bool = False) -> Tensor:
    # first row full, then shorter ones; a 0 length makes every row of that batch empty
    vals = [s, max(1, s // 2), 1, 0 if allow_zero else max(1, s - 1)]
    return torch.tensor([vals[i % len(vals)] for i in range(b)])


def _pad_keep(lengths: Tensor, s: int) -> Tensor:
    return (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


def _rand_bool(*shape: int, p: float = 0.7) -> Tensor:
    return torch.rand(*shape) < p


def _bias(*shape: int) -> Tensor:
    return randn(*shape).requires_grad_()


MaskCase = Callable[[Shape], Built]


def _case_none(sh):
    return Built({}, None, None)


def _case_causal_br(sh):
    return Built({"mask": Causal()}, _causal_keep(sh.n, sh.s, False), None)


def _case_causal_tl(sh):
    return Built({"mask": Causal("top_left")}, _causal_keep(sh.n, sh.s, True), None)


def _case_causal_flag(sh):
    return Built({"causal": True}, _causal_keep(sh.n, sh.s, False), None)


def _case_pad_lengths(sh):
    lengths = _lengths(sh.b, sh.s)
    return Built({"mask": Padding(lengths)}, _pad_keep(lengths, sh.s), None)


def _case_pad_keep(sh):
    keep = _rand_bool(sh.b, sh.s)
    return Built({"mask": Padding(keep=keep)}, keep[:, None, None, :], None)


def _case_causal_and_pad(sh):
    lengths = _lengths(sh.b, sh.s, allow_zero=True)
    return Built({"mask": Causal() & Padding(lengths)},
                 _causal_keep(sh.n, sh.s, False) & _pad_keep(lengths, sh.s), None)


def _case_causal_flag_and_pad(sh):
    lengths = _lengths(sh.b, sh.s, allow_zero=True)
    return Built({"mask": Padding(lengths), "causal": True},
                 _causal_keep(sh.n, sh.s, False) & _pad_keep(lengths, sh.s), None)


def _case_causal_tl_and_pad(sh):
    lengths = _lengths(sh.b, sh.s)
    return Built({"mask": Causal("top_left") & Padding(lengths)},
                 _causal_keep(sh.n, sh.s, True) & _pad_keep(lengths, sh.s), None)


def _bool_case(shape_fn):
    def case(sh):
        t = _rand_bool(*shape_fn(sh))
        return Built({"mask": t}, t, None)
    return case


def _case_causal_and_bool(sh):
    t = _rand_bool(sh.b, 1, sh.n, sh.s)
    return Built({"mask": Causal() & t}, _causal_keep(sh.n, sh.s, False) & t, None)


def _case_bool_and_causal(sh):  # Mask.__rand__ order
    t = _rand_bool(sh.n, sh.s)
    return Built({"mask": qkv.masks.DenseMask(t) & Causal("top_left")},
                 _causal_keep(sh.n, sh.s, True) & t, None)


def _bias_case(shape_fn, mask_case: MaskCase | None = None):
    def case(sh):
        bias = _bias(*shape_fn(sh))
        built = Built({}, None, None) if mask_case is None else mask_case(sh)
        return Built({**built.kwargs, "bias": bias}, built.keep, bias)
    return case


MASK_CASES: dict[str, MaskCase] = {
    "none": _case_none,
    "causal-bottom-right": _case_causal_br,
    "causal-top-left": _case_causal_tl,
    "causal=True": _case_causal_flag,
    "padding-lengths": _case_pad_lengths,
    "padding-keep": _case_pad_keep,
    "causal&padding": _case_causal_and_pad,
    "causal=True+padding": _case_causal_flag_and_pad,
    "causal-top-left&padding": _case_causal_tl_and_pad,
    "bool(S)": _bool_case(lambda sh: (sh.s,)),
    "bool(N,S)": _bool_case(lambda sh: (sh.n, sh.s)),
    "bool(1,1,N,S)": _bool_case(lambda sh: (1, 1, sh.n, sh.s)),
    "bool(B,1,1,S)": _bool_case(lambda sh: (sh.b, 1, 1, sh.s)),
    "bool(B,1,N,S)": _bool_case(lambda sh: (sh.b, 1, sh.n, sh.s)),
    "bool(1,H,N,1)": _bool_case(lambda sh: (1, sh.h, sh.n, 1)),
    "bool(B,H,N,S)": _bool_case(lambda sh: (sh.b, sh.h, sh.n, sh.s)),
    "causal&bool": _case_causal_and_bool,
    "bool&causal-top-left": _case_bool_and_causal,
    "bias(B,H,N,S)": _bias_case(lambda sh: (sh.b, sh.h, sh.n, sh.s)),
    "bias(N,S)": _bias_case(lambda sh: (sh.n, sh.s)),
    "bias(1,H,1,S)": _bias_case(lambda sh: (1, sh.h, 1, sh.s)),
    "bias(B,1,N,1)": _bias_case(lambda sh: (sh.b, 1, sh.n, 1)),
    "bias+causal": _bias_case(lambda sh: (1, sh.h, sh.n, sh.s), _case_causal_br),
    "bias+causal-top-left": _bias_case(lambda sh: (sh.n, sh.s), _case_causal_tl),
    "bias+padding": _bias_case(lambda sh: (sh.b, sh.h, sh.n, sh.s), _case_causal_and_pad),
    "bias+bool": _bias_case(lambda sh: (sh.b, 1, sh.n, sh.s),
                            _bool_case(lambda sh: (sh.b, sh.h, sh.n, sh.s))),
}

MASK_SHAPES = [
    Shape("N17-S29-gqa", 2, 4, 2, 17, 29, 24, 24),
    Shape("N29-S17-Dv40", 2, 2, 1, 29, 17, 24, 40),
]


def _run(backend: str, q, k, v, built: Built, d_out: Tensor, **extra):
    bias = built.bias
    out, grads = grads_of(
        lambda: qkv.attention(q, k, v, backend=backend, **built.kwargs, **extra),
        [q, k, v, bias], d_out)
    return out, grads


def _check_against_oracle64(backend: str, sh: Shape, built: Built, gen) -> None:
    q, k, v = make_qkv(sh.b, sh.h, sh.n, sh.s, sh.d, hkv=sh.hkv, dv=sh.dv, gen=gen)
    d_out = randn(sh.b, sh.h, sh.n, sh.dv, gen=gen)
    bias = built.bias
    out, grads = _run(backend, q, k, v, built, d_out)
    q64, k64, v64, b64 = fp64(q), fp64(k), fp64(v), fp64(bias)
    # the oracle sees only tensors and the independently built keep matrix (no mask object)
    ref, ref_grads = grads_of(
        lambda: oracle_attention(q64, k64, v64, keep=built.keep, bias=b64),
        [q64, k64, v64, b64], d_out.double())
    assert out.dtype == torch.float32 and out.shape == (sh.b, sh.h, sh.n, sh.dv)
    # fp32 backend vs fp64 reference: atol 5e-5, rtol 5e-6
    assert_close_to(out, ref, atol=ATOL, rtol=RTOL, what=f"{backend} out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        if r is None:
            continue
        assert g.shape == r.shape, name
        assert_close_to(g, r, atol=ATOL, rtol=RTOL, what=f"{backend} {name}")


# ------------------------------------------------------------------------------- tests


def _shape_params():
    for shape in SHAPES:
        big = shape.n * shape.s > 100_000  # the 1023/1024 shapes: no mask and causal only
        for mask_id in ("none", "causal-bottom-right", *(() if big else ("padding-lengths",))):
            yield pytest.param(shape, mask_id, id=f"{shape.id}-{mask_id}")


@pytest.mark.parametrize(("shape", "mask_id"), list(_shape_params()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_match_fp64_oracle(backend, shape, mask_id, gen):
    """Awkward shapes (Checklist 7), outputs and grads vs the fp64 oracle."""
    _check_against_oracle64(backend, shape, MASK_CASES[mask_id](shape), gen)


@pytest.mark.parametrize("mask_id", list(MASK_CASES))
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: s.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_and_biases_match_fp64_oracle(backend, shape, mask_id, gen):
    """Every mask/bias kind and broadcast shape, outputs and grads (incl. dense bias)."""
    _check_against_oracle64(backend, shape, MASK_CASES[mask_id](shape), gen)


@pytest.mark.parametrize("mask_id", list(MASK_CASES))
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: s.id)
def test_reference_matches_independent_oracle(shape, mask_id, gen):
    """The oracle's oracle: reference (fp64) == formula written in conftest, 1e-12."""
    sh = shape
    built = MASK_CASES[mask_id](sh)
    q, k, v = make_qkv(sh.b, sh.h, sh.n, sh.s, sh.d, hkv=sh.hkv, dv=sh.dv, gen=gen,
                       dtype=torch.float64)
    bias = None if built.bias is None else built.bias.detach().double()
    kw = {**built.kwargs, **({"bias": bias} if bias is not None else {})}
    got, weights = qkv.attention(q, k, v, backend="reference", return_weights=True, **kw)
    want = oracle_attention(q, k, v, keep=built.keep, bias=bias)
    want_w = oracle_weights(q, k, keep=built.keep, bias=bias)
    atol, rtol = TOL[torch.float64]  # 1e-12, 1e-10: same math in fp64
    assert_close_to(got, want, atol=atol, rtol=rtol, what="reference out")
    assert_close_to(weights, want_w, atol=atol, rtol=rtol, what="reference weights")


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_custom_scale(backend, gen):
    """scale= replaces 1/sqrt(D) (outputs vs fp64 oracle, atol 5e-5, rtol 5e-6)."""
    q, k, v = make_qkv(2, 2, 9, 11, 16, gen=gen)
    out = qkv.attention(q, k, v, scale=0.37, mask=Causal(), backend=backend)
    want = oracle_attention(q.double(), k.double(), v.double(), scale=0.37,
                            keep=_causal_keep(9, 11, False))
    assert_close_to(out, want, atol=ATOL, rtol=RTOL, what=backend)


def test_auto_backend_serves_and_matches_oracle(gen):
    q, k, v = make_qkv(2, 4, 13, 21, 24, hkv=2, gen=gen)
    assert all(r is None for r in qkv.explain(q, k, v, mask=Causal()).values())
    out = qkv.attention(q, k, v, mask=Causal())
    ref = oracle_attention(q.double(), k.double(), v.double(), keep=_causal_keep(13, 21, False))
    assert_close_to(out, ref, atol=ATOL, rtol=RTOL, what="auto")  # 5e-5 / 5e-6


# ------------------------------------------------------------- determinism (Checklist 12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_zero_is_deterministic(backend, gen):
    """dropout_p=0 (eval): two calls are bit-equal, whatever the global RNG does."""
    q, k, v = make_qkv(2, 2, 37, 41, 24, gen=gen)
    a = qkv.attention(q, k, v, mask=Causal(), dropout_p=0.0, backend=backend)
    torch.rand(100)  # move the global RNG on
    b = qkv.attention(q, k, v, mask=Causal(), dropout_p=0.0, backend=backend)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_backward_is_bit_equal(backend, gen):
    """Two forward+backward runs, and two backward passes of one graph, give equal bits."""
    q, k, v = make_qkv(2, 4, 37, 41, 24, hkv=2, gen=gen)
    bias = randn(1, 4, 37, 41, gen=gen).requires_grad_()
    d_out = randn(2, 4, 37, 24, gen=gen)
    mask = Causal() & Padding(torch.tensor([41, 20]))

    def fn():
        return qkv.attention(q, k, v, mask=mask, bias=bias, backend=backend)

    _, first = grads_of(fn, [q, k, v, bias], d_out)
    _, second = grads_of(fn, [q, k, v, bias], d_out)
    out = fn()
    third = torch.autograd.grad(out, [q, k, v, bias], d_out, retain_graph=True)
    fourth = torch.autograd.grad(out, [q, k, v, bias], d_out)
    for a, b, c, d in zip(first, second, third, fourth, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(c, d)


# ------------------------------------------------------------------- dropout (Checklist 12)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_keeps_one_minus_p(backend, p):
    """Kept fraction of weights == 1-p within 0.01, kept weights scaled by 1/(1-p).

    Trick: q = 0 gives uniform weights 1/S, and one-hot values v[j] = e_j make the output
    out[i, j] = keep[i, j] / (S (1-p)): the dropout mask itself. 1*4*256*256 = 262144
    weights: the fraction's standard deviation is <= 0.001, so 0.01 is a 10-sigma bound.
    """
    b, h, n, s = 1, 4, 256, 256
    q = torch.zeros(b, h, n, 16)
    k = torch.randn(b, h, s, 16)
    v = torch.eye(s).expand(b, h, s, s)  # (B, H, S, Dv=S) one-hot values
    out = qkv.attention(q, k, v, dropout_p=p, backend=backend)
    kept = out != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01
    # each kept weight is exactly the rescaled uniform weight (fp32 rounding: rtol 1e-5)
    want = torch.full_like(out[kept], 1.0 / (s * (1 - p)))
    torch.testing.assert_close(out[kept], want, rtol=1e-5, atol=0)
    # and the pattern is fresh per call (not a fixed mask)
    again = qkv.attention(q, k, v, dropout_p=p, backend=backend)
    assert not torch.equal(kept, again != 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_backward_matches_finite_differences(backend):
    """With the RNG reseeded before each call the dropout mask is fixed, so the function is
    deterministic: fp64 gradcheck proves backward uses the same mask as forward."""
    q, k, v = make_qkv(1, 2, 5, 7, 4, dtype=torch.float64)
    bias = randn(1, 2, 5, 7, dtype=torch.float64).requires_grad_()

    def fn(q, k, v, bias):
        torch.manual_seed(1234)
        return qkv.attention(q, k, v, bias=bias, mask=Causal(), dropout_p=0.4,
                             backend=backend)

    with torch.random.fork_rng():
        first = fn(q, k, v, bias)
        assert torch.equal(first, fn(q, k, v, bias))  # reseeding reproduces the output
        assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-7)


# ------------------------------------------------------ return_weights (Checklist 18)


@pytest.mark.parametrize("mask_id", ["none", "causal&padding", "bias+bool", "bool(1,H,N,1)"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_return_weights(backend, mask_id, gen):
    """(B, H, N, S) weights == oracle weights (fp32 vs fp64: atol 5e-5, rtol 5e-6), rows
    sum to 1 or exactly 0 where fully masked; out is the same as without weights."""
    sh = MASK_SHAPES[0]
    built = MASK_CASES[mask_id](sh)
    q, k, v = make_qkv(sh.b, sh.h, sh.n, sh.s, sh.d, hkv=sh.hkv, gen=gen)
    out, w = qkv.attention(q, k, v, return_weights=True, backend=backend, **built.kwargs)
    assert w.shape == (sh.b, sh.h, sh.n, sh.s)
    bias = None if built.bias is None else built.bias.detach().double()
    want = oracle_weights(q.double(), k.double(), keep=built.keep, bias=bias)
    want = want.expand(sh.b, sh.h, sh.n, sh.s)
    assert_close_to(w, want, atol=ATOL, rtol=RTOL, what="weights")
    sums = w.double().sum(-1)
    empty = want.sum(-1) == 0
    assert torch.equal(sums[empty], torch.zeros_like(sums[empty]))
    assert_close_to(sums[~empty], torch.ones_like(sums[~empty]), atol=1e-5, rtol=0,
                    what="row sums")  # fp32 sum of <= 29 terms
    assert torch.equal(out, qkv.attention(q, k, v, backend=backend, **built.kwargs))
