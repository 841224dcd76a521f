"""The encoder-decoder decode engine (``qkv.generation.seq2seq_engine``; docs/ARCHITECTURE.md:
Decode backends): every backend's logits against the Transformer's uncached full forward,
and its greedy / beam tokens against the module path, on post-norm, pre-norm T5-style and
BART-style models with padded sources; the plan's refusals and ``explain``.

Shapes: B sources, S source length, K beams, R = B·K rows, V vocab size.

Tolerances (docs/ARCHITECTURE.md: Tolerances): fp32 backends 1e-5 of the logits' scale
against ``model(src, tgt)`` (another summation order: the plan's attention is baddbmm ->
softmax -> bmm, the full forward's SDPA, and the projections run in another GEMM); fp64
1e-10 of the scale; int8 backends 1e-4 of the scale against the quantized model's own
forward (the same int8 math: each activation row re-quantized, so an fp32 rounding
difference upstream can move one int8 step). Tokens are compared exactly (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv
from qkv.generation import attention_kernel, explain, int8_kernel
from qkv.generation import seq2seq_engine as engine
from qkv.generation.plan import Unplannable
from qkv.generation.seq2seq_engine import choose_seq2seq
from qkv.generation.seq2seq_plan import seq2seq_plan
from qkv.generation.steppers import Seq2SeqStepper
from qkv.models import Transformer, TransformerConfig

V_SRC, V_TGT = 50, 60
VARIANTS = {
    # Vaswani's post-norm ReLU layer
    "post_relu": dict(),
    # T5: pre-norm RMSNorm, bucketed relative bias, q·k unscaled, gated FFN, no biases,
    # H·D != C, the head's input scaled
    "t5": dict(norm_first=True, norm="rmsnorm", positions="t5", attention_scale=1.0,
               activation="geglu_tanh", bias=False, attention_head_dim=12,
               head_scale=32 ** -0.5, tie_output=True),
    # BART: learned positions read at + 2, a norm on the embeddings, a biased head
    "bart": dict(positions="learned", position_offset=2, embed_norm=True, head_bias=True,
                 activation="gelu", tie_output=False),
    # Marian: [sin | cos] sinusoids, SiLU, final_logits_bias
    "marian": dict(activation="silu", sinusoidal_layout="halves", head_bias=True,
                   share_embeddings=False),
    # ALiBi on the self-attention, pre-norm with final norms, SwiGLU
    "alibi_swiglu": dict(positions="alibi", norm_first=True, activation="swiglu"),
}
FP32 = ("torch", "onednn-packed")
INT8 = ("int8-torch", "int8-kernel")


def tiny(variant: str, **kw) -> Transformer:
    """A seeded 2+2-layer, 32-wide Transformer of ``VARIANTS[variant]`` in eval mode, its
    matrices drawn from N(0, 0.3²) and every vector moved off its initial value, so that a
    decode path dropping one is seen."""
    torch.manual_seed(0)
    cfg = dict(src_vocab_size=V_SRC, tgt_vocab_size=V_TGT, dim=32, num_heads=4,
               ffn_hidden=48, num_encoder_layers=2, num_decoder_layers=2, dropout=0.0,
               max_len=32)
    cfg.update(VARIANTS[variant], **kw)
    model = Transformer(TransformerConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3, generator=g)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def sources(batch: int = 3, s: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) right-padded source ids (pad 0) and their mask: row b has S - 2b real tokens."""
    g = torch.Generator().manual_seed(2)
    src = torch.randint(3, V_SRC, (batch, s), generator=g)
    keep = torch.arange(s)[None, :] < (s - 2 * torch.arange(batch))[:, None]
    return src * keep, keep


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """torch on 1 thread (where the C attention kernel serves) and on 2, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def pack_small(monkeypatch):
    """The oneDNN backend for the tiny test models and rows too (its thresholds off)."""
    monkeypatch.setattr("qkv.generation.linears.PACKED_MIN_WEIGHTS", 0)
    monkeypatch.setattr("qkv.ops.fast_linear.MIN_ROWS", 1)


def drive(model, src, keep, beams: int, backend: str, steps: int = 5):
    """Decode with ``backend`` (forced): prefill, ``steps`` steps of random tokens (so that
    the rows of a source differ) each after a random within-source beam reorder, then a
    ``run`` of 3 tokens; returns the logits of every call (R, 1 + steps + 3, V) and the
    target sequences fed (R, 1 + steps + 3), the start token first."""
    rows = src.shape[0] * beams
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        st = Seq2SeqStepper(model, src, keep, 1, beams, steps + 4, True, backend=backend)
        assert st.backend == backend
        if backend != "modules":  # the C attention kernel serves fp32 on one thread
            one = torch.get_num_threads() == 1 and model.tgt_embed.weight.dtype is torch.float32
            assert (st.impl.runner.kernel is not None) == (one and _attention_builds())
            # the int8 backends run the encoder on its plan too
            planned = backend in INT8 and seq2seq_plan(model).encoder is not None
            assert st.impl.encoder == ("plan" if planned else "modules")
        spare = [] if backend == "modules" else st.impl.runner.spare or []
        for t in [x for kc in st.cache for x in (kc.keys, kc.values)] + [
                x for pair in spare for x in pair]:  # a slot read before it is written
            t.fill_(float("nan"))  # would give NaN
        seq = torch.ones(rows, 1, dtype=torch.long)
        logits = [st.prefill()[:, None]]
        for _ in range(steps):
            idx = (torch.arange(rows) // beams) * beams + torch.randint(0, beams, (rows,),
                                                                          generator=g)
            st.reorder(idx)  # each row's history moves with it: its tokens and logits
            seq = seq.index_select(0, idx)
            logits = [x.index_select(0, idx) for x in logits]
            tok = torch.randint(0, V_TGT, (rows,), generator=g)  # rows differ: reorder matters
            seq = torch.cat([seq, tok[:, None]], 1)
            logits.append(st.step(tok)[:, None])
        more = torch.randint(0, V_TGT, (rows, 3), generator=g)
        logits.append(st.run(more))
        seq = torch.cat([seq, more], 1)
    return torch.cat(logits, 1), seq


def _attention_builds() -> bool:
    return attention_kernel.load() is not None


def full_forward(model, src, keep, beams: int, seq: torch.Tensor) -> torch.Tensor:
    """The uncached forward's logits (R, L, V) of the target sequences ``seq`` (R, L)."""
    with torch.inference_mode():
        return model(src.repeat_interleave(beams, 0), seq,
                     src_mask=keep.repeat_interleave(beams, 0))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("beams", [1, 4])
