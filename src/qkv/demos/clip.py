"""``qkv demo clip``: a small CLIP (Radford et al. 2021) trained from scratch on synthetic
image-caption pairs — coloured shapes captioned in English and Chinese (``qkv.data.shapes``)
— then classifies images of (colour, shape) combinations it never saw together, through
text prompts alone.

Shapes: B images, K = 30 classes (every (colour, shape) of ``COMBINATIONS``), M prompt
templates, E embedding width, gh × gw image patches.

The run: ``qkv train --model clip --task shapes`` with the "clip-shapes" preset (32×32
images, patch 8, towers of width 64 with 3 image and 2 text layers), ``DEMO_TRAINING``
(800 steps of 256 pairs; ``train_clip``). The training split never shows the six
held-out combinations of the run's seed (``heldout_combinations``); the test split is made
only of them. Then, on ``TEST_EXAMPLES`` test images:

- ``zero-shot accuracy``: each image is given the combination whose prompts are most
  similar to it (cosine), among the prompts of all 30 combinations — not only the six
  held-out ones, among which colour alone would decide — the M templates of a language
  ensembled (``qkv.models.zero_shot_weights``: the mean of the normalised prompt
  embeddings, renormalised). English templates ("a photo of a {colour} {shape}", ...) are
  the headline; the Chinese ones ("一张{colour}{shape}的照片", ...) are reported beside them.
  Chance is 1/30 = 3.3 %.
- ``text→image recall@1``: for each test image's own caption (English or Chinese, as the
  data wrote it), the nearest of the test images; a hit when that image is one the caption
  describes (its caption, written in English, is the same: identical captions occur, e.g.
  "two blue circles", and any image they describe is a right answer).

Files, beside the run (checkpoint/, metrics.jsonl, run.json): ``similarity.png`` (cosine
similarities of 12 test images × their English captions), ``predictions.png`` (test
images with the predicted prompt), ``attention.png`` (attention rollout of the image
tower over the patches, drawn over a few test images), ``demo.json`` (the figures printed).

The budget is set in steps, not seconds, so a loaded machine changes the time, not the
result. What made the recipe work: a quarter of the training captions are zero-shot
prompts of their image's (colour, shape) ("a photo of a red circle"; the kind's
``PROMPT_CAPTION_SHARE``). Without them the prompts are a text form the character-level
text tower never reads (no size, position or count, words at other positions): after 300
steps it named held-out images right 34 % of the time by "a photo of a {colour} {shape}"
but 81 % by prompts in their own caption's form, and even on trained combinations the
prompts read only 30-50 % (colour 60-80 %). With them: the trainer's evaluation read
54 % / 88.5 % at steps 200 / 400 of 800 (seed 0, 200 test images), where 1,300 steps of
the old recipe peaked at 45 %; the demo printed 96.3 % (Chinese prompts 96.3 %), and
95.4 % / 95.7 % with ``--steps 700``. CPU cost: the whole 700-step demo took 150
CPU-seconds on one thread (0.2 s a step, image drawing included): the 800 steps come to
about 170 CPU-seconds, within three minutes on an idle 2-core machine; 2 threads on a
loaded machine can be far slower than 1 (oversubscription).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DEMO_TRAINING", "PRESET", "QUICK_STEPS", "QUICK_TEST_EXAMPLES", "TEST_EXAMPLES",
           "run_clip_demo", "train_clip", "training_settings", "zero_shot_class_weights"]

#: the model: ``CLIPConfig.PRESETS["clip-shapes"]`` (32 px, patch 8, width 64, 3 + 2 layers)
PRESET = "clip-shapes"
#: training settings of the full demo (TrainConfig fields)
DEMO_TRAINING: dict[str, Any] = dict(steps=800, batch_size=256, lr=2e-3, warmup=100,
                                     schedule="cosine", weight_decay=0.1, label_smoothing=0.0,
                                     eval_every=200, eval_examples=200)
#: ``--quick``: steps (seconds, for smoke tests; accuracy near chance)
QUICK_STEPS = 4
#: test images of the full demo / of ``--quick``
TEST_EXAMPLES = 1000
QUICK_TEST_EXAMPLES = 60
#: test images drawn in similarity.png / predictions.png
SIMILARITY_IMAGES = 12
GRID_IMAGES = 16


def training_settings(steps: int | None = None, *, quick: bool = False) -> dict[str, Any]:
    """The TrainConfig fields of a demo run: ``DEMO_TRAINING``, with ``steps`` (or
    ``QUICK_STEPS`` for ``quick``) replacing its step budget — warm-up at most a tenth of
    the run, four evaluations (one at the end; a run under 40 steps: only that one),
    batches of 64 for ``quick``.

    Raises:
        ValueError naming ``steps`` when it is not a positive int.
    """
    settings = dict(DEMO_TRAINING)
    if quick and steps is None:
        steps = QUICK_STEPS
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        settings.update(steps=steps, warmup=min(DEMO_TRAINING["warmup"], steps // 10),
                        eval_every=steps // 4 if steps >= 40 else steps)
    if quick:
        settings.update(batch_size=64, eval_examples=32)
    return settings


def train_clip(out_dir: str | os.PathLike, *, steps: int | None = None, seed: int = 0,
               quick: bool = False, log: Callable[[str], None] | None = print,
               lock: Any = None) -> Path:
    """Train the demo's CLIP on the shapes task into the run directory ``out_dir`` (new or
    empty: checkpoint/, metrics.jsonl, run.json) and return it; ``qkv.train.load_run(out_dir)``
    gives ``(CLIP, tokenizer)``. The recipe ``qkv demo clip`` reports on (and Flamingo's demo
    reuses for its vision tower).

    Args:
        out_dir: the run directory.
        steps: the step budget (default ``DEMO_TRAINING["steps"]``; see ``training_settings``).
        seed: initialisation, and the held-out combinations and images of the shapes task.
        quick: a few steps of small batches (smoke tests).
        log: receives the trainer's lines (evaluations, checkpoints); None: silent.
        lock: a held ``qkv.train.RunDirLock`` on ``out_dir`` (default: the trainer takes one).

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from ..train import TrainConfig, Trainer

    config = TrainConfig(model="clip", task="shapes", preset=PRESET, seed=seed,
                         **training_settings(steps, quick=quick))
    trainer = Trainer(config, out_dir, lock=lock,
                      log=(lambda line: None) if log is None else log)
    if log is not None:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        log(f"training {n_params / 1e6:.2f}M parameters for {config.steps} steps of "
            f"{config.batch_size} image-caption pairs ({torch.get_num_threads()} CPU threads)")
    trainer.run()
    return Path(out_dir)


