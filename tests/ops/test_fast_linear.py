"""qkv.ops.fast_linear against F.linear and an fp64 oracle (values and gradients)."""

import pytest
import torch
import torch.nn.functional as F

import qkv.ops.fast_linear as il
from qkv.ops.fast_linear import fast_linear, onednn_linear, onednn_linear_active


@pytest.fixture
def small_on_onednn(monkeypatch):
    """Small test shapes take the oneDNN path too (the size thresholds are for speed)."""
    monkeypatch.setattr(il, "MIN_ROWS", 1)
    monkeypatch.setattr(il, "MIN_MACS", 1)


def _oracle(x, w, b):
    """fp64 x @ w.T + b, written apart from the code under test."""
    y = torch.einsum("...k,nk->...n", x.double(), w.double())
    return y if b is None else y + b.double()


@pytest.mark.parametrize("shape", [(1, 16), (7, 16), (3, 5, 16), (2, 1, 4, 16), (113, 16)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_fp64_oracle_no_grad(shape, with_bias, small_on_onednn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(24, 16, generator=g)
    b = torch.randn(24, generator=g) if with_bias else None
    with torch.no_grad():
        y = fast_linear(x, w, b)
    assert y.shape == (*shape[:-1], 24) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _oracle(x, w, b), atol=5e-5, rtol=5e-6)


def test_non_contiguous_input_and_weight(small_on_onednn):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 9, 32, generator=g).transpose(0, 1)[..., ::2]  # (9, 6, 16) strided
    w = torch.randn(24, 32, generator=g)[:, 1::2]  # (24, 16) strided
    b = torch.randn(48, generator=g)[::2]
    with torch.inference_mode():
        y = fast_linear(x, w, b)
    torch.testing.assert_close(y.double(), _oracle(x, w, b), atol=5e-5, rtol=5e-6)


def test_uses_onednn_when_active_and_f_linear_when_disabled(monkeypatch):
    if not onednn_linear_active():
        pytest.skip("this torch build has no working oneDNN linear")
    calls = []
    real = il.onednn_op()
    monkeypatch.setitem(il._checked, "op", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(64, 512), torch.randn(512, 512)  # 2^24 multiply-adds: oneDNN
    with torch.no_grad():
        fast_linear(x, w)
        assert calls == [1]
        fast_linear(x[:3], w)  # fewer than MIN_ROWS rows: F.linear
        fast_linear(x[:32], w)  # fewer than MIN_MACS multiply-adds: F.linear
        assert calls == [1]
        with onednn_linear(False):
            assert not onednn_linear_active()
            torch.testing.assert_close(fast_linear(x, w), F.linear(x, w), rtol=0, atol=0)
        assert calls == [1] and onednn_linear_active()
        fast_linear(x.double(), w.double())  # fp64: F.linear
        fast_linear(x[0], w)  # 1-D input: F.linear
        fast_linear(x[:0], w)  # no rows: F.linear
        assert calls == [1]


@pytest.mark.parametrize("shape", [(7, 16), (3, 5, 16)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("frozen", [False, True])
def test_gradients_match_fp64_oracle(shape, with_bias, frozen, small_on_onednn):
    """The autograd Function (oneDNN forward and input gradient, mm weight gradient) against
    fp64 autograd through the einsum oracle; atol 5e-5 / rtol 5e-6 (fp32 vs fp64)."""
    if not onednn_linear_active():
        pytest.skip("this torch build has no working oneDNN linear")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(24, 16, generator=g, requires_grad=not frozen)
    b = torch.randn(24, generator=g, requires_grad=not frozen) if with_bias else None
    up = torch.randn(*shape[:-1], 24, generator=g)  # upstream gradient
    y = fast_linear(x, w, b)
    assert type(y.grad_fn).__name__ == "_OneDNNLinearBackward"
    y.backward(up)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_(not frozen)
    b64 = None if b is None else b.detach().double().requires_grad_(not frozen)
    y64 = _oracle(x64, w64, b64)
    y64.backward(up.double())
    tol = dict(atol=5e-5, rtol=5e-6)
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    if frozen:
        assert w.grad is None
    else:
        torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
        if with_bias:
            torch.testing.assert_close(b.grad.double(), b64.grad, **tol)


def test_falls_back_under_autocast_and_vmap(monkeypatch, small_on_onednn):
    """Autocast must still cast (bf16 result) and functorch transforms must still work: both
    go to F.linear."""
    if not onednn_linear_active():
        pytest.skip("this torch build has no working oneDNN linear")
    calls = []
    real = il.onednn_op()
    monkeypatch.setitem(il._checked, "op", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(6, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast_linear(x, w).dtype == torch.bfloat16
    y = torch.vmap(lambda r: fast_linear(r, w))(x.reshape(2, 3, 8))
    torch.testing.assert_close(y, F.linear(x, w).reshape(2, 3, 3), atol=1e-5, rtol=1e-5)
    assert calls == []


def test_double_backward_is_refused_not_wrong(small_on_onednn):
    """The Function is once-differentiable: a second derivative raises instead of being
    silently zero."""
    if not onednn_linear_active():
        pytest.skip("this torch build has no working oneDNN linear")
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(fast_linear(x, w).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|differentiate twice"):
        gx.sum().backward()


def test_onednn_linear_checks_its_argument():
    with pytest.raises(TypeError, match="enabled"), onednn_linear(0):
        pass


def test_package_exports_the_switch_without_shadowing_the_module():
    """``qkv.ops.onednn_linear`` is the switch; ``qkv.ops.fast_linear`` stays the module
    (re-exporting the function once shadowed it and broke ``import ... as``)."""
    import inspect

    import qkv.ops

    assert qkv.ops.onednn_linear is onednn_linear
    assert inspect.ismodule(qkv.ops.fast_linear) and qkv.ops.fast_linear is il
