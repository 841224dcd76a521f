"""Speculative decoding (``qkv.generate(..., draft_model=d, num_draft_tokens=k)``).

Greedy: the output equals the target's greedy output token for token (``torch.equal``,
docs/ARCHITECTURE.md: Tolerances: greedy tokens are exact), against qkv's uncached greedy
(the model's full forward each step) and the cached one: random drafts of other weights and
depth, the target itself as its draft, a slightly perturbed copy (rows keep different numbers
of draft tokens), a draft of another architecture (RoPE for a learned-position target) and
one on the generic module path (a hook); batch 1 and batch 4 left-padded; stop tokens, one
inside a kept draft. Models are tiny fp64 GPTs with random weights.

Sampling: on V = 8 (fp32 models), the empirical joint distribution of the first two (or
three) generated tokens over 20 000 rows of one prompt, drawn in one batched call at a fixed
seed, against the target's own distribution computed apart (an fp64 copy's full forward,
then temperature, top-k or top-p written here): a chi-square test whose p-value
(``torch.special.gammaincc``: the chi-square survival function; no scipy here) must exceed
1e-3, for a draft that disagrees often (its acceptance rate asserted below 0.8) and for the
target as its own draft (every draft token kept: the bonus token path). With 20 000 rows some
row rejects the first draft token of every round, so those rounds emit one token each; a
rejection after kept tokens is the accept rule's own unit test (every position of a round,
exact rates and the exact residual), and greedy covers the in-round bookkeeping. Planted bugs
in the rule (min(1, q/p); resampling from p) must fail the same chi-square test (Checklist
39).
"""

from __future__ import annotations

import copy

import pytest
import torch

import qkv
from qkv.generation import speculative
from qkv.generation.speculative import acceptance, residual, speculative_accept, verifier_stepper
from qkv.generation.steppers import GPTStepper
from qkv.models import GPT, GPTConfig

F64 = torch.float64
N_DRAWS = 20_000
P_MIN = 1e-3  # the chi-square p-value a correct sampler must exceed at the fixed seed


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gpt(seed: int, std: float, dtype: torch.dtype = F64, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=48, max_len=96, dim=32, num_layers=3, num_heads=4)
    cfg.update(kw)
    model = GPT(GPTConfig(**cfg), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="module")
def target() -> GPT:
    return _gpt(0, 0.5)


def _drafts(target: GPT) -> dict[str, GPT]:
    near = copy.deepcopy(target)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    hooked = _gpt(4, 0.5, num_layers=2)
    hooked.layers[0].register_forward_hook(lambda *args: None)  # no decode plan: modules path
    return {"random": _gpt(1, 0.5, num_layers=2), "itself": target, "near": near,
            "rope": _gpt(2, 0.5, num_layers=2, positions="rope"), "hooked": hooked}


@pytest.fixture
def stats(monkeypatch) -> dict:
    """The stats of the last speculative run (rounds, drafted, accepted, emitted)."""
    box: dict = {}
    real = speculative.speculative_decode

    def spy(*args, stats=None, **kw):
        return real(*args, stats=box, **kw)

    monkeypatch.setattr(speculative, "speculative_decode", spy)
    return box


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """(4, 9) left-padded prompts and their mask: 9, 6, 3 and 7 real tokens."""
    torch.manual_seed(3)
    ids = torch.randint(0, 48, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.long)
    for r, real in enumerate((9, 6, 3, 7)):
        mask[r, :9 - real] = 0
    return ids * mask, mask


