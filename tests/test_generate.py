"""qkv.generate: cached == uncached, the decode engine's GPT step == GPT.forward, greedy ==
an independent argmax loop, beam 1 == greedy, top-k 1 == greedy, batch row == alone, HF GPT-2
greedy and beam search give the same tokens, sampling filters == HF's warpers, eos/pad, bad
arguments.

Models are tiny with random weights, redrawn with a large std so that generations are varied
(PyTorch's small default init makes random models repeat one token); fp64 where two qkv paths
are compared, so that rounding cannot flip an argmax.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qkv
from qkv.generation import api, engine, filter_logits, reorder_cache
from qkv.generation.engine import decoder_stepper
from qkv.generation.linears import DenseLinears
from qkv.generation.plan import Unplannable, decode_plan
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig

F64 = torch.float64


def _plannable(model) -> bool:
    """The model has an fp32/fp64 decode plan (``decode_plan`` describes it, not int8)."""
    try:
        return not decode_plan(model).int8
    except Unplannable:
        return False


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Decoding is many tiny ops: with two OpenMP threads on a loaded 2-core machine each op
    waits for a descheduled thread (100x slower); one thread is also what a decode step uses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _spread(model: torch.nn.Module, std: float) -> torch.nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return model.eval()


def _gpt(dtype=F64, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=48, max_len=64, dim=32, num_layers=2, num_heads=4)
    cfg.update(kw)
    return _spread(GPT(GPTConfig(**cfg), dtype=dtype), 0.5)


def _transformer(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(src_vocab_size=40, tgt_vocab_size=40, dim=32, num_encoder_layers=2,
               num_decoder_layers=2, num_heads=4, ffn_hidden=64, dropout=0.0, max_len=64,
               norm_first=True, scale_embeddings=False)
    cfg.update(kw)
    return _spread(Transformer(TransformerConfig(**cfg), dtype=F64), 1.0)


@pytest.fixture(scope="module")
def gpt() -> GPT:
    return _gpt()


@pytest.fixture(scope="module")
def seq2seq() -> Transformer:
    return _transformer()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 7) left-padded prompts and their mask (rows of 7, 4 and 6 real tokens)."""
    torch.manual_seed(2)
    ids = torch.randint(3, 48, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids * mask, mask


def _sources() -> torch.Tensor:
    """(3, 9) right-padded sources (pad_id 0): 9, 6 and 3 real tokens."""
    torch.manual_seed(3)
    src = torch.randint(3, 40, (3, 9))
    src[1, 6:] = 0
    src[2, 3:] = 0
    return src


SEARCHES = [dict(), dict(num_beams=3), dict(num_beams=3, length_penalty=0.5, eos_token_id=3),
            dict(num_beams=4, length_penalty=2.0, eos_token_id=18)]


# --- cached == uncached ---------------------------------------------------------------------
@pytest.mark.parametrize("kw", SEARCHES, ids=["greedy", "beam3", "beam3-lp0.5-eos", "beam4-lp2"])
def test_gpt_cached_equals_uncached(gpt, kw, monkeypatch):
    ids, mask = _prompts()
    fast = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=10, **kw)
    slow = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=10, use_cache=False, **kw)
    ran = []

    def on_modules(*args, **kwargs):  # the generic cached stepper: the "modules" backend
        stepper = engine.decoder_stepper(*args, **{**kwargs, "backend": "modules"})
        ran.append(stepper.backend)
        return stepper

    monkeypatch.setattr(api, "decoder_stepper", on_modules)
    generic = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=10, **kw)
    assert ran == ["modules"]
    assert torch.equal(fast, slow)
    assert torch.equal(generic, slow)
    assert torch.equal(fast[:, :7], ids)


