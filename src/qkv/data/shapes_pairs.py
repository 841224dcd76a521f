"""The synthetic shapes task (``qkv.data.shapes``) as image-caption pairs for contrastive
training (``qkv train --model clip --task shapes``), and the texts of its zero-shot test.

Shapes: S image side, K = 30 classes (the colour/shape combinations of ``COMBINATIONS``),
M prompt templates of a language.

``ShapesPairs(image_size, seed)``: ``train(start, count)`` gives training examples start ..
start + count - 1 of an endless, index-addressable stream (images drawn on demand);
``heldout(count)`` the "valid" split (same combinations, other images); ``test(count)`` the
"test" split (the held-out combinations) with class indices. Captions are in English and
Chinese.

Captions: a quarter of the training examples (``PROMPT_CAPTION_SHARE``, a coin of (seed,
index)) are captioned by a zero-shot prompt of their (colour, shape) in their language — "a
photo of a red circle" / "一张红色圆形的照片" — instead of the data's "a small red circle on
the left". Without it the prompts are a form of text the tower never reads (no size,
position or count; at other character positions) and zero-shot accuracy falls far (the
figures: BENCHMARKS.md, "qkv demo clip"). The held-out combinations still never appear, in
any form.

``zero_shot_prompts(language)``: the M x K prompt table of the zero-shot test;
``shapes_texts()``: every caption and prompt the task can write (what a run's tokenizer is
fitted to, so that every prompt is encodable).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

import torch
from torch import Tensor

from .shapes import (
    COMBINATIONS,
    POSITIONS,
    PROMPT_TEMPLATES,
    SIZES,
    ShapesDataset,
    caption_for,
    class_prompts,
)

__all__ = ["PROMPT_CAPTION_SHARE", "ShapesPairs", "shapes_texts", "zero_shot_prompts"]

#: the share of training captions replaced by a zero-shot prompt of the example's
#: (colour, shape) ("a photo of a red circle"; ``ShapesPairs.prompt_caption``)
PROMPT_CAPTION_SHARE = 0.25
#: the examples of an endless ShapesDataset stream (images are drawn on demand)
_ENDLESS = 2**62


def zero_shot_prompts(language: str = "en") -> list[list[str]]:
    """The zero-shot prompts of the shapes task: for each of the M templates of
    ``PROMPT_TEMPLATES[language]``, the K = 30 prompts in ``COMBINATIONS`` order (M lists)."""
    return [class_prompts(t, language=language) for t in PROMPT_TEMPLATES[language]]


def shapes_texts() -> list[str]:
    """Every caption the shapes task can write (both languages) and every zero-shot prompt
    (both languages): what the tokenizer of a shapes run is fitted to."""
    labels = [{"colour": c, "shape": s, "count": 1, "size": size, "position": pos}
              for c, s in COMBINATIONS for size in SIZES for pos in POSITIONS]
    labels += [{"colour": c, "shape": s, "count": n, "size": "small", "position": None}
               for c, s in COMBINATIONS for n in (2, 3)]
    texts = [caption_for(lab, lang) for lang in ("en", "zh") for lab in labels]
    texts += [p for lang in ("en", "zh") for ps in zero_shot_prompts(lang) for p in ps]
    return texts


def _prompt_of(template: str, language: str, colour: str, shape: str) -> str:
    """``template`` filled with (colour, shape) as ``class_prompts`` fills it."""
    return class_prompts(template, language=language)[COMBINATIONS.index((colour, shape))]


@dataclasses.dataclass
class ShapesPairs:
    """The shapes task as training data (captions in English and Chinese).

    ``train(start, count)``: training examples start .. start + count - 1 of an endless
    stream -> (images (count, 3, S, S) float32 in [0, 1], captions). ``heldout(count)``:
    the first ``count`` of the "valid" split (same combinations, other images).
    ``test(count)``: the first ``count`` of the "test" split (held-out combinations) ->
    (images, labels (count,) int64 indices into ``COMBINATIONS``).

    Raises:
        ValueError naming ``prompt_share`` when it is not a number in [0, 1].
    """

    image_size: int
    seed: int = 0
    prompt_share: float = PROMPT_CAPTION_SHARE

    def __post_init__(self) -> None:
        if not (isinstance(self.prompt_share, (int, float)) and not isinstance(
                self.prompt_share, bool) and 0.0 <= self.prompt_share <= 1.0):
            raise ValueError(f"ShapesPairs: prompt_share must be a number in [0, 1], got "
                             f"{self.prompt_share!r}")

        self.splits = {split: ShapesDataset(split, size=_ENDLESS, image_size=self.image_size,
                                            seed=self.seed, language="both")
                       for split in ("train", "valid", "test")}

    @property
    def texts(self) -> list[str]:
        """Every text a run reads (``shapes_texts``): what its tokenizer is fitted to."""
        return shapes_texts()

    def train(self, start: int, count: int) -> tuple[Tensor, list[str]]:
        """Training pairs ``start .. start + count - 1``: the dataset's captions, each
        replaced with probability ``prompt_share`` by a prompt (``prompt_caption``)."""
        batch = self.splits["train"].batch(range(start, start + count))
        captions = [self.prompt_caption(start + k, lab) or caption
                    for k, (caption, lab) in enumerate(zip(batch.captions, batch.labels,
                                                           strict=True))]
        return batch.images, captions

    def prompt_caption(self, index: int, labels: dict[str, Any]) -> str | None:
        """The prompt that replaces the caption of training example ``index`` (labels as
        ``ShapesDataset`` gives), or None when it keeps its own: with probability
        ``prompt_share`` (a coin of ``(seed, index)`` alone, so that a resumed run reads
        the same), one of ``PROMPT_TEMPLATES[language]`` (uniform) filled with the
        example's colour and shape, in its caption's language."""
        if self.prompt_share <= 0.0:
            return None
        # the key names the coin's first home (the clip kind); changing it changes every run
        key = f"qkv.train.kinds.clip/prompt\x1f{self.seed}\x1f{index}".encode()
        rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(),
                                           "little"))
        if rng.random() >= self.prompt_share:
            return None
        lang = labels["language"]
        return _prompt_of(rng.choice(PROMPT_TEMPLATES[lang]), lang, labels["colour"],
                          labels["shape"])

    def heldout(self, count: int) -> tuple[Tensor, list[str]]:
        """The first ``count`` validation pairs: (images (count, 3, S, S), captions)."""
        batch = self.splits["valid"].batch(range(count))
        return batch.images, batch.captions

    def test(self, count: int) -> tuple[Tensor, Tensor]:
        """The first ``count`` test images (count, 3, S, S) and their class indices (count,)
        into ``COMBINATIONS``."""
        batch = self.splits["test"].batch(range(count))
        labels = torch.tensor([COMBINATIONS.index((lab["colour"], lab["shape"]))
                               for lab in batch.labels], dtype=torch.long)  # (count,)
        return batch.images, labels
