"""qkv.generate's logits processors (no_repeat_ngram_size, bad_words_ids, min_length,
min_new_tokens, forced_bos/eos_token_id, renormalize_logits) and beam search's
early_stopping == HF transformers' ``generate``, token for token.

The oracle is code nobody here wrote: a GPT-2 with random weights built by transformers from
a tiny config, saved with ``save_pretrained`` and loaded into qkv with ``GPT.from_hf``; greedy
decoding, sampling (the same seed: HF draws from the global generator, qkv from a
``torch.Generator`` seeded alike) and 4-beam search of a batch of 3 left-padded prompts.
The processors themselves are also compared with HF's processor classes on random scores.

Exact equality: both sides compute in fp32 from the same fp32 weights; the random weights
(std 0.5, the tied head included) make the distributions peaked enough that no two
candidates tie. Each case also checks that its processors change HF's output (where the case
is not a stated no-op), so that a processor qkv ignored would fail it.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

import qkv
from qkv.generation.processors import make_processors
from qkv.models import GPT, Transformer, TransformerConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Unfeasible length constraints")

VOCAB, PAD, N, T = 32, 3, 5, 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF GPT2LMHeadModel, the same weights as a qkv GPT), eval mode, one thread; HF's own
    generation_config has no stop token, so that each case's ``eos_token_id`` is the only
    one on both sides."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is fastest and deterministic
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                  vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=PAD)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    d = tmp_path_factory.mktemp("hf-gpt2-processors")
    hf.save_pretrained(d, safe_serialization=True)
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.save_pretrained(d)  # qkv's model reads the same settings
    yield hf, GPT.from_hf(d).eval()
    torch.set_num_threads(threads)


def _prompts(width: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    """3 prompts (3, width), left-padded with PAD (rows of width, width - 2, width - 4 real
    tokens where width allows), and their mask."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(4, VOCAB, (3, width), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 4)):
        mask[row, :min(pad, width - 1)] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _both(pair, ids, mask, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv's output, HF's) for the same arguments (greedy/beams unless do_sample)."""
    hf, model = pair
    kw = dict(attention_mask=mask, max_new_tokens=T, pad_token_id=PAD, **kw)
    sample = kw.get("do_sample", False)
    if sample:
        torch.manual_seed(1234)
    with torch.no_grad():
        want = hf.generate(ids, **({"do_sample": False} if not sample else {}), **kw)
    if sample:
        kw["generator"] = torch.Generator().manual_seed(1234)
    return qkv.generate(model, ids, **kw), want


def _assert_equal(got, want, kw) -> None:
    assert got.shape == want.shape and torch.equal(got, want), (
        f"{kw}: qkv {got[:, -T:].tolist()} != HF {want[:, -T:].tolist()}")


@pytest.fixture(scope="module")
def frequent(pair):
    """The new tokens of the unconstrained greedy and 4-beam runs, most frequent first (to
    pick stop tokens and banned words the searches really meet), and the greedy tokens."""
    ids, mask = _prompts()
    greedy = _both(pair, ids, mask)[1][:, N:]
    beams = _both(pair, ids, mask, num_beams=4)[1][:, N:]
    counts = Counter(greedy.flatten().tolist()) + Counter(beams.flatten().tolist())
    return [t for t, _ in counts.most_common()], greedy


def _cases(frequent) -> list[tuple[str, dict, bool]]:
    """(name, generate's processor arguments, whether they may leave the output unchanged)."""
    top, greedy = frequent
    row = greedy[0].tolist()
    bigram, trigram = row[2:4], row[5:8]
    prompt_pair = _prompts()[0][0, 1:3].tolist()  # a bigram of the first prompt
    stop = top[0]
    return [
        ("ngram-1", dict(no_repeat_ngram_size=1), False),
        ("ngram-2", dict(no_repeat_ngram_size=2), False),
        ("ngram-3", dict(no_repeat_ngram_size=3), False),
        ("ngram-2-eos", dict(no_repeat_ngram_size=2, eos_token_id=stop), False),
        ("bad-single", dict(bad_words_ids=[[top[1]]]), False),
        ("bad-multi", dict(bad_words_ids=[bigram, trigram]), False),
        ("bad-single-multi", dict(bad_words_ids=[[top[2]], bigram, trigram, prompt_pair]),
         False),
        ("bad-eos-dropped", dict(bad_words_ids=[[stop], [top[1]]], eos_token_id=stop), False),
        ("forced-bos-padded-noop", dict(forced_bos_token_id=top[3]), True),
        ("forced-eos", dict(forced_eos_token_id=top[4]), False),
        ("forced-eos-list", dict(forced_eos_token_id=[top[4], 2], eos_token_id=[2, stop]),
         False),
        ("min-length", dict(min_length=N + 8, eos_token_id=[stop, top[1]]), False),
        ("min-new-tokens", dict(min_new_tokens=6, eos_token_id=[stop, top[1]]), False),
        ("min-new-tokens-precedence", dict(min_length=N + 11, min_new_tokens=3,
                                           eos_token_id=stop), False),
        ("min-length-no-eos-noop", dict(min_length=N + 8), True),
        ("renormalize-noop", dict(renormalize_logits=True), True),
        ("renormalize-min-new", dict(renormalize_logits=True, min_new_tokens=8,
                                     eos_token_id=[stop, top[1]]), False),
        ("renormalize-bad", dict(renormalize_logits=True, bad_words_ids=[[top[1]], bigram]),
         False),
        ("all", dict(no_repeat_ngram_size=2, bad_words_ids=[[top[2]], bigram],
                     min_new_tokens=3, forced_eos_token_id=top[4], renormalize_logits=True,
                     eos_token_id=[stop, top[1]]), False),
    ]


def test_each_processor_equals_hf_greedy_and_beams(pair, frequent):
    """Greedy and 4-beam search, each processor alone and together, batch 3 left-padded."""
    ids, mask = _prompts()
    for name, kw, may_be_noop in _cases(frequent):
        changed = False
        for beams in (1, 4):
            got, want = _both(pair, ids, mask, num_beams=beams, **kw)
            _assert_equal(got, want, {"case": name, "num_beams": beams, **kw})
            plain = {k: v for k, v in kw.items() if k == "eos_token_id"}
            free = _both(pair, ids, mask, num_beams=beams, **plain)[1]
            changed |= free.shape != want.shape or not torch.equal(free, want)
        assert changed or may_be_noop, f"{name}: {kw} does not change HF's output"


def test_forced_bos_after_a_one_token_prompt(pair, frequent):
    """HF forces the bos token when the tokens so far number 1: a decoder-only model's first
    new token only after a one-token prompt (with a longer one it is a no-op, above)."""
    top, _ = frequent
    ids = torch.tensor([[5], [9], [17]])
    for beams in (1, 4):
        got, want = _both(pair, ids, torch.ones_like(ids), num_beams=beams,
                          forced_bos_token_id=top[3], no_repeat_ngram_size=2)
        _assert_equal(got, want, {"num_beams": beams})
        assert (got[:, 1] == top[3]).all()


def test_early_stopping_equals_hf(pair, frequent):
    """early_stopping True / False / "never" on 30 seeded random cases (8 prompts, 2-4
    beams, 4-12 new tokens, a length penalty in {-1, 0, 1, 2}, 1-3 stop tokens the beams
    meet); True and "never" must each change HF's output (vs False) in some of them."""
    top, _ = frequent
    failures, differ = [], Counter()
    for i in range(30):
        rng = random.Random(900 + i)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        width = rng.randint(1, 6)
        ids = torch.randint(4, VOCAB, (8, width), generator=gen)
        mask = torch.ones_like(ids)
        for r in range(8):
            mask[r, :rng.randint(0, width - 1)] = 0
        ids = ids.masked_fill(mask == 0, PAD)
        kw = dict(num_beams=rng.randint(2, 4), length_penalty=rng.choice([-1.0, 0.0, 1.0, 2.0]),
                  eos_token_id=rng.sample(top[:4], rng.randint(1, 3)))
        new = rng.randint(4, T)
        outs = {}
        for early in (False, True, "never"):
            got, outs[early] = _both_t(pair, ids, mask, new, early_stopping=early, **kw)
            if got.shape != outs[early].shape or not torch.equal(got, outs[early]):
                failures.append((i, early, kw))
        for early in (True, "never"):
            differ[early] += (outs[early].shape != outs[False].shape
                              or not torch.equal(outs[early], outs[False]))
    assert not failures, f"{len(failures)} cases differ from HF; first: {failures[:3]}"
    assert differ[True] and differ["never"], differ


def test_random_combinations_equal_hf(pair, frequent):
    """40 seeded random cases: 1-4 beams (1 = greedy), 1-12 new tokens, a random subset of
    the processors, stop tokens, early_stopping and length penalty."""
    top, greedy = frequent
    ids, mask = _prompts()
    failures = []
    for i in range(40):
        rng = random.Random(500 + i)
        kw: dict = dict(num_beams=rng.choice([1, 1, 2, 3, 4]))
        if kw["num_beams"] > 1:
            kw.update(early_stopping=rng.choice([False, True, "never"]),
                      length_penalty=rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0]))
        if rng.random() < 0.7:
            kw["eos_token_id"] = rng.sample(top[:6], rng.randint(1, 3))
        if rng.random() < 0.5:
            kw["no_repeat_ngram_size"] = rng.randint(1, 4)
        if rng.random() < 0.5:
            row = greedy[rng.randrange(3)].tolist()
            at = rng.randrange(T - 3)
            kw["bad_words_ids"] = [[rng.choice(top[:8])], row[at:at + rng.randint(2, 3)]]
        if rng.random() < 0.4:
            kw[rng.choice(["min_length", "min_new_tokens"])] = rng.randint(0, N + T)
        if rng.random() < 0.3:
            kw["forced_eos_token_id"] = rng.choice(top[:8])
        kw["renormalize_logits"] = rng.random() < 0.5
        got, want = _both_t(pair, ids, mask, rng.randint(1, T), **kw)
        if got.shape != want.shape or not torch.equal(got, want):
            failures.append((i, kw, got[:, N:].tolist(), want[:, N:].tolist()))
    assert not failures, f"{len(failures)}/40 differ from HF; first: {failures[:2]}"