@pytest.mark.parametrize("kw", SEARCHES, ids=["greedy", "beam3", "beam3-lp0.5-eos", "beam4-lp2"])
def test_transformer_cached_equals_uncached(seq2seq, kw):
    src = _sources()
    cached = qkv.generate(seq2seq, src, max_new_tokens=10, **kw)
    uncached = qkv.generate(seq2seq, src, max_new_tokens=10, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    assert (cached[:, 0] == seq2seq.config.bos_id).all()


def test_gpt_subclass_uses_generic_path():
    class MyGPT(GPT):
        pass

    model = _gpt()
    sub = MyGPT(model.config, dtype=F64).eval()
    sub.load_state_dict(model.state_dict())
    assert _plannable(model) and not _plannable(sub)
    ids, mask = _prompts()
    for kw in ({}, {"num_beams": 3}):
        assert torch.equal(qkv.generate(sub, ids, attention_mask=mask, max_new_tokens=8, **kw),
                           qkv.generate(model, ids, attention_mask=mask, max_new_tokens=8, **kw))


_GPT_FIELDS = {f.name for f in dataclasses.fields(GPTConfig)}


@pytest.mark.parametrize("variant", [dict(attention_window=4),
                                     dict(attention_window=3, positions="rope"),
                                     dict(attention="linear"),
                                     dict(attention="linear", feature_map="favor")],
                         ids=["window", "window-rope", "linear-elu", "linear-favor"])
@pytest.mark.parametrize("kw", SEARCHES[:3], ids=["greedy", "beam3", "beam3-lp0.5-eos"])
def test_gpt_variants_cached_equals_uncached(variant, kw):
    """Sliding-window GPTs decode with ring-buffer caches, linear-attention GPTs with a
    recurrent state: the generic stepper (and its beam reordering) must not care."""
    if not set(variant) <= _GPT_FIELDS:
        pytest.skip(f"GPTConfig has no {sorted(set(variant) - _GPT_FIELDS)}")
    model = _gpt(**variant)
    assert not _plannable(model)
    ids, mask = _prompts()
    cached = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=10, **kw)
    uncached = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=10,
                            use_cache=False, **kw)
    assert torch.equal(cached, uncached)


# --- the decode engine's step computes GPT.forward -----------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(positions="rope"), dict(num_kv_heads=2),
                                dict(activation="relu", bias=False, tie_embeddings=False),
                                dict(activation="gelu", norm_eps=1e-6)],
                         ids=["gpt2", "rope", "gqa", "relu-nobias-untied", "gelu"])
@pytest.mark.parametrize("padded", [False, True])
def test_engine_step_logits_equal_forward(kw, padded):
    model = _gpt(**kw)
    assert _plannable(model)
    ids, mask = _prompts()
    keep = mask.bool() if padded else None
    if not padded:
        ids = torch.randint(3, 48, (3, 7))
    new = torch.randint(3, 48, (3, 5))
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + 5)
        got = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(5)]
        full_ids = torch.cat((ids, new), dim=1)
        full_mask = None if keep is None else torch.cat(
            (keep, torch.ones_like(new, dtype=torch.bool)), dim=1)
        want = model(full_ids, attention_mask=full_mask)[:, 6:]  # (3, 6, V)
    torch.testing.assert_close(torch.stack(got, dim=1), want, atol=1e-12, rtol=1e-10)


def test_no_plan_for_dropout_in_training_or_half():
    """Active dropout and fp16 weights have no decode plan (they decode on the modules);
    RMSNorm has one."""
    assert not _plannable(_gpt(dropout=0.1).train())
    assert _plannable(_gpt(dropout=0.1).eval())
    assert _plannable(_gpt(norm="rmsnorm"))
    assert not _plannable(_gpt(dtype=torch.float16))


def test_transposed_weights_are_fresh_copies_of_the_weights_now():
    """Each stepper build copies the weights as they are (nothing kept with the model): two
    builds hold distinct, equal (in, out) copies (``DenseLinears``, the torch backend's), and
    an edit in place, even behind the version counter, is in the next copy and the next
    generate."""
    model = _gpt(dtype=torch.float32)
    ids, mask = _prompts()

    def copies():  # (in, out) copies of every projection (4 per layer) and the LM head
        return DenseLinears(decode_plan(model)).w

    def check():  # fast path == the model's own uncached forward passes
        out = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=6)
        assert torch.equal(out, qkv.generate(model, ids, attention_mask=mask,
                                             max_new_tokens=6, use_cache=False))
        return out

    first = check()
    with torch.inference_mode():
        kept, again = (decoder_stepper(model, ids, mask.bool(), 10, backend="torch").runner.lin.w
                       for _ in range(2))
    assert all(a is not b and a.data_ptr() != b.data_ptr() and torch.equal(a, b)
               for a, b in zip(kept, again, strict=True))
    linears = [m for layer in model.layers for m in (layer.attn.in_proj, layer.attn.out_proj,
                                                     layer.ffn.fc_in, layer.ffn.fc_out)]
    assert all(torch.equal(t, w.t()) for t, w in zip(
        kept, [m.weight for m in linears] + [model.lm_head.weight], strict=True))
    with torch.no_grad():
        model.layers[0].ffn.fc_in.weight.mul_(-1.0)  # in place: version counter
    assert torch.equal(copies()[2], -kept[2])
    assert not torch.equal(check(), first)
    model.lm_head.weight.data[5:9].normal_()  # through .data: no version bump
    assert torch.equal(copies()[-1], model.lm_head.weight.t())
    check()
    model.load_state_dict(_gpt(dtype=torch.float32).state_dict())
    assert torch.equal(check(), first)