def test_every_fp32_backend_equals_the_full_forward(variant, beams, pack_small, threads):
    model = tiny(variant)
    src, keep = sources()
    for name in (*FP32, "modules"):
        got, seq = drive(model, src, keep, beams, name)
        want = full_forward(model, src, keep, beams, seq)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max(),
                                   msg=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("beams", [1, 4])
def test_every_int8_backend_equals_the_quantized_models_forward(variant, beams, threads):
    model = qkv.quantize(tiny(variant), "int8")
    assert seq2seq_plan(model).int8
    src, keep = sources()
    for name in (*INT8, "modules"):
        got, seq = drive(model, src, keep, beams, name)
        want = full_forward(model, src, keep, beams, seq)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max(),
                                   msg=name)


@pytest.mark.parametrize("variant", ["post_relu", "t5"])
def test_fp64_models_decode_on_the_torch_backend_to_fp64_precision(variant):
    model = tiny(variant).double()
    src, keep = sources()
    assert choose_seq2seq(model, 3, 4).backend.name == "torch"
    got, seq = drive(model, src, keep, 4, "torch")
    want = full_forward(model, src, keep, 4, seq)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * want.abs().max())


def _generate(model, src, keep, beams: int, use_cache: bool = True, **kw) -> torch.Tensor:
    return qkv.generate(model, src, attention_mask=keep, max_new_tokens=8, num_beams=beams,
                        eos_token_id=5, use_cache=use_cache, **kw)


