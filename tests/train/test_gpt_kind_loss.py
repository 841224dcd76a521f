"""The gpt kind trains through ``GPT.loss`` (the LM head fused with the cross-entropy over
row chunks, no (B, N, V) logits), and its loss is still the token cross-entropy summed over
the predicted tokens.

Oracles: ``torch.nn.functional.cross_entropy`` (sum, ``ignore_index=-100``,
``label_smoothing``) on the full logits of a float64 copy of the model, and autograd's
gradients of that sum; with an adapter (LoRA, bottleneck adapters, prefix) the same
cross-entropy on the adapted model's own full logits. Tolerances: fp32 vs fp64, losses rtol
1e-5, gradients as a whole ||got - want|| <= 1e-4 ||want|| (fp32 sums over ~10^4 products).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from qkv.data import CharTokenizer, get_task
from qkv.models import GPT, GPTConfig
from qkv.peft import AdapterConfig, LoraConfig, PrefixConfig, add_adapters, add_lora, add_prefix
from qkv.train import TrainConfig, Trainer
from qkv.train.data import PairData, TextData
from qkv.train.kinds import get_kind

KIND = get_kind("gpt")
REL = 1e-4


def _model(vocab: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=vocab, max_len=64, dim=32,
                                    num_heads=2, num_layers=2, dropout=0.0,
                                    attn_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # spread the weights: a fresh model predicts nearly uniformly
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _pair_batch() -> tuple[dict[str, torch.Tensor], CharTokenizer]:
    """Pairs of several lengths: prompts (-100) and right padding (-100) in the targets."""
    task = get_task("copy", seed=0)
    tok = CharTokenizer(task.alphabet())
    return KIND.make_batch(task.examples("train", 0, 7), tok), tok


def _oracle(model: GPT, batch: dict[str, torch.Tensor], eps: float
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed smoothed cross-entropy of the fp64 model's full logits, and its gradients."""
    ref = copy.deepcopy(model).double()
    logits = ref(batch["ids"])  # (B, N, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1),
                           ignore_index=-100, reduction="sum", label_smoothing=eps)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    num = sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want)
    return (num / sum(float((want[k].double() ** 2).sum()) for k in want)) ** 0.5


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_loss_is_the_summed_cross_entropy_and_its_gradients(eps):
    batch, tok = _pair_batch()
    assert (batch["targets"] == -100).any(dim=1).all()  # prompts and padding are ignored
    model = _model(tok.vocab_size)
    loss_sum, count = KIND.loss(model, batch, label_smoothing=eps)
    loss_sum.backward()
    want, grads = _oracle(model, batch, eps)
    assert loss_sum.dtype == torch.float32 and count.dtype == torch.int64
    assert int(count) == int((batch["targets"] != -100).sum()) > 0
    torch.testing.assert_close(loss_sum.double(), want, rtol=1e-5, atol=0)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert _rel(got, grads) <= REL


def test_text_windows_predict_every_token():
    """A plain-text batch: every position predicts the next token (no -100)."""
    ids = torch.randint(4, 30, (3, 17 + 1), generator=torch.Generator().manual_seed(1))
    batch = KIND.make_batch(ids, None)
    model = _model(30)
    loss_sum, count = KIND.loss(model, batch)
    want, _ = _oracle(model, batch, 0.0)
    assert int(count) == 3 * 17
    torch.testing.assert_close(loss_sum.double(), want, rtol=1e-5, atol=0)


def test_no_full_logits_are_built(monkeypatch, tmp_path):
    """Neither the kind's loss nor a training step calls GPT.forward (the (B, N, V) logits):
    with label smoothing or without (GPT.loss smooths labels itself)."""
    batch, tok = _pair_batch()
    model = _model(tok.vocab_size)

    def no_logits(self, *args, **kwargs):
        raise AssertionError("GPT.forward was called: the full logits were built")

    monkeypatch.setattr(GPT, "forward", no_logits)
    KIND.loss(model, batch)[0].backward()
    KIND.loss(model, batch, label_smoothing=0.1)[0].backward()
    monkeypatch.undo()
    trainer = Trainer(TrainConfig(model="gpt", task="copy", preset="gpt-tiny",
                                  overrides=dict(dim=32, num_heads=2, num_layers=1), steps=2,
                                  batch_size=4, label_smoothing=0.1, eval_every=2,
                                  eval_examples=4), tmp_path / "run", progress=False,
                      log=lambda line: None)
    try:
        monkeypatch.setattr(GPT, "forward", no_logits)
        assert trainer.train_step()["loss"] > 0
    finally:
        trainer.close()


