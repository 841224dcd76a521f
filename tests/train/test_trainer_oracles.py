"""One training step of each model kind against an independent fp64 computation.

The oracle is written apart from ``qkv.train``: the model's own logits (a float64 copy of the
model as it was before the step), ``torch.nn.functional.cross_entropy`` with
``label_smoothing`` and ``ignore_index=-100`` (mean over the predicted tokens), autograd
gradients, the clip formula g · min(1, c / ||g||) on the global norm, and the first AdamW
update written out: p - lr · g / (|g| + eps) (weight decay 0; bias corrections cancel at
step 1). ``adam_eps`` is set well above the clipped gradients so that the update depends on
their size (with a tiny eps the first Adam step is lr · sign(g) and hides any scaling).

Tolerances: fp32 training vs the fp64 oracle: losses and norms rtol 1e-5; gradients and
updates compared as a whole, ||got - want|| <= 2e-4 ||want|| (seen: 2e-5; summation order
of fp32 matmuls over ~10^4 products).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from qkv.train import TrainConfig, Trainer
from qkv.train.kinds import get_kind
from qkv.train.loss import token_loss

KINDS = {
    "transformer": dict(preset="transformer-tiny",
                        overrides=dict(dim=32, num_heads=2, ffn_hidden=64, num_encoder_layers=1,
                                       num_decoder_layers=1, dropout=0.0, attn_dropout=0.0)),
    "gpt": dict(preset="gpt-tiny", overrides=dict(dim=32, num_heads=2, num_layers=1)),
    "bert-mlm": dict(preset="bert-tiny", overrides=dict(dim=32, num_heads=2, num_layers=1,
                                                        dropout=0.0, attn_dropout=0.0)),
}
CLIP = 0.01  # far below the first step's gradient norm, so clipping must act
LR, ADAM_EPS = 1e-2, 1e-3
REL = 2e-4  # whole-tensor relative error of fp32 gradients/updates vs fp64 (seen: 2e-5)


def _config(kind: str, label_smoothing: float) -> TrainConfig:
    return TrainConfig(model=kind, task="copy", steps=4, batch_size=8, lr=LR,
                       schedule="constant", warmup=0, weight_decay=0.0, adam_eps=ADAM_EPS,
                       label_smoothing=label_smoothing, clip_norm=CLIP, eval_every=4,
                       eval_examples=8, **KINDS[kind])


def _logits_and_target(kind: str, model: torch.nn.Module, batch: dict) -> tuple:
    """The model's logits (B, N, V) and the targets (B, N) of a ``make_batch`` batch, called
    the way each model kind is documented to be called (not through qkv.train.loss)."""
    if kind == "transformer":
        return model(batch["src"], batch["tgt_in"]), batch["tgt_out"]
    if kind == "gpt":
        return model(batch["ids"]), batch["targets"]
    return model.masked_lm(batch["ids"], batch["attention_mask"]), batch["labels"]


def _oracle_loss(kind, model, batch, eps: float) -> torch.Tensor:
    """Mean smoothed cross-entropy over the predicted tokens, in the model's dtype."""
    logits, target = _logits_and_target(kind, model, batch)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=-100, label_smoothing=eps, reduction="mean")


