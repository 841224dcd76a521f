"""The batched fast prefill on token rows (``qkv.generation.prefill.prefill_rows``: a
left-padded batch runs its real tokens only; the decode engine's fp32 steppers call it)
against oracles written apart from it: the model's own padded prefill (``GPT.hidden_states``
/ ``GPT.forward`` over all N positions with the same caches), the fp64 copy of the model's
uncached forward, the generic stepper (``GPTStepper``) and ``use_cache=False`` greedy
decoding; learned positions, RoPE with GQA, the torch backend (< 4 rows) and the
oneDNN-packed one (>= 4 rows).

Shapes: R rows, N prompt length, T new tokens, V vocab size, C width.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _fast_gpt_models import left_padded, tiny_gpt

import qkv
from qkv.generation import stepper as stepper_module
from qkv.generation.engine import choose, decoder_stepper
from qkv.generation.linears import packing_works
from qkv.generation.plan import Unplannable, decode_plan
from qkv.generation.prefill import prefill_rows
from qkv.generation.search import greedy_or_sample
from qkv.generation.steppers import GPTStepper

# the rows prefill runs the same fp32 ops on fewer rows; the padded prefill's sums may be
# ordered otherwise (other GEMM shapes): logits O(1-10) agree far below this
TIGHT = dict(atol=1e-5, rtol=1e-5)
# fp32 vs the fp64 forward
F32 = dict(atol=2e-4, rtol=2e-5)

VARIANTS = [dict(), dict(positions="rope", num_kv_heads=2), dict(num_kv_heads=1, bias=False),
            dict(num_layers=1, activation="relu"), dict(num_layers=3, positions="rope")]
VARIANT_IDS = ["learned", "rope-gqa", "mqa-nobias", "1-layer-relu", "3-layer-rope"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


_gpt = tiny_gpt


def _prompts(rows: int = 6, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, n) left-padded prompts (``left_padded``, shift 1) and their mask."""
    return left_padded(rows, n, shift=1)


def _plannable(model) -> bool:
    """The model has an fp32/fp64 decode plan (``decode_plan`` describes it, not int8)."""
    try:
        return not decode_plan(model).int8
    except Unplannable:
        return False


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
def test_prefill_rows_equals_padded_prefill_and_fills_the_same_caches(kw):
    """Last-position hidden states == ``hidden_states`` over all N padded positions (1e-5);
    the caches hold the same keys/values at the real positions and zeros at the padded
    ones, with length N."""
    model = _gpt(**kw)
    ids, keep = _prompts()
    with torch.inference_mode():
        padded, rows = model.new_cache(6, 10), model.new_cache(6, 10)
        want, _ = model.hidden_states(ids, attention_mask=keep, cache=padded)
        got = prefill_rows(model, ids, keep, rows)
    torch.testing.assert_close(got, want[:, -1], **TIGHT)
    real = keep[:, None, :, None]  # (R, 1, N, 1)
    for p, r in zip(padded, rows, strict=True):
        assert r.length == p.length == ids.shape[1]
        for a, b in ((p.keys, r.keys), (p.values, r.values)):
            torch.testing.assert_close(b[:, :, :7] * real, a[:, :, :7] * real, **TIGHT)
            assert not bool((b[:, :, :7] * ~real).any())  # padded slots: zeros


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("batch", [3, 6], ids=["unpacked", "packed"])
def test_stepper_prefill_uses_rows_and_matches_fp64(kw, batch, monkeypatch):
    """The engine stepper's ``prefill`` of a padded batch goes through ``prefill_rows``; its
    logits and the next 4 steps' == the fp64 uncached forward, and the prefill logits == the
    padded forward's (1e-5)."""
    monkeypatch.setattr("qkv.generation.linears.PACKED_MIN_WEIGHTS", 1)
    monkeypatch.setattr("qkv.ops.fast_linear.MIN_ROWS", 4)
    calls = []
    real_fn = prefill_rows
    monkeypatch.setattr(stepper_module, "prefill_rows",
                        lambda *a: calls.append(1) or real_fn(*a))
    model = _gpt(**kw)
    ids, keep = _prompts(rows=batch)
    torch.manual_seed(3)
    new = torch.randint(3, 48, (batch, 4))
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + new.shape[1])
        assert (stepper.backend == "onednn-packed") == (batch >= 4 and packing_works())
        assert stepper.backend in ("onednn-packed", "torch")
        got = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(new.shape[1])]
        assert calls == [1]
        padded = model(ids, attention_mask=keep)[:, -1]
        full = torch.cat((ids, new), dim=1)
        mask = torch.cat((keep, torch.ones_like(new, dtype=torch.bool)), dim=1)
        want = copy.deepcopy(model).double()(full, attention_mask=mask)[:, ids.shape[1] - 1:]
    torch.testing.assert_close(got[0], padded, **TIGHT)
    torch.testing.assert_close(torch.stack(got, dim=1).double(), want, **F32)


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("batch", [4, 6])
def test_greedy_tokens_equal_generic_stepper_and_uncached(kw, batch):
    """Greedy tokens through ``generate`` (rows prefill) == the generic stepper's (the
    model's modules, padded prefill) == the uncached recomputation; batch >= 4, left-padded."""
    model = _gpt(**kw)
    ids, keep = _prompts(rows=batch)
    out = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=10)
    with torch.inference_mode():
        generic = GPTStepper(model, ids, keep, 10, use_cache=True)
        slow = greedy_or_sample(generic, batch, 10, do_sample=False, temperature=1.0,
                                top_k=None, top_p=None, eos=None, pad=0, generator=None,
                                device=ids.device)
    assert torch.equal(out[:, ids.shape[1]:], slow)
    assert torch.equal(out, qkv.generate(model, ids, attention_mask=keep, max_new_tokens=10,
                                         use_cache=False))


