"""``qkv demo coref``: self-attention resolves pronouns — "it" attends to "cat".

Shapes: B batch, N padded sequence length (bos + words + eos), L layers, H heads, V vocab.

The seeds' example, "The cat sat on the mat because it was tired" (猫坐在垫子上，因为它很累):
the pronoun's representation draws on the noun it refers to. This demo trains a small
``qkv.models.BERT`` (2 layers × 4 heads, C=64) on the sentences of ``qkv.data.coref``
(English and Chinese; the antecedent is decided by the adjective — cats get tired, mats get
soft — or by he/she agreement) to predict, at the pronoun's position, the antecedent word
itself through the tied masked-LM head. Nothing tells the model where the nouns are or that
attention should link them.

Reported on held-out sentences, whose noun pairs never met in one training sentence (the
seeds' cat/mat pair among them):

- accuracy: the masked-LM head's top word over the whole vocabulary at the pronoun is the
  antecedent;
- head fraction: for every layer l and head h, a sentence counts when the pronoun's
  attention weight on its antecedent exceeds its weight on the other noun. The head with
  the highest fraction on the "valid" split is chosen; its fraction on "test" is reported
  (chance: 50%);
- strongest head: per test sentence, the single largest pronoun -> noun weight over all
  layers and heads; the fraction where that weight is on the antecedent (chance 50%).

The run directory holds config.json + model.safetensors (a "qkv-bert" model with its MLM
head), tokenizer.json (``qkv.data.WordTokenizer``), metrics.json and PNGs of the chosen
head; ``qkv attention RUN --input "the cat sat on the mat because it was soft"`` draws any
other sentence (inputs are framed bos + words + eos, as here).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data import (
    COREF_KINDS,
    CorefExample,
    WordTokenizer,
    coref_examples,
    coref_sentence,
    coref_vocabulary,
)
from ..files import atomic_write
from ..models import BERT, BERTConfig
from ..outputs import new_output_dir

__all__ = ["CHANCE", "coref_batch", "coref_model", "evaluate_coref", "pronoun_noun_attention",
           "run_coref_demo", "showcase_sentences", "train_coref"]

#: The fraction a head pointing at a random one of the two nouns reaches.
CHANCE = 0.5
_FULL = {"steps": 800, "batch_size": 64, "valid": 1000, "test": 2000}
_QUICK = {"steps": 60, "batch_size": 32, "valid": 200, "test": 200}


def coref_model(vocab_size: int) -> BERT:
    """A fresh BERT for the task: C=64, 2 layers, 4 heads, F=128, no dropout, no pooler,
    with the (tied) masked-LM head; positions for N ≤ 32."""
    return BERT(BERTConfig(vocab_size=vocab_size, max_len=32, type_vocab_size=1, dim=64,
                           num_layers=2, num_heads=4, ffn_hidden=128, dropout=0.0,
                           attn_dropout=0.0, with_pooler=False, with_mlm_head=True))


def coref_batch(tok: WordTokenizer, examples: Sequence[CorefExample]) -> dict[str, torch.Tensor]:
    """Tensors for ``examples`` framed bos + words + eos, right-padded.

    Returns ``{"ids": (B, N), "mask": (B, N) bool (True = real token), "pronoun": (B,),
    "antecedent": (B,), "other": (B,)}`` — positions in ``ids`` of the pronoun, its
    antecedent and the other noun — and ``"answer": (B,)``, the antecedent's token id.
    """
    ids, lengths = tok.encode_batch([e.text for e in examples], add_bos=True, add_eos=True)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]  # (B, N)
    pos = torch.tensor([[e.pronoun, e.antecedent, sum(e.nouns) - e.antecedent]
                        for e in examples], dtype=torch.long) + 1  # (B, 3), +1: bos
    rows = torch.arange(len(examples))
    return {"ids": ids, "mask": mask, "pronoun": pos[:, 0], "antecedent": pos[:, 1],
            "other": pos[:, 2], "answer": ids[rows, pos[:, 1]]}


def _pronoun_logits(model: BERT, batch: dict[str, torch.Tensor], *,
                    output_attentions: bool = False) -> tuple[torch.Tensor, Any]:
    out = model(batch["ids"], batch["mask"], output_attentions=output_attentions)
    rows = torch.arange(batch["ids"].shape[0])
    hidden = out.last_hidden_state[rows, batch["pronoun"]]  # (B, C)
    return model.mlm_logits(hidden), out.attentions  # (B, V)


def train_coref(model: BERT, tok: WordTokenizer, *, steps: int, batch_size: int = 64,
                lr: float = 3e-3, seed: int = 0,
                log: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``model`` for ``steps`` AdamW steps on "train" examples (step s reads examples
    s·batch_size ...), cross-entropy of the pronoun's MLM logits (B, V) against the
    antecedent word; linear warm-up over 5% of the steps, then cosine decay to 0.
    ``log(step, loss)`` is called every 100 steps. Returns the loss of every step; the
    model is left in eval mode (ready to evaluate)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm
        else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    model.train()
    losses = []
    for step in range(steps):
        batch = coref_batch(tok, coref_examples("train", step * batch_size, batch_size,
                                                seed=seed))
        logits, _ = _pronoun_logits(model, batch)
        loss = F.cross_entropy(logits, batch["answer"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log is not None and ((step + 1) % 100 == 0 or step + 1 == steps):
            log(step + 1, sum(losses[-100:]) / len(losses[-100:]))
    model.eval()
    return losses


@torch.no_grad()
def pronoun_noun_attention(model: BERT, tok: WordTokenizer,
                           examples: Sequence[CorefExample], *,
                           batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` on ``examples`` in eval mode (its train/eval mode is restored after).

    Returns ``(correct, weights)``: correct (E,) bool, the MLM head's top word at the
    pronoun is the antecedent; weights (E, L, H, 2), each head's attention from the pronoun
    to [antecedent, other noun].
    """
    was_training = model.training
    model.eval()
    try:
        return _pronoun_noun_attention(model, tok, examples, batch_size)
    finally:
        model.train(was_training)


