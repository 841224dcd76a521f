"""qkv.modules.feedforward against independent implementations written here and HF's LlamaMLP.

Shapes: B batch, N length, C model width, F hidden width; (B, N, C) -> (B, N, C).

The oracles copy the module's weights into fp64 leaves and apply the published formulas with
activations written from their definitions (no torch.nn.functional activation):
- FeedForward: W_out act(W_in x + b_in) + b_out, act in relu / gelu (erf) / gelu_tanh / silu;
- SwiGLU (Shazeer 2020): W_2 (silu(W_1 x) ∘ W_3 x); qkv fuses W_1 (gate, first F rows of
  fc_in) and W_3 (up, last F rows) into one C -> 2F projection.
fp32 module vs fp64 oracle, outputs and gradients of the input and every weight: atol 5e-5,
rtol 5e-6 (the house bar); fp64 module vs fp64 oracle: atol 1e-12, rtol 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from qkv.modules.feedforward import ACTIVATIONS, FeedForward, SwiGLU

C, F_ = 24, 40
TOLS = {torch.float64: (1e-12, 1e-10), torch.float32: (5e-5, 5e-6)}


def act_oracle(name: str, x: Tensor) -> Tensor:
    """Activations from their definitions."""
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name == "gelu":  # x Φ(x), Φ the standard normal CDF
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":  # Hendrycks & Gimpel's tanh approximation (GPT-2 "gelu_new")
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "silu":  # x σ(x)
        return x / (1.0 + torch.exp(-x))
    if name == "quick_gelu":  # OpenAI CLIP: x σ(1.702 x)
        return x / (1.0 + torch.exp(-1.702 * x))
    raise AssertionError(name)


def _leaves(module) -> dict[str, Tensor]:
    return {k: p.detach().double().requires_grad_() for k, p in module.named_parameters()}


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)


def _compare(module, oracle, dtype, *, dims=(2, 9)):
    """module(x) and its grads (x, every parameter) vs ``oracle(x64, fp64 weights)``."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(*dims, C, generator=g, dtype=torch.float64) * 2).to(dtype)
    x.requires_grad_()
    d_out = torch.randn(*dims, C, generator=g, dtype=torch.float64)
    out = module(x)
    w = _leaves(module)
    x64 = x.detach().double().requires_grad_()
    want = oracle(x64, w)
    atol, rtol = TOLS[dtype]
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
    names = list(w)
    got = torch.autograd.grad(out, [x, *module.parameters()], d_out.to(dtype))
    ref = torch.autograd.grad(want, [x64, *w.values()], d_out)
    for name, a, b in zip(["x", *names], got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_activation_table_is_the_documented_one():
    assert sorted(ACTIVATIONS) == ["gelu", "gelu_tanh", "quick_gelu", "relu", "silu"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_feedforward_matches_formula(activation, bias, dtype):
    ff = FeedForward(C, F_, activation=activation, bias=bias).to(dtype).eval()
    _randomise(ff)

    def oracle(x, w):
        h = x @ w["fc_in.weight"].t()  # (B, N, F)
        if bias:
            h = h + w["fc_in.bias"]
        y = act_oracle(activation, h) @ w["fc_out.weight"].t()  # (B, N, C)
        return y + w["fc_out.bias"] if bias else y

    _compare(ff, oracle, dtype)


def test_feedforward_default_is_relu():
    """Vaswani et al.: ReLU. Negative pre-activations give exactly 0 hidden units."""
    ff = FeedForward(C, F_)
    assert ff.activation == "relu"
    with torch.no_grad():
        ff.fc_in.weight.zero_()
        ff.fc_in.bias.fill_(-1.0)
    x = torch.randn(2, 3, C)
    torch.testing.assert_close(ff(x), ff.fc_out.bias.expand(2, 3, C), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_formula(bias, dtype):
    ff = SwiGLU(C, F_, bias=bias).to(dtype).eval()
    _randomise(ff)

    def oracle(x, w):
        w1, w3 = w["fc_in.weight"][:F_], w["fc_in.weight"][F_:]  # gate, up: (F, C) each
        a, b = x @ w1.t(), x @ w3.t()  # (B, N, F)
        if bias:
            a, b = a + w["fc_in.bias"][:F_], b + w["fc_in.bias"][F_:]
        y = (act_oracle("silu", a) * b) @ w["fc_out.weight"].t()  # (B, N, C)
        return y + w["fc_out.bias"] if bias else y

    _compare(ff, oracle, dtype)


def test_swiglu_matches_transformers_llama_mlp():
    """HF LlamaMLP (down(silu(gate(x)) * up(x))) with random weights: fc_in = [gate; up],
    fc_out = down. fp32, atol 1e-5, rtol 1e-5 (two fp32 implementations)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf = LlamaMLP(LlamaConfig(hidden_size=C, intermediate_size=F_, num_attention_heads=4,
                              num_key_value_heads=4, hidden_act="silu", mlp_bias=False)).eval()
    ff = SwiGLU(C, F_).eval()
    with torch.no_grad():
        ff.fc_in.weight.copy_(torch.cat([hf.gate_proj.weight, hf.up_proj.weight], 0))
        ff.fc_out.weight.copy_(hf.down_proj.weight)
    x = torch.randn(2, 11, C) * 2
    torch.testing.assert_close(ff(x), hf(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: SwiGLU(C, F_),
                                  lambda: FeedForward(C, F_, activation="gelu")],
                         ids=["swiglu", "gelu"])
def test_dropout_only_in_training(make):
    """dropout=0.5: eval output is deterministic and equals the dropout-free module."""
    torch.manual_seed(0)
    base = make().eval()
    x = torch.randn(2, 5, C)
    with_dropout = type(base)(C, F_, dropout=0.5, **({"activation": "gelu"}
                                                    if isinstance(base, FeedForward) else {}))
    with_dropout.load_state_dict(base.state_dict())
    with_dropout.eval()
    torch.testing.assert_close(with_dropout(x), base(x), atol=0, rtol=0)
    with_dropout.train()
    assert not torch.equal(with_dropout(x), base(x))


def test_feedforward_rejects_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be one of .*'swish'"):
        FeedForward(C, F_, activation="swish")