def _spread(model: torch.nn.Module) -> torch.nn.Module:
    """Redraw the matrices with std 0.3 (seeded): the freshly initialised models predict
    nearly uniform distributions, where label smoothing hardly changes the loss."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _rel(got: dict, want: dict) -> float:
    num = sum(float(((got[k].double() - want[k]) ** 2).sum()) for k in want)
    den = sum(float((want[k] ** 2).sum()) for k in want)
    return (num / den) ** 0.5


def _close(trainer: Trainer) -> None:
    close = getattr(trainer, "close", None)  # releases the run-directory lock, where there is one
    if callable(close):
        close()


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("kind", list(KINDS))
def test_token_loss_equals_cross_entropy_with_label_smoothing(tmp_path, kind, eps):
    """token_loss's sum / count == F.cross_entropy(label_smoothing=eps, mean) on the same
    logits, for every model kind (the smoothing must reach the loss)."""
    trainer = Trainer(_config(kind, eps), tmp_path / "run", progress=False, log=lambda s: None)
    try:
        model = _spread(trainer.model).eval()
        batch = trainer._batch(0)
        with torch.no_grad():
            loss_sum, count, _, target = token_loss(get_kind(kind), model, batch,
                                                    label_smoothing=eps)
            want = _oracle_loss(kind, copy.deepcopy(model).double(), batch, eps)
            plain = _oracle_loss(kind, copy.deepcopy(model).double(), batch, 0.0)
        assert int(count) == int((target != -100).sum()) > 0
        torch.testing.assert_close(loss_sum.double() / count, want, rtol=1e-5, atol=0)
        if eps:  # the comparison can tell smoothing from none
            assert abs(float(want - plain)) > 100 * 1e-5 * float(want)  # 100x the tolerance
    finally:
        _close(trainer)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_step_matches_an_fp64_clip_and_adamw(tmp_path, kind, eps):
    """train_step's logged loss (smoothed), grad_norm (the norm before clipping, as
    clip_grad_norm_ reports it), the gradients the optimizer sees (clipped to CLIP) and the
    parameters after the step, all against the fp64 oracle."""
    trainer = Trainer(_config(kind, eps), tmp_path / "run", progress=False, log=lambda s: None)
    try:
        _spread(trainer.model)
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        before = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
        ref = copy.deepcopy(trainer.model).double().train()  # dropout is 0 in every kind here
        batches: list[dict] = []
        real_batch = trainer._batch
        trainer._batch = lambda step: batches.append(real_batch(step)) or batches[-1]
        seen: dict[str, torch.Tensor] = {}

        def capture(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        seen[names[id(p)]] = p.grad.detach().double().clone()

        hook = trainer.optimizer.register_step_pre_hook(capture)
        metrics = trainer.train_step()
        hook.remove()

        loss = _oracle_loss(kind, ref, batches[0], eps)
        loss.backward()
        loss = float(loss.detach())
        grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
        clipped = {n: g * min(1.0, CLIP / float(norm)) for n, g in grads.items()}
        lr = LR  # constant schedule, no warm-up
        stepped = {n: before[n] - lr * g / (g.abs() + ADAM_EPS) for n, g in clipped.items()}
        after = {n: p.detach() for n, p in trainer.model.named_parameters()}

        assert metrics["lr"] == pytest.approx(lr, rel=1e-12)
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
        assert float(norm) > 20 * CLIP  # the step really is clipped
        assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)  # pre-clip norm
        assert seen.keys() == grads.keys()
        assert _rel(seen, clipped) < REL
        seen_norm = torch.sqrt(sum((g ** 2).sum() for g in seen.values()))
        assert float(seen_norm) == pytest.approx(CLIP, rel=1e-4)
        delta = {n: after[n].double() - before[n] for n in stepped}
        assert _rel(delta, {n: stepped[n] - before[n] for n in stepped}) < REL
    finally:
        _close(trainer)


def test_each_step_uses_the_scheduled_learning_rate(tmp_path):
    """The lr the optimizer holds at each step (and the one logged) == the closed form of a
    cosine schedule written here: linear warm-up s / w to the peak, then min + (1 - min) ·
    (1 + cos(pi (s - w) / (T - w))) / 2 (steps s are 1-based)."""
    import math

    steps, warmup, floor = 7, 2, 0.1
    cfg = TrainConfig(**{**_config("gpt", 0.0).to_dict(), "steps": steps, "eval_every": steps,
                         "schedule": "cosine", "warmup": warmup, "min_lr_ratio": floor})
    trainer = Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)
    try:
        used: list[float] = []
        trainer.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
        logged = [trainer.train_step()["lr"] for _ in range(steps)]
    finally:
        _close(trainer)
    want = [LR * (s / warmup if s <= warmup else floor + (1 - floor) * 0.5 * (
        1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))) for s in range(1, steps + 1)]
    assert used == pytest.approx(want, rel=1e-12)
    assert logged == pytest.approx(want, rel=1e-12)