# --- greedy == plain greedy ---------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["random", "itself", "near", "rope", "hooked"])
def test_greedy_equals_plain_greedy(target, kind, batch, eos, k, stats):
    draft = _drafts(target)[kind]
    ids, mask = _prompts()
    ids, mask = ids[:batch], mask[:batch]
    if eos:  # per row, a token first produced mid-way (by any row): rows end apart
        free = qkv.generate(target, ids, attention_mask=mask, max_new_tokens=24)[:, 9:]
        eos = sorted({next(int(free[r, p]) for p in range(4 + 3 * r, 24)
                           if not (free[:, :p] == free[r, p]).any()) for r in range(batch)})
    else:
        eos = None
    kw = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=1)
    want = qkv.generate(target, ids, use_cache=False, **kw)
    plain = qkv.generate(target, ids, **kw)
    got = qkv.generate(target, ids, draft_model=draft, num_draft_tokens=k, **kw)
    assert torch.equal(plain, want)
    assert got.shape == want.shape and torch.equal(got, want)
    assert stats["drafted"] > 0
    if kind == "itself":  # every draft token kept: fewer target passes than tokens
        assert stats["accepted"] == stats["drafted"]
        assert stats["rounds"] <= -(-(got.shape[1] - 9) // (k + 1))
    if eos is not None:
        # every row ended early, apart for a batch (padded after)
        assert want.shape[1] < 9 + 24 and torch.isin(want[:, 9:], torch.tensor(eos)).any(1).all()
        assert batch == 1 or (want[:, 9:] == 1).any()


def test_rows_keep_different_numbers_of_draft_tokens(target, stats):
    """A near draft: rows disagree within rounds (some kept tokens are not emitted and are
    redone), and each row still equals the row decoded alone, without padding."""
    draft = _drafts(target)["near"]
    ids, mask = _prompts()
    got = qkv.generate(target, ids, attention_mask=mask, max_new_tokens=24,
                       draft_model=draft, num_draft_tokens=4)
    assert 0 < stats["emitted"] < stats["accepted"] < stats["drafted"]
    for r in range(4):
        real = int(mask[r].sum())
        alone = qkv.generate(target, ids[r:r + 1, 9 - real:], max_new_tokens=24,
                             use_cache=False)
        assert torch.equal(alone[0, real:], got[r, 9:])


@pytest.mark.parametrize("k", [2, 4])
def test_rounds_follow_a_reference_loop(target, k, stats):
    """The rounds (how many, how many draft tokens kept) equal a reference written apart:
    every draft token and every target token from the models' full forwards (no cache) on
    the text so far. A draft cache left holding a rejected token changes only the drafts,
    never the output: this catches it."""
    draft = _drafts(target)["near"]
    ids = torch.randint(0, 48, (1, 5))
    got = qkv.generate(target, ids, max_new_tokens=24, draft_model=draft, num_draft_tokens=k)

    def argmax(model, tokens):
        with torch.no_grad():
            return int(model(torch.tensor([tokens]))[0, -1].argmax())

    text, out, rounds, accepted = ids[0].tolist(), [], 0, 0
    while len(out) < 24:
        budget = min(k, 24 - len(out) - 1)
        drafted = []
        for _ in range(budget):
            drafted.append(argmax(draft, text + out + drafted))
        hits = 0
        while hits < budget and argmax(target, text + out + drafted[:hits]) == drafted[hits]:
            hits += 1
        out += [*drafted[:hits], argmax(target, text + out + drafted[:hits])]
        rounds += 1
        accepted += hits
    assert got[0, 5:].tolist() == out
    assert (stats["rounds"], stats["accepted"]) == (rounds, accepted)
    assert 0 < accepted < stats["drafted"]  # the drafts were partly right


def test_stop_token_inside_a_kept_draft(target, stats):
    """With the target as its draft every round keeps all k tokens: a stop token that first
    appears in the middle of a round ends the output exactly where greedy's ends."""
    ids = torch.randint(0, 48, (1, 6))
    free = qkv.generate(target, ids, max_new_tokens=30)[0, 6:].tolist()
    pos = next(i for i in range(1, 30) if i % 5 not in (0, 4) and free[i] not in free[:i])
    want = qkv.generate(target, ids, max_new_tokens=30, eos_token_id=free[pos],
                        use_cache=False)
    got = qkv.generate(target, ids, max_new_tokens=30, eos_token_id=free[pos],
                       draft_model=target, num_draft_tokens=4)
    assert torch.equal(got, want) and got.shape[1] == 6 + pos + 1


def test_verifier_stepper_paths(target):
    """The engine's stepper for a plannable GPT; the generic ``GPTStepper`` for a hooked one."""
    ids = torch.randint(0, 48, (2, 5))
    assert not isinstance(verifier_stepper(target, ids, None, 12), GPTStepper)
    assert isinstance(verifier_stepper(_drafts(target)["hooked"], ids, None, 12), GPTStepper)


def test_the_target_verifies_in_one_pass(target):
    """One fp32 row on one thread: the engine picks the C layer where it builds (one token
    per call); the target's stepper (tokens_per_pass > 1) feeds several tokens in one pass
    instead, with the same logits (fp32 against fp32: atol 1e-4, rtol 1e-4, two kernels'
    summation orders over 3 layers)."""
    model = copy.deepcopy(target).float()
    ids = torch.randint(0, 48, (1, 5))
    with torch.inference_mode():
        draft_like = verifier_stepper(model, ids, None, 12)
        verify = verifier_stepper(model, ids, None, 12, tokens_per_pass=4)
        assert not getattr(getattr(verify, "runner", None), "one_token_only", False)
        if getattr(getattr(draft_like, "runner", None), "one_token_only", False):
            assert verify.backend != draft_like.backend
        tokens = torch.randint(0, 48, (1, 4))
        a = torch.cat((draft_like.prefill()[:, None], draft_like.run(tokens)), dim=1)
        b = torch.cat((verify.prefill()[:, None], verify.run(tokens)), dim=1)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --- sampling: the target's distribution ---------------------------------------------------
def _tiny(seed: int, **kw) -> GPT:
    """A V = 8 GPT in fp32 (sampling draws in fp32 whatever the model's dtype; fp32 decodes
    20 000 rows about twice as fast as fp64)."""
    return _gpt(seed, 0.3, torch.float32, vocab_size=8, max_len=16, dim=16, num_heads=2, **kw)


@pytest.fixture(scope="module")
def tiny_target() -> GPT:
    return _tiny(0, num_layers=2)


@pytest.fixture(scope="module")
def tiny_draft() -> GPT:
    return _tiny(1, num_layers=1)


PROMPT = [1, 2, 3]


def _filtered(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """fp64 softmax of logits (M, V) after temperature, top-k and top-p (the smallest set of
    most likely tokens whose probability reaches top_p), written apart from filter_logits."""
    logits = logits.double() / temperature
    if top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values[:, top_k - 1:top_k]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p is not None:
        for row in probs:
            order = row.argsort(descending=True).tolist()
            total, keep = 0.0, []
            for tok in order:
                keep.append(tok)
                total += float(row[tok])
                if total >= top_p:
                    break
            row[[t for t in order if t not in keep]] = 0.0
            row /= row.sum()
    return probs


def _target_joint(model: GPT, length: int, temperature=1.0, top_k=None, top_p=None):
    """The target's fp64 probability of every continuation of PROMPT by ``length`` tokens:
    (V,) * length, from full forwards of every prefix (no cache) of an fp64 copy."""
    model = copy.deepcopy(model).double()
    vocab = model.config.vocab_size
    joint = torch.ones((), dtype=F64)
    for t in range(length):
        prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * t).reshape(-1, t) if t else \
            torch.empty(1, 0, dtype=torch.long)  # (V^t, t), in row-major order
        ids = torch.cat((torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes), dim=1)
        with torch.no_grad():
            step = _filtered(model(ids)[:, -1], temperature, top_k, top_p)  # (V^t, V)
        joint = joint.reshape(-1, 1) * step
    return joint.reshape((vocab,) * length)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (same shape).
    Impossible cells must be empty (asserted); cells expecting fewer than 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten()
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "drew a token the target cannot produce"
    expected = probs * n
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs = torch.cat((counts[big], counts[small].sum()[None]))
    exp = torch.cat((expected[big], expected[small].sum()[None]))
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    dof = len(exp) - 1
    if dof == 0:  # one possible outcome, and every draw is it
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=F64), stat / 2))