def test_a_batch_with_nothing_to_predict():
    batch, tok = _pair_batch()
    batch = {**batch, "targets": torch.full_like(batch["targets"], -100)}
    model = _model(tok.vocab_size)
    loss_sum, count = KIND.loss(model, batch)
    loss_sum.backward()
    assert int(count) == 0 and float(loss_sum.detach()) == 0.0
    assert all(torch.isfinite(p.grad).all() and not p.grad.any()
               for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("peft", ["lora", "adapters", "prefix"])
def test_adapters_train_through_the_fused_loss(peft):
    """With an adapter, the loss and the adapter's gradients (the only ones) equal the full
    logits' cross-entropy of the same adapted model."""
    batch, tok = _pair_batch()
    model = _model(tok.vocab_size)
    if peft == "lora":
        add_lora(model, LoraConfig(r=4, alpha=8, targets=("q", "v", "ffn_in")))
    elif peft == "adapters":
        add_adapters(model, AdapterConfig(reduction_factor=4))
    else:
        add_prefix(model, PrefixConfig(num_tokens=3))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # LoRA's B and the adapters' up projections start at 0
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and len(trainable) < len(list(model.parameters()))
    loss_sum, _ = KIND.loss(model, batch, label_smoothing=0.0)
    got = dict(zip(trainable, torch.autograd.grad(loss_sum, list(trainable.values())),
                   strict=True))
    logits = model(batch["ids"])  # (B, N, V): the adapted model's own full logits
    want_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                               batch["targets"].reshape(-1), ignore_index=-100,
                               reduction="sum")
    want = dict(zip(trainable, torch.autograd.grad(want_sum, list(trainable.values())),
                    strict=True))
    torch.testing.assert_close(loss_sum.double(), want_sum.detach(), rtol=1e-5, atol=0)
    assert _rel(got, want) <= REL


def test_bf16_autocast_trains():
    """Under bf16 autocast (``--precision bf16`` without ``--fsdp``) the layers compute in
    bf16: the loss is an fp32 scalar close to fp32's, not equal to it, with finite
    gradients."""
    batch, tok = _pair_batch()
    model = _model(tok.vocab_size)
    with torch.no_grad():
        fp32, _ = KIND.loss(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = KIND.loss(model, batch)
    bf16.backward()
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16)
    got, want = float(bf16.detach()), float(fp32)
    assert got != want and got == pytest.approx(want, rel=2e-2)  # bf16 layers: close
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("source", ["pairs", "text"])
def test_evaluation_loss_is_the_mean_cross_entropy(source):
    """``evaluate``'s eval_loss (through GPT.loss) == the mean cross-entropy of the full fp64
    logits over the held-out batches, no label smoothing; the model's training flag is
    restored."""
    task = get_task("copy", seed=0)
    tok = CharTokenizer(task.alphabet())
    if source == "pairs":
        data = PairData(task=task, seed=0)
    else:
        text = " ".join(s for s, _ in task.examples("train", 0, 200))
        data = TextData.from_ids(tok.encode(text), window=24, seed=0)
    model = _model(tok.vocab_size).train()
    got = KIND.evaluate(model, tok, data, 12)
    assert model.training
    batch = KIND.make_batch(data.heldout(12), tok)
    want, _ = _oracle(model.eval(), batch, 0.0)
    n = int((batch["targets"] != -100).sum())
    assert got["eval_loss"] == pytest.approx(float(want) / n, rel=1e-5)
    assert ("exact_match" in got) == (source == "pairs")
