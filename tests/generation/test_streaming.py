"""``qkv.generate(..., streamer=)``: the streamed columns, stacked, are exactly the new tokens
``generate`` returns (compared with ``torch.equal``), on every path that streams — greedy,
sampling with a seeded generator, prompt lookup; decoder-only with left padding and several
stop tokens, and the encoder-decoder — and the output is the one generated without a
streamer (the oracle: the same call without it). Beams and speculative decoding refuse it.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig

V = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # small ops: spinning OpenMP threads only slow them (tests/conftest.py)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _spread(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return _spread(GPT(GPTConfig(vocab_size=V, max_len=64, dim=32, num_layers=2, num_heads=4)))


@pytest.fixture(scope="module")
def seq2seq():
    torch.manual_seed(0)
    return _spread(Transformer(TransformerConfig(
        src_vocab_size=V, tgt_vocab_size=V, dim=32, num_encoder_layers=1, num_decoder_layers=2,
        num_heads=4, ffn_hidden=64, dropout=0.0, max_len=64)))


def _prompts():
    torch.manual_seed(3)
    ids = torch.randint(4, V, (3, 9))
    ids[:, 4:] = ids[:, :5]  # a repeat, so that prompt lookup finds drafts
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


MODES = {
    "greedy": {},
    "sampling": {"do_sample": True, "top_k": 10, "temperature": 1.3},
    "lookup": {"prompt_lookup_num_tokens": 3},
}


def _run(model, ids, mask, mode, eos, streamer=None):
    kwargs = dict(MODES[mode])
    if mode == "sampling":
        kwargs["generator"] = torch.Generator().manual_seed(11)
    return qkv.generate(model, ids, attention_mask=mask, max_new_tokens=17, eos_token_id=eos,
                        streamer=streamer, **kwargs)


@pytest.mark.parametrize("stops", [False, True], ids=["no-eos", "three-eos"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["gpt", "seq2seq"])
def test_streamed_columns_are_the_output(gpt, seq2seq, kind, mode, stops):
    model = gpt if kind == "gpt" else seq2seq
    ids, mask = _prompts()
    first = ids.shape[1] if kind == "gpt" else 1  # neither prompt nor start token streamed
    eos = None
    if stops:  # three stop tokens that end greedy's rows at new tokens 3, 5 and 7 (or before)
        greedy = _run(model, ids, mask, "greedy", None)[:, first:]
        eos = [int(greedy[0, 2]), int(greedy[1, 4]), int(greedy[2, 6])]
    got = []
    out = _run(model, ids, mask, mode, eos, streamer=got.append)
    assert torch.equal(out, _run(model, ids, mask, mode, eos))  # streaming changes nothing
    assert all(t.shape == (3,) and t.dtype == torch.long for t in got)
    assert torch.equal(torch.stack(got, dim=1), out[:, first:])
    if stops and mode != "sampling":  # the rows ended early; the columns after hold pads
        assert out.shape[1] - first <= 7


def test_streamer_sees_each_column_before_the_next_is_made(gpt):
    """Greedy: call t happens after step t and before step t + 1 (the column it gets is the
    one the model reads next): the count of model forwards at each call grows by one."""
    ids, mask = _prompts()
    calls = []
    forwards = [0]
    hook = gpt.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:  # a hook makes the engine decode through the modules, where it counts each step
        qkv.generate(gpt, ids, attention_mask=mask, max_new_tokens=6,
                     streamer=lambda t: calls.append(forwards[0]))
    finally:
        hook.remove()
    assert calls == [1, 2, 3, 4, 5, 6]


def test_streamer_refusals(gpt):
    ids = torch.tensor([[4, 5, 6]])
    with pytest.raises(TypeError, match="streamer must be a callable"):
        qkv.generate(gpt, ids, max_new_tokens=3, streamer=[])
    with pytest.raises(ValueError, match="streamer cannot be used with num_beams=2"):
        qkv.generate(gpt, ids, max_new_tokens=3, num_beams=2, streamer=print)
    with pytest.raises(ValueError, match="streamer is not supported with draft_model"):
        qkv.generate(gpt, ids, max_new_tokens=3, draft_model=gpt, streamer=print)
