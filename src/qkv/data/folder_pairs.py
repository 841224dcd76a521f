"""A folder of images with a captions TSV (``qkv.data.ImageFolderDataset``) as image-caption
pairs for contrastive training (``qkv train --model clip --data DIR``).

Shapes: S image side.

``FolderPairs(folder, image_size, seed)``: every image is checked when the pairs are built
(a bad file stops the run before it starts); whole images (with all their captions) are held
out — 5 %, at least 1, at most 1000 — and never trained on; the training lines are read in
seeded per-epoch permutations (``qkv.data.order.epoch_indices``), so a resumed run reads the
same. Images are resized (shorter side, bicubic) and centre-cropped to S, in [0, 1]
(``FolderPairs.to_unit``; CLIP's normalisation comes later, ``to_pixel_values``).
``folder_fingerprint(folder)``: what a run records to notice a changed folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from pathlib import Path
from typing import Any

from torch import Tensor

from .files import regular_file
from .image_preprocess import preprocess_image
from .images_folder import ImageFolderDataset
from .order import epoch_indices

__all__ = ["FolderPairs", "folder_fingerprint"]

#: a folder's held-out share of its images (at least 1, at most _MAX_HELD)
_HELD_FRACTION, _MAX_HELD = 0.05, 1000


@dataclasses.dataclass
class FolderPairs:
    """A folder of images + captions TSV as training data: whole images (with all their
    captions) held out, the rest shuffled per epoch. Items as ``ShapesPairs``: (images
    (count, 3, S, S) float32 in [0, 1], resized and centre-cropped to S, captions).

    Raises:
        ValueError naming the folder when it holds fewer than 2 different images; the
        dataset's ``DataError`` for a bad TSV line or image.
    """

    folder: str
    image_size: int
    seed: int = 0

    @staticmethod
    def to_unit(image: Tensor, size: int) -> Tensor:
        """A decoded image (3, h, w) uint8 (``qkv.data.load_image``) -> (3, S, S) float32
        in [0, 1]: shorter side resized to S = ``size`` (bicubic), centre-cropped — what a
        folder's images are trained on (``qkv attention --image`` reads its image so)."""
        return preprocess_image(image, size, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))

    def __post_init__(self) -> None:
        size = self.image_size

        def to_unit(image: Tensor) -> Tensor:  # (3, h, w) uint8 -> (3, S, S) in [0, 1]
            return FolderPairs.to_unit(image, size)

        # every image checked now (header, size, mode, a PNG's checksums, a truncated
        # JPEG): a bad file stops the run before it starts, not when first drawn
        self.dataset = ImageFolderDataset(self.folder, transform=to_unit, verify="quick")
        files = sorted({str(f) for f in self.dataset.files})
        if len(files) < 2:
            raise ValueError(f"--data {self.folder}: needs at least 2 different images (one to "
                             f"train on, one to hold out), got {len(files)}")
        random.Random(self.seed).shuffle(files)
        n_held = min(max(1, int(len(files) * _HELD_FRACTION)), _MAX_HELD, len(files) - 1)
        held = set(files[:n_held])
        rows = range(len(self.dataset))  # one per TSV line (an image may have several)
        self.held_rows = [i for i in rows if str(self.dataset.files[i]) in held]
        self.train_rows = [i for i in rows if str(self.dataset.files[i]) not in held]

    @property
    def captions(self) -> list[str]:
        """Every caption of the TSV."""
        return self.dataset.captions

    @property
    def texts(self) -> list[str]:
        """Every text a run reads (the TSV's captions): what its tokenizer is fitted to."""
        return list(self.dataset.captions)

    def train(self, start: int, count: int) -> tuple[Tensor, list[str]]:
        """Training pairs ``start .. start + count - 1`` (epochs shuffled by (seed, epoch)):
        (images (count, 3, S, S), captions)."""
        idx = epoch_indices(len(self.train_rows), start, count, self.seed)
        return self.dataset.batch([self.train_rows[i] for i in idx])

    def heldout(self, count: int) -> tuple[Tensor, list[str]]:
        """The first ``count`` held-out pairs (fewer if the folder holds fewer)."""
        return self.dataset.batch(self.held_rows[:count])


def folder_fingerprint(folder: str | Path) -> dict[str, Any]:
    """``{"size", "sha256"}`` of a folder of images: SHA-256 over the captions TSV's bytes
    and each other file's relative name and size; size the total of their bytes."""
    folder = Path(folder)
    tsv = regular_file(folder / "captions.tsv")  # a FIFO would block, a device never end
    digest = hashlib.sha256(tsv.read_bytes())
    total = tsv.stat().st_size
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p != tsv):
        size = path.stat().st_size
        digest.update(f"\0{path.relative_to(folder).as_posix()}\0{size}".encode())
        total += size
    return {"size": total, "sha256": digest.hexdigest()}
