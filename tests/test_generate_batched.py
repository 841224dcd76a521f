"""Batched decoding: greedy / beam search over a left-padded batch == each row alone (the
batch-1 path), and == HF GPT-2's batched greedy ``generate`` on the same weights (fp32, batch
16). The multi-token step of prompt-lookup decoding (the decode engine's torch backend:
``decoder_stepper(..., backend="torch")``'s ``run`` and ``rewind``): its logits ==
``GPT.forward`` over the whole sequence (fp64; one and several tokens per call, after a
rewind).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.generation.engine import decoder_stepper
from qkv.generation.plan import decode_plan
from qkv.models import GPT, GPTConfig

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gpt(dtype=F64, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=48, max_len=64, dim=32, num_layers=2, num_heads=4)
    cfg.update(kw)
    model = GPT(GPTConfig(**cfg), dtype=dtype)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model.eval()


def _prompts(rows: int = 5, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, n) left-padded prompts with 1..n real tokens, and their mask."""
    torch.manual_seed(2)
    ids = torch.randint(3, 48, (rows, n))
    mask = torch.ones(rows, n, dtype=torch.long)
    for r in range(rows):
        mask[r, :(3 * r) % n] = 0
    return ids * mask, mask


VARIANTS = [dict(), dict(positions="rope"), dict(num_kv_heads=2), dict(num_kv_heads=1),
            dict(activation="relu", bias=False, tie_embeddings=False)]
VARIANT_IDS = ["gpt2", "rope", "gqa", "mqa", "relu-nobias-untied"]


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("padded", [False, True])
def test_logits_equal_forward(kw, padded):
    """prefill, 2 single steps, a 3-token run, a rewind over 2 of them, a 4-token run: every
    logit == the model's uncached forward over the sequence the cache then holds."""
    model = _gpt(**kw)
    assert not decode_plan(model).int8
    ids, mask = _prompts()
    keep = mask.bool() if padded else None
    if not padded:
        ids = torch.randint(3, 48, ids.shape)
    torch.manual_seed(3)
    new = torch.randint(3, 48, (5, 9))
    with torch.inference_mode():
        s = decoder_stepper(model, ids, keep, 7 + 9, backend="torch")
        got = [s.prefill()[:, None], s.step(new[:, 0])[:, None], s.step(new[:, 1])[:, None],
               s.run(new[:, 2:5])]
        s.rewind(7 + 3)  # keeps new[:, :3]; new[:, 3:5] forgotten
        got.append(s.run(new[:, 5:9]))
        seq = torch.cat((ids, new[:, :3], new[:, 5:9]), dim=1)  # (5, 14)
        full_keep = None if keep is None else torch.cat(
            (keep, torch.ones(5, 7, dtype=torch.bool)), dim=1)
        want = model(seq, attention_mask=full_keep)  # (5, 14, V)
        dropped = model(torch.cat((ids, new[:, :5]), dim=1), attention_mask=None if keep is None
                        else full_keep[:, :12])[:, 10:12]  # logits of the rewound run's tail
    got_kept = torch.cat([*got[:3], got[3][:, :1], got[4]], dim=1)  # positions 6..13
    torch.testing.assert_close(got_kept, want[:, 6:], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got[3][:, 1:], dropped, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kw", VARIANTS[:3], ids=VARIANT_IDS[:3])
@pytest.mark.parametrize("search", [dict(), dict(eos_token_id=4), dict(num_beams=3),
                                    dict(num_beams=2, eos_token_id=4)],
                         ids=["greedy", "greedy-eos", "beam3", "beam2-eos"])
def test_batched_equals_each_row_alone(kw, search):
    model = _gpt(**kw)
    ids, mask = _prompts()
    batch = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=12, pad_token_id=1,
                         **search)
    assert torch.equal(batch, qkv.generate(model, ids, attention_mask=mask, max_new_tokens=12,
                                           pad_token_id=1, use_cache=False, **search))
    for r in range(5):
        real = int(mask[r].sum())
        alone = qkv.generate(model, ids[r:r + 1, 7 - real:], max_new_tokens=12,
                             pad_token_id=1, **search)  # batch 1 (beams: K rows)
        new = alone.shape[1] - real
        assert torch.equal(batch[r, 7:7 + new], alone[0, real:])
        assert (batch[r, 7 + new:] == 1).all()


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  vocab_size=96, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=3)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    d = tmp_path_factory.mktemp("hf-gpt2")
    hf.save_pretrained(d, safe_serialization=True)
    return hf, GPT.from_hf(d).eval()


@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_matches_hf_batched_greedy(hf_pair, eos):
    """fp32, batch 16, left-padded prompts of 1..10 tokens: HF's tokens."""
    hf, model = hf_pair
    torch.manual_seed(5)
    ids = torch.randint(4, 96, (16, 10))
    mask = torch.ones_like(ids)
    for r in range(16):
        mask[r, :r % 10] = 0
    ids = ids.masked_fill(mask == 0, 3)
    if eos:  # the commonest new token: it ends several rows early
        free = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=20)[:, 12:]
        eos = int(free.flatten().mode().values)
    else:
        eos = None
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           eos_token_id=eos, pad_token_id=3)
    got = qkv.generate(model, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                       pad_token_id=3)
    assert got.shape == want.shape and torch.equal(got, want)
    if eos is not None:
        assert (got[:, 10:] == 3).all(dim=1).sum() == 0  # no row padded from the start
        assert (got[:, -1] == 3).sum() >= 2  # rows that ended early, padded