def test_unpadded_or_with_grad_keeps_the_padded_prefill(monkeypatch):
    """No padding, or gradients enabled: ``prefill`` stays on ``GPT.hidden_states``."""
    monkeypatch.setattr(stepper_module, "prefill_rows",
                        lambda *a: pytest.fail("rows path taken"))
    model = _gpt()
    ids, keep = _prompts(rows=4)
    with torch.inference_mode():
        got = decoder_stepper(model, ids, None, ids.shape[1] + 2).prefill()
        torch.testing.assert_close(got, model(ids)[:, -1], **TIGHT)
    model.requires_grad_(False)  # grad mode on, nothing to differentiate: caches accept it
    with torch.no_grad():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + 2)
        want = model(ids, attention_mask=keep)[:, -1]
    with torch.enable_grad():
        got = stepper.prefill()
    torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("kw", [dict(), dict(positions="rope", num_kv_heads=2)],
                         ids=["learned", "rope-gqa"])
def test_hooked_last_layer_falls_back_to_the_padded_batch(kw):
    """A hook on the last layer's attention: the last layer's ``forward(rows=, at=)`` computes
    the padded batch inside (calling the modules, hook included) and takes the rows; same
    result."""
    model = _gpt(**kw)
    seen = []
    model.layers[-1].attn.register_forward_hook(lambda *a: seen.append(1))
    ids, keep = _prompts()
    with torch.inference_mode():
        want, _ = model.hidden_states(ids, attention_mask=keep, cache=model.new_cache(6, 8))
        seen.clear()
        got = prefill_rows(model, ids, keep, model.new_cache(6, 8))
    assert seen == [1]
    torch.testing.assert_close(got, want[:, -1], **TIGHT)


def test_prefill_rows_rejects_right_padding_and_bad_ids():
    model = _gpt()
    ids, keep = _prompts(rows=4)
    with torch.inference_mode(), pytest.raises(ValueError, match="left-padded"):
        prefill_rows(model, ids, keep.flip(1), model.new_cache(4, 8))
    with torch.inference_mode(), pytest.raises(ValueError, match="vocab_size"):
        prefill_rows(model, ids + 48, keep, model.new_cache(4, 8))


def test_hooks_on_a_layer_fire_in_the_fast_prefill():
    """A forward hook on a GPT layer: the decode steps call no module, so the model
    has no decode plan and decodes on the ``modules`` backend, whose prefill calls the layer
    on the padded (R, N) batch (the hook fires once per layer call); the tokens are
    unchanged."""
    model = _gpt()
    ids, keep = _prompts(rows=6)
    want = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=4)
    calls = []
    model.layers[0].register_forward_hook(lambda *a: calls.append(a[1][0].shape[:2]))
    assert choose(model, 6).backend.name == "modules"
    got = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=4)
    assert calls and calls[0] == ids.shape  # the prefill called the layer on (R, N)
    assert torch.equal(got, want)


def test_a_hooked_model_decodes_on_the_generic_path_with_its_hooks():
    """A plan's backends call no module: a model with a hook anywhere has no decode plan
    (the ``modules`` backend calls the modules, so the hook runs at every step); same
    tokens."""
    model = _gpt()
    ids, keep = _prompts(rows=6)
    assert _plannable(model)
    want = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=4)
    calls = []
    handle = model.layers[-1].ffn.fc_out.register_forward_hook(lambda *a: calls.append(1))
    assert not _plannable(model)
    assert choose(model, 6).backend.name == "modules"
    got = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=4)
    assert torch.equal(got, want)
    assert len(calls) >= 4  # the prefill and every decode step called the hooked module
    handle.remove()
    assert _plannable(model)
