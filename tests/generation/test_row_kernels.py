"""The one-row fp32 decode step's C kernels against oracles written apart from them:
``gemv_kernel`` (y = res + b + x @ W) against the fp64 product, and the decode engine's
"c-layer-fp32" backend (``row_step_kernel``: a whole layer per call) against the fp64 copy
of the model's own uncached forward (logits) and ``use_cache=False`` (greedy tokens), for
each activation, RoPE (both pair layouts), GQA/MQA, no bias, and a left-padded one-row
prompt.

Shapes: K input features, N output features, T new tokens, V vocab size.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _fast_gpt_models import left_padded, tiny_gpt

import qkv
from qkv.generation import attention_kernel, gemv_kernel, row_step_kernel
from qkv.generation.engine import decoder_stepper

# The one-row C layer (torch's fp32 prefill, then the C layer kernel) vs the fp64 forward: the
# logits are O(1-7) here and the largest |difference| measured over every case below is
# 5.3e-6 (~10 fp32 ulps at 5); the bound is ~3x that. (2e-4, the other fast-step tests'
# bound, let a GELU constant cut to 4 digits through: its 1.2e-5 to 3.6e-5 errors fit.)
F32 = dict(atol=1.5e-5, rtol=0.0)
# gemv vs the fp64 product: |error| <= 1.33 eps·S measured (eps fp32's epsilon, S = the
# sum of |x_i·w_ij| + |b_j| + |res_j|, what fp32 summation error scales with); bound 4 eps·S
GEMV_ULPS = 4.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _kernels_or_skip() -> None:
    if gemv_kernel.load() is None or row_step_kernel.load() is None \
            or attention_kernel.load() is None:
        pytest.skip("the C kernels cannot be built here")


@pytest.mark.parametrize("k,n", [(32, 32), (37, 45), (384, 1152), (5, 3), (16, 17), (9, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("res", ["none", "other", "in-place"])
def test_gemv_equals_fp64_product(k, n, bias, res):
    _kernels_or_skip()
    fn = gemv_kernel.load()
    torch.manual_seed(k * n)
    x, w = torch.randn(k), torch.randn(k, n)  # w: (in, out)
    b = torch.randn(n) if bias else None
    r = torch.randn(n)
    y = r.clone() if res == "in-place" else torch.full((n,), float("nan"))
    want = x.double() @ w.double() + (b.double() if bias else 0) + (
        0 if res == "none" else r.double())
    scale = x.double().abs() @ w.double().abs() + (b.double().abs() if bias else 0) + (
        0 if res == "none" else r.double().abs())  # (N,) what the rounding error scales with
    rp = {"none": None, "other": r.data_ptr(), "in-place": y.data_ptr()}[res]
    assert fn(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), rp,
              y.data_ptr(), k, n) == 0
    bound = GEMV_ULPS * torch.finfo(torch.float32).eps * scale  # (N,)
    assert bool(((y.double() - want).abs() <= bound).all()), \
        f"max |error| / bound {float(((y.double() - want).abs() / bound).max()):.2f}"


VARIANTS = [dict(), dict(activation="gelu"), dict(activation="silu"),
            dict(activation="quick_gelu"), dict(activation="relu", bias=False,
                                                tie_embeddings=False),
            dict(positions="rope", num_kv_heads=2), dict(positions="rope", num_kv_heads=1),
            dict(num_kv_heads=1)]
VARIANT_IDS = ["gpt2-gelu_tanh", "gelu", "silu", "quick_gelu", "relu-nobias-untied",
               "rope-gqa", "rope-mqa", "mqa"]


def _model(kw: dict, interleaved: bool):
    model = tiny_gpt(**kw)
    if interleaved:
        model.rope.interleaved = True  # the other pair layout, in the model and the step
    return model


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_row_step_logits_equal_fp64_forward(kw, padded):
    """prefill + 8 steps of one row through the C layer kernel: every logit == the fp64
    model's uncached forward over the prompt and the tokens fed so far."""
    _kernels_or_skip()
    for interleaved in ([False, True] if "positions" in kw else [False]):
        model = _model(kw, interleaved)
        ids, keep = left_padded(rows=3, n=7)
        ids, keep = ids[2:], keep[2:]  # one row, its first 6 positions padded
        if not padded:
            ids, keep = torch.randint(3, 48, (1, 7)), None
        torch.manual_seed(3)
        new = torch.randint(3, 48, (1, 8))
        with torch.inference_mode():
            stepper = decoder_stepper(model, ids, keep, ids.shape[1] + new.shape[1])
            assert stepper.backend == "c-layer-fp32"
            got = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(8)]
            full = torch.cat((ids, new), dim=1)
            mask = None if keep is None else torch.cat(
                (keep, torch.ones_like(new, dtype=torch.bool)), dim=1)
            want = copy.deepcopy(model).double()(full, attention_mask=mask)[:, 6:]
        torch.testing.assert_close(torch.stack(got, dim=1).double(), want, **F32)


