"""Attention-logit soft-capping (``qkv.attention(..., softcap=c)``, Gemma 2) on every backend
that serves it, against an fp64 oracle written here (docs/ARCHITECTURE.md: Backends (attention)).

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim.

Oracle (``_oracle``): plain fp64 math on fp64 copies of the inputs, in Gemma 2's eager order:
logits = q kᵀ · scale, then ``c · tanh(logits / c)``, then + bias, then the mask (-inf), then
softmax over the allowed keys (a row with none gives zero weights); out = weights @ v. The
keep matrices are built here from each mask's documented meaning with explicit index
comparisons (query i at position p = i + S - N: causal ``j <= p``, padding ``j < length``,
SlidingWindow(W) ``p - W < j <= p`` / ``|j - p| < W``, BlockSparse ``layout[i//bs, j//bs]``,
ALiBi ``-slope[h] · |j - p|``), never from the mask objects (no ``.dense()``). Gradients of
the oracle come from autograd through that formula.

Tolerances: fp32 outputs, attention weights and q/k/v/bias gradients against the fp64 oracle:
atol 5e-5, rtol 5e-6 (``TOL[torch.float32]``); fp64: atol 1e-12, rtol 1e-10
(``TOL[torch.float64]``). fp16/bf16: error <= 2x (outputs) / 3x (gradients) that of a naive
implementation of the same formula in the half dtype (``HALF_FACTOR_OUT`` /
``HALF_FACTOR_GRAD``). Custom autograd paths (chunked tiles) pass ``gradcheck`` in fp64.
Inputs are scaled so that most logits exceed the cap: each case first asserts that the cap
moves the oracle's output by more than 1e-2, so ignoring ``softcap`` fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import qkv
from conftest import (
    HALF_FACTOR_GRAD,
    HALF_FACTOR_OUT,
    TOL,
    assert_close_to,
    fp64,
    grads_of,
    max_err,
    oracle_attention,
    randn,
)
from qkv.masks import BlockSparse, Causal, Padding, SlidingWindow
from qkv.ops.chunked import chunked_attention
from qkv.ops.sdpa import MAX_MATERIALISED
from qkv.positions import ALiBi

CAP = 1.5  # logits of std ~4 (inputs x2): most are capped hard


# ------------------------------------------------------------------------------ the oracle


def _oracle(q: Tensor, k: Tensor, v: Tensor, *, softcap: float | None, keep: Tensor | None,
            bias: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, H, N, Dv), weights (B, H, N, S)) of capped attention, from the formula."""
    g = q.shape[1] // k.shape[1]
    k = torch.repeat_interleave(k, g, dim=1)  # (B, H, S, D)
    v = torch.repeat_interleave(v, g, dim=1)  # (B, H, S, Dv)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.einsum("bhnd,bhsd->bhns", q, k) * scale  # (B, H, N, S)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias
    allowed = torch.ones_like(logits, dtype=torch.bool) if keep is None else (
        keep.expand(logits.shape))
    logits = torch.where(allowed, logits, torch.zeros_like(logits))
    top = torch.where(allowed, logits, torch.full_like(logits, -math.inf)).amax(-1, True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.where(allowed, torch.exp(logits - top), torch.zeros_like(logits))
    total = e.sum(-1, keepdim=True)
    weights = e / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("bhns,bhsv->bhnv", weights, v), weights


def _rel(n: int, s: int) -> Tensor:
    """(N, S) key index minus query position (p = i + S - N)."""
    return torch.arange(s)[None, :] - (torch.arange(n)[:, None] + s - n)


def _causal_keep(n, s):
    return (_rel(n, s) <= 0)[None, None]  # (1, 1, N, S)


def _pad_keep(lengths, s):
    return (torch.arange(s)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]


def _window_keep(w, causal, n, s):
    rel = _rel(n, s)
    keep = (rel > -w) & (rel <= 0) if causal else rel.abs() < w
    return keep[None, None]


# --------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One request: shapes, and ``build(gen)`` -> (attention kwargs, oracle keep, oracle
    bias or None) with the bias a leaf shared by both when it is a tensor."""

    id: str
    b: int
    h: int
    hkv: int
    n: int
    s: int
    d: int
    build: Callable


def _none(c, gen):
    return {}, None, None


def _causal(c, gen):
    return {"causal": True}, _causal_keep(c.n, c.s), None


def _pad_causal(c, gen):
    lengths = [c.s, 6]
    return ({"mask": Padding(torch.tensor(lengths)), "causal": True},
            _pad_keep(lengths, c.s) & _causal_keep(c.n, c.s), None)


def _pad_empty(c, gen):  # batch row 0 has no key: its rows give zeros, finite gradients
    lengths = [0, 5]
    return {"mask": Padding(torch.tensor(lengths))}, _pad_keep(lengths, c.s), None


def _bias(c, gen):
    bias = randn(c.b, c.h, c.n, c.s, gen=gen).requires_grad_()
    return {"bias": bias, "causal": True}, _causal_keep(c.n, c.s), bias


def _bool_mask(c, gen):
    keep = torch.rand(c.b, 1, c.n, c.s, generator=gen) > 0.4
    keep[..., 0] = True
    return {"mask": keep}, keep, None


def _window(w, causal):
    def build(c, gen):
        return ({"mask": SlidingWindow(w, causal=causal)}, _window_keep(w, causal, c.n, c.s),
                None)
    return build


def _window_pad(c, gen):
    lengths = [c.s, 11]
    return ({"mask": SlidingWindow(5) & Padding(torch.tensor(lengths))},
            _window_keep(5, True, c.n, c.s) & _pad_keep(lengths, c.s), None)


def _window_bias(c, gen):
    bias = randn(1, c.h, c.n, c.s, gen=gen).requires_grad_()
    return {"mask": SlidingWindow(4), "bias": bias}, _window_keep(4, True, c.n, c.s), bias


def _block_sparse(c, gen):
    layout = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    keep = layout[torch.arange(c.n) // 4][:, torch.arange(c.s) // 4]  # (N, S)
    return {"mask": BlockSparse(layout, 4)}, keep[None, None], None


def _alibi(c, gen):
    slopes = torch.tensor([0.5, 0.25])  # exact in fp32
    bias = -(slopes.double()[:, None, None] * _rel(c.n, c.s).abs())[None]  # (1, H, N, S)
    return ({"bias": ALiBi(c.h, slopes=slopes), "causal": True}, _causal_keep(c.n, c.s),
            bias)


CASES = [
    Case("plain-N17-S17", 2, 2, 2, 17, 17, 16, _none),
    Case("causal-N5-S17", 2, 2, 2, 5, 17, 24, _causal),
    Case("padding-causal", 2, 2, 2, 17, 17, 16, _pad_causal),
    Case("padding-empty-row", 2, 2, 2, 3, 9, 8, _pad_empty),
    Case("bias-causal-N7-S11", 2, 2, 2, 7, 11, 16, _bias),
    Case("bool-mask", 2, 2, 2, 6, 13, 16, _bool_mask),
    Case("gqa-H4-Hkv2-causal", 2, 4, 2, 13, 13, 16, _causal),
    Case("window4-causal-gqa", 2, 4, 1, 23, 23, 16, _window(4, True)),
    Case("window3-bidir-N9-S20", 1, 2, 2, 9, 20, 16, _window(3, False)),
    Case("window-padding", 2, 2, 2, 20, 20, 8, _window_pad),
    Case("window-bias", 1, 2, 1, 15, 15, 16, _window_bias),
    Case("block-sparse", 1, 2, 2, 12, 12, 16, _block_sparse),
    Case("alibi-causal", 1, 2, 2, 15, 15, 16, _alibi),
]


def _inputs(c: Case, dtype, gen):
    q = (2 * randn(c.b, c.h, c.n, c.d, gen=gen)).to(dtype).requires_grad_()
    k = (2 * randn(c.b, c.hkv, c.s, c.d, gen=gen)).to(dtype).requires_grad_()
    v = randn(c.b, c.hkv, c.s, c.d, gen=gen).to(dtype).requires_grad_()
    return q, k, v


def _oracle_of(q, k, v, keep, bias, softcap=CAP):
    q64, k64, v64 = fp64(q), fp64(k), fp64(v)
    b64 = fp64(bias) if isinstance(bias, Tensor) else None
    return (q64, k64, v64, b64), _oracle(q64, k64, v64, softcap=softcap, keep=keep, bias=b64)


# ------------------------------------------------------------------------ against the oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", ["chunked", "reference", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_outputs_weights_and_grads_match_the_oracle(case, backend, dtype, gen):
    """Outputs, return_weights and q/k/v/bias gradients vs the fp64 oracle (TOL[dtype])."""
    atol, rtol = TOL[dtype]
    q, k, v = _inputs(case, dtype, gen)
    kwargs, keep, bias = case.build(case, gen)
    if isinstance(kwargs.get("bias"), Tensor):
        kwargs["bias"] = bias = bias.detach().to(dtype).requires_grad_()
    leaves64, (expected, weights64) = _oracle_of(q, k, v, keep, bias)
    uncapped, _ = _oracle(*leaves64[:3], softcap=None, keep=keep,
                          bias=None if leaves64[3] is None else leaves64[3].detach())
    assert max_err(expected, uncapped) > 1e-2, "inputs too small for the cap to matter"

    d_out = randn(*expected.shape, gen=gen)
    tensor_bias = bias if isinstance(kwargs.get("bias"), Tensor) else None
    out, grads = grads_of(
        lambda: qkv.attention(q, k, v, softcap=CAP, backend=backend, **kwargs),
        [q, k, v, tensor_bias], d_out)
    _, grads64 = grads_of(lambda: expected, list(leaves64), d_out.double())
    assert out.dtype == dtype
    assert_close_to(out, expected, atol=atol, rtol=rtol, what=f"{backend} out")
    for name, got, want in zip("qkvb", grads, grads64, strict=True):
        if got is not None:
            assert torch.isfinite(got).all(), name
            assert_close_to(got, want, atol=atol, rtol=rtol, what=f"{backend} d{name}")

    out_w, weights = qkv.attention(q, k, v, softcap=CAP, backend=backend, return_weights=True,
                                   **kwargs)
    assert_close_to(out_w, expected, atol=atol, rtol=rtol, what="out with weights")
    assert_close_to(weights, weights64, atol=atol, rtol=rtol, what=f"{backend} weights")


@pytest.mark.parametrize("blocks", [(1, 1), (3, 4), (5, 7)], ids=lambda b: f"bq{b[0]}-bk{b[1]}")
@pytest.mark.parametrize("which", ["bias-causal-N7-S11", "window-padding", "alibi-causal"])
def test_chunked_tiles_of_every_size(which, blocks, gen):
    """The chunked tiles with forced block sizes (many key tiles merged online, several query
    blocks): fp32 outputs and gradients vs the fp64 oracle at TOL[fp32]."""
    atol, rtol = TOL[torch.float32]
    case = next(c for c in CASES if c.id == which)
    q, k, v = _inputs(case, torch.float32, gen)
    kwargs, keep, bias = case.build(case, gen)
    mask = kwargs.get("mask")
    if kwargs.get("causal"):
        mask = Causal() if mask is None else Causal() & mask
    leaves64, (expected, _) = _oracle_of(q, k, v, keep, bias)
    d_out = randn(*expected.shape, gen=gen)
    tensor_bias = bias if isinstance(kwargs.get("bias"), Tensor) else None
    out, grads = grads_of(
        lambda: chunked_attention(q, k, v, mask=mask, bias=kwargs.get("bias"),
                                  scale=case.d ** -0.5, block_q=blocks[0], block_k=blocks[1],
                                  softcap=CAP)[0],
        [q, k, v, tensor_bias], d_out)
    _, grads64 = grads_of(lambda: expected, list(leaves64), d_out.double())
    assert_close_to(out, expected, atol=atol, rtol=rtol, what="out")
    for name, got, want in zip("qkvb", grads, grads64, strict=True):
        if got is not None:
            assert_close_to(got, want, atol=atol, rtol=rtol, what=f"d{name}")


@pytest.mark.parametrize("which", ["window4-causal-gqa", "window-bias", "alibi-causal",
                                   "padding-empty-row", "block-sparse"])
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_gradcheck_fp64(which, backend, gen):
    """torch.autograd.gradcheck in fp64 (its default eps 1e-6, atol 1e-5, rtol 1e-3) of q, k,
    v (and a dense bias) on a tiny case; the chunked backend's backward is its own."""
    base = next(c for c in CASES if c.id == which)
    case = Case(base.id, base.b, base.h, base.hkv, min(base.n, 12), min(base.s, 12), 3,
                base.build)
    q, k, v = _inputs(case, torch.float64, gen)
    kwargs, _, bias = case.build(case, gen)
    extra = ()
    if isinstance(kwargs.get("bias"), Tensor):
        kwargs.pop("bias")
        extra = (bias.detach().double().requires_grad_(),)

    def f(q, k, v, *dense_bias):
        if dense_bias:
            kwargs["bias"] = dense_bias[0]
        return qkv.attention(q, k, v, softcap=0.7, backend=backend, **kwargs)

    assert torch.autograd.gradcheck(f, (q, k, v, *extra))


