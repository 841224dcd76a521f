"""Prompt-lookup decoding (``qkv.generate(..., prompt_lookup_num_tokens=k)``) returns greedy's
tokens, token for token: against qkv's uncached greedy (the model's full forward each step),
qkv's cached greedy, and HF GPT-2's greedy ``generate`` (batched, left-padded) and HF's own
prompt lookup (batch 1); GPT (the decode engine's plan, and its generic "modules" backend)
and the encoder-decoder; k = 1, 3, 10; a stop token inside an accepted draft; rows that accept
different numbers of draft tokens; prompts with and without matches. The n-gram index against
a brute-force search.

Models are tiny with random weights redrawn with a large std, fp64 where two qkv paths are
compared. Random models rarely repeat themselves, and a batch advances only as far as its
worst row's draft, so the "loopy" GPT also scales its attention outputs and positions by 0.02:
its greedy text falls into short cycles (drafts from it get accepted in every row) while the
attention still changes most of its tokens (so a cache rolled back wrongly changes them).
Each test that relies on drafts being accepted asserts that they were (``stats``).
"""

from __future__ import annotations

import random

import pytest
import torch

import qkv
from qkv.generation import api, engine, prompt_lookup
from qkv.generation.prompt_lookup import NgramIndex
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
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


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=48, max_len=96, dim=32, num_layers=2, num_heads=4)
    cfg.update(kw)
    return _spread(GPT(GPTConfig(**cfg), dtype=F64), 0.5)


def _loopy(model: GPT) -> GPT:
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.out_proj.weight.mul_(0.02)
        model.positions.weight.mul_(0.02)
    return model


@pytest.fixture(scope="module")
def gpt() -> GPT:
    return _loopy(_gpt())


@pytest.fixture(scope="module")
def random_gpt() -> GPT:
    return _gpt()


@pytest.fixture(scope="module")
def seq2seq() -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, dim=32, num_encoder_layers=2,
                            num_decoder_layers=2, num_heads=4, ffn_hidden=64, dropout=0.0,
                            max_len=96, norm_first=True, scale_embeddings=False)
    return _spread(Transformer(cfg, dtype=F64), 1.0)


def _stop_token(free: torch.Tensor, rows: int = 2) -> int:
    """A token that ``rows`` rows of ``free`` (R, T) produce, first at different steps, not
    the first two (so that, as eos, it ends them early and at different steps)."""
    for tok in free[:, 2:].flatten().tolist():
        firsts = {row.tolist().index(tok) for row in free if tok in row.tolist()}
        if len(firsts) >= rows and min(firsts) >= 2:
            return tok
    raise AssertionError(f"no stop token found in {free}")


def _prompts(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, 9) left-padded prompts (9, 5, 8 and 2 real tokens) and their mask."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 48, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    mask[3, :7] = 0
    return ids * mask, mask


def _sources() -> torch.Tensor:
    """(3, 9) right-padded sources (pad_id 0): 9, 6 and 3 real tokens."""
    torch.manual_seed(3)
    src = torch.randint(3, 40, (3, 9))
    src[1, 6:] = 0
    src[2, 3:] = 0
    return src


@pytest.fixture
def stats(monkeypatch) -> dict:
    """The stats of the last prompt-lookup run (forward passes, drafts, blocks)."""
    box: dict = {}
    real = prompt_lookup.prompt_lookup_greedy

    def spy(*args, **kw):
        return real(*args, stats=box, **kw)

    monkeypatch.setattr(api, "prompt_lookup_greedy", spy)
    return box


# --- == greedy ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("kind", ["loopy", "random"])
def test_gpt_equals_greedy(gpt, random_gpt, kind, k, eos, path, stats, monkeypatch):
    gpt = gpt if kind == "loopy" else random_gpt
    ids, mask = _prompts()
    eos = _stop_token(qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30)[:, 9:]) \
        if eos else None
    want = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                        pad_token_id=1, use_cache=False)
    plain = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                         pad_token_id=1)
    if path == "generic":  # the model's own modules and caches
        def on_modules(*args, **kwargs):
            return engine.decoder_stepper(*args, **{**kwargs, "backend": "modules"})

        monkeypatch.setattr(api, "decoder_stepper", on_modules)
    got = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                       pad_token_id=1, prompt_lookup_num_tokens=k)
    assert torch.equal(plain, want)
    assert got.shape == want.shape and torch.equal(got, want)
    assert stats["drafted"] > 0  # drafts were verified (and rolled back when rejected)
    if kind == "loopy":  # ... and accepted: fewer forward passes than tokens
        assert stats["accepted"] > 0 and stats["passes"] < got.shape[1] - 9 - 1
    if eos is not None:
        assert (want[:, 9:] == 1).any(dim=1).sum() >= 2  # rows ended early (padded after)