@pytest.mark.parametrize("kw", [dict(), dict(positions="rope", num_kv_heads=2)],
                         ids=["gpt2", "rope-gqa"])
def test_row_greedy_tokens_equal_uncached_and_torch_path(kw, monkeypatch):
    """Greedy tokens of one row through the C kernels == ``use_cache=False`` == the torch
    backend (``QKV_ROW_KERNEL=0``)."""
    _kernels_or_skip()
    model = tiny_gpt(**kw)
    torch.manual_seed(5)
    ids = torch.randint(3, 48, (1, 5))
    with torch.inference_mode():
        assert decoder_stepper(model, ids, None, ids.shape[1] + 3).backend == "c-layer-fp32"
    got = qkv.generate(model, ids, max_new_tokens=20)
    assert torch.equal(got, qkv.generate(model, ids, max_new_tokens=20, use_cache=False))
    monkeypatch.setenv("QKV_ROW_KERNEL", "0")
    with torch.inference_mode():
        assert decoder_stepper(model, ids, None, ids.shape[1] + 3).backend == "torch"
    assert torch.equal(got, qkv.generate(model, ids, max_new_tokens=20))


def test_row_path_only_for_one_fp32_row_on_one_thread():
    """Two rows or fp64 keep the torch ops (the "torch" backend). (At more torch threads
    the engine times the C layer against the torch backend: ``tests/generation/
    test_explain.py``.)"""
    _kernels_or_skip()
    model = tiny_gpt()
    ids = torch.randint(3, 48, (2, 5))
    wide = copy.deepcopy(model).double()

    def backend(m, prompt):
        return decoder_stepper(m, prompt, None, prompt.shape[1] + 3).backend

    with torch.inference_mode():
        assert backend(model, ids[:1]) == "c-layer-fp32"
        assert backend(model, ids) == "torch"
        assert backend(wide, ids[:1]) == "torch"


def test_model_built_under_inference_mode_generates():
    """A model made under ``inference_mode`` (inference tensors: no version counter) decodes
    on the decode engine's plan, and an in-place edit of its weights there is still seen."""
    with torch.inference_mode():
        model = tiny_gpt(tie_embeddings=False)
        ids = torch.randint(3, 48, (1, 5))
        before = qkv.generate(model, ids, max_new_tokens=6)
        assert torch.equal(before, qkv.generate(model, ids, max_new_tokens=6, use_cache=False))
        model.lm_head.weight.neg_()  # argmax becomes argmin: the next call must follow
        got = qkv.generate(model, ids, max_new_tokens=6)
        assert not torch.equal(got, before)
        assert torch.equal(got, qkv.generate(model, ids, max_new_tokens=6, use_cache=False))
        model.lm_head.weight[1:-1].neg_()  # neither the first nor the last row
        again = qkv.generate(model, ids, max_new_tokens=6)
        assert not torch.equal(again, got)
        assert torch.equal(again, qkv.generate(model, ids, max_new_tokens=6, use_cache=False))


def test_nan_passes_through_relu_as_in_torch():
    """A NaN in the feed-forward stays NaN through the C kernel's ReLU (torch.relu keeps it):
    the logits are NaN on both paths, not silently finite."""
    _kernels_or_skip()
    model = tiny_gpt(activation="relu")
    with torch.no_grad():  # the last layer's FFN: the prefilled caches stay finite
        model.layers[-1].ffn.fc_in.bias[0] = float("nan")
    ids = torch.randint(3, 48, (1, 4))
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, None, ids.shape[1] + 2)
        assert stepper.backend == "c-layer-fp32"
        stepper.prefill()
        got = stepper.step(torch.tensor([5]))
        want = model(torch.cat((ids, torch.tensor([[5]])), dim=1))[:, -1]
    assert bool(want.isnan().all()) and bool(got.isnan().all())


def test_row_step_past_the_cache_raises():
    """The C kernel writes the cache slot itself: a step past the capacity is refused (an
    IndexError before the kernel runs)."""
    _kernels_or_skip()
    model = tiny_gpt()
    with torch.inference_mode():
        stepper = decoder_stepper(model, torch.randint(3, 48, (1, 4)), None, 4 + 2)
        assert stepper.backend == "c-layer-fp32"
        stepper.prefill()
        stepper.step(torch.tensor([5]))
        stepper.step(torch.tensor([6]))
        with pytest.raises(IndexError, match="the caches hold 6 positions"):
            stepper.step(torch.tensor([7]))