# --- equivalences ------------------------------------------------------------------------
def _argmax_loop_gpt(model, ids, steps):  # written without qkv.generate's machinery
    seq = ids.clone()
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(seq)[:, -1].argmax(-1)
        seq = torch.cat((seq, nxt[:, None]), dim=1)
    return seq


def test_greedy_equals_argmax_loop(gpt, seq2seq):
    torch.manual_seed(4)
    ids = torch.randint(3, 48, (2, 5))
    assert torch.equal(qkv.generate(gpt, ids, max_new_tokens=9), _argmax_loop_gpt(gpt, ids, 9))
    src = _sources()
    tgt = torch.full((3, 1), seq2seq.config.bos_id)
    for _ in range(9):
        with torch.no_grad():
            nxt = seq2seq(src, tgt)[:, -1].argmax(-1)
        tgt = torch.cat((tgt, nxt[:, None]), dim=1)
    assert torch.equal(qkv.generate(seq2seq, src, max_new_tokens=9, eos_token_id=None), tgt)


def test_greedy_is_not_trivial(gpt, seq2seq):  # the equivalences above compare varied text
    ids, mask = _prompts()
    out = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=10)[:, 7:]
    assert min(len(set(row.tolist())) for row in out) >= 3
    out = qkv.generate(seq2seq, _sources(), max_new_tokens=10, eos_token_id=None)[:, 1:]
    assert len(set(out.flatten().tolist())) >= 5


def test_beam_one_equals_greedy_and_topk_one_equals_greedy(gpt, seq2seq):
    ids, mask = _prompts()
    greedy = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=8)
    greedy_as_beam = _run_beam_path(gpt, ids, mask)
    assert torch.equal(greedy, greedy_as_beam)
    sampled = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                           top_k=1, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy, sampled)
    src = _sources()
    assert torch.equal(qkv.generate(seq2seq, src, max_new_tokens=8),
                       qkv.generate(seq2seq, src, max_new_tokens=8, do_sample=True, top_k=1))


def _run_beam_path(model, ids, mask):
    """num_beams=1 through the beam-search loop itself (generate sends K=1 to greedy)."""
    from qkv.generation.search import beam_search

    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, mask.bool(), ids.shape[1] + 8)
        new = beam_search(stepper, 3, 1, 8, length_penalty=1.0, eos=None, pad=0,
                          device=ids.device)
    return torch.cat((ids, new), dim=1)


@pytest.mark.parametrize("kw", [dict(), dict(eos_token_id=4), dict(num_beams=3, eos_token_id=3)],
                         ids=["greedy", "greedy-eos", "beam"])
def test_batch_row_equals_alone(gpt, seq2seq, kw):
    ids, mask = _prompts()
    batch = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1, **kw)
    lengths = set()
    for r in range(3):
        real = int(mask[r].sum())
        alone = qkv.generate(gpt, ids[r:r + 1, 7 - real:], max_new_tokens=8, pad_token_id=1,
                             **kw)
        new = alone.shape[1] - real  # this row's new tokens
        lengths.add(new)
        assert torch.equal(batch[r, 7:7 + new], alone[0, real:])
        assert (batch[r, 7 + new:] == 1).all()  # padded after its eos
    if kw:
        assert len(lengths) > 1  # rows really ended at different steps
    src = _sources()
    out = qkv.generate(seq2seq, src, max_new_tokens=8, **kw)
    for r in range(3):
        alone = qkv.generate(seq2seq, src[r:r + 1, src[r] != 0], max_new_tokens=8, **kw)
        assert torch.equal(out[r, :alone.shape[1]], alone[0])
        assert (out[r, alone.shape[1]:] == seq2seq.config.pad_id).all()


# --- against HuggingFace GPT-2 -------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  vocab_size=50, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=3)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    d = tmp_path_factory.mktemp("hf-gpt2")
    hf.save_pretrained(d, safe_serialization=True)
    return hf, GPT.from_hf(d).eval()