def test_large_window_on_auto_is_served_exactly_by_the_band_tiles(gen):
    """Above MAX_MATERIALISED scores auto takes the chunked backend; a plain SlidingWindow with
    softcap skips the flash-kernel window path (no tanh step) for the explicit tiles over the
    band. fp32 output and dq vs the fp64 oracle at TOL[fp32]; the same call without softcap
    must differ (the cap is applied, not the uncapped kernel)."""
    atol, rtol = TOL[torch.float32]
    n = 2100
    assert n * n > MAX_MATERIALISED
    q = (2 * randn(1, 1, n, 8, gen=gen)).requires_grad_()
    k, v = 2 * randn(1, 1, n, 8, gen=gen), randn(1, 1, n, 8, gen=gen)
    mask = SlidingWindow(16)
    reasons = qkv.explain(q, k, v, mask=mask, softcap=CAP)
    assert "softcap" in reasons["sdpa"] and reasons["chunked"] is None
    (q64, *_), (expected, _) = _oracle_of(q, k, v, _window_keep(16, True, n, n), None)
    d_out = randn(1, 1, n, 8, gen=gen)
    out, (dq,) = grads_of(lambda: qkv.attention(q, k, v, mask=mask, softcap=CAP), [q], d_out)
    (dq64,) = torch.autograd.grad(expected, [q64], d_out.double())
    assert_close_to(out, expected, atol=atol, rtol=rtol, what="out")
    assert_close_to(dq, dq64, atol=atol, rtol=rtol, what="dq")
    assert max_err(qkv.attention(q, k, v, mask=mask).detach(), expected) > 1e-2


