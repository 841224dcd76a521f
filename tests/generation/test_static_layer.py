"""The static-shape decode step (``qkv.generation.static_layer``, backends ``static-eager`` and
``compiled`` of ``qkv.generation.static_backend``) against the model's uncached full forward
(docs/ARCHITECTURE.md: Decode backends; Tolerances; Checklist 19).

Shapes: R rows, N prompt length, V vocab size.

The step attends over every slot of the caches with a mask built from a slot tensor, so a
mask that let in one slot too many, or a write at the wrong slot, changes the logits. Caches
are filled with NaN before the prefill (Checklist 9): the unwritten slots the step reads
must be kept out of the output. Tolerances: fp32 1e-5 relative to the logits' scale (another
summation order than the full forward's, as tests/generation/test_engine_backends.py);
fp64 1e-10 of the scale; compiled vs eager static step 1e-5 of the scale (inductor fuses
the elementwise ops: another rounding order).
"""

from __future__ import annotations

import pytest
import torch
from _fast_gpt_models import cases, drive, reference_logits, spread_vectors, tiny_gpt

from qkv import quantize
from qkv.generation import static_backend
from qkv.generation.plan import decode_plan
from qkv.generation.static_backend import Compiled, StaticEager
from qkv.generation.static_layer import StaticLayers

VARIANTS = {
    "learned": {},
    "rope_gqa": dict(positions="rope", num_kv_heads=2),
    "rms_swiglu": dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False,
                       tie_embeddings=False),
    "rope_interleaved_mqa": dict(positions="rope", num_heads=8, num_kv_heads=1,
                                 activation="silu"),
}


def gpt(**kw):
    """``tiny_gpt(**kw)`` with every vector moved off its initial value
    (``spread_vectors``); the 8-head RoPE variant with the adjacent-pairs convention."""
    model = spread_vectors(tiny_gpt(**kw))
    if model.rope is not None and kw.get("num_heads") == 8:
        model.rope.interleaved = True  # the adjacent-pairs convention too
    return model


_cases = cases


def _stepper(backend, model, ids, keep, capacity):
    """A stepper of ``backend`` with NaN-filled caches."""
    st = backend.stepper(decode_plan(model), model, ids, keep, capacity)
    for kc in st.cache:
        kc.keys.fill_(float("nan"))
        kc.values.fill_(float("nan"))
    return st


def _decode(model, ids, keep, backend):
    """``drive`` a stepper of ``backend``: logits (R, 6, V), fed tokens (R, 5)."""
    return drive(backend.stepper(decode_plan(model), model, ids, keep, ids.shape[1] + 6))


_reference = reference_logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("rows,padded", [(1, False), (4, False), (4, True)])
def test_static_eager_step_equals_the_full_forward(variant, rows, padded, one_torch_thread):
    """fp32: 1e-5 of the logits' scale."""
    model = gpt(**VARIANTS[variant])
    ids, keep = _cases(rows, padded, model.config.vocab_size)
    got, fed = _decode(model, ids, keep, StaticEager())
    want = _reference(model, ids, keep, fed)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("variant", ["learned", "rope_gqa"])
def test_static_eager_step_in_fp64(variant):
    """fp64: 1e-10 of the logits' scale, padded batch of four."""
    model = gpt(**VARIANTS[variant]).double()
    ids, keep = _cases(4, True, model.config.vocab_size)
    got, fed = _decode(model, ids, keep, StaticEager())
    want = _reference(model, ids, keep, fed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * want.abs().max())


@pytest.mark.parametrize("variant", ["learned", "rope_gqa"])
def test_rewind_and_reorder_read_only_the_slots_they_keep(variant, one_torch_thread):
    """After a rewind the slots past the new length hold stale (finite) keys the mask must
    hide; after a reorder each row continues another's cache. fp32, 1e-5 of the scale."""
    model = gpt(**VARIANTS[variant])
    ids, keep = _cases(4, True, model.config.vocab_size)
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(3, 48, (4, 4), generator=g) for _ in range(2))
    idx = torch.tensor([2, 0, 3, 2])
    with torch.inference_mode():
        st = _stepper(StaticEager(), model, ids, keep, ids.shape[1] + 8)
        st.prefill()
        st.run(a)  # slots N .. N+3
        st.rewind(ids.shape[1] + 1)  # keep a[:, 0]; a[:, 1:] stays stale in the buffers
        st.reorder(idx)
        got = st.run(b)  # (R, 4, V)
    seq = torch.cat([ids, a[:, :1]], 1).index_select(0, idx)
    mask = torch.cat([keep, torch.ones(4, 1, dtype=torch.bool)], 1).index_select(0, idx)
    want = _reference(model, seq, mask, b)[:, 1:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max())


