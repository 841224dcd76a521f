"""Interleaved image-text question answering on ``ShapesDataset`` images, for Flamingo.

Shapes: B batch, N text length (characters = token ids with a ``CharTokenizer``), T images per
row, H = W image side.

A row interleaves 1..``max_images`` images, each followed by questions about it::

    <image> Q: what colour is the circle? A: red. <image> Q: how many squares? A: 3.

Questions (each answerable only from its image; the question never names the answer):

- "colour": "what colour is the circle?" (one object) / "what colour are the squares?" ->
  a colour of ``COLOURS``;
- "shape": "what shape is it?" (one object) / "what shape are they?" -> a shape of ``SHAPES``;
- "count": "how many circles?" -> "1", "2" or "3".

With ``questions_per_image`` > 1 the wording of one question can hint at another's answer
("what colour are the squares?" says the count is 2 or 3); one question per image (the
default) leaves the text no hint.

The ``<image>`` token. In text a row writes ``IMAGE_CHAR`` (U+FFFC OBJECT REPLACEMENT
CHARACTER, Unicode's placeholder for an embedded object) where an image goes, so a
``CharTokenizer`` whose alphabet holds it (``qa_alphabet()``) gives ``<image>`` one id
(``image_token_id(tokenizer)``), and no ordinary text can spell it. ``QARow.display()``
writes it as ``<image>``. A byte-level ``BPETokenizer`` splits U+FFFC into bytes unless its
merges joined them; ``image_token_id`` refuses a tokenizer that does not give it one id.

Answers are marked for the loss and the accuracy: ``QARow.answer_spans`` holds the character
offsets [start, end) of each answer in ``text`` (the answer word, without the final "."),
one per ``QARow.pairs`` entry. ``QARow.text_only()`` is the same row with the images removed
(the text-only baseline), its spans shifted to match.

Splits: "train" rows use images of ``ShapesDataset("train")``; "test" rows use images of
``ShapesDataset(image_split)`` — default "valid", a separate stream of images that no train
row shows (held-out images of the same colours and shapes); "test" for the held-out
(colour, shape) combinations (compositional generalisation). Row ``i`` of ``(seed, split)``
is drawn from its own BLAKE2-seeded ``random.Random``: the same index gives the same row on
every machine, without drawing the rows before it.

Example::

    qa = ShapesQADataset("train", size=10_000)
    row = qa[0]
    row.display()                 # "<image> Q: what shape is it? A: star. <image> Q: ..."
    images = qa.images_of(row)    # (T, 3, 32, 32)
    tok = CharTokenizer(qa_alphabet())
    batch = qa.collate([qa[i] for i in range(8)], tok)   # ids, images, masks
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .order import hash_int
from .shapes import COLOURS, PLURAL, SHAPES, ShapesDataset

__all__ = ["IMAGE_CHAR", "IMAGE_TOKEN", "QA_KINDS", "QABatch", "QAPair", "QARow",
           "ShapesQADataset", "image_token_id", "qa_alphabet"]

#: the character that stands for an image in a row's text (U+FFFC OBJECT REPLACEMENT CHAR)
IMAGE_CHAR = "\ufffc"
#: how ``QARow.display`` writes it
IMAGE_TOKEN = "<image>"
QA_KINDS = ("colour", "shape", "count")
_QA_SIZES = {"train": 100_000, "test": 1_000}


def qa_alphabet() -> str:
    """Every character a row can hold (``IMAGE_CHAR`` included), sorted: the alphabet of a
    ``CharTokenizer`` for this data."""
    words = [*COLOURS, *SHAPES, *PLURAL.values(), "123", "Q: A: .?",
             "what colour is the are shape it they how many"]
    return "".join(sorted(set("".join(words)) | {IMAGE_CHAR}))


def image_token_id(tokenizer: Any) -> int:
    """The id ``tokenizer`` gives ``IMAGE_CHAR``; ValueError when it is not exactly one id
    (or is ``<unk>``)."""
    ids = tokenizer.encode(IMAGE_CHAR)
    if len(ids) != 1 or ids[0] == getattr(tokenizer, "unk_id", None):
        raise ValueError(f"tokenizer must encode IMAGE_CHAR (U+FFFC, the <image> token) as one "
                         f"id, got {ids}; build a CharTokenizer with qa_alphabet()")
    return ids[0]


@dataclasses.dataclass(frozen=True)
class QAPair:
    """One question about image ``image`` (0-based, within the row) of kind ``kind``."""

    question: str
    answer: str
    kind: str
    image: int


@dataclasses.dataclass(frozen=True)
class QARow:
    """An interleaved row.

    Attributes:
        text: the row, ``IMAGE_CHAR`` where each image goes.
        image_indices: T indices into the dataset's ``images`` (a ``ShapesDataset``).
        pairs: the questions and answers, in text order.
        answer_spans: [start, end) character offsets in ``text`` of each pair's answer.
        labels: T label dicts of the images (``ShapesDataset`` labels).
    """

    text: str
    image_indices: tuple[int, ...]
    pairs: tuple[QAPair, ...]
    answer_spans: tuple[tuple[int, int], ...]
    labels: tuple[dict[str, Any], ...] = ()

    def display(self) -> str:
        """``text`` with each image written ``<image>``."""
        return self.text.replace(IMAGE_CHAR, IMAGE_TOKEN)

    def text_only(self) -> QARow:
        """The row without its images (``IMAGE_CHAR`` and the space after it removed),
        answer spans shifted: the text-only baseline's input."""
        drop = IMAGE_CHAR + " "
        spans = []
        for start, end in self.answer_spans:
            shift = self.text[:start].count(drop) * len(drop)
            spans.append((start - shift, end - shift))
        return QARow(self.text.replace(drop, ""), (), self.pairs, tuple(spans), ())