@pytest.mark.parametrize("variant", ["post_relu", "t5", "bart"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("beams", [1, 4])
def test_generate_on_the_engine_gives_the_module_paths_tokens(variant, precision, beams,
                                                               pack_small, monkeypatch):
    """``qkv.generate`` (the plan's backend: ``explain`` says which) returns the tokens of the
    module path (``Seq2SeqStepper(backend="modules")``) and of the uncached oracle, greedy
    and 4-beam, on a batch of 3 padded sources."""
    model = tiny(variant)
    if precision == "int8":
        model = qkv.quantize(model, "int8")
    src, keep = sources()
    chosen = choose_seq2seq(model, 3, beams).backend.name
    assert chosen in (INT8 if precision == "int8" else FP32)
    fast = _generate(model, src, keep, beams)
    oracle = _generate(model, src, keep, beams, use_cache=False)
    monkeypatch.setattr(engine, "SEQ2SEQ_BACKENDS", (engine.Modules(),))
    modules = _generate(model, src, keep, beams)
    assert torch.equal(fast, modules) and torch.equal(fast, oracle)


def test_prompt_lookup_on_the_engine_gives_greedy_tokens():
    """Prompt lookup verifies drafts with ``run(n)`` and rolls back with ``rewind``: the
    tokens equal plain greedy decoding's."""
    model = tiny("post_relu")
    src, keep = sources()
    greedy = _generate(model, src, keep, 1)
    looked = _generate(model, src, keep, 1, prompt_lookup_num_tokens=3)
    assert torch.equal(looked, greedy)


@pytest.mark.parametrize("beams", [1, 3])
def test_one_source_decodes_as_the_full_forward(beams, threads):
    """B = 1 (views of the memory that are not copies: the kernel's buffers must still be
    dense), unpadded, int8 and fp32."""
    int8 = "int8-kernel" if int8_kernel.load() is not None else "int8-torch"
    for model, name, tol in ((tiny("marian"), "torch", 1e-5),
                             (qkv.quantize(tiny("t5"), "int8"), int8, 1e-4)):
        src, keep = sources(1)
        got, seq = drive(model, src, keep, beams, name)
        want = full_forward(model, src, keep, beams, seq)
        torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max(), msg=name)


def test_a_source_of_padding_only_attends_nothing_as_the_modules():
    """A source row whose mask is all False: its cross-attention gives zeros on every path."""
    model = tiny("post_relu")
    src, keep = sources()
    keep[1] = False
    got, _ = drive(model, src, keep, 2, "torch")
    want, _ = drive(model, src, keep, 2, "modules")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max())


def test_explain_names_the_backend_that_runs_and_why_the_others_refuse():
    """With measuring off (the suite's QKV_DECODE_MEASURE=0) the first accepting backend
    runs; ``explain`` names it, the refusals before it, and the stepper runs on it."""
    fp32, int8 = tiny("post_relu"), qkv.quantize(tiny("post_relu"), "int8")
    text = explain(fp32, batch=2, num_beams=4)
    assert "Transformer (encoder-decoder), 2 source(s) x 4 beam(s) = 8 row(s)" in text
    assert "2 decoder layers, width 32, 4 heads of 8, post-norm layernorm" in text
    assert "* torch: runs" in text and "int8-kernel: the weights are not int8" in text
    assert "onednn-packed: " in text and "weights per projection <" in text
    text8 = explain(int8, batch=2, num_beams=4)
    first = "int8-kernel" if int8_kernel.load() is not None else "int8-torch"
    assert f"* {first}: runs" in text8 and "    torch: not tried" in text8
    src, keep = sources(2)
    with torch.inference_mode():
        assert Seq2SeqStepper(int8, src, keep, 1, 4, 4, True).backend == first


