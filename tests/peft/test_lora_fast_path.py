"""LoRA training on the fast path: ``qkv.peft.lora_function.LoraLinearFunction`` (base GEMM
and input gradient through ``qkv.ops.fast_linear``, per-segment updates in place) and GPT's
LM head /
fused cross-entropy through ``fast_linear``, with oneDNN forced on these small shapes
(``MIN_ROWS`` / ``MIN_MACS`` = 1). The loss and every LoRA gradient are compared with

- an fp64 oracle written apart from the code: a plain fp64 copy of the base model whose
  adapted weights are W + scale · B A placed on each role's rows (``functional_call``, so
  autograd differentiates the merge), the full logits and ``F.cross_entropy``;
- the same model under ``onednn_linear(False)`` (composed torch ops, MKL's GEMMs);
- HF PEFT's LoRA on GPT-2's ``c_attn`` (``init_lora_weights=False``: B != 0), loss and
  the gradients of its ``lora_A`` / ``lora_B``.

Plus gradcheck (fp64) of ``LoraLinearFunction`` itself with every input differentiable (x, a
separate dropout input, a trainable base weight and bias, partial row spans).

Shapes: B batch, N length, V vocab, C width, M rows, In / Out features, r rank.
Tolerances: fp32 vs the fp64 oracle: loss atol 5e-5 rtol 5e-6
(docs/ARCHITECTURE.md: Tolerances); gradients atol 5e-7 rtol 1e-5 (entries ~1e-3..0.3,
errors seen <= 2e-7). fp32 vs fp32 (oneDNN vs MKL, qkv vs PEFT): loss 1e-5, gradients as
against the oracle.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import qkv.ops.fast_linear as fl
from qkv.models import GPT, GPTConfig
from qkv.ops.fast_linear import onednn_linear
from qkv.peft import LoraConfig, add_lora
from qkv.peft import lora_layers as lora_mod

V, C, H = 61, 48, 4
ROWS = {"q": (0, C), "k": (C, 2 * C), "v": (2 * C, 3 * C), "qkv": (0, 3 * C)}  # of in_proj
GRAD_TOL = {"atol": 5e-7, "rtol": 1e-5}


@pytest.fixture
def small_on_onednn(monkeypatch):
    """Small shapes take the oneDNN path; returns a dict counting oneDNN matmuls and
    ``LoraLinearFunction`` calls (so a test can tell the fast path really ran)."""
    if not fl.onednn_linear_active():
        pytest.skip("no working oneDNN linear in this torch build")
    monkeypatch.setattr(fl, "MIN_ROWS", 1)
    monkeypatch.setattr(fl, "MIN_MACS", 1)
    calls = {"onednn": 0, "lora_fn": 0}
    op = fl.onednn_op()

    def counting_op(*args):
        calls["onednn"] += 1
        return op(*args)

    monkeypatch.setitem(fl._checked, "op", counting_op)
    apply = lora_mod.LoraLinearFunction.apply

    def counting_apply(*args):
        calls["lora_fn"] += 1
        return apply(*args)

    monkeypatch.setattr(lora_mod.LoraLinearFunction, "apply", counting_apply)
    return calls


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 13), generator=g)
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    targets[1, 4] = -100
    return ids, targets


def _lora_gpt(targets, *, dropout: float = 0.0) -> tuple[GPT, GPT]:
    """(a GPT with LoRA on ``targets`` and random B (train mode), its base model before
    add_lora)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, max_len=32, dim=C, num_layers=2, num_heads=H))
    base = copy.deepcopy(model)
    add_lora(model, LoraConfig(r=4, alpha=8, targets=targets, dropout=dropout))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 at init would leave every A without a gradient
        for name, p in model.named_parameters():
            if ".B_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.train(), base


def _loss_and_grads(model, ids, targets):
    model.zero_grad(set_to_none=True)
    loss = model.loss(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.requires_grad}


def _oracle(model, base, ids, targets, scale):
    """fp64: the base model with W + scale · B A merged on each adapted role's rows (by
    autograd through ``functional_call``), full logits, ``F.cross_entropy``."""
    base64 = copy.deepcopy(base).double().train()
    leaves = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()
              if p.requires_grad}
    weights: dict[str, torch.Tensor] = {}
    for name, a in leaves.items():
        path, rest = name.split(".lora.default.")
        if rest[0] != "A":
            continue
        role = rest[2:]
        b = leaves[f"{path}.lora.default.B_{role}"]
        w = weights.get(f"{path}.weight", base64.get_parameter(f"{path}.weight").detach())
        lo, hi = ROWS[role] if path.endswith("in_proj") else (0, w.shape[0])
        delta = scale * b @ a  # (hi - lo, In)
        weights[f"{path}.weight"] = w + F.pad(delta, (0, 0, lo, w.shape[0] - hi))
    logits = functional_call(base64, weights, (ids,))  # (B, N, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("targets", [("q", "k", "v"), ("qkv", "out", "ffn_in", "ffn_out"),
                                     ("k", "ffn_out")])