def _pronoun_noun_attention(model: BERT, tok: WordTokenizer,
                            examples: Sequence[CorefExample],
                            batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    correct, weights = [], []
    for i in range(0, len(examples), batch_size):
        batch = coref_batch(tok, examples[i:i + batch_size])
        logits, attentions = _pronoun_logits(model, batch, output_attentions=True)
        correct.append(logits.argmax(-1) == batch["answer"])
        rows = torch.arange(batch["ids"].shape[0])
        att = torch.stack(attentions, 1)  # (B, L, H, N, N)
        from_pronoun = att[rows, :, :, batch["pronoun"]]  # (B, L, H, N)
        pick = torch.stack([batch["antecedent"], batch["other"]], 1)  # (B, 2)
        weights.append(from_pronoun.gather(
            3, pick[:, None, None, :].expand(-1, *from_pronoun.shape[1:3], 2)))  # (B, L, H, 2)
    return torch.cat(correct), torch.cat(weights).float()


def evaluate_coref(model: BERT, tok: WordTokenizer, examples: Sequence[CorefExample],
                   *, head: tuple[int, int] | None = None) -> dict[str, Any]:
    """Accuracy and head fractions on ``examples`` (see the module docstring).

    Returns a JSON-ready dict: ``accuracy``, ``accuracy_by`` ({"property": ...,
    "en/property": ...}),
    ``head_fractions`` (L × H nested lists), ``best_head`` [l, h] (the highest fraction
    here), ``strongest_head_fraction``, and with ``head=(l, h)`` also ``head`` and
    ``head_fraction`` (that head's fraction), ``head_weights`` (its mean weight on the
    antecedent and on the other noun) and ``head_fraction_by``.
    """
    correct, w = pronoun_noun_attention(model, tok, examples)
    points = w[..., 0] > w[..., 1]  # (E, L, H)
    fractions = points.float().mean(0)  # (L, H)
    best = divmod(int(fractions.argmax()), fractions.shape[1])
    flat = w.flatten(1, 2)  # (E, L·H, 2)
    strongest = flat.amax(1)  # (E, 2): the largest weight on each noun over all heads
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.kind, []).append(i)
        groups.setdefault(f"{e.lang}/{e.kind}", []).append(i)
    res: dict[str, Any] = {
        "examples": len(examples),
        "accuracy": float(correct.float().mean()),
        "accuracy_by": {k: float(correct[v].float().mean()) for k, v in sorted(groups.items())},
        "head_fractions": [[round(float(x), 4) for x in row] for row in fractions],
        "best_head": list(best),
        "strongest_head_fraction": float((strongest[:, 0] > strongest[:, 1]).float().mean()),
    }
    if head is not None:
        layer, h = head
        res["head"] = [layer, h]
        res["head_fraction"] = float(fractions[layer, h])
        res["head_weights"] = {"antecedent": float(w[:, layer, h, 0].mean()),
                               "other": float(w[:, layer, h, 1].mean())}
        res["head_fraction_by"] = {k: float(points[v, layer, h].float().mean())
                                   for k, v in sorted(groups.items())}
    return res