def _both_t(pair, ids, mask, new, **kw):
    """``_both`` with ``new`` new tokens."""
    hf, model = pair
    kw = dict(attention_mask=mask, max_new_tokens=new, pad_token_id=PAD, **kw)
    with torch.no_grad():
        want = hf.generate(ids, do_sample=False, **kw)
    return qkv.generate(model, ids, **kw), want


@pytest.mark.parametrize("kw", [
    dict(no_repeat_ngram_size=2, renormalize_logits=True),
    dict(top_k=6, temperature=0.7, bad_words_ids=[[11], [6, 6]], renormalize_logits=True),
    dict(top_p=0.8, min_new_tokens=5, eos_token_id=[11, 6], forced_eos_token_id=2),
])
def test_sampling_with_processors_equals_hf(pair, kw):
    """Sampling: processors, then temperature / top-k / top-p, then the log-softmax, then
    one draw per row from the same seed: HF's tokens."""
    ids, mask = _prompts()
    got, want = _both(pair, ids, mask, do_sample=True, **kw)
    _assert_equal(got, want, kw)


def test_processors_equal_hf_processor_classes():
    """``LogitsProcessors.apply`` + ``normalize`` == HF's processor list in HF's order on
    random fp32 scores and token histories (a vocabulary of 6 so that n-grams and bad-word
    prefixes repeat), at every length, exactly."""
    lp = transformers.generation.logits_process
    gen = torch.Generator().manual_seed(3)
    rows, vocab, prefix, new = 5, 6, 3, 7
    words = [[4], [1, 2], [2, 2, 0], [5, 1]]
    for ngram in (1, 2, 3):
        ours = make_processors(vocab=vocab, prefix_length=prefix, max_new_tokens=new,
                               eos=(0, 3), device=torch.device("cpu"),
                               no_repeat_ngram_size=ngram, bad_words_ids=words, min_length=6,
                               forced_bos_token_id=2, forced_eos_token_id=[3, 5],
                               renormalize_logits=True)
        theirs = lp.LogitsProcessorList([
            lp.NoRepeatNGramLogitsProcessor(ngram), lp.NoBadWordsLogitsProcessor(words, [0, 3]),
            lp.MinLengthLogitsProcessor(6, [0, 3]), lp.ForcedBOSTokenLogitsProcessor(2),
            lp.ForcedEOSTokenLogitsProcessor(prefix + new, [3, 5]), lp.LogitNormalization()])
        for length in range(1, prefix + new):
            tokens = torch.randint(0, vocab, (rows, length), generator=gen)
            scores = torch.randn(rows, vocab, generator=gen)
            got = ours.normalize(ours.apply(tokens, length, scores))
            want = theirs(tokens, scores.clone())
            # bit for bit (rows where every token is banned are NaN on both sides)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, n=ngram, k=length: f"n={n} L={k}: {m}")


