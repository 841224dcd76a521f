"""qkv.modules.norms against oracles nobody here wrote and formulas written in this file.

Shapes: B batch, N length, C model width; every norm maps (..., C) -> (..., C).

- RMSNorm: the formula x / sqrt(mean_C(x²) + eps) · w written here (fp64), and
  ``torch.nn.RMSNorm`` with the same eps and copied weights: fp64 at atol 1e-12, rtol 1e-10;
  fp32 at atol 1e-6, rtol 1e-6 (one fp32 reduction over C = 48).
- LayerNorm: ``torch.nn.LayerNorm`` / ``F.layer_norm`` with copied weight and bias, same tolerances.
- Half precision (Checklist 13): statistics in fp32, so fp16/bf16 output == the fp32 norm of
  the same input rounded once to the half dtype (atol 0: one rounding); inputs whose squares
  overflow fp16 (|x| ~ 300..1000) and constant fp16 inputs stay finite; LayerNorm's default
  eps >= 1e-5.
Weights and biases are random (not the identity init), so a mapping error cannot hide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.modules.norms import LayerNorm, RMSNorm, make_norm

C = 48
TOLS = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-6, 1e-6)}
HALF = (torch.float16, torch.bfloat16)


def _x(*shape, dtype=torch.float64, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.3).to(dtype)


def _randomise(module: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 + 1.0)


def rms_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean over C of x² + eps) · weight, in x's dtype (Zhang & Sennrich 2019)."""
    c = x.shape[-1]
    ms = (x * x).sum(-1, keepdim=True) / c  # (..., 1)
    return x / torch.sqrt(ms + eps) * weight


def layer_formula(x, weight, bias, eps):
    """(x - mean) / sqrt(biased var + eps) · weight + bias."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * weight
    return y if bias is None else y + bias


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("scale", [1.0, 1e-2], ids=["unit", "small"])  # small: eps matters
def test_rmsnorm_matches_formula_and_torch(dtype, eps, scale):
    norm = RMSNorm(C, eps=eps).to(dtype)
    _randomise(norm)
    ref = nn.RMSNorm(C, eps=eps, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
    x = _x(2, 7, C, dtype=dtype, scale=scale).requires_grad_()
    out = norm(x)
    atol, rtol = TOLS[dtype]
    assert out.dtype == dtype and out.shape == x.shape
    x64 = x.detach().double()
    torch.testing.assert_close(out.double(), rms_formula(x64, norm.weight.detach().double(), eps),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(out, ref(x), atol=atol, rtol=rtol)
    # gradients of x and weight equal torch's
    g = _x(2, 7, C, dtype=dtype, seed=5)
    got = torch.autograd.grad(out, (x, norm.weight), g)
    want = torch.autograd.grad(ref(x), (x, ref.weight), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=atol * 10, rtol=rtol * 10)  # sums over B·N


def test_rmsnorm_is_not_a_sum_of_squares():
    """Constant input c: mean(x²) = c², so the output is exactly ±weight (up to eps)."""
    norm = RMSNorm(C, eps=1e-6).double()
    _randomise(norm)
    x = torch.full((3, C), 2.5, dtype=torch.float64)
    want = norm.weight.detach() * 2.5 / (2.5 ** 2 + 1e-6) ** 0.5
    torch.testing.assert_close(norm(x), want.expand(3, C), atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-12])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_layernorm_matches_torch(dtype, eps, bias):
    norm = LayerNorm(C, eps=eps, bias=bias).to(dtype)
    _randomise(norm)
    ref = nn.LayerNorm(C, eps=eps, bias=bias, dtype=dtype)
    ref.load_state_dict(norm.state_dict())
    x = _x(2, 7, C, dtype=dtype, scale=3.0).requires_grad_()
    out = norm(x)
    atol, rtol = TOLS[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref(x), atol=atol, rtol=rtol)
    b = norm.bias.detach().double() if bias else None
    torch.testing.assert_close(out.double(), layer_formula(x.detach().double(),
                                                          norm.weight.detach().double(), b, eps),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(out, F.layer_norm(x, (C,), norm.weight, norm.bias, eps),
                               atol=atol, rtol=rtol)
    g = _x(2, 7, C, dtype=dtype, seed=5)
    params = [x, *norm.parameters()]
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref(x), [x, *ref.parameters()], g)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=atol * 10, rtol=rtol * 10)


def test_layernorm_default_eps_and_make_norm():
    """eps >= 1e-5 by default (Checklist 13); make_norm builds the named norm with its eps."""
    assert LayerNorm(C).eps == 1e-5
    assert make_norm("layernorm", C).eps >= 1e-5
    ln = make_norm("layernorm", C, eps=1e-12, bias=False)
    assert isinstance(ln, LayerNorm) and ln.eps == 1e-12 and ln.bias is None
    rms = make_norm("rmsnorm", C, eps=1e-5)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-5
    with pytest.raises(ValueError, match="'batchnorm'"):
        make_norm("batchnorm", C)


# -------------------------------------------------------------- half precision (Checklist 13)


def _pair(kind: str):
    """(qkv norm in fp32 with random weights, the same norm in torch.nn, fp32)."""
    if kind == "rmsnorm":
        norm, ref = RMSNorm(C, eps=1e-6), nn.RMSNorm(C, eps=1e-6)
    else:
        norm, ref = LayerNorm(C), nn.LayerNorm(C, eps=1e-5)
    _randomise(norm)
    ref.load_state_dict(norm.state_dict())
    return norm, ref


@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["unit", "squares-overflow-fp16"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_half_input_computed_in_fp32(kind, dtype, scale):
    """Half weights and input: output == torch's fp32 norm of the same values, rounded once
    to ``dtype`` (atol 0). At |x| ~ 300 the squares (9e4) overflow fp16: computing the
    statistics in fp16 would give inf and zeros."""
    norm, ref = _pair(kind)
    norm = norm.to(dtype)
    ref.load_state_dict({k: v.float() for k, v in norm.state_dict().items()})
    x = _x(2, 9, C, dtype=dtype, scale=scale)
    out = norm(x)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref(x.float()).to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("value", [0.0, 1.0, 1000.0, -60000.0])
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_constant_fp16_input_stays_finite(kind, value):
    """A constant fp16 row (variance 0; |x|² up to 3.6e9, far past fp16's 65504): finite,
    and equal to the fp32 formula (LayerNorm: the bias; RMSNorm: sign(x)·weight)."""
    norm, _ = _pair(kind)
    norm = norm.half()
    x = torch.full((2, 3, C), value, dtype=torch.float16)
    out = norm(x)
    assert torch.isfinite(out).all()
    w = norm.weight.float()
    if kind == "layernorm":
        want = norm.bias.float().expand(2, 3, C)
    else:
        want = (x.float() / torch.sqrt(x.float() ** 2 + norm.eps)) * w
    torch.testing.assert_close(out.float(), want.to(torch.float16).float(), atol=0, rtol=0)