def _draws(target: GPT, draft: GPT, length: int, k: int, seed: int = 0, **filters):
    """The first ``length`` tokens after PROMPT for N_DRAWS rows in one call -> counts
    (V,)*length. The call makes one token more: a round never passes max_new_tokens, so the
    last token of a call is drawn from the target alone, never drafted."""
    g = torch.Generator().manual_seed(seed)
    out = qkv.generate(target, torch.tensor([PROMPT]).expand(N_DRAWS, -1),
                       max_new_tokens=length + 1, do_sample=True, draft_model=draft,
                       num_draft_tokens=k, generator=g, **filters)[:, len(PROMPT):]
    vocab = target.config.vocab_size
    flat = torch.zeros(out.shape[0], dtype=torch.long)
    for t in range(length):
        flat = flat * vocab + out[:, t]
    return torch.bincount(flat, minlength=vocab ** length).reshape((vocab,) * length)


FILTERS = [dict(), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("filters", FILTERS, ids=["plain", "top_k", "top_p"])
def test_sampling_keeps_the_targets_distribution(tiny_target, tiny_draft, filters):
    """First two tokens, a draft that disagrees often: joint == the target's (chi-square)."""
    p = _target_joint(tiny_target, 1, **filters)
    q = _target_joint(tiny_draft, 1, **filters)
    assert float(torch.minimum(p, q).sum()) < 0.8  # the first token's acceptance rate
    counts = _draws(tiny_target, tiny_draft, 2, k=3, **filters)
    assert _chi2_pvalue(counts.sum(dim=1), p) > P_MIN  # the first token alone
    assert _chi2_pvalue(counts, _target_joint(tiny_target, 2, **filters)) > P_MIN


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_with_every_draft_token_kept(tiny_target, k, stats):
    """The target as its own draft: tokens 1..k are kept draft tokens, token k + 1 the bonus
    from the target's last verified position; the joint of k + 1 tokens == the target's."""
    counts = _draws(tiny_target, tiny_target, k + 1, k=k, temperature=0.8)
    assert stats["accepted"] >= 0.999 * stats["drafted"]  # p / q = 1 up to rounding
    assert _chi2_pvalue(counts, _target_joint(tiny_target, k + 1, temperature=0.8)) > P_MIN


def _acceptance_q_over_p(p_draft, q_draft):
    return (q_draft / p_draft).clamp(max=1.0)


def _residual_is_p(p, q):
    return p


@pytest.mark.parametrize("bug", ["accept-q-over-p", "resample-from-p"])
def test_planted_bugs_fail_the_chi_square_test(tiny_target, tiny_draft, bug, monkeypatch):
    """The distribution test has the power to see a wrong rule at this seed and size."""
    if bug == "accept-q-over-p":
        monkeypatch.setattr(speculative, "acceptance", _acceptance_q_over_p)
    else:
        monkeypatch.setattr(speculative, "residual", _residual_is_p)
    counts = _draws(tiny_target, tiny_draft, 1, k=3)
    assert _chi2_pvalue(counts, _target_joint(tiny_target, 1)) < 1e-6


# --- the accept rule on its own ------------------------------------------------------------
def _rand_dist(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=F64) * 0.8).softmax(dim=-1)


