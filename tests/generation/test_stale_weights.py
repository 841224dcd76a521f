"""No decode path of ``qkv.generate`` decodes with stale weights: after ``generate`` has run
once (so that any copies of the weights it makes exist), part of a weight is edited in place
behind autograd's back — through ``.data`` and through a numpy view, which bump no version
counter and leave the first and last rows alone — and ``generate`` again must give exactly
the tokens of ``generate(copy.deepcopy(model))`` (a model no copy of which was ever made).
Covered, on the decode engine's backends: the fp32 one-row step (the "c-layer-fp32" C
layer, and the "torch" backend under ``QKV_ROW_KERNEL=0``), a few rows on (in, out) copies,
the "onednn-packed" batch step (>= 4 rows), the prompt-lookup step (the torch backend's
multi-token ``run``), a model built under ``inference_mode`` (no version counter), and the
int8 backends (their buffers edited in place; re-quantizing an edited float model).
Each edit is checked to change the tokens, so that an equality is never vacuous.

Shapes: R rows, N prompt length, T new tokens.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from _fast_gpt_models import left_padded, tiny_gpt

import qkv
from qkv.generation import api, attention_kernel, gemv_kernel, row_step_kernel
from qkv.generation.linears import packing_works

T = 8  # new tokens per generate call


def _weight(model, where: str) -> torch.Tensor:
    """The (out, in) weight of the first layer's fc_in / fused in_proj, or the LM head."""
    return {"fc_in": lambda: model.layers[0].ffn.fc_in.weight,
            "in_proj": lambda: model.layers[0].attn.in_proj.weight,
            "lm_head": lambda: model.lm_head.weight}[where]()


