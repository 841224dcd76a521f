"""Every decode backend against the model's uncached full forward (docs/ARCHITECTURE.md:
Decode backends; Tolerances): prefill, single steps and a multi-token ``run`` of each backend
that supports a model give the logits ``model(whole sequence)`` gives, over GPT-2-style,
RoPE, GQA, RMSNorm + SwiGLU and odd-sized models, padded and unpadded, one row and four.

Shapes: R rows, N prompt length, V vocab size.

Tolerances: fp32 backends 1e-5 relative to the logits' scale (another summation order than
the full forward's); fp64 1e-10; int8 backends 1e-4 of the scale against the quantized model's
own forward (the same int8 math; the C layer rounds norms and attention in another order).
Caches are filled with NaN before the prefill: a backend that read a slot it did not write
would return NaN (Checklist 12).
"""

from __future__ import annotations

import os

import pytest
import torch
from _fast_gpt_models import cases, drive, left_padded, reference_logits, spread_vectors, tiny_gpt

from qkv import quantize
from qkv.generation import backends as backends_module
from qkv.generation import row_step_kernel
from qkv.generation.backends import BACKENDS
from qkv.generation.engine import choose, decoder_stepper
from qkv.generation.plan import Unplannable, decode_plan

VARIANTS = {
    "gpt2": {},
    "rope": dict(positions="rope"),
    "gqa": dict(positions="rope", num_kv_heads=2),
    "rms_swiglu": dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False,
                       tie_embeddings=False),
    "odd": dict(dim=36, num_heads=3, ffn_hidden=50, vocab_size=53, activation="relu"),
    "silu_interleaved_heads": dict(activation="silu", num_heads=8, num_kv_heads=1,
                                   positions="rope"),
    # the Llama-style families' variants (HF Llama / Qwen2 / Qwen3 / Gemma)
    "llama_head_dim_qkv_bias": dict(norm="rmsnorm", activation="swiglu", positions="rope",
                                    num_kv_heads=2, attention_head_dim=12, rope_base=5e5,
                                    bias=False, qkv_bias=True, tie_embeddings=False),
    "qwen3_qk_norm": dict(norm="rmsnorm", activation="swiglu", positions="rope",
                          num_kv_heads=2, attention_head_dim=16, qk_norm=True, bias=False),
    "gemma": dict(norm="rmsnorm_plus_one", activation="geglu_tanh", positions="rope",
                  attention_head_dim=16, embed_scale=True, bias=False),
}
#: variants the C layer does not compute (it says why: per-head q/k norms, Gemma's norm)
NO_C_LAYER = {"qwen3_qk_norm", "gemma"}


def gpt(**kw):
    """``tiny_gpt(**kw)`` with every vector moved off its initial value (``spread_vectors``)."""
    return spread_vectors(tiny_gpt(**kw))