def test_acceptance_and_residual_exact(gen):
    """min(1, p/q) and norm(max(0, p - q)) against loops over plain floats (fp64 TOL:
    atol 1e-12, rtol 1e-10)."""
    p, q = _rand_dist(gen, 6, 5), _rand_dist(gen, 6, 5)
    got = acceptance(p, q)
    want = torch.tensor([[min(1.0, a / b) for a, b in zip(pr.tolist(), qr.tolist(), strict=True)]
                         for pr, qr in zip(p, q, strict=True)], dtype=F64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    rows = []
    for pr, qr in zip(p.tolist(), q.tolist(), strict=True):
        extra = [max(0.0, a - b) for a, b in zip(pr, qr, strict=True)]
        rows.append([e / sum(extra) for e in extra])
    torch.testing.assert_close(residual(p, q), torch.tensor(rows, dtype=F64), atol=1e-12,
                               rtol=1e-10)
    assert torch.equal(residual(p, p.clone()), p)  # nothing positive left: p itself


def test_accept_rule_rates_and_distributions(gen):
    """200 000 rows of one round (k = 3, V = 5, the same p, q in every row, drafts drawn
    from q): the number kept, the token after a rejection at each position (== the exact
    residual), every emitted token (== p at its position) and the bonus (== p_4), each by
    chi-square with p-value > 1e-3."""
    rows, k, vocab = 200_000, 3, 5
    p1, q1 = _rand_dist(gen, k + 1, vocab), _rand_dist(gen, k, vocab)
    p, q = p1.expand(rows, -1, -1), q1.expand(rows, -1, -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(rows, k)
    hits, token = speculative_accept(p, q, draft, gen)
    beta = torch.minimum(p1[:k], q1).sum(dim=-1)  # (k,) the acceptance rate per position
    kept_probs = torch.stack([torch.cat((beta[:h], 1 - beta[h:h + 1])).prod()
                              for h in range(k)] + [beta.prod()])
    assert _chi2_pvalue(torch.bincount(hits, minlength=k + 1), kept_probs) > P_MIN
    for h in range(k):  # the first rejection at h: a draw from norm(max(0, p - q))
        extra = (p1[h] - q1[h]).clamp(min=0)
        counts = torch.bincount(token[hits == h], minlength=vocab)
        assert _chi2_pvalue(counts, extra / extra.sum()) > P_MIN
        # the token emitted at position h among rows that got there: p_h
        reached = hits >= h
        emitted = torch.where(hits[reached] > h, draft[reached, h], token[reached])
        assert _chi2_pvalue(torch.bincount(emitted, minlength=vocab), p1[h]) > P_MIN
    assert _chi2_pvalue(torch.bincount(token[hits == k], minlength=vocab), p1[k]) > P_MIN


# --- errors -------------------------------------------------------------------------------
def test_bad_arguments_raise(target, tiny_target):
    ids = torch.randint(0, 8, (2, 4))
    other = _gpt(3, 0.3, vocab_size=9, max_len=16, dim=16, num_heads=2, num_layers=1)
    cases = [
        (dict(draft_model=other), ValueError,
         "draft_model has vocab_size 9, the target 8: speculative decoding needs one "
         "vocabulary"),
        (dict(draft_model=tiny_target, num_beams=2), ValueError, "num_beams=2"),
        (dict(draft_model=tiny_target, prompt_lookup_num_tokens=2), ValueError,
         "prompt_lookup_num_tokens"),
        (dict(draft_model=tiny_target, use_cache=False), ValueError, "use_cache=False"),
        (dict(num_draft_tokens=3), ValueError, "num_draft_tokens=3 only applies with"),
        (dict(draft_model=torch.nn.Linear(2, 2)), TypeError, "draft_model must be"),
    ]
    for bad in (2.0, 0, True, "3", None):
        cases.append((dict(draft_model=tiny_target, num_draft_tokens=bad), ValueError,
                      f"num_draft_tokens must be an int >= 1, got {bad!r}"))
    for kw, err, msg in cases:
        with pytest.raises(err) as info:
            qkv.generate(tiny_target, ids, max_new_tokens=3, **kw)
        assert msg in str(info.value) and "\n" not in str(info.value), (kw, str(info.value))


def test_seq2seq_short_drafts_and_caches_that_cannot_roll_back_are_refused(tiny_target):
    from qkv.models import Transformer, TransformerConfig

    ids = torch.randint(0, 8, (2, 4))
    cfg = TransformerConfig(src_vocab_size=8, tgt_vocab_size=8, dim=16, num_encoder_layers=1,
                            num_decoder_layers=1, num_heads=2, ffn_hidden=32, max_len=16)
    seq2seq = Transformer(cfg).eval()
    with pytest.raises(ValueError, match="cannot be combined with an encoder-decoder"):
        qkv.generate(seq2seq, ids, max_new_tokens=3, draft_model=tiny_target)
    with pytest.raises(TypeError, match="draft_model must be a decoder-only"):
        qkv.generate(tiny_target, ids, max_new_tokens=3, draft_model=seq2seq)
    short = _gpt(3, 0.3, vocab_size=8, max_len=6, dim=16, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match=r"draft_model needs 7 positions .* max_len=6"):
        qkv.generate(tiny_target, ids, max_new_tokens=5, draft_model=short)
    for variant, cache in ((dict(attention_window=3), "WindowKVCache"),
                           (dict(attention="linear"), "LinearCache")):
        cannot = _gpt(3, 0.3, vocab_size=8, max_len=16, dim=16, num_heads=2, num_layers=1,
                      **variant)
        with pytest.raises(TypeError, match=rf"draft_model's cache back .* {cache}"):
            qkv.generate(tiny_target, ids, max_new_tokens=5, draft_model=cannot)
        with pytest.raises(TypeError, match=rf"model's cache back .* {cache}"):
            qkv.generate(cannot, ids, max_new_tokens=5, draft_model=tiny_target)