def test_encoder_decoder_processors_see_the_start_token():
    """A qkv Transformer (no HF oracle here: the HF encoder-decoder families are tested with
    their mappings): the processors' rules hold on [start] + new tokens, cached or not."""
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, dim=16, num_heads=2,
                            num_encoder_layers=1, num_decoder_layers=1, ffn_hidden=32,
                            max_len=32, pad_id=0, bos_id=1, eos_id=2)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.7)
    src = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    kw = dict(max_new_tokens=10, no_repeat_ngram_size=2, bad_words_ids=[[7], [4, 5]],
              forced_bos_token_id=13, min_new_tokens=4, forced_eos_token_id=2)
    for beams in (1, 3):
        out = qkv.generate(model, src, num_beams=beams, **kw)
        assert torch.equal(out, qkv.generate(model, src, num_beams=beams, use_cache=False,
                                             **kw))
        assert (out[:, 1] == 13).all()
        for row in out.tolist():
            new = row[1:]
            assert 2 in new, row  # forced at the last step if not before
            end = new.index(2) + 1
            assert end >= 5, row  # min_new_tokens=4: eos 5th at the earliest
            assert 7 not in new[:end]
            seq = row[:1 + end]
            grams = list(itertools.pairwise(seq))
            assert len(grams) == len(set(grams)), row
            assert (4, 5) not in grams, row