def zero_shot_class_weights(model: Any, tokenizer: Any, language: str) -> Tensor:
    """Class embeddings (K, E), unit rows, of the 30 combinations from the M prompt templates
    of ``language`` ("en" / "zh"): each class's M prompts encoded and normalised, averaged and
    renormalised (``qkv.models.zero_shot.prompt_weights``)."""
    from ..data.clip_text import encode_texts
    from ..data.shapes import PROMPT_TEMPLATES, class_prompts
    from ..models.zero_shot import prompt_weights

    device = next(model.parameters()).device

    def tokenize(texts: list[str]) -> tuple[Tensor, Tensor]:
        ids, mask = encode_texts(tokenizer, texts)
        return ids.to(device), mask.to(device)

    per_template = [class_prompts(t, language=language) for t in PROMPT_TEMPLATES[language]]
    by_class = [list(p) for p in zip(*per_template, strict=True)]  # K lists of M prompts
    return prompt_weights(model, tokenize, by_class)  # (K, E)


@torch.no_grad()
def _image_embeds(model: Any, images: Tensor, chunk: int = 250) -> Tensor:
    """(B, E) image embeddings of images (B, 3, H, W) in [0, 1], fp32."""
    from ..data.image_preprocess import to_pixel_values

    device = next(model.parameters()).device
    return torch.cat([model.encode_image(to_pixel_values(images[i:i + chunk]).to(device))
                      for i in range(0, len(images), chunk)]).float()


@torch.no_grad()
def _text_embeds(model: Any, tokenizer: Any, texts: list[str], chunk: int = 250) -> Tensor:
    """(B, E) text embeddings, fp32."""
    from ..data.clip_text import encode_texts

    device = next(model.parameters()).device
    rows = []
    for i in range(0, len(texts), chunk):
        ids, mask = encode_texts(tokenizer, texts[i:i + chunk])
        rows.append(model.encode_text(ids.to(device), mask.to(device)))
    return torch.cat(rows).float()


