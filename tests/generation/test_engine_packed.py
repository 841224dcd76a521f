"""The decode engine's batched backend on oneDNN packed weights (``decoder_stepper`` on
"onednn-packed": R >= ``qkv.ops.fast_linear.MIN_ROWS`` rows, fp32) against oracles written
apart from it: the fp64 copy of the model's own uncached forward (logits), the generic stepper
(``GPTStepper``: the model's modules with their caches) and ``use_cache=False`` (tokens), at
batch >= 4 with left padding, for each activation (fused into oneDNN or not), RoPE, GQA, no
bias, and beam search (``reorder``); and the torch backend's (in, out) copies below
``MIN_ROWS`` rows. The tiny models here are below the size at which the engine picks the
packed backend on its own, so ``PACKED_MIN_WEIGHTS`` is lowered to let it.

Shapes: R rows, N prompt length, T new tokens, V vocab size.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _fast_gpt_models import left_padded, tiny_gpt

import qkv
from qkv.generation import attention_kernel
from qkv.generation.engine import choose, decoder_stepper
from qkv.generation.linears import packing_works
from qkv.generation.steppers import GPTStepper
from qkv.ops.fast_linear import onednn_linear, onednn_linear_active

pytestmark = pytest.mark.skipif(not packing_works(),
                                reason="this torch build cannot pack weights for oneDNN")

# fp32 step vs the fp64 forward: logits are O(1-10) here; the step's fp32 rounding
# (oneDNN's summation order, fused activation) stays far below this
F32 = dict(atol=2e-4, rtol=2e-5)


@pytest.fixture(autouse=True)
def _packed_small(monkeypatch):
    """Send even these tiny models through the packed backend at 4+ rows, one thread."""
    monkeypatch.setattr("qkv.generation.linears.PACKED_MIN_WEIGHTS", 1)
    monkeypatch.setattr("qkv.ops.fast_linear.MIN_ROWS", 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["c-attention", "torch-attention"])
def attn(request, monkeypatch):
    """The step's attention through the C kernel, or through baddbmm/softmax/bmm."""
    if request.param == "c-attention":
        if attention_kernel.load() is None:
            pytest.skip("the C attention kernel cannot be built here")
        return True
    monkeypatch.setenv("QKV_ATTN_KERNEL", "0")
    return False


_gpt = tiny_gpt


def _prompts(rows: int = 6, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, n) left-padded prompts (``left_padded``, shift 0) and their mask."""
    return left_padded(rows, n, shift=0)


VARIANTS = [dict(), dict(activation="gelu"), dict(activation="silu"),
            dict(activation="quick_gelu"), dict(positions="rope", num_kv_heads=2),
            dict(num_kv_heads=1), dict(activation="relu", bias=False, tie_embeddings=False)]
VARIANT_IDS = ["gpt2-gelu_tanh", "gelu", "silu", "quick_gelu-unfused", "rope-gqa", "mqa",
               "relu-nobias-untied"]


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_packed_step_logits_equal_fp64_forward(kw, padded, attn):
    """prefill + 8 steps of a batch of 6: every logit == the fp64 model's uncached forward
    over the prompt and the tokens fed so far."""
    model = _gpt(**kw)
    ids, keep = _prompts()
    if not padded:
        keep = torch.ones_like(keep)
        ids = torch.randint(3, 48, ids.shape)
    torch.manual_seed(3)
    new = torch.randint(3, 48, (6, 8))
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, None if not padded else keep,
                                  ids.shape[1] + new.shape[1])
        assert stepper.backend == "onednn-packed"
        assert (stepper.runner.kernel is not None) == attn
        got = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(new.shape[1])]
        ref = copy.deepcopy(model).double()
        full = torch.cat((ids, new), dim=1)
        mask = torch.cat((keep, torch.ones_like(new, dtype=torch.bool)), dim=1)
        want = ref(full, attention_mask=mask)[:, ids.shape[1] - 1:]  # (R, T + 1, V)
    torch.testing.assert_close(torch.stack(got, dim=1).double(), want, **F32)


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
def test_packed_greedy_tokens_equal_generic_stepper(kw, attn):
    """Greedy tokens of the packed step (batch 6, padded) == the generic stepper's (the
    model's modules and caches) == the uncached recomputation."""
    model = _gpt(**kw)
    ids, keep = _prompts()
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + 12)
        assert stepper.backend == "onednn-packed"
        assert (stepper.runner.kernel is not None) == attn
        logits, fast = stepper.prefill(), []
        generic = GPTStepper(model, ids, keep, 12, use_cache=True)
        g_logits, slow = generic.prefill(), []
        for i in range(12):
            fast.append(logits.argmax(dim=-1))
            slow.append(g_logits.argmax(dim=-1))
            if i < 11:
                logits, g_logits = stepper.step(fast[-1]), generic.step(slow[-1])
    assert torch.equal(torch.stack(fast, 1), torch.stack(slow, 1))
    out = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=12)
    assert torch.equal(out[:, 7:], torch.stack(fast, 1))
    assert torch.equal(out, qkv.generate(model, ids, attention_mask=keep, max_new_tokens=12,
                                         use_cache=False))


