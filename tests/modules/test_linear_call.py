"""``qkv.modules.linear_call.apply_linear``: plain ``nn.Linear``s go through
``qkv.ops.fast_linear`` (oneDNN), anything else is called as a module; and the modules built
on it — an ``EncoderLayer`` stack (padded and on token rows), cross-attention,
``FeedForward`` (quick_gelu folded without gradients), ``SwiGLU``, GPT — with the oneDNN path
forced on for small shapes, against the same code under ``onednn_linear(False)`` (F.linear)
and an fp64 oracle, outputs and gradients.

Shapes: B batch, N length, C width, F hidden width, H heads.
Tolerances: oneDNN vs F.linear in fp32 differ only in summation order: atol 1e-5, rtol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.modules.attention import MultiHeadAttention, project_rows
from qkv.modules.feedforward import FeedForward, SwiGLU
from qkv.modules.layers import EncoderLayer, TokenRows
from qkv.modules.linear_call import apply_linear, is_plain_linear
from qkv.ops.fast_linear import onednn_linear, onednn_linear_active

TOL = {"atol": 1e-5, "rtol": 1e-5}

pytestmark = pytest.mark.skipif(not onednn_linear_active(),
                                reason="this torch build has no working oneDNN linear")


def _x(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


# --- the rule --------------------------------------------------------------------------------
def test_plain_linear_goes_through_onednn(onednn_calls):
    torch.manual_seed(0)
    lin = nn.Linear(8, 12)
    x = _x(3, 5, 8)
    with torch.no_grad():
        got = apply_linear(lin, x)
    assert onednn_calls == [1]
    want = torch.einsum("bnk,ok->bno", x.double(), lin.weight.double()) + lin.bias.double()
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=5e-6)


def _hooked(kind: str):
    torch.manual_seed(0)
    lin = nn.Linear(8, 12)
    seen: list[str] = []
    if kind == "forward_hook":
        lin.register_forward_hook(lambda m, i, o: seen.append(kind) or o * 2)
    elif kind == "forward_pre_hook":
        lin.register_forward_pre_hook(lambda m, i: seen.append(kind) or (i[0] * 2,))
    elif kind == "backward_hook":
        lin.register_full_backward_hook(lambda m, gi, go: seen.append(kind) and None)
    elif kind == "instance_forward":
        base = lin.forward
        lin.forward = lambda x: seen.append(kind) or base(x) * 2
    elif kind == "subclass":
        class Doubled(nn.Linear):
            def forward(self, x):
                seen.append(kind)
                return super().forward(x) * 2
        lin2 = Doubled(8, 12)
        lin2.load_state_dict(lin.state_dict())
        lin = lin2
    return lin, seen


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "backward_hook",
                                  "instance_forward", "subclass"])
def test_anything_but_a_plain_linear_is_called_as_a_module(kind, onednn_calls):
    lin, seen = _hooked(kind)
    assert not is_plain_linear(lin)
    x = _x(3, 8, grad=True)
    out = apply_linear(lin, x)
    out.sum().backward()
    assert seen == [kind]  # the hook / override ran
    x2 = x.detach() * 2 if kind == "forward_pre_hook" else x.detach()
    want = F.linear(x2, lin.weight, lin.bias)
    if kind not in ("backward_hook", "forward_pre_hook"):
        want = want * 2  # what the hook / override does
    torch.testing.assert_close(out, want, **TOL)


def test_global_forward_hook_is_respected(onednn_calls):
    torch.manual_seed(0)
    lin = nn.Linear(8, 12)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(type(m).__name__))
    try:
        assert not is_plain_linear(lin)
        apply_linear(lin, _x(3, 8))
    finally:
        handle.remove()
    assert seen == ["Linear"] and is_plain_linear(lin)


def test_project_rows_plain_and_own(onednn_calls):
    torch.manual_seed(0)
    lin = nn.Linear(8, 12)
    x = _x(2, 3, 8)
    with torch.no_grad():
        got = project_rows(lin, x, 4, 9)
    assert onednn_calls == [1]
    want = F.linear(x, lin.weight[4:9], lin.bias[4:9])
    torch.testing.assert_close(got, want, **TOL)

    class Own(nn.Module):  # stands in for a LoRA wrapper / quantized linear
        def project_rows(self, x, start, stop):
            return torch.full((*x.shape[:-1], stop - start), 7.0)

    assert torch.equal(project_rows(Own(), x, 4, 9), torch.full((2, 3, 5), 7.0))


def test_lora_wrapped_projections_are_called(onednn_calls):
    """A qkv.peft LoRA on every projection: the wrappers run (a non-zero B changes the
    output exactly as with oneDNN off), and only the plain linears inside them may use
    oneDNN."""
    peft = pytest.importorskip("qkv.peft")
    torch.manual_seed(0)
    layer = EncoderLayer.build(16, 4, activation="quick_gelu", norm_first=True)
    peft.add_lora(layer, peft.LoraConfig(r=2, targets=("qkv", "out", "ffn_in", "ffn_out")))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "lora" in name.lower():
                p.normal_(0, 0.3)
    x = _x(2, 5, 16)
    with torch.no_grad():
        got = layer(x)
        with onednn_linear(False):
            want = layer(x)
    torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad(), peft.disable_adapters(layer), onednn_linear(False):
        base = layer(x)
    assert (got - base).abs().max() > 1e-3  # the adapters took part


# --- FeedForward / SwiGLU --------------------------------------------------------------------
def _quick_gelu_ffn_oracle(ff: FeedForward, x):
    """fp64 fc_out(z·sigmoid(1.702·z)), z = fc_in(x), written apart from the module."""
    d = {k: v.double() for k, v in ff.state_dict().items()}
    z = x.double() @ d["fc_in.weight"].T + d["fc_in.bias"]
    return (z * torch.sigmoid(1.702 * z)) @ d["fc_out.weight"].T + d["fc_out.bias"]


@pytest.mark.parametrize("grad", [False, True])
def test_quick_gelu_ffn_vs_fp64_oracle(grad, onednn_calls):
    torch.manual_seed(0)
    ff = FeedForward(16, 40, activation="quick_gelu")
    with torch.no_grad():
        ff.fc_in.bias.normal_(0, 0.5)
        ff.fc_out.bias.normal_(0, 0.5)
    x = _x(3, 7, 16, grad=grad)
    with torch.set_grad_enabled(grad):
        got = ff(x)
    assert len(onednn_calls) == 2
    torch.testing.assert_close(got.double(), _quick_gelu_ffn_oracle(ff, x.detach()),
                               atol=2e-6, rtol=2e-6)
    with torch.no_grad():  # in place (the token rows' no-grad path): the same values
        torch.testing.assert_close(ff.run(x.detach(), inplace=True), got.detach(), **TOL)


def test_quick_gelu_ffn_with_hooked_fc_in_is_not_folded():
    torch.manual_seed(0)
    ff = FeedForward(16, 40, activation="quick_gelu")
    seen = []
    ff.fc_in.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    x = _x(3, 16)
    with torch.no_grad():
        out = ff(x)
    # the hook saw fc_in's own output z (not the folded 1.702·z) and the result is unchanged
    torch.testing.assert_close(seen[0], F.linear(x, ff.fc_in.weight, ff.fc_in.bias), **TOL)
    torch.testing.assert_close(out.double(), _quick_gelu_ffn_oracle(ff, x), atol=2e-6,
                               rtol=2e-6)


@pytest.mark.parametrize("ffn", ["relu", "gelu", "swiglu"])
def test_other_ffns_forced_onednn_vs_f_linear(ffn, onednn_calls):
    torch.manual_seed(0)
    m = SwiGLU(16, 24) if ffn == "swiglu" else FeedForward(16, 24, activation=ffn)
    x = _x(2, 5, 16, grad=True)
    got = m(x)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    assert len(onednn_calls) == 4  # 2 forwards, 2 input gradients
    with onednn_linear(False):
        want = m(x)
        (wx,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(gx, wx, **TOL)


# --- stacks and models with oneDNN forced on ---------------------------------------------------
def _both(run):
    """run() -> (outputs, grads) with oneDNN forced on, then with F.linear."""
    got = run()
    with onednn_linear(False):
        want = run()
    return got, want


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["quick_gelu", "gelu", "swiglu"])
def test_encoder_stack_forced_onednn_vs_f_linear(norm_first, activation, onednn_calls):
    """Three EncoderLayers (causal, padded keys): forward, token rows (``rows=``) with and
    without gradients, and the gradients of every parameter and of x."""
    torch.manual_seed(0)
    layers = nn.ModuleList(EncoderLayer.build(16, 4, ffn_hidden=24, activation=activation,
                                              norm_first=norm_first) for _ in range(3))
    x = _x(3, 6, 16, grad=True)
    keep = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.bool)
    mask = keep[:, None, None, :]  # (B, 1, 1, N) True = may attend
    rows = TokenRows(keep)

    def run():
        h = x
        for layer in layers:
            h = layer(h, mask=mask, causal=True)
        r = rows.pack(x)
        for layer in layers:
            r = layer(r, rows=rows, mask=mask, causal=True)
        loss = (rows.pack(h) * torch.linspace(-1, 1, 16)).square().sum() + r.square().sum()
        with torch.no_grad():
            r0, bufs = rows.pack(x), {}
            for layer in layers:
                r0 = layer(r0, rows=rows, mask=mask, causal=True, bufs=bufs)
        return (rows.pack(h), r, r0), torch.autograd.grad(loss, [x, *layers.parameters()])

    (got, got_g), (want, want_g) = _both(run)
    assert onednn_calls  # the oneDNN path ran
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got[1], got[0], **TOL)  # rows == forward's real rows
    torch.testing.assert_close(got[2], got[0], **TOL)  # no-grad rows (in place, buffers)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_cross_attention_forced_onednn_vs_f_linear(onednn_calls):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, kv_dim=12)  # q_proj, kv_proj, out_proj
    fused = MultiHeadAttention(16, 4)  # in_proj row blocks (project_rows)
    x, ctx = _x(2, 5, 16, grad=True), _x(2, 7, 12, seed=1, grad=True)
    ctx16 = _x(2, 7, 16, seed=2, grad=True)

    def run():
        a, b = mha(x, ctx), fused(x, ctx16)
        loss = a.square().sum() + b.square().sum()
        return (a, b), torch.autograd.grad(loss, [x, ctx, ctx16, *mha.parameters(),
                                                  *fused.parameters()])

    (got, got_g), (want, want_g) = _both(run)
    assert onednn_calls
    for a, b in zip(got + got_g, want + want_g, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_gpt_forward_backward_forced_onednn_vs_f_linear(onednn_calls):
    from qkv.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt-tiny", num_layers=2, dim=32, num_heads=4))
    ids = torch.randint(0, 256, (2, 9))

    def run():
        out = model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))
        return (logits,), torch.autograd.grad(loss, list(model.parameters()))

    (got, got_g), (want, want_g) = _both(run)
    assert onednn_calls
    torch.testing.assert_close(got[0], want[0], **TOL)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("where", ["attn", "attn.in_proj", "attn.out_proj", "ffn", "ffn.fc_in"])
@pytest.mark.parametrize("grad", [True, False])
def test_token_rows_honour_hooks(where, grad, onednn_calls):
    """A forward hook (doubling the output) anywhere in a layer fires on token rows
    (``rows=``) as on the padded batch, and the rows equal the padded forward's."""
    torch.manual_seed(0)
    layer = EncoderLayer.build(16, 4, ffn_hidden=24, activation="quick_gelu", norm_first=True)
    fired = []
    layer.get_submodule(where).register_forward_hook(
        lambda m, i, o: fired.append(where) or o * 2)
    x = _x(2, 5, 16)
    rows = TokenRows(None, batch=2, length=5)
    with torch.set_grad_enabled(grad):
        want = layer(x)
        assert fired == [where]
        got = layer(rows.pack(x), rows=rows, bufs=None if grad else {})
    assert fired == [where, where]
    torch.testing.assert_close(got, rows.pack(want), **TOL)


def test_inplace_activation_only_on_a_plain_projection_output():
    """The token rows' no-grad in-place activation must not overwrite what another fc_in
    returns (here its own input)."""
    torch.manual_seed(0)
    ff = FeedForward(16, 16, activation="relu")
    ff.fc_in = nn.Identity()
    x = _x(3, 16)
    before = x.clone()
    with torch.no_grad():
        out = ff.run(x, inplace=True)
    assert torch.equal(x, before)
    torch.testing.assert_close(out, F.linear(x.relu(), ff.fc_out.weight, ff.fc_out.bias),
                               **TOL)
