"""quick_gelu x·σ(1.702·x) (OpenAI CLIP): the ``QuickGELU`` autograd Function (saves x
only, one fused backward) and the in-place ``quick_gelu_`` used by the no-grad token-rows
path, against the definition in fp64 (written apart) and autograd of that definition.

Shapes: any; the tests use (N, F) and (B, N, F) with F the MLP width.
"""

from __future__ import annotations

import pytest
import torch

from qkv.modules.feedforward import ACTIVATIONS, FeedForward, QuickGELU, quick_gelu, quick_gelu_


def oracle(x: torch.Tensor) -> torch.Tensor:
    """x σ(1.702 x) from the definition of σ, fp64."""
    x = x.double()
    return x / (1.0 + torch.exp(-1.702 * x))


def test_registered_under_its_name():
    assert ACTIVATIONS["quick_gelu"] is quick_gelu


@pytest.mark.parametrize("shape", [(1,), (17, 24), (2, 5, 80)])
def test_forward_matches_definition_and_is_bitwise_the_plain_expression(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 4
    plain = x * torch.sigmoid(1.702 * x)  # the expression quick_gelu always computed
    torch.testing.assert_close(quick_gelu(x).double(), oracle(x), atol=1e-6, rtol=1e-6)
    xg = x.clone().requires_grad_()
    assert torch.equal(quick_gelu(xg), plain)  # the Function's forward: same arithmetic
    assert torch.equal(QuickGELU.apply(xg), plain)


def test_gradcheck_fp64():
    torch.manual_seed(1)
    x = (torch.randn(6, 7, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(QuickGELU.apply, (x,))
    assert torch.autograd.gradgradcheck(QuickGELU.apply, (x,))


def test_gradient_equals_autograd_of_the_definition():
    torch.manual_seed(2)
    x = torch.randn(33, 48) * 3
    g = torch.randn(33, 48)
    x32 = x.clone().requires_grad_()
    quick_gelu(x32).backward(g)
    x64 = x.double().requires_grad_()
    oracle(x64).backward(g.double())
    torch.testing.assert_close(x32.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    assert x32.grad.dtype == torch.float32


def test_create_graph_gradient_equals_the_definitions():
    """With create_graph the backward is composed of differentiable ops: its first
    derivative must still be the definition's (gradgradcheck alone only checks the second
    derivative against that graph)."""
    torch.manual_seed(5)
    x = (torch.randn(7, 9, dtype=torch.float64) * 3).requires_grad_()
    g = torch.randn(7, 9, dtype=torch.float64)
    (got,) = torch.autograd.grad(QuickGELU.apply(x), x, g, create_graph=True)
    (want,) = torch.autograd.grad(oracle(x), x, g, create_graph=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    (got2,) = torch.autograd.grad(got.sum(), x)
    (want2,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(got2, want2, atol=1e-10, rtol=1e-10)


def test_saves_only_the_input():
    x = torch.randn(4, 8, requires_grad=True)
    y = quick_gelu(x)
    assert type(y.grad_fn).__name__ == "QuickGELUBackward"
    assert len(y.grad_fn.saved_tensors) == 1 and y.grad_fn.saved_tensors[0] is x


def test_no_grad_path_is_the_plain_expression():
    x = torch.randn(9, 10, requires_grad=True)
    with torch.no_grad():
        y = quick_gelu(x)
    assert y.grad_fn is None and torch.equal(y, x.detach() * torch.sigmoid(1.702 * x.detach()))


@pytest.mark.parametrize("with_buffer", [False, True])
def test_in_place_is_bitwise_quick_gelu(with_buffer):
    torch.manual_seed(3)
    x = torch.randn(20, 36) * 4
    want = quick_gelu(x)
    t = x.clone()
    buf = torch.empty_like(t) if with_buffer else None
    out = quick_gelu_(t, buffer=buf)
    assert out is t and torch.equal(out, want)


def test_feedforward_gradients_match_fp64_definition():
    torch.manual_seed(4)
    ff = FeedForward(12, 40, activation="quick_gelu")
    x = torch.randn(3, 5, 12)
    ff(x).square().sum().backward()
    ff64 = FeedForward(12, 40, activation="quick_gelu", dtype=torch.float64)
    ff64.load_state_dict({k: v.double() for k, v in ff.state_dict().items()})
    x64 = x.double()
    h = oracle(x64 @ ff64.fc_in.weight.T + ff64.fc_in.bias)
    (h @ ff64.fc_out.weight.T + ff64.fc_out.bias).square().sum().backward()
    for (name, p), p64 in zip(ff.named_parameters(), ff64.parameters(), strict=True):
        torch.testing.assert_close(p.grad.double(), p64.grad, atol=1e-4, rtol=1e-5,
                                   msg=name)