def test_rows_accept_different_numbers_of_tokens(gpt, stats):
    """A batch advances by the fewest tokens any running row got right; rows that got more
    right recompute them. The blocks show that rows really disagreed."""
    ids, mask = _prompts()
    want = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30, use_cache=False)
    got = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30,
                       prompt_lookup_num_tokens=5)
    assert torch.equal(got, want)
    assert any(len({h for h in hits if h >= 0}) > 1 for _, _, _, hits in stats["blocks"])
    for r in range(4):  # each row == the row decoded alone, without padding
        real = int(mask[r].sum())
        alone = qkv.generate(gpt, ids[r:r + 1, 9 - real:], max_new_tokens=30,
                             prompt_lookup_num_tokens=5)
        assert torch.equal(alone[0, real:], got[r, 9:])


def test_without_matches_is_plain_greedy(gpt, stats):
    """Distinct prompt tokens and one new token past the first: nothing to look up."""
    ids = torch.arange(3, 13)[None]  # (1, 10), no repeated n-gram
    got = qkv.generate(gpt, ids, max_new_tokens=2, prompt_lookup_num_tokens=4)
    assert torch.equal(got, qkv.generate(gpt, ids, max_new_tokens=2, use_cache=False))
    assert stats["drafted"] == 0 and stats["passes"] == 1


def _eos_inside_a_draft(stats: dict, out: torch.Tensor, first: int) -> tuple[int, int]:
    """(row, token) of a token that was accepted from inside a draft (not the block's
    first token) and occurs there for the first time in its row."""
    for start, _d, m, hits in stats["blocks"]:
        for r, h in enumerate(hits):
            for j in range(1, min(m, h + 1)):  # an accepted draft token of row r
                pos = start + j
                tok = int(out[r, first + pos])
                if tok not in out[r, first:first + pos].tolist():
                    return r, tok
    raise AssertionError("no draft token was accepted")


def test_gpt_eos_inside_a_draft(gpt, stats):
    ids, mask = _prompts()
    free = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30,
                        prompt_lookup_num_tokens=10)
    row, eos = _eos_inside_a_draft(stats, free, 9)
    want = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                        pad_token_id=0, use_cache=False)
    got = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos,
                       pad_token_id=0, prompt_lookup_num_tokens=10)
    assert torch.equal(got, want)
    stop = free[row, 9:].tolist().index(eos)
    assert (got[row, 9 + stop + 1:] == 0).all() and got[row, 9 + stop] == eos


@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("eos", [None, "default"])
def test_seq2seq_equals_greedy(seq2seq, k, eos, stats):
    src = _sources()
    kw = {} if eos == "default" else {"eos_token_id": None}
    want = qkv.generate(seq2seq, src, max_new_tokens=30, use_cache=False, **kw)
    got = qkv.generate(seq2seq, src, max_new_tokens=30, prompt_lookup_num_tokens=k, **kw)
    assert got.shape == want.shape and torch.equal(got, want)
    assert stats["accepted"] > 0
    uncached = qkv.generate(seq2seq, src, max_new_tokens=30, prompt_lookup_num_tokens=k,
                            use_cache=False, **kw)
    assert torch.equal(uncached, want)


def test_seq2seq_copy_from_the_source_and_eos_inside_a_draft(seq2seq, stats):
    """Sources that hold the model's own output: drafts come from the source."""
    src = _sources()
    out = qkv.generate(seq2seq, src, max_new_tokens=10, eos_token_id=None)[:, 1:]  # (3, 10)
    copy = torch.cat((out, src[:, :4]), dim=1)  # (3, 14), no padding
    free = qkv.generate(seq2seq, copy, max_new_tokens=20, eos_token_id=None,
                        prompt_lookup_num_tokens=10)
    assert torch.equal(free, qkv.generate(seq2seq, copy, max_new_tokens=20, eos_token_id=None,
                                          use_cache=False))
    assert stats["accepted"] > 0
    row, eos = _eos_inside_a_draft(stats, free, 1)
    want = qkv.generate(seq2seq, copy, max_new_tokens=20, eos_token_id=eos, use_cache=False)
    got = qkv.generate(seq2seq, copy, max_new_tokens=20, eos_token_id=eos,
                       prompt_lookup_num_tokens=10)
    assert torch.equal(got, want)
    assert (got[row, 1:] == eos).any()


# --- against HuggingFace ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=96,
                                  vocab_size=50, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=3)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
        for block in hf.transformer.h:  # loopy, as the qkv GPT above
            block.attn.c_proj.weight.mul_(0.02)
        hf.transformer.wpe.weight.mul_(0.02)
    d = tmp_path_factory.mktemp("hf-gpt2")
    hf.save_pretrained(d, safe_serialization=True)
    return hf, GPT.from_hf(d).eval()


@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_matches_hf_greedy_batched(hf_pair, k, eos, stats):
    hf, model = hf_pair
    torch.manual_seed(5)
    ids = torch.randint(4, 50, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 3)
    free = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=25)[:, 6:]
    eos = _stop_token(free, rows=1) if eos else 49
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False,
                           eos_token_id=eos, pad_token_id=3)
    got = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=25, eos_token_id=eos,
                       pad_token_id=3, prompt_lookup_num_tokens=k)
    assert got.shape == want.shape and torch.equal(got, want)
    assert stats["accepted"] > 0