def showcase_sentences() -> list[CorefExample]:
    """The sentences the demo prints: the seeds' "the cat sat on the mat because it was
    tired", the same with "soft" (it = mat), the Chinese 猫坐在垫子上，因为它很累, and a
    he/she pair. Their noun pairs are all in the "test" split."""
    return [
        coref_sentence("cat", "mat", relation="sat on", adjective="tired", antecedent=0),
        coref_sentence("cat", "mat", relation="sat on", adjective="soft", antecedent=1),
        coref_sentence("cat", "mat", relation="sat on", adjective="tired", antecedent=0,
                       lang="zh"),
        coref_sentence("mother", "boy", relation="thanked", adjective="happy", antecedent=1),
        coref_sentence("mother", "boy", relation="thanked", adjective="happy", antecedent=0,
                       lang="zh"),
    ]


def _write_json(path: Path, data: dict) -> None:
    text = json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _plots(model: BERT, tok: WordTokenizer, shows: Sequence[CorefExample],
           head: tuple[int, int], out: Path) -> list[Path]:
    """PNGs: the chosen head on the two English cat/mat sentences, every head on the first."""
    from ..viz import attention_maps, plot_alignment, plot_attention_grid

    layer, h = head
    paths = []
    for e in shows[:2]:
        ids = tok.encode(e.text, add_bos=True, add_eos=True)
        maps = attention_maps(model, ids)["encoder"]  # (L, H, N, N)
        tokens = tok.tokens(ids)
        word = e.tokens[-1]
        paths.append(plot_alignment(
            maps[layer, h], source_tokens=tokens, target_tokens=tokens,
            path=out / f"attention-{word}.png",
            title=f"layer {layer} head {h}: {e.text}  ({e.tokens[e.pronoun]} -> {e.answer})"))
        if e is shows[0]:
            paths.append(plot_attention_grid(maps, query_tokens=tokens, key_tokens=tokens,
                                             path=out / "attention-all-heads.png",
                                             title=e.text))
    return paths


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def run_coref_demo(*, out: str | None = None, quick: bool = False, seed: int = 0) -> int:
    """Train, evaluate and report (see the module docstring); write the run directory
    (``out``, new or empty — ``qkv.outputs.new_output_dir`` — default
    runs/demo-coref-<timestamp>). ``quick``: 60 small steps and 200
    held-out sentences (seconds; accuracy stays low). Returns 0.

    Runs on one CPU thread (restored after): the model is so small that more threads only
    add synchronisation, and one thread makes a seed reproduce the same run."""
    from ..train.rundir import RunDirLock

    run = new_output_dir(out if out is not None else Path("runs") / time.strftime(
        "demo-coref-%Y%m%d-%H%M%S"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with RunDirLock(run):  # one writer, as for training runs
            return _run(run=run, quick=quick, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _run(*, run: Path, quick: bool, seed: int) -> int:
    settings = _QUICK if quick else _FULL
    torch.manual_seed(seed)
    tok = WordTokenizer(coref_vocabulary())
    model = coref_model(tok.vocab_size)
    c = model.config
    print(f"qkv demo coref: a {c.num_layers}-layer, {c.num_heads}-head BERT (C={c.dim}) "
          f"learns which noun a pronoun means")
    print("  task: at 'it'/'he'/'she' (它/他/她) predict the antecedent word; the adjective "
          "(cats get tired, mats get soft) or he/she decides it")
    print(f"  held out: noun pairs never seen together in training, cat/mat among them "
          f"(seed {seed})")
    start = time.perf_counter()
    losses = train_coref(model, tok, steps=settings["steps"], batch_size=settings["batch_size"],
                         seed=seed, log=lambda s, loss: print(f"  step {s:5d}  loss {loss:.3f}"))
    train_s = time.perf_counter() - start
    valid = evaluate_coref(model, tok, coref_examples("valid", 0, settings["valid"], seed=seed))
    head = tuple(valid["best_head"])
    test = evaluate_coref(model, tok, coref_examples("test", 0, settings["test"], seed=seed),
                          head=head)
    layer, h = head
    print(f"  trained {settings['steps']} steps in {train_s:.1f} s (final loss "
          f"{sum(losses[-20:]) / len(losses[-20:]):.3f})")
    def kinds(by: dict[str, float]) -> str:
        return ", ".join(f"{k} {_percent(by[k])}" for k in COREF_KINDS if k in by)

    print(f"  held-out accuracy: {_percent(test['accuracy'])} of {test['examples']} test "
          f"sentences name the antecedent ({kinds(test['accuracy_by'])})")
    print(f"  attention: layer {layer} head {h} (best on valid) points the pronoun at its "
          f"antecedent in {_percent(test['head_fraction'])} of held-out pronouns "
          f"({kinds(test['head_fraction_by'])}; chance {_percent(CHANCE)}); mean weight "
          f"{test['head_weights']['antecedent']:.2f} on the antecedent vs "
          f"{test['head_weights']['other']:.2f} on the other noun")
    print(f"  strongest head per pronoun (any layer/head) is on the antecedent in "
          f"{_percent(test['strongest_head_fraction'])} (chance {_percent(CHANCE)})")
    shows = showcase_sentences()
    correct, w = pronoun_noun_attention(model, tok, shows)
    pred = coref_batch(tok, shows)
    with torch.no_grad():
        logits, _ = _pronoun_logits(model, pred)
    showcase = []
    for i, e in enumerate(shows):
        guess = tok.tokens([int(logits[i].argmax())])[0]
        other = e.tokens[sum(e.nouns) - e.antecedent]
        pron = e.tokens[e.pronoun]
        mark = "✓" if bool(correct[i]) else "✗"
        top = int(w[i].argmax())  # flat over (L, H, 2): the strongest pronoun -> noun weight
        sl, rest = divmod(top, 2 * w.shape[2])
        sh, sn = divmod(rest, 2)
        print(f"    {e.text}\n      {pron} -> {guess} {mark}   head {layer}.{h}: {e.answer} "
              f"{float(w[i, layer, h, 0]):.2f}, {other} {float(w[i, layer, h, 1]):.2f};  "
              f"strongest: head {sl}.{sh} on {(e.answer, other)[sn]} "
              f"{float(w[i, sl, sh, sn]):.2f}")
        showcase.append({"text": e.text, "pronoun": pron, "antecedent": e.answer,
                         "predicted": guess, "weights": {e.answer: float(w[i, layer, h, 0]),
                                                         other: float(w[i, layer, h, 1])}})
    model.save_pretrained(run)
    tok.save(run / "tokenizer.json")
    paths = _plots(model, tok, shows, head, run)
    _write_json(run / "metrics.json", {
        "seed": seed, "quick": quick, "steps": settings["steps"],
        "batch_size": settings["batch_size"], "train_seconds": round(train_s, 2),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]), "chance": CHANCE,
        "head": list(head), "valid": valid, "test": test, "showcase": showcase})
    print(f"  wrote {run}/: config.json, model.safetensors, tokenizer.json, metrics.json, "
          + ", ".join(p.name for p in paths))
    print(f'  try: qkv attention {run} --input "the duck slept on the sofa because it was '
          f'soft" --layer {layer} --head {h}')
    return 0