class QABatch(NamedTuple):
    """``ShapesQADataset.collate``: ``input_ids`` (B, N) right-padded with ``pad_id``,
    ``attention_mask`` (B, N) bool, ``images`` (B, T, 3, H, W) (padded slots zero),
    ``image_counts`` (B,), ``answer_mask`` (B, N) bool: True on the answer characters'
    positions."""

    input_ids: Tensor
    attention_mask: Tensor
    images: Tensor
    image_counts: Tensor
    answer_mask: Tensor


def _question(kind: str, labels: dict[str, Any]) -> tuple[str, str]:
    shape, count = labels["shape"], labels["count"]
    if kind == "colour":
        q = (f"what colour is the {shape}?" if count == 1
             else f"what colour are the {PLURAL[shape]}?")
        return q, labels["colour"]
    if kind == "shape":
        return ("what shape is it?" if count == 1 else "what shape are they?"), shape
    return f"how many {PLURAL[shape]}?", str(count)


class ShapesQADataset:
    """Interleaved image-question-answer rows; see the module docstring.

    Args:
        split: "train" or "test".
        size: rows (default 100 000 / 1 000); made on demand.
        max_images: T, the most images per row (each row has 1..T, uniformly).
        questions_per_image: questions after each image (distinct kinds; <= 3).
        kinds: the question kinds drawn from (a subset of ``QA_KINDS``).
        image_size: H = W. seed: selects rows and images (and the held-out combinations).
        image_split: the ``ShapesDataset`` split test rows draw from: "valid" (default,
            held-out images) or "test" (held-out colour-shape combinations). Train rows always
            use "train".

    Attributes:
        images: the ``ShapesDataset`` the rows' ``image_indices`` index.
    """

    def __init__(self, split: str = "train", *, size: int | None = None, max_images: int = 3,
                 questions_per_image: int = 1, kinds: Sequence[str] = QA_KINDS,
                 image_size: int = 32, seed: int = 0, image_split: str = "valid") -> None:
        if split not in _QA_SIZES:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        size = _QA_SIZES[split] if size is None else size
        for name, val in (("size", size), ("max_images", max_images),
                          ("questions_per_image", questions_per_image)):
            if not isinstance(val, int) or isinstance(val, bool) or val < (0 if name == "size"
                                                                          else 1):
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        kinds = tuple(kinds)
        if not kinds or any(k not in QA_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(f"kinds must be distinct names of {QA_KINDS}, got {kinds!r}")
        if questions_per_image > len(kinds):
            raise ValueError(f"questions_per_image={questions_per_image} exceeds the "
                             f"{len(kinds)} kinds {kinds}")
        if image_split not in ("valid", "test"):
            raise ValueError(f"image_split must be 'valid' or 'test', got {image_split!r}")
        self.split, self.size, self.seed = split, size, seed
        self.max_images, self.questions_per_image, self.kinds = (max_images,
                                                                 questions_per_image, kinds)
        self.images = ShapesDataset("train" if split == "train" else image_split,
                                    image_size=image_size, seed=seed)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return (f"ShapesQADataset({self.split!r}, size={self.size}, max_images="
                f"{self.max_images}, images={self.images!r})")

    def __getitem__(self, index: int) -> QARow:
        """Row ``index`` (negative from the end); deterministic per (seed, split, index)."""
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} rows")
        i = index % self.size
        rng = random.Random(hash_int("qkv.data.shapes_qa", self.seed, self.split, i))
        count = rng.randint(1, self.max_images)
        indices = tuple(rng.randrange(len(self.images)) for _ in range(count))
        text, pairs, spans, labels = "", [], [], []
        for t, idx in enumerate(indices):
            _, lab = self.images.describe(idx)
            labels.append(lab)
            text += ("" if t == 0 else " ") + IMAGE_CHAR
            for kind in rng.sample(self.kinds, self.questions_per_image):
                question, answer = _question(kind, lab)
                text += f" Q: {question} A: "
                spans.append((len(text), len(text) + len(answer)))
                text += answer + "."
                pairs.append(QAPair(question, answer, kind, t))
        return QARow(text, indices, tuple(pairs), tuple(spans), tuple(labels))

    def images_of(self, row: QARow) -> Tensor:
        """The row's images (T, 3, H, W), in ``image_indices`` order."""
        if not row.image_indices:
            side = self.images.image_size
            return torch.zeros(0, 3, side, side, dtype=self.images.dtype)
        return torch.stack([self.images[i][0] for i in row.image_indices])

    def collate(self, rows: Sequence[QARow], tokenizer: Any, *,
                max_images: int | None = None) -> QABatch:
        """Batch rows for a ``Flamingo`` with a ``CharTokenizer`` (one id per character, so
        character offsets are token positions). Text right-padded; ``images`` (B, T, 3, H, W)
        with T = ``max_images`` (default ``self.max_images``; text-only rows: 0 allowed).

        Raises:
            ValueError for an empty batch, a tokenizer that is not one id per character, a
            row with more images than T.
        """
        if not rows:
            raise ValueError("rows is empty")
        t = self.max_images if max_images is None else max_images
        encoded = [tokenizer.encode(r.text) for r in rows]
        bad = [r for r, ids in zip(rows, encoded, strict=True) if len(ids) != len(r.text)]
        if bad:
            raise ValueError(f"collate needs one token per character (a CharTokenizer); "
                             f"{type(tokenizer).__name__} gave another length for "
                             f"{bad[0].display()!r}")
        b, n = len(rows), max(len(ids) for ids in encoded)
        ids = torch.full((b, n), tokenizer.pad_id, dtype=torch.long)  # (B, N)
        keep = torch.zeros(b, n, dtype=torch.bool)  # (B, N)
        answers = torch.zeros(b, n, dtype=torch.bool)  # (B, N)
        side = self.images.image_size
        images = torch.zeros(b, t, 3, side, side, dtype=self.images.dtype)  # (B, T, 3, H, W)
        counts = torch.zeros(b, dtype=torch.long)  # (B,)
        for r, (row, row_ids) in enumerate(zip(rows, encoded, strict=True)):
            if len(row.image_indices) > t:
                raise ValueError(f"row {r} has {len(row.image_indices)} images, more than "
                                 f"max_images={t}")
            ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
            keep[r, :len(row_ids)] = True
            for start, end in row.answer_spans:
                answers[r, start:end] = True
            counts[r] = len(row.image_indices)
            if row.image_indices:
                images[r, :counts[r]] = self.images_of(row)
        return QABatch(ids, keep, images, counts, answers)