@pytest.mark.parametrize("kw", [dict(), dict(num_beams=3), dict(num_beams=3, length_penalty=0.5),
                                dict(num_beams=4, length_penalty=2.0)],
                         ids=["greedy", "beam3", "beam3-lp0.5", "beam4-lp2"])
@pytest.mark.parametrize("eos", [49, 7])
def test_matches_hf_generate(hf_pair, kw, eos):
    hf, model = hf_pair
    torch.manual_seed(5)
    ids = torch.randint(4, 50, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 3)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False,
                           eos_token_id=eos, pad_token_id=3, **kw)
    got = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=15, eos_token_id=eos,
                       pad_token_id=3, **kw)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    if eos == 7:  # these cases end rows early: the eos and stopping rules are exercised
        assert (got[:, 6:] == 7).any()


@pytest.mark.parametrize("top_k, top_p, temperature", [(5, None, 1.0), (None, 0.8, 1.0),
                                                      (7, 0.6, 0.7), (None, 1.0, 2.0)])
def test_filters_equal_hf_warpers(top_k, top_p, temperature):
    lp = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(6)
    logits = torch.randn(4, 50) * 3
    want = logits.clone()
    if temperature != 1.0:
        want = lp.TemperatureLogitsWarper(temperature)(None, want)
    if top_k is not None:
        want = lp.TopKLogitsWarper(top_k)(None, want)
    if top_p is not None:
        want = lp.TopPLogitsWarper(top_p)(None, want)
    got = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


# --- sampling, eos, padding ---------------------------------------------------------------
def test_sampling_is_reproducible_with_a_generator(gpt, seq2seq):
    ids, mask = _prompts()

    def run(seed, model=gpt, **kw):
        return qkv.generate(model, ids if model is gpt else _sources(),
                            attention_mask=mask if model is gpt else None, max_new_tokens=12,
                            do_sample=True, top_p=0.9, temperature=1.3,
                            generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))
    assert torch.equal(run(0, use_cache=False), run(0))
    assert torch.equal(run(3, seq2seq), run(3, seq2seq))
    assert not torch.equal(run(0), qkv.generate(gpt, ids, attention_mask=mask,
                                                max_new_tokens=12))


