"""``qkv.ops.lm_loss.linear_cross_entropy``: the LM head fused with its cross-entropy against
``torch.nn.functional.cross_entropy`` on the full fp64 logits (the oracle: PyTorch's own loss,
label smoothing included), for every chunk size (1, non-divisors, more than the rows),
ignored rows, label smoothing 0 / 0.1 / 1, half-precision inputs, and no gradient work
under ``torch.no_grad``.

Tolerances: fp32 vs the fp64 oracle atol 5e-5, rtol 5e-6 on the loss and 1e-6 absolute on
gradients (docs/ARCHITECTURE.md: Tolerances); bf16/fp16 inputs vs the oracle on the same values
upcast: loss within 2e-4 relative and at most a tenth of a naive same-dtype cross-entropy's
error (the softmax is fp32 inside; the logits are rounded to the input dtype by the matmul;
naive bf16 is off by 2e-3..7e-3, naive fp16 overflows to inf), gradients within 2 eps of
their largest entry (Checklist 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.ops.lm_loss import linear_cross_entropy


def _data(m=37, c=24, v=101, dtype=torch.float32, seed=0, ignored=(3, 4, 20)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, c, generator=g, dtype=torch.float64)
    w = torch.randn(v, c, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, v, (m,), generator=g)
    t[list(ignored)] = -100
    return h.to(dtype), w.to(dtype), t


def _oracle(h, w, t, smoothing):
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.t(), t, ignore_index=-100, label_smoothing=smoothing)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("chunk", [1, 5, 37, 512])
def test_fp32_equals_cross_entropy_on_the_full_logits(smoothing, chunk):
    h, w, t = _data()
    h.requires_grad_()
    w.requires_grad_()
    loss = linear_cross_entropy(h, w, t, label_smoothing=smoothing, chunk=chunk)
    loss.backward()
    want, gh, gw = _oracle(h, w, t, smoothing)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, atol=5e-5, rtol=5e-6)
    torch.testing.assert_close(h.grad.double(), gh, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.grad.double(), gw, atol=1e-6, rtol=0)
    assert h.grad[[3, 4, 20]].abs().max() == 0  # ignored rows get no gradient


def test_a_scaled_backward_scales_the_gradients():
    h, w, t = _data()
    h.requires_grad_()
    (3.0 * linear_cross_entropy(h, w, t, label_smoothing=0.1, chunk=8)).backward()
    _, gh, _ = _oracle(h, w, t, 0.1)
    torch.testing.assert_close(h.grad.double(), 3.0 * gh, atol=3e-6, rtol=0)


def test_every_row_ignored_gives_zero_and_zero_gradients():
    h, w, t = _data(m=6, ignored=range(6))
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, t, chunk=4)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_get_an_fp32_softmax(dtype):
    h, w, t = _data(m=64, c=32, v=2000, dtype=dtype)
    h.requires_grad_()
    w.requires_grad_()
    loss = linear_cross_entropy(h, w, t, label_smoothing=0.1, chunk=16)
    loss.backward()
    want, gh, gw = _oracle(h, w, t, 0.1)  # the same half values, upcast
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, atol=0, rtol=2e-4)  # measured <= 1e-4
    naive = F.cross_entropy(h.detach() @ w.detach().t(), t, label_smoothing=0.1)  # all in dtype
    assert not (abs(loss.double() - want) > abs(naive.double() - want) / 10)  # fp16: inf
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert (h.grad.double() - gh).abs().max() <= 2 * eps * gh.abs().max()
    assert (w.grad.double() - gw).abs().max() <= 2 * eps * gw.abs().max()


def test_no_grad_computes_no_gradient(monkeypatch):
    import qkv.ops.lm_loss as lm_loss

    h, w, t = _data()
    h.requires_grad_()
    w.requires_grad_()
    calls = []
    real = lm_loss.fast_linear
    monkeypatch.setattr(lm_loss, "fast_linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, chunk=10)
    assert len(calls) == 4  # the 4 chunks' logits, no input-gradient matmul
    want, _, _ = _oracle(h, w, t, 0.0)
    torch.testing.assert_close(loss.double(), want, atol=5e-5, rtol=5e-6)
    assert not loss.requires_grad


@pytest.mark.parametrize("kwargs, match", [
    ({"label_smoothing": -0.1}, "label_smoothing"),
    ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"label_smoothing": True}, "label_smoothing"),
    ({"chunk": 0}, "chunk"),
    ({"chunk": 2.0}, "chunk"),
])
def test_bad_arguments(kwargs, match):
    h, w, t = _data()
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, t, **kwargs)


def test_mismatched_dtypes_are_refused():
    h, w, t = _data()
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(h, w.double(), t)