def test_loss_and_lora_grads_on_onednn_path(small_on_onednn, targets):
    model, base = _lora_gpt(targets)
    ids, tg = _batch()
    loss, grads = _loss_and_grads(model, ids, tg)
    assert small_on_onednn["lora_fn"] > 0 and small_on_onednn["onednn"] > 0
    want_loss, want = _oracle(model, base, ids, tg, scale=2.0)
    torch.testing.assert_close(loss.double(), want_loss, atol=5e-5, rtol=5e-6)
    assert grads.keys() == want.keys() and len(grads) >= 4
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(g.double(), want[name], **GRAD_TOL, msg=name)
    calls = dict(small_on_onednn)
    with onednn_linear(False):  # composed ops and MKL: the same numbers up to rounding
        loss_off, grads_off = _loss_and_grads(model, ids, tg)
    assert small_on_onednn == calls  # nothing of the fast path ran under the switch
    torch.testing.assert_close(loss, loss_off, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_off[name], **GRAD_TOL, msg=name)


def test_lora_dropout_on_fused_path_equals_composed(small_on_onednn):
    """Dropout on the LoRA input: the fused path draws the same mask as the composed one
    (same RNG state, same element count) and gives the same loss and gradients."""
    model, _ = _lora_gpt(("q", "v", "ffn_in"), dropout=0.3)
    ids, tg = _batch(1)
    torch.manual_seed(5)
    loss, grads = _loss_and_grads(model, ids, tg)
    assert small_on_onednn["lora_fn"] > 0
    torch.manual_seed(5)
    with onednn_linear(False):
        loss_off, grads_off = _loss_and_grads(model, ids, tg)
    torch.manual_seed(6)
    other, _ = _loss_and_grads(model, ids, tg)
    assert not torch.allclose(loss, other)  # dropout is on: another mask, another loss
    torch.testing.assert_close(loss, loss_off, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_off[name], **GRAD_TOL, msg=name)


def test_fused_path_no_grad_forward_and_eval(small_on_onednn):
    """Inference with an unmerged adapter takes the fused path too (no graph) and equals
    the composed one."""
    model, _ = _lora_gpt(("q", "k", "v", "out"))
    model.eval()
    ids, _ = _batch(2)
    with torch.no_grad():
        got = model(ids)
        assert small_on_onednn["lora_fn"] > 0
        with onednn_linear(False):
            want = model(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- against HF PEFT ----------------------------------------------------------------------
def test_lora_loss_and_grads_equal_peft(tmp_path, small_on_onednn):
    """LoRA on GPT-2's c_attn trained by PEFT vs the same adapter loaded into qkv (role
    "qkv"): the loss of one step and the gradients of A and B."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from qkv.models import from_hf
    from qkv.peft import load_adapter

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(cfg)
    hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(hf, peft.LoraConfig(
        r=4, lora_alpha=12, target_modules=["c_attn"], fan_in_fan_out=True,
        init_lora_weights=False, lora_dropout=0.0)).train()
    pm.save_pretrained(tmp_path / "adapter")
    model = from_hf(tmp_path / "base").train()
    load_adapter(model, tmp_path / "adapter")
    ids, _ = _batch(3)
    want = pm(input_ids=ids, labels=ids).loss  # HF shifts the labels inside
    want.backward()
    tg = ids.roll(-1, dims=1)
    tg[:, -1] = -100
    loss, grads = _loss_and_grads(model, ids, tg)
    assert small_on_onednn["lora_fn"] == 2 and small_on_onednn["onednn"] > 0
    torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5)
    assert len(grads) == 4
    for i in range(2):
        ours = f"layers.{i}.attn.in_proj.lora.default."
        theirs = dict(pm.named_parameters())
        hf_name = f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{{}}.default.weight"
        for q, h in (("A_qkv", "A"), ("B_qkv", "B")):
            ref = theirs[hf_name.format(h)].grad
            assert ref is not None and ref.abs().max() > 0
            torch.testing.assert_close(grads[ours + q], ref, **GRAD_TOL, msg=ours + q)


# --- the Function itself ------------------------------------------------------------------
@pytest.mark.parametrize("separate_dropout_input", [False, True])
@pytest.mark.parametrize("spans", [((0, 3), (5, 10)), ((0, 10),), ((2, 4),)])
def test_gradcheck_lora_linear_fn(spans, separate_dropout_input):
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    x, w, b = t(6, 5), t(10, 5), t(10)
    xd = t(6, 5) if separate_dropout_input else None
    ab = [p for lo, hi in spans for p in (t(2, 5), t(hi - lo, 2))]

    def fn(x, xd, w, b, *ab):
        return lora_mod.LoraLinearFunction.apply(x, xd, w, b, 1.5, spans, *ab)

    assert torch.autograd.gradcheck(fn, (x, xd, w, b, *ab))
    # the oracle: the same sum written out (the update only on its own columns)
    want = x @ w.T + b
    src = x if xd is None else xd
    for j, (lo, hi) in enumerate(spans):
        want = want + 1.5 * F.pad(src @ ab[2 * j].T @ ab[2 * j + 1].T, (lo, 10 - hi))
    torch.testing.assert_close(fn(x, xd, w, b, *ab), want, atol=1e-12, rtol=1e-10)