def test_explain_shows_the_measured_choice(monkeypatch):
    """With measuring on, the accepting backends are timed: ``explain`` shows the figures,
    the slower one's refusal says so, and ``Seq2SeqStepper`` runs the measured winner."""
    monkeypatch.setenv("QKV_DECODE_MEASURE", "1")
    model = qkv.quantize(tiny("post_relu"), "int8")
    choice = choose_seq2seq(model, 2, 3)
    assert set(choice.measured) == {"int8-kernel", "int8-torch"} - (
        set() if int8_kernel.load() is not None else {"int8-kernel"}) or not choice.measured
    text = explain(model, batch=2, num_beams=3)
    if choice.measured:
        slower = next(n for n in choice.measured if n != choice.backend.name)
        assert f"* {choice.backend.name}: runs (measured: " in text
        assert f"{slower}: measured slower here" in text
    src, keep = sources(2)
    with torch.inference_mode():
        assert Seq2SeqStepper(model, src, keep, 1, 3, 4, True).backend == choice.backend.name


def test_a_model_the_plan_cannot_describe_decodes_on_its_modules_with_its_hooks():
    """A hook on a decoder module (or a wrapped projection, or Shaw positions) has no plan:
    the model decodes through its modules, where the hook runs, with the oracle's tokens."""
    model = tiny("post_relu")
    calls = []
    model.decoder_layers[1].ffn.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(Unplannable, match=r"decoder_layers\.1\.ffn has hooks"):
        seq2seq_plan(model)
    assert "plan: none: decoder_layers.1.ffn has hooks" in explain(model)
    assert "* modules: runs" in explain(model)
    src, keep = sources()
    got = _generate(model, src, keep, 2)
    assert calls and torch.equal(got, _generate(model, src, keep, 2, use_cache=False))

    class Wrapped(nn.Module):  # e.g. an unmerged adapter around a projection
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    wrapped = tiny("post_relu")
    wrapped.decoder_layers[0].self_attn.out_proj = Wrapped(
        wrapped.decoder_layers[0].self_attn.out_proj)
    with pytest.raises(Unplannable, match="self out_proj is a Wrapped"):
        seq2seq_plan(wrapped)
    encoder_hooked = qkv.quantize(tiny("post_relu"), "int8")  # the decoder still has a plan
    encoder_hooked.encoder_layers[0].register_forward_hook(lambda *a: calls.append(2))
    plan = seq2seq_plan(encoder_hooked)
    assert plan.encoder is None and "encoder_layers.0 has hooks" in plan.why_no_encoder
    assert "encoder: modules (encoder_layers.0 has hooks)" in explain(encoder_hooked)
    calls.clear()
    got, seq = drive(encoder_hooked, src, keep, 2, "int8-torch")
    want = full_forward(encoder_hooked, src, keep, 2, seq)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max())
    assert 2 in calls
    with pytest.raises(Unplannable, match="positions 'shaw'"):
        seq2seq_plan(tiny("post_relu", positions="shaw"))
    with pytest.raises(Unplannable, match="dropout is active"):
        seq2seq_plan(tiny("post_relu", dropout=0.1).train())


def test_a_reorder_across_sources_and_a_forced_refusal_are_errors():
    model = tiny("post_relu")
    src, keep = sources()
    with torch.inference_mode():
        st = Seq2SeqStepper(model, src, keep, 1, 2, 4, True, backend="torch")
        st.prefill()
        with pytest.raises(ValueError, match="among its source's 2 beams"):
            st.reorder(torch.tensor([2, 1, 0, 3, 4, 5]))
        with pytest.raises(ValueError, match="cannot decode this model: the weights are "
                                             "not int8"):
            Seq2SeqStepper(model, src, keep, 1, 2, 4, True, backend="int8-torch")
        with pytest.raises(ValueError, match="unknown encoder-decoder decode backend"):
            Seq2SeqStepper(model, src, keep, 1, 2, 4, True, backend="nope")