def _pick(labels: list[dict[str, Any]], combos: tuple[tuple[str, str], ...],
          per_combo: int) -> list[int]:
    """Indices of the first ``per_combo`` examples of each combination, with distinct
    English captions, combination by combination."""
    from ..data.shapes import caption_for

    picked: list[int] = []
    for combo in combos:
        seen: set[str] = set()
        for i, lab in enumerate(labels):
            caption = caption_for(lab, "en")
            if (lab["colour"], lab["shape"]) == combo and caption not in seen:
                seen.add(caption)
                picked.append(i)
                if len(seen) == per_combo:
                    break
    return picked


def _name(combo: tuple[str, str]) -> str:
    return f"{combo[0]} {combo[1]}"


def run_clip_demo(*, out: str | None = None, steps: int | None = None, quick: bool = False,
                  seed: int = 0) -> int:
    """Train, evaluate and report (see the module docstring); returns the exit status 0.

    Args:
        out: the run directory, new or empty (default ``runs/demo-clip-<time>``; see
            ``qkv.outputs.new_output_dir``).
        steps: the step budget (default 800; ``training_settings``).
        quick: a short run for smoke tests (accuracy near chance).
        seed: initialisation, and the held-out combinations and images of the shapes task.

    Raises:
        ValueError: ``out`` not new/empty; ``steps`` not a positive int.
    """
    from ..data.shapes import (
        COMBINATIONS,
        PROMPT_TEMPLATES,
        ShapesDataset,
        caption_for,
        class_prompts,
    )
    from ..files import atomic_write
    from ..outputs import new_output_dir
    from ..train import load_run
    from ..train.rundir import RunDirLock
    from ..viz.patches import attention_rollout, draw_image_grid, draw_similarity

    settings = training_settings(steps, quick=quick)  # refuses a bad budget before writing
    t0 = time.perf_counter()
    run_dir = new_output_dir(out or f"runs/demo-clip-{time.strftime('%Y%m%d-%H%M%S')}")
    with RunDirLock(run_dir) as lock:  # one writer, up to demo.json
        count = QUICK_TEST_EXAMPLES if quick else TEST_EXAMPLES
        test = ShapesDataset("test", size=count, seed=seed, language="both")
        train = ShapesDataset("train", size=4, seed=seed, language="both")
        print("qkv demo clip: CLIP (Radford et al. 2021) learns a shared space for images and "
              "captions from scratch,\nthen names images of colour/shape combinations it never "
              "saw together, through text prompts alone.\nTraining pairs (generated 32×32 "
              "images; English and Chinese captions):")
        for i in range(len(train)):
            caption, labels = train.describe(i)
            print(f"  {_name((labels['colour'], labels['shape'])):16} {caption!r}")
        print(f"Held out of training (the test split is only these): "
              f"{', '.join(_name(c) for c in test.heldout)}")
        train_clip(run_dir, steps=settings["steps"], seed=seed, quick=quick,
                   log=lambda line: print(f"  {line}"), lock=lock)
        train_s = time.perf_counter() - t0

        model, tok = load_run(run_dir)
        model.eval()
        batch = test.batch(range(count))
        labels = torch.tensor([COMBINATIONS.index((lab["colour"], lab["shape"]))
                               for lab in batch.labels])  # (B,)
        with torch.no_grad():
            image_embeds = _image_embeds(model, batch.images)  # (B, E)
            scores = {lang: F.normalize(image_embeds, dim=-1)
                      @ zero_shot_class_weights(model, tok, lang).t()  # (B, K)
                      for lang in ("en", "zh")}
            caption_embeds = _text_embeds(model, tok, batch.captions)  # (B, E)
        preds = {lang: s.argmax(dim=-1) for lang, s in scores.items()}  # (B,)
        accuracy = {lang: float((p == labels).float().mean()) for lang, p in preds.items()}
        per_combo = {_name(c): float((preds["en"][labels == COMBINATIONS.index(c)]
                                      == COMBINATIONS.index(c)).float().mean())
                     for c in test.heldout if bool((labels == COMBINATIONS.index(c)).any())}
        chance = 1 / len(COMBINATIONS)
        # text -> image: the nearest test image to each caption is one the caption describes
        sim = F.normalize(caption_embeds, dim=-1) @ F.normalize(image_embeds, dim=-1).t()
        nearest = sim.argmax(dim=-1).tolist()  # (B,) per caption
        english = [caption_for(lab, "en") for lab in batch.labels]
        recall = sum(english[j] == english[i] for i, j in enumerate(nearest)) / count

        # pictures: the similarity matrix, predictions, attention rollout
        shown = _pick(batch.labels, test.heldout, 2)[:SIMILARITY_IMAGES]
        shown_captions = [english[i] for i in shown]
        with torch.no_grad():
            pair_sim = (F.normalize(image_embeds[shown], dim=-1)
                        @ F.normalize(_text_embeds(model, tok, shown_captions), dim=-1).t())
        sim_png = draw_similarity(batch.images[shown], shown_captions, pair_sim,
                                  run_dir / "similarity.png",
                                  title="cosine similarity of test images and their captions")
        prompts = class_prompts(language="en")
        grid = list(range(min(GRID_IMAGES, count)))
        grid_captions = []
        for i in grid:
            guess = prompts[int(preds["en"][i])]
            truth = _name(COMBINATIONS[int(labels[i])])
            grid_captions.append(guess if int(preds["en"][i]) == int(labels[i])
                                 else f"{guess} (truth: {truth})")
        pred_png = draw_image_grid(batch.images[grid], run_dir / "predictions.png",
                                   captions=grid_captions,
                                   title="zero-shot predictions on held-out combinations")
        one_each = _pick(batch.labels, test.heldout, 1)
        with torch.no_grad():
            from ..data.image_preprocess import to_pixel_values

            vis = model.vision(to_pixel_values(batch.images[one_each]), output_attentions=True)
        maps = attention_rollout(vis.attentions)  # (b, gh, gw)
        images, overlays, captions = [], [], []
        for k, i in enumerate(one_each):
            images += [batch.images[i], batch.images[i]]
            overlays += [torch.zeros_like(maps[k]), maps[k]]  # a zero map: the image as is
            captions += [english[i], "attention rollout"]
        att_png = draw_image_grid(images, run_dir / "attention.png", captions=captions,
                                  maps=overlays, columns=4,
                                  title="where the image tower's class token reads from")
        wall = time.perf_counter() - t0
        summary = {"zero_shot_accuracy": accuracy["en"], "zero_shot_accuracy_zh": accuracy["zh"],
                   "chance": chance, "text_to_image_recall_at_1": recall,
                   "per_combination": per_combo, "test_examples": count,
                   "heldout": [list(c) for c in test.heldout], "classes": len(COMBINATIONS),
                   "templates": {lang: list(PROMPT_TEMPLATES[lang]) for lang in ("en", "zh")},
                   "steps": settings["steps"], "seed": seed,
                   "train_seconds": round(train_s, 1), "wall_seconds": round(wall, 1),
                   "threads": torch.get_num_threads()}
        text = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
        atomic_write(run_dir / "demo.json", lambda tmp: Path(tmp).write_text(text,
                                                                            encoding="utf-8"))
    print(f"\nZero-shot on {count} test images of the {len(test.heldout)} held-out "
          f"combinations, each classified among the prompts of all {len(COMBINATIONS)}:")
    print(f"zero-shot accuracy: {100 * accuracy['en']:.1f}% (English prompts "
          f"{' / '.join(repr(t) for t in PROMPT_TEMPLATES['en'])}; chance 1/"
          f"{len(COMBINATIONS)} = {100 * chance:.1f}%)")
    print(f"with Chinese prompts ({' / '.join(repr(t) for t in PROMPT_TEMPLATES['zh'])}): "
          f"{100 * accuracy['zh']:.1f}%")
    print("  per held-out combination: " + ", ".join(f"{k} {100 * v:.0f}%"
                                                     for k, v in per_combo.items()))
    print(f"text→image recall@1: {100 * recall:.1f}% (each test caption's nearest of the "
          f"{count} test images is one it describes)")
    print(f"time: {wall:.0f} s in all ({train_s:.0f} s of training, "
          f"{torch.get_num_threads()} CPU threads)")
    print(f"run directory: {run_dir}\n  checkpoint:  {run_dir / 'checkpoint'}\n"
          f"  similarity:  {sim_png}\n  predictions: {pred_png}\n  attention:   {att_png}  "
          f"(qkv attention {run_dir} --index 0)")
    return 0