@pytest.fixture
def one_thread():
    """torch on one thread (the C layer backend runs only there), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pack_small(monkeypatch):
    """The oneDNN backend for the tiny test models too (its size threshold off)."""
    monkeypatch.setattr("qkv.generation.linears.PACKED_MIN_WEIGHTS", 0)


def _decode(model, ids, keep, backend):
    """``drive`` a stepper of ``backend`` (forced through the engine): logits (R, 6, V), fed
    tokens (R, 5)."""
    st = decoder_stepper(model, ids, keep, ids.shape[1] + 6, backend=backend)
    assert st.backend == backend
    return drive(st)


_reference = reference_logits


def _kernels() -> bool:
    """Whether the C layer backends must be among those that serve a model: the kernel
    builds here, or CI (where a C compiler is part of the machine; a kernel that fails to
    build there is a failure, not a skip)."""
    return row_step_kernel.load() is not None or os.environ.get("CI") == "true"


_cases = cases


def _supported(model, rows):
    plan = decode_plan(model)
    return [b.name for b in BACKENDS
            if b.name != "modules" and b.supports(plan, rows, plan.dtype, plan.device,
                                                  torch.get_num_threads()) is None]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("rows,padded", [(1, False), (4, False), (4, True)])
def test_every_fp32_backend_equals_the_full_forward(variant, rows, padded, one_thread,
                                                    pack_small):
    model = gpt(**VARIANTS[variant])
    ids, keep = _cases(rows, padded, model.config.vocab_size)
    names = _supported(model, rows)
    assert "torch" in names and ("onednn-packed" in names) == (rows >= 4)
    if rows == 1 and _kernels() and variant not in NO_C_LAYER:  # these have a C form
        assert "c-layer-fp32" in names
    for name in [*names, "modules"]:
        got, fed = _decode(model, ids, keep, name)
        want = _reference(model, ids, keep, fed)
        scale = want.abs().max()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("variant", ["gpt2", "rms_swiglu", "gqa"])
def test_fp64_models_decode_on_the_torch_backend_to_fp64_precision(variant):
    model = gpt(**VARIANTS[variant]).double()
    ids, keep = _cases(4, True, model.config.vocab_size)
    assert choose(model, 4).backend.name == "torch"
    got, fed = _decode(model, ids, keep, "torch")
    want = _reference(model, ids, keep, fed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * want.abs().max())


@pytest.mark.parametrize("variant", ["gpt2", "gqa", "rms_swiglu", "odd",
                                     "llama_head_dim_qkv_bias", "qwen3_qk_norm"])
@pytest.mark.parametrize("rows,padded", [(1, False), (4, True)])
def test_every_int8_backend_equals_the_quantized_models_forward(variant, rows, padded,
                                                                one_thread):
    model = quantize(gpt(**VARIANTS[variant]), "int8")
    assert decode_plan(model).int8
    ids, keep = _cases(rows, padded, model.config.vocab_size)
    names = _supported(model, rows)
    assert "int8-torch" in names
    if _kernels() and variant not in NO_C_LAYER:
        assert "c-layer-int8" in names
    for name in [*names, "modules"]:
        got, fed = _decode(model, ids, keep, name)
        want = _reference(model, ids, keep, fed)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max(), msg=name)


def test_a_forced_backend_that_refuses_says_why():
    model = tiny_gpt(norm="rmsnorm")
    ids = torch.randint(3, 48, (1, 4))
    with pytest.raises(ValueError, match="the fp32 C layer decodes one row, not 2"):
        decoder_stepper(model, ids.repeat(2, 1), None, 8, backend="c-layer-fp32")
    with pytest.raises(ValueError, match="not int8"):
        decoder_stepper(model, ids, None, 8, backend="int8-torch")
    with pytest.raises(ValueError, match=r"unknown decode backend 'nope'.*torch"):
        decoder_stepper(model, ids, None, 8, backend="nope")


def test_a_model_without_a_plan_decodes_on_its_modules_with_its_hooks():
    """A forward hook (or any part the plan does not describe) sends the model to the
    ``modules`` backend, where the hook runs; the tokens equal the uncached greedy ones."""
    import qkv
    model = tiny_gpt()
    calls = []
    handle = model.layers[1].ffn.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        with pytest.raises(Unplannable, match=r"layers\.1\.ffn has hooks"):
            decode_plan(model)
        assert choose(model, 1).backend.name == "modules"
        ids = torch.randint(3, 48, (2, 5))
        got = qkv.generate(model, ids, max_new_tokens=4)
        assert len(calls) == 4  # the prefill and three steps, each through the hooked module
        want = qkv.generate(model, ids, max_new_tokens=4, use_cache=False)
        assert torch.equal(got, want)
    finally:
        handle.remove()


@pytest.mark.parametrize("kw,reason", [
    (dict(attention_window=4), "config.attention_window=4"),
    (dict(attention="linear"), "config.attention='linear'"),
])
def test_config_variants_the_plan_does_not_know_are_refused_by_name(kw, reason):
    import qkv
    model = tiny_gpt(**kw)
    with pytest.raises(Unplannable, match=reason.replace("(", r"\(")):
        decode_plan(model)
    ids = torch.randint(3, 48, (2, 5))
    assert torch.equal(qkv.generate(model, ids, max_new_tokens=3),
                       qkv.generate(model, ids, max_new_tokens=3, use_cache=False))


def test_plan_refuses_lora_wrappers_and_mixed_int8():
    from qkv.peft import LoraConfig, add_lora
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=2, targets=("qkv",)))
    with pytest.raises(Unplannable, match="in_proj is a"):
        decode_plan(model)
    mixed = quantize(tiny_gpt(), "int8")
    mixed.lm_head = torch.nn.Linear(32, 48, bias=False)
    with pytest.raises(Unplannable, match="int8 and some are not"):
        decode_plan(mixed)


def test_beam_reorder_is_exact_on_every_backend(one_thread, pack_small):
    """Beam search through each backend returns the tokens of beam search on the uncached
    model (``reorder`` moves caches and padding bias together)."""
    import qkv
    from qkv.generation import api
    model = gpt(positions="rope", num_kv_heads=2)
    ids, keep = left_padded(2, 6)
    want = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=5, num_beams=3,
                        use_cache=False)
    for name in ("torch", "onednn-packed", "modules"):
        real = api.decoder_stepper

        def forced(m, i, k, c, _name=name, _real=real, **kw):
            return _real(m, i, k, c, backend=_name)
        api.decoder_stepper = forced
        try:
            got = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=5,
                               num_beams=3)
        finally:
            api.decoder_stepper = real
        assert torch.equal(got, want), name


def _native_bf16() -> bool:
    from qkv.ops.cpu import cpu_bf16
    return cpu_bf16().native


@pytest.mark.skipif(not _native_bf16(), reason="bf16 is not native on this CPU")
@pytest.mark.parametrize("variant", ["gpt2", "rms_swiglu"])
def test_bf16_models_decode_on_packed_bf16_weights(variant):
    """A bf16 model on a CPU with native bf16 decodes on ``bf16-packed`` (any rows) and its
    logits are the bf16 model's own forward's to bf16 rounding (3e-2 of the scale: bf16 keeps
    8 bits; the two round norms, softmax and sums in other orders)."""
    model = gpt(**VARIANTS[variant], dim=64).bfloat16()
    for rows, padded in ((1, False), (4, True)):
        ids, keep = _cases(rows, padded, model.config.vocab_size)
        assert choose(model, rows).backend.name == "bf16-packed"
        for name in ("bf16-packed", "torch"):
            got, fed = _decode(model, ids, keep, name)
            want = _reference(model, ids, keep, fed)
            assert got.dtype is torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                       atol=3e-2 * want.float().abs().max(), msg=name)


def test_bf16_backends_refuse_a_cpu_without_native_bf16(monkeypatch):
    """Where the CPU has no native bf16 (bf16 matmuls ~100x slower than fp32), the bf16
    backends refuse with what was found, and the model decodes on its modules."""
    from qkv.ops.cpu import CPUBF16, MatmulProbe
    slow = CPUBF16("a test CPU", (), MatmulProbe(512, 1.0, 100.0))
    monkeypatch.setattr(backends_module, "cpu_bf16", lambda: slow)
    model = gpt(dim=64).bfloat16()
    choice = choose(model, 4)
    assert choice.backend.name == "modules"
    refusals = dict(choice.refusals)
    assert "bf16 is not native on this CPU (a test CPU" in refusals["bf16-packed"]
    assert "not native" in refusals["torch"]