def test_eos_stops_a_row_and_pads_it(gpt):
    ids, mask = _prompts()
    free = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=10)
    eos = int(free[0, 7 + 2])  # row 0 says it at step 2
    out = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos,
                       pad_token_id=0)
    for r in range(3):
        hits = (free[r, 7:] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else out.shape[1] - 7
        assert torch.equal(out[r, 7:7 + end], free[r, 7:7 + end])
        assert (out[r, 7 + end:] == 0).all()
    assert out[0, 7 + 2] == eos and (out[0, 10:] == 0).all()
    every = qkv.generate(gpt, ids[:1], max_new_tokens=10, eos_token_id=eos)
    assert every.shape == (1, 7 + 3)  # stops once every row ended


def test_transformer_defaults_and_start_token(seq2seq):
    src = _sources()
    free = qkv.generate(seq2seq, src, max_new_tokens=8, eos_token_id=None)
    eos = int(free[0, 1])  # row 0's first new token
    out = qkv.generate(seq2seq, src, max_new_tokens=8, eos_token_id=eos)
    assert out[0, 1] == eos and (out[0, 2:] == seq2seq.config.pad_id).all()
    assert (out[1:] != seq2seq.config.pad_id).any()  # other rows went on
    out = qkv.generate(seq2seq, src, max_new_tokens=6, decoder_start_token_id=5)
    assert (out[:, 0] == 5).all()
    mask = src != 0
    assert torch.equal(qkv.generate(seq2seq, src, attention_mask=mask, max_new_tokens=6),
                       qkv.generate(seq2seq, src, max_new_tokens=6))


def test_result_is_a_normal_tensor(gpt):
    out = qkv.generate(gpt, torch.randint(3, 48, (1, 4)), max_new_tokens=3)
    assert not out.is_inference() and out.dtype == torch.int64
    out[0, 0] = 1  # writable outside inference mode


# --- cache reordering ------------------------------------------------------------------------
def test_reorder_cache_kv_and_refuses_objects_without_reorder():
    cache = qkv.KVCache(3, 2, 8, 4, dtype=F64)
    k = torch.randn(3, 2, 5, 4, dtype=F64)
    with torch.inference_mode():
        cache.append(k, k + 1)
        idx = torch.tensor([2, 2, 0])
        reorder_cache([cache], idx)
        torch.testing.assert_close(cache.get()[0], k[idx], rtol=0, atol=0)
        torch.testing.assert_close(cache.get()[1], k[idx] + 1, rtol=0, atol=0)

    class State:  # a custom cache without reorder(): refused, not reordered by guessed sizes
        def __init__(self):
            self.state = qkv.LinearState(torch.arange(3.0)[:, None], torch.arange(3.0), None)

    s = State()
    with pytest.raises(TypeError, match=r"reorder\(idx\)"):
        reorder_cache(s, torch.tensor([1, 0, 0]))
    assert s.state.z.tolist() == [0.0, 1.0, 2.0]  # untouched


# --- bad arguments -------------------------------------------------------------------------
@pytest.mark.parametrize("kw, err, match", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(num_beams=0), ValueError, "num_beams"),
    (dict(num_beams=2, do_sample=True), ValueError, "do_sample"),
    (dict(do_sample=True, top_p=0.0), ValueError, "top_p"),
    (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
    (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
    (dict(do_sample=True, top_k=0), ValueError, "top_k"),
    (dict(temperature=0.5), ValueError, "do_sample=True"),
    (dict(do_sample=1), TypeError, "do_sample"),
    (dict(generator=3), TypeError, "generator"),
    (dict(eos_token_id=48), ValueError, "eos_token_id"),
    (dict(decoder_start_token_id=1), ValueError, "decoder_start_token_id"),
    (dict(length_penalty=float("nan")), ValueError, "length_penalty"),
    (dict(max_new_tokens=70), ValueError, "max_len"),
])
def test_bad_arguments_raise(gpt, kw, err, match):
    args = dict(max_new_tokens=4)
    args.update(kw)
    with pytest.raises(err, match=match):
        qkv.generate(gpt, torch.randint(3, 48, (2, 5)), **args)


def test_bad_inputs_raise(gpt, seq2seq):
    ids = torch.randint(3, 48, (2, 5))
    with pytest.raises(ValueError, match="input_ids"):
        qkv.generate(gpt, ids.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids"):
        qkv.generate(gpt, ids[0], max_new_tokens=2)
    right = torch.ones(2, 5, dtype=torch.long)
    right[0, 3:] = 0
    with pytest.raises(ValueError, match="left"):
        qkv.generate(gpt, ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match="no real token"):
        qkv.generate(gpt, ids, attention_mask=torch.zeros(2, 5, dtype=torch.long),
                      max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask"):
        qkv.generate(gpt, ids, attention_mask=torch.ones(2, 4), max_new_tokens=2)
    with pytest.raises(TypeError, match="model"):
        qkv.generate(torch.nn.Linear(2, 2), ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_len"):
        qkv.generate(seq2seq, _sources(), max_new_tokens=65)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_several_stop_tokens_end_a_row_at_the_first_one_met(gpt, num_beams):
    """eos_token_id=[a, b]: a row ends at whichever it produces first, exactly as with the
    single id it met (the other id never produced)."""
    ids = torch.tensor([[5, 6, 7]])
    free = qkv.generate(gpt, ids, max_new_tokens=8, num_beams=num_beams)[0, 3:].tolist()
    stop = next(t for i, t in enumerate(free) if i >= 1 and t not in free[:i])
    unused = next(t for t in range(gpt.config.vocab_size) if t not in free)
    both = qkv.generate(gpt, ids, max_new_tokens=8, num_beams=num_beams,
                        eos_token_id=[unused, stop], pad_token_id=0)
    single = qkv.generate(gpt, ids, max_new_tokens=8, num_beams=num_beams, eos_token_id=stop,
                          pad_token_id=0)
    assert torch.equal(both, single)
    cut = free.index(stop) + 1
    if num_beams == 1:
        assert both[0, 3:3 + cut].tolist() == free[:cut] and both.shape[1] == 3 + cut


@pytest.mark.parametrize("bad", [[], "2", [1.0], True])
def test_bad_stop_tokens_are_refused(gpt, bad):
    with pytest.raises(TypeError, match="eos_token_id"):
        qkv.generate(gpt, torch.tensor([[5, 6]]), max_new_tokens=2, eos_token_id=bad)