def test_static_backends_refuse_what_they_cannot_decode_and_say_why(monkeypatch):
    plan = decode_plan(tiny_gpt())
    cpu = torch.device("cpu")
    eager, compiled = StaticEager(), Compiled()
    assert eager.supports(None, 1, torch.float32, cpu, 1) == "the model has no decode plan"
    int8 = decode_plan(quantize(tiny_gpt(), "int8"))
    assert "int8" in eager.supports(int8, 1, torch.float32, cpu, 1)
    bf16 = decode_plan(tiny_gpt().to(torch.bfloat16))
    assert "not torch.bfloat16" in eager.supports(bf16, 1, torch.bfloat16, cpu, 1)
    assert "activations in torch.float64" in eager.supports(plan, 1, torch.float64, cpu, 1)
    assert eager.supports(plan, 3, torch.float32, cpu, 2) is None
    monkeypatch.setattr(static_backend, "compile_probe",
                        lambda device: "torch.compile does not work here (no compiler)")
    assert compiled.supports(plan, 1, torch.float32, cpu, 1) == (
        "torch.compile does not work here (no compiler)")
    assert "int8" in compiled.supports(int8, 1, torch.float32, cpu, 1)
    with pytest.raises(ValueError, match="mode must be one of"):
        Compiled("reduce-overhead")
    with pytest.raises(ValueError, match="fp32/fp64 weights only"):
        StaticLayers(bf16, tiny_gpt().to(torch.bfloat16).new_cache(1, 4), None)


def _feed(st, fed):
    """The logits (R, 1 + T, V) of ``st``'s prefill and of steps feeding fed (R, T)."""
    with torch.inference_mode():
        return torch.stack([st.prefill()] + [st.step(fed[:, j]) for j in range(fed.shape[1])],
                           1)


@pytest.mark.slow
@pytest.mark.timeout(900)  # one compile: ~30 s on 2 idle cores, minutes on a loaded machine
def test_compiled_step_equals_eager_and_compiles_once(one_torch_thread):
    """The compiled static step (rope + GQA, padded batch of four) gives the full forward's
    logits and the eager static step's (1e-5 of the scale each); after its first step
    dynamo captures no new graph: neither the later steps (another slot, other positions)
    nor a second stepper on other prompts of the same shapes (the next ``generate`` call)
    recompile."""
    from torch._dynamo.utils import counters

    backend = Compiled()
    plan = decode_plan(gpt(**VARIANTS["rope_gqa"]))
    if (why := backend.supports(plan, 4, plan.dtype, plan.device, 1)) is not None:
        pytest.skip(why)
    model = plan.model
    ids, keep = _cases(4, True, model.config.vocab_size)
    fed = torch.randint(3, 48, (4, 5), generator=torch.Generator().manual_seed(6))
    capacity = ids.shape[1] + fed.shape[1]
    before = counters["stats"]["unique_graphs"]
    st = _stepper(backend, model, ids, keep, capacity)
    with torch.inference_mode():
        got = [st.prefill(), st.step(fed[:, 0])]
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > before  # the first step compiled
        got = torch.stack(got + [st.step(fed[:, j]) for j in range(1, 5)], 1)
    other = (ids + 5) % 48 * keep
    got2 = _feed(_stepper(backend, model, other, keep, capacity), fed)
    assert counters["stats"]["unique_graphs"] == graphs
    eager = _feed(_stepper(StaticEager(), model, ids, keep, capacity), fed)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-5 * eager.abs().max())
    for prompt, out in ((ids, got), (other, got2)):
        full = _reference(model, prompt, keep, fed)
        torch.testing.assert_close(out, full, rtol=0, atol=1e-5 * full.abs().max())