@pytest.mark.parametrize("kw, message", [
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an int >= 0"),
    (dict(min_length=1.5), "min_length must be an int >= 0"),
    (dict(bad_words_ids=[]), "bad_words_ids must be a non-empty list"),
    (dict(bad_words_ids=[[1, -2]]), "bad_words_ids must be a non-empty list"),
    (dict(bad_words_ids=[[5, VOCAB]]), f"token id {VOCAB}, outside the vocabulary"),
    (dict(forced_bos_token_id=VOCAB), "forced_bos_token_id must be a token id in"),
    (dict(forced_eos_token_id=[]), "forced_eos_token_id must be a token id, a non-empty"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or \"never\""),
    (dict(prompt_lookup_num_tokens=3, no_repeat_ngram_size=2),
     "prompt_lookup_num_tokens verifies drafts against the model's unprocessed"),
    (dict(prompt_lookup_num_tokens=3, renormalize_logits=True),
     "cannot be combined with logits processors (renormalize_logits=True)"),
])
def test_bad_processor_arguments_are_refused(pair, kw, message):
    _, model = pair
    ids, mask = _prompts()
    with pytest.raises(ValueError) as err:
        qkv.generate(model, ids, attention_mask=mask, max_new_tokens=4, **kw)
    assert message in str(err.value)


def test_draft_model_refuses_processors(pair):
    _, model = pair
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="draft_model verifies drafts"):
        qkv.generate(model, ids, attention_mask=mask, max_new_tokens=4, draft_model=model,
                     bad_words_ids=[[5]])
    with pytest.raises(TypeError, match="renormalize_logits must be a bool"):
        qkv.generate(model, ids, attention_mask=mask, max_new_tokens=4, renormalize_logits=1)