@pytest.mark.parametrize("search", [dict(num_beams=2), dict(num_beams=3, eos_token_id=4)],
                         ids=["beam2", "beam3-eos"])
def test_packed_beam_search_equals_uncached(search, attn):
    """Beam search over 3 padded prompts (6-9 rows: the packed path, ``reorder`` included)
    == the same search recomputing the whole sequence every step."""
    model = _gpt(positions="rope", num_kv_heads=2)
    ids, keep = _prompts(rows=3)
    got = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=10, pad_token_id=1,
                       **search)
    want = qkv.generate(model, ids, attention_mask=keep, max_new_tokens=10, pad_token_id=1,
                        use_cache=False, **search)
    assert torch.equal(got, want)


def test_dispatch_rows_dtype_switch():
    """The engine picks the packed backend only from MIN_ROWS rows, fp32, and not under
    ``onednn_linear(False)``; the 1-row stepper keeps (in, out) copies (the fp32 C layer,
    or the torch backend where the C kernels cannot be built)."""
    model = _gpt()
    assert onednn_linear_active()

    def packed(m, rows):
        return choose(m, rows).backend.name == "onednn-packed"

    assert packed(model, 4) and not packed(model, 3)
    with onednn_linear(False):
        assert not packed(model, 16)
    assert not packed(copy.deepcopy(model).double(), 16)
    ids, _ = _prompts(rows=1)
    with torch.inference_mode():
        backend = decoder_stepper(model, ids, None, ids.shape[1] + 3).backend
    assert backend in ("c-layer-fp32", "torch")


def test_packed_weights_are_fresh_copies_of_the_weights_now():
    """Each stepper build packs the weights as they are: two builds hold distinct packed
    copies, and an edit behind the version counter is in the next build's packing and its
    steps (copies of one generate call: nothing kept)."""
    model = _gpt()
    ids, keep = _prompts()
    with torch.inference_mode():
        kept = decoder_stepper(model, ids, keep, ids.shape[1] + 2).runner.lin.w
        again = decoder_stepper(model, ids, keep, ids.shape[1] + 2).runner.lin.w
        assert all(a is not b for a, b in zip(again, kept, strict=True))
    with torch.no_grad():
        model.layers[1].ffn.fc_out.weight.data[5, 7] += 1.0  # behind the version counter
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + 2)
        assert stepper.backend == "onednn-packed"
        got = stepper.prefill()
        want = model(ids, attention_mask=keep)[:, -1]
        step = stepper.step(want.argmax(dim=-1))
        full = model(torch.cat((ids, want.argmax(dim=-1)[:, None]), dim=1),
                     attention_mask=torch.cat((keep, torch.ones_like(keep[:, :1])), dim=1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, full[:, -1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(positions="rope", num_kv_heads=2)],
                         ids=["gpt2", "rope-gqa"])
@pytest.mark.parametrize("rows", [1, 3])
def test_unpacked_step_with_c_attention_equals_fp64_forward(kw, rows, attn):
    """Below MIN_ROWS, the torch backend (forced: at 1 row the engine picks the fp32 C layer)
    on its (in, out) addmm copies, fp32 on one thread: attention through the C kernel (or
    torch's ops) == the fp64 model's uncached forward; 3 rows padded."""
    model = _gpt(**kw)
    ids, keep = _prompts(rows=rows)
    keep = None if rows == 1 else keep
    ids = ids if keep is not None else torch.randint(3, 48, ids.shape)
    torch.manual_seed(4)
    new = torch.randint(3, 48, (rows, 8))
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + new.shape[1],
                                  backend="torch")
        assert (stepper.runner.kernel is not None) == attn
        got = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(new.shape[1])]
        full = torch.cat((ids, new), dim=1)
        mask = None if keep is None else torch.cat(
            (keep, torch.ones_like(new, dtype=torch.bool)), dim=1)
        want = copy.deepcopy(model).double()(full, attention_mask=mask)[:, ids.shape[1] - 1:]
    torch.testing.assert_close(torch.stack(got, dim=1).double(), want, **F32)
