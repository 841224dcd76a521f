"""qkv.ops.inference_linear against F.linear and an fp64 oracle."""

import pytest
import torch
import torch.nn.functional as F

import qkv.ops.inference_linear as il
from qkv.ops.inference_linear import inference_linear, onednn_linear, onednn_linear_active


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
        y = inference_linear(x, w, b)
    assert y.shape == (*shape[:-1], 24) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _oracle(x, w, b), atol=5e-5, rtol=5e-6)


def test_non_contiguous_input_and_weight(small_on_onednn):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 9, 32, generator=g).transpose(0, 1)[..., ::2]  # (9, 6, 16) strided
    w = torch.randn(24, 32, generator=g)[:, 1::2]  # (24, 16) strided
    b = torch.randn(48, generator=g)[::2]
    with torch.inference_mode():
        y = inference_linear(x, w, b)
    torch.testing.assert_close(y.double(), _oracle(x, w, b), atol=5e-5, rtol=5e-6)


def test_uses_onednn_when_active_and_f_linear_when_disabled(monkeypatch):
    if not onednn_linear_active():
        pytest.skip("this torch build has no working oneDNN linear")
    calls = []
    real = il._op()
    monkeypatch.setitem(il._checked, "op", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(64, 512), torch.randn(512, 512)  # 2^24 multiply-adds: oneDNN
    with torch.no_grad():
        inference_linear(x, w)
        assert calls == [1]
        inference_linear(x[:3], w)  # fewer than MIN_ROWS rows: F.linear
        inference_linear(x[:32], w)  # fewer than MIN_MACS multiply-adds: F.linear
        assert calls == [1]
        with onednn_linear(False):
            assert not onednn_linear_active()
            torch.testing.assert_close(inference_linear(x, w), F.linear(x, w), rtol=0, atol=0)
        assert calls == [1] and onednn_linear_active()
        inference_linear(x.double(), w.double())  # fp64: F.linear
        inference_linear(x[0], w)  # 1-D input: F.linear
        inference_linear(x[:0], w)  # no rows: F.linear
        assert calls == [1]


def test_gradients_flow_through_f_linear():
    """With grad mode on and a weight that needs a gradient, the result is F.linear's, with
    F.linear's gradients (oneDNN's op has no backward here)."""
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(inference_linear, (x, w, b))
    xf, wf = x.detach().float(), w.detach().float().requires_grad_()
    y = inference_linear(xf, wf)
    y.sum().backward()
    torch.testing.assert_close(wf.grad, xf.sum(0).expand(3, 8), atol=1e-6, rtol=1e-6)


def test_onednn_linear_checks_its_argument():
    with pytest.raises(TypeError, match="enabled"), onednn_linear(0):
        pass