# ------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("which", ["gqa-H4-Hkv2-causal", "window4-causal-gqa"])
def test_half_precision_within_factor_of_naive(which, backend, dtype, gen):
    """fp16/bf16 inputs (tanh and softmax in fp32 inside): error vs the fp64 oracle at most
    HALF_FACTOR_OUT (outputs) / HALF_FACTOR_GRAD (q/k/v gradients) times that of the naive
    same-formula implementation run in the half dtype; out keeps the half dtype, the weights
    come back in fp32."""
    case = next(c for c in CASES if c.id == which)
    q, k, v = _inputs(case, dtype, gen)
    kwargs, keep, _ = case.build(case, gen)
    leaves64, (expected, _) = _oracle_of(q, k, v, keep, None)
    d_out = randn(*expected.shape, gen=gen)
    _, grads64 = grads_of(lambda: expected, list(leaves64[:3]), d_out.double())
    out, grads = grads_of(lambda: qkv.attention(q, k, v, softcap=CAP, backend=backend,
                                                **kwargs), [q, k, v], d_out)
    naive, naive_grads = grads_of(lambda: _oracle(q, k, v, softcap=CAP, keep=keep)[0],
                                  [q, k, v], d_out)
    assert out.dtype == dtype and naive.dtype == dtype
    assert max_err(out, expected) <= HALF_FACTOR_OUT * max_err(naive, expected)
    for name, got, nai, want in zip("qkv", grads, naive_grads, grads64, strict=True):
        assert max_err(got, want) <= HALF_FACTOR_GRAD * max_err(nai, want), name
    _, weights = qkv.attention(q, k, v, softcap=CAP, backend=backend, return_weights=True,
                               **kwargs)
    assert weights.dtype == torch.float32


