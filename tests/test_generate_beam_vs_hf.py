"""qkv.generate's beam search == HF transformers' ``GPT2LMHeadModel.generate`` on many random
cases, token for token.

The oracle is code nobody here wrote: a GPT-2 with random weights, built by transformers from
a tiny config, saved with ``save_pretrained`` and loaded into qkv with ``GPT.from_hf``. Each
case draws (seeded) a batch of 1-8 left-padded prompts of 1-6 tokens, K = 2-4 beams, a
length penalty in {-1, 0, 0.5, 1, 2}, max_new_tokens 1-10, and stop tokens taken from what
an unconstrained beam search of that case generates (so that hypotheses finish early, at
different steps): one of its tokens, or its 2-4 most frequent ones. HF's ``early_stopping``
stays at its default False, the only rule qkv implements.

What this catches that the fixed-prompt comparison in test_generate.py does not: which of the
top candidates may become finished hypotheses (HF: only the first K), how many candidates
are kept with several stop tokens (HF: max(2, 1 + E)·K), the stopping heuristic with
negative, zero and large length penalties, hypotheses of different lengths across a batch.
Planted in qkv.generation.search, "finished hypotheses from all 2K candidates" fails 26 of
the 200 random cases and "2K candidates whatever the number of stop tokens" (qkv's old
behaviour) 1 of them and 5 of the 80 several-stop-token cases.

Exact token equality: both sides compute log-softmax in fp32 from the same fp32 weights; the
random weights (std 0.5) make the distributions peaked enough that no two candidates tie.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import qkv
from qkv.models import GPT

VOCAB, PAD = 24, 3
CASES = 200
STOP_CASES = 80
LENGTH_PENALTIES = (-1.0, 0.0, 0.5, 1.0, 2.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF GPT2LMHeadModel, the same weights as a qkv GPT), eval mode, one thread."""
    transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is fastest and deterministic
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                  vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=PAD)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    d = tmp_path_factory.mktemp("hf-gpt2-beams")
    hf.save_pretrained(d, safe_serialization=True)
    yield hf, GPT.from_hf(d).eval()
    torch.set_num_threads(threads)


def _case(model: GPT, i: int, *, several_stops: bool) -> tuple[torch.Tensor, dict]:
    """Case ``i``: prompts (B, N) left-padded with PAD, and generate's keyword arguments.
    ``several_stops``: 2-4 stop tokens and a positive length penalty (the search goes on
    while several stop tokens crowd the top candidates), 8 prompts."""
    rng = random.Random(1000 + i + (10**6 if several_stops else 0))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    b, n = (8 if several_stops else rng.randint(1, 8)), rng.randint(1, 6)
    ids = torch.randint(4, VOCAB, (b, n), generator=gen)
    mask = torch.ones_like(ids)
    for r in range(b):
        mask[r, :rng.randint(0, n - 1)] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    penalties = LENGTH_PENALTIES[2:] if several_stops else LENGTH_PENALTIES
    kw = dict(attention_mask=mask, num_beams=rng.randint(2, 4),
              max_new_tokens=rng.randint(3 if several_stops else 1, 10),
              length_penalty=rng.choice(penalties), pad_token_id=PAD)
    # stop tokens the search really meets, from an unconstrained run of this case: one of its
    # tokens, or its 2-4 most frequent ones
    free = qkv.generate(model, ids, **kw)[:, n:].flatten().tolist()
    if several_stops or rng.random() < 0.5:
        kw["eos_token_id"] = [t for t, _ in Counter(free).most_common(rng.randint(2, 4))]
    else:
        kw["eos_token_id"] = rng.choice(free)
    return ids, kw


def _compare(pair, cases: int, *, several_stops: bool) -> tuple[list, int]:
    """Run ``cases`` cases through both; returns (the differing cases, how many of HF's
    outputs ended before max_new_tokens)."""
    hf, model = pair
    failures, finished_early = [], 0
    for i in range(cases):
        ids, kw = _case(model, i, several_stops=several_stops)
        with torch.no_grad():
            want = hf.generate(ids, do_sample=False, **kw)
        got = qkv.generate(model, ids, **kw)
        if got.shape != want.shape or not torch.equal(got, want):
            failures.append((i, {k: v for k, v in kw.items() if k != "attention_mask"},
                             got.tolist(), want.tolist()))
        finished_early += want.shape[1] < ids.shape[1] + kw["max_new_tokens"]
    return failures, finished_early


def test_beam_search_equals_hf_generate_on_random_cases(pair):
    failures, finished_early = _compare(pair, CASES, several_stops=False)
    assert not failures, f"{len(failures)}/{CASES} cases differ from HF; first: {failures[:3]}"
    # the cases exercise early finishing, not just full-length hypotheses
    assert finished_early >= CASES // 5, finished_early


def test_several_stop_tokens_equal_hf_generate(pair):
    """With E stop tokens HF keeps max(2, 1 + E)·K candidates a step, so that K beams can
    go on even when more than K of the best candidates end; keeping 2K loses beams."""
    failures, _ = _compare(pair, STOP_CASES, several_stops=True)
    assert not failures, (f"{len(failures)}/{STOP_CASES} cases differ from HF; first: "
                          f"{failures[:3]}")