def _rows(w: torch.Tensor) -> slice:
    """A block of rows in the middle of w: neither its first nor its last row."""
    n = w.shape[0]
    return slice(n // 4, n // 2)


def _edit(w: torch.Tensor, how: str) -> None:
    """Scale a middle block of rows of w by -20 in place, behind autograd's back."""
    rows = _rows(w)
    if how == "data":
        w.data[rows].mul_(-20.0)
    else:  # a numpy view of the same memory
        w.detach().numpy()[rows] *= -20.0


def _spy(monkeypatch) -> list:
    """Record every engine stepper that generate builds (to check which backend ran)."""
    made = []
    real = api.decoder_stepper

    def spy(*a, **kw):
        stepper = real(*a, **kw)
        made.append(stepper)
        return stepper

    monkeypatch.setattr(api, "decoder_stepper", spy)
    return made


def _check_fresh(model, edit, **kw) -> None:
    """generate, edit, generate again == generate on a deep copy; the edit matters."""
    before = qkv.generate(model, max_new_tokens=T, **kw)
    edit()
    want = qkv.generate(copy.deepcopy(model), max_new_tokens=T, **kw)
    assert not torch.equal(want, before), "the edit does not change the tokens: no test"
    got = qkv.generate(model, max_new_tokens=T, **kw)
    assert torch.equal(got, want)
    # and the deep copy's answer is the model's own (uncached forward passes)
    assert torch.equal(want, qkv.generate(model, max_new_tokens=T, use_cache=False, **kw))


WHERE = ["fc_in", "in_proj", "lm_head"]
HOW = ["data", "numpy"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("path", ["c-row-kernel", "torch-ops"])
def test_one_row_sees_an_in_place_edit(path, where, how, monkeypatch, one_torch_thread):
    if path == "torch-ops":
        monkeypatch.setenv("QKV_ROW_KERNEL", "0")
    elif (row_step_kernel.load() is None or gemv_kernel.load() is None
          or attention_kernel.load() is None):
        pytest.skip("the C row kernel cannot be built here")
    made = _spy(monkeypatch)
    model = tiny_gpt()
    ids = torch.randint(3, 48, (1, 5))
    _check_fresh(model, lambda: _edit(_weight(model, where), how), input_ids=ids)
    want = "c-layer-fp32" if path == "c-row-kernel" else "torch"
    assert made and all(s.rows == 1 and s.backend == want for s in made)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("where", WHERE)
def test_a_few_rows_see_an_in_place_edit(where, how, monkeypatch, one_torch_thread):
    """3 prompts × 2 beams (layers too small for the packed backend): the torch backend's
    (in, out) copies, padded prompts, beams."""
    made = _spy(monkeypatch)
    model = tiny_gpt()
    ids, keep = left_padded(rows=3, n=6)
    _check_fresh(model, lambda: _edit(_weight(model, where), how), input_ids=ids,
                 attention_mask=keep, num_beams=2)
    assert made and all(s.backend == "torch" for s in made)


@pytest.mark.skipif(not packing_works(),
                    reason="this torch build cannot pack weights for oneDNN")
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("where", WHERE)
def test_packed_batch_sees_an_in_place_edit(where, how, monkeypatch, one_torch_thread):
    """>= 4 rows: the step multiplies by oneDNN-packed copies (let in for the tiny model)."""
    monkeypatch.setattr("qkv.generation.linears.PACKED_MIN_WEIGHTS", 1)
    monkeypatch.setattr("qkv.ops.fast_linear.MIN_ROWS", 4)
    made = _spy(monkeypatch)
    model = tiny_gpt()
    ids, keep = left_padded(rows=6, n=7)
    _check_fresh(model, lambda: _edit(_weight(model, where), how), input_ids=ids,
                 attention_mask=keep)
    assert made and all(s.backend == "onednn-packed" for s in made)


@pytest.mark.parametrize("where", WHERE)
def test_prompt_lookup_sees_an_in_place_edit(where, monkeypatch, one_torch_thread):
    """The multi-token (prompt-lookup) step multiplies by (in, out) copies too: the torch
    backend's ``run`` (``QKV_ROW_KERNEL=0``: at one row the C layer feeds one token a call)."""
    monkeypatch.setenv("QKV_ROW_KERNEL", "0")
    made = _spy(monkeypatch)
    model = tiny_gpt()
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    _check_fresh(model, lambda: _edit(_weight(model, where), "data"), input_ids=ids,
                 prompt_lookup_num_tokens=3)
    assert made and all(s.backend == "torch" for s in made)


@pytest.mark.parametrize("where", WHERE)
def test_a_model_built_under_inference_mode_sees_an_edit(where, one_torch_thread):
    """Inference tensors have no version counter; swapping two rows keeps every sum."""
    with torch.inference_mode():
        model = tiny_gpt()
    w = _weight(model, where)
    assert w.is_inference()
    ids = torch.randint(3, 48, (2, 5))

    first = int(qkv.generate(model, ids, max_new_tokens=1)[0, -1])  # < every w's rows
    a, b = (_rows(w).start, first) if first != _rows(w).start else (_rows(w).start + 1, first)

    def swap():  # the LM head: the row of the first token generated, with another
        with torch.inference_mode():
            w[[a, b]] = w[[b, a]].clone()

    _check_fresh(model, swap, input_ids=ids)


@pytest.mark.parametrize("path", ["c-layer", "torch-ops"])
def test_copies_live_only_as_long_as_the_call(path, monkeypatch, one_torch_thread):
    """Whatever weight copies generate makes are gone when it returns: nothing is kept
    with the model that a later edit could leave stale. One row: the C layer's runner (which
    holds its (in, out) copies), or under ``QKV_ROW_KERNEL=0`` the torch backend's (in, out)
    copies themselves (``runner.lin.w``)."""
    if path == "torch-ops":
        monkeypatch.setenv("QKV_ROW_KERNEL", "0")
    elif (row_step_kernel.load() is None or gemv_kernel.load() is None
          or attention_kernel.load() is None):
        pytest.skip("the C row kernel cannot be built here")
    made, backends = [], []
    real = api.decoder_stepper

    def spy(*a, **kw):
        stepper = real(*a, **kw)
        backends.append(stepper.backend)
        made.extend(weakref.ref(x) for x in (stepper, stepper.runner))
        lin = getattr(stepper.runner, "lin", None)
        made.extend(weakref.ref(t) for t in getattr(lin, "w", ()))
        return stepper

    monkeypatch.setattr(api, "decoder_stepper", spy)
    model = tiny_gpt()
    qkv.generate(model, torch.randint(3, 48, (1, 5)), max_new_tokens=T)
    gc.collect()
    assert backends == ["c-layer-fp32" if path == "c-layer" else "torch"]
    assert len(made) > 2 or path == "c-layer"  # the torch backend's copies were recorded
    assert made and all(r() is None for r in made)


# --- int8 -----------------------------------------------------------------------------------
def _int8_weight(model, where: str) -> torch.Tensor:
    """The int8 (out, in) weight buffer of a quantized model's fc_in / in_proj / LM head."""
    return {"fc_in": lambda: model.layers[0].ffn.fc_in.weight_int8,
            "in_proj": lambda: model.layers[0].attn.in_proj.weight_int8,
            "lm_head": lambda: model.lm_head.weight_int8}[where]()


def _negate(w: torch.Tensor, how: str) -> None:
    """Negate a middle block of rows of an int8 buffer in place (-127..127: no overflow)."""
    rows = _rows(w)
    if how == "data":
        w.data[rows].neg_()
    else:
        w.numpy()[rows] *= -1


@pytest.mark.parametrize("kernel", ["c-kernels", "torch-ops"])
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("where", WHERE)
def test_int8_step_sees_an_in_place_edit_of_its_buffers(where, how, kernel, monkeypatch,
                                                        one_torch_thread):
    if kernel == "torch-ops":
        monkeypatch.setenv("QKV_INT8_KERNEL", "0")
    made = _spy(monkeypatch)
    quantized = qkv.quantize(tiny_gpt(), "int8")
    ids = torch.randint(3, 48, (2, 5))
    _check_fresh(quantized, lambda: _negate(_int8_weight(quantized, where), how),
                 input_ids=ids)
    assert made and all((s.backend == "int8-torch") == (kernel == "torch-ops") for s in made)


@pytest.mark.parametrize("where", WHERE)
def test_requantizing_an_edited_float_model_sees_the_edit(where, one_torch_thread):
    """``quantize`` makes int8 copies of the weights (an edit of the float weights afterwards
    cannot reach them, by design); quantizing the edited float model decodes the edit."""
    model = tiny_gpt()
    ids = torch.randint(3, 48, (2, 5))
    first = qkv.generate(qkv.quantize(copy.deepcopy(model), "int8"), ids, max_new_tokens=T)
    _edit(_weight(model, where), "data")
    want = qkv.generate(qkv.quantize(copy.deepcopy(model), "int8"), ids, max_new_tokens=T)
    assert not torch.equal(want, first)
    assert torch.equal(qkv.generate(qkv.quantize(model, "int8"), ids, max_new_tokens=T), want)