# ------------------------------------------------------------------- None, sdpa, validation


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "reference", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_none_is_plain_attention(backend, causal, gen):
    """softcap=None is plain attention on every backend (sdpa included), vs the conftest's
    uncapped fp64 oracle at TOL[fp32], and a cap far above every logit (1e6) agrees with it
    too (the cap is ~identity there)."""
    atol, rtol = TOL[torch.float32]
    q, k, v = (randn(2, 2, 9, 16, gen=gen) for _ in range(3))
    keep = _causal_keep(9, 9) if causal else None
    expected = oracle_attention(fp64(q), fp64(k), fp64(v), keep=keep)
    for cap in (None, 1e6):
        if backend == "sdpa" and cap is not None:
            continue
        out = qkv.attention(q, k, v, causal=causal, softcap=cap, backend=backend)
        assert_close_to(out, expected, atol=atol, rtol=rtol, what=f"softcap={cap}")
    assert qkv.explain(q, k, v, causal=causal, softcap=None)["sdpa"] is None


def test_sdpa_requested_with_softcap_refuses_naming_it():
    """sdpa cannot cap logits before the mask: asked for explicitly it raises NoBackendError
    (a ValueError) whose message names softcap; auto serves the same request."""
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with pytest.raises(qkv.NoBackendError, match=r"sdpa: .*softcap=2\.0"):
        qkv.attention(q, k, v, softcap=2.0, backend="sdpa")
    assert issubclass(qkv.NoBackendError, ValueError)
    assert qkv.attention(q, k, v, softcap=2.0).shape == (1, 2, 5, 8)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, -math.inf, math.nan, 0])
def test_softcap_value_errors(bad):
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="softcap"):
        qkv.attention(q, q, q, softcap=bad)
    with pytest.raises(ValueError, match="softcap"):
        qkv.explain(q, q, q, softcap=bad)


@pytest.mark.parametrize("bad", [True, "50", torch.tensor(50.0), [50.0]],
                         ids=["bool", "str", "tensor", "list"])
def test_softcap_type_errors(bad):
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match="softcap"):
        qkv.attention(q, q, q, softcap=bad)


def test_integer_softcap_is_its_float(gen):
    """An int cap (Gemma 2's configs write 50.0; 50 means the same) equals the float one."""
    q, k, v = (4 * randn(1, 2, 6, 8, gen=gen) for _ in range(3))
    for backend in ("chunked", "reference"):
        assert torch.equal(qkv.attention(q, k, v, softcap=2, backend=backend),
                           qkv.attention(q, k, v, softcap=2.0, backend=backend))