def test_matches_hf_prompt_lookup_batch_one(hf_pair):
    hf, model = hf_pair
    ids = torch.tensor([[5, 8, 13, 21, 34, 8, 13, 40, 5, 8]])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=25,
                           do_sample=False, eos_token_id=None, pad_token_id=3,
                           prompt_lookup_num_tokens=4)
    got = qkv.generate(model, ids, max_new_tokens=25, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)


# --- the n-gram index ---------------------------------------------------------------------
def _brute_draft(segments: list[list[int]], ngram: int, k: int, stops: set[int]) -> list[int]:
    """The latest earlier occurrence (within the last segment or an earlier one, never
    spanning two) of the longest matching suffix n-gram; what followed it."""
    flat, seg_of = [], []
    for i, seg in enumerate(segments):
        flat += seg
        seg_of += [i] * len(seg)
    p = len(flat)
    for n in range(ngram, 0, -1):
        if n > len(segments[-1]):
            continue
        suffix = flat[p - n:]
        for i in range(p - n - 1, -1, -1):  # occurrence at i..i+n-1, followed by i+n < p
            if flat[i:i + n] == suffix and seg_of[i] == seg_of[i + n - 1] == seg_of[i + n]:
                out = flat[i + n:i + n + k]
                cut = next((j for j, t in enumerate(out) if t in stops), None)
                return out if cut is None else out[:cut + 1]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_ngram_index_equals_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 9])
    segments = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
                for _ in range(rng.choice([1, 2]))]
    segments[-1] = segments[-1] or [rng.randrange(vocab)]
    ngram, k = rng.choice([1, 2, 3]), rng.choice([1, 3, 10])
    stops = {rng.randrange(vocab)} if rng.random() < 0.5 else set()
    index = NgramIndex(ngram, segments)
    assert index.draft(k, frozenset(stops)) == _brute_draft(segments, ngram, k, stops)
    extra = [rng.randrange(vocab) for _ in range(6)]  # appended token by token
    for tok in extra:
        index.append(tok)
        segments[-1].append(tok)
        assert index.draft(k, frozenset(stops)) == _brute_draft(segments, ngram, k, stops)


# --- refused ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, err, match", [
    (dict(prompt_lookup_num_tokens=0), ValueError, "prompt_lookup_num_tokens"),
    (dict(prompt_lookup_num_tokens=-2), ValueError, "prompt_lookup_num_tokens"),
    (dict(prompt_lookup_num_tokens=2.0), ValueError, "prompt_lookup_num_tokens"),
    (dict(prompt_lookup_num_tokens=True), ValueError, "prompt_lookup_num_tokens"),
    (dict(prompt_lookup_num_tokens=3, num_beams=2), ValueError, "num_beams=2"),
    (dict(prompt_lookup_num_tokens=3, do_sample=True), ValueError, "do_sample"),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=0), ValueError,
     "max_matching_ngram_size"),
    (dict(max_matching_ngram_size=2), ValueError, "prompt_lookup_num_tokens"),
])
def test_bad_arguments_raise(gpt, seq2seq, kw, err, match):
    with pytest.raises(err, match=match):
        qkv.generate(gpt, torch.randint(3, 48, (2, 5)), max_new_tokens=4, **kw)
    with pytest.raises(err, match=match):
        qkv.generate(seq2seq, _sources(), max_new_tokens=4, **kw)


@pytest.mark.parametrize("variant", [dict(attention_window=4), dict(attention="linear")],
                         ids=["window", "linear"])
def test_caches_that_cannot_roll_back_are_refused(variant):
    model = _gpt(**variant)
    with pytest.raises(TypeError, match=r"prompt_lookup_num_tokens.*roll back"):
        qkv.generate(model, torch.randint(3, 48, (2, 5)), max_new_tokens=4,
                     prompt_lookup_num_tokens=3)


def test_ngram_size_changes_drafts_not_tokens(gpt, stats):
    ids, mask = _prompts()
    want = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=25)
    for n in (1, 3):
        got = qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=25,
                           prompt_lookup_num_tokens=4, max_matching_ngram_size=n)
        assert torch.equal(got, want)


def test_output_stops_where_greedy_stops_when_every_row_ends_inside_a_block():
    """When the last running row reaches its stop token inside a verified block, the output
    ends at that column, as greedy's does (not at the block's end, with pads after): the
    same tokens and the same shape, for every stop token, on a small-vocabulary model whose
    repeated prompts get drafts accepted (before the fix: 2 of these 12 stop tokens gave
    longer outputs)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=12, max_len=64, dim=32, num_layers=2, num_heads=4))
    _spread(model, 0.3)
    torch.manual_seed(0)
    ids = torch.randint(1, 12, (1, 6)).repeat(1, 2)
    for rows in (ids, ids.repeat(3, 1)):
        for eos in range(12):
            want = qkv.generate(model, rows, max_new_tokens=24, eos_token_id=eos)
            got = qkv.generate(model, rows, max_new_tokens=24, eos_token_id=eos,
                               prompt_lookup_num_tokens=4)
            assert got.shape == want.shape and torch.equal(got, want), eos
