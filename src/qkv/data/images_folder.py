"""Users' own image-caption data: a folder of images and a captions TSV.

Shapes: B batch, H image height, W image width.

The TSV (UTF-8, default ``<folder>/captions.tsv``) holds one ``file<TAB>caption`` per line;
``file`` is a path relative to the folder (sub-folders allowed, ``/`` separators). Blank
lines are skipped, a first line ``file<TAB>caption`` is taken as a header, and one image
may appear on several lines (several captions). Every problem is a ``DataError`` (a
``ValueError``) naming the TSV and its line:

- a line without exactly one tab, an empty file name or caption, a TSV with no lines;
- an absolute path or one that leaves the folder (``../x.png``, or a link that resolves
  outside it);
- a missing image (checked when the dataset is built);
- an image Pillow cannot decode (when it is loaded; ``verify=True`` loads every image when
  the dataset is built).

``load_image(path)`` decodes one image to a (3, H, W) uint8 RGB tensor: the EXIF orientation
is applied; grayscale, palette, CMYK and other modes are converted to RGB; an alpha channel
(RGBA, LA, a palette with transparency) is composited onto white; 16-bit grayscale is
scaled to 8 bits (divided by 257). Floating-point images (mode "F") are refused.

The dataset gives each image as decoded, (3, H, W) uint8 of its own size, unless
``image_size=S`` asks for CLIP preprocessing (``qkv.data.image_preprocess.preprocess_image``:
shorter side resized to S, bicubic; centre crop S × S; CLIP mean / std) -> (3, S, S)
float32, or ``transform`` maps the uint8 tensor to anything else.
``ImageFolderDataset.batch`` stacks images and so needs them all the same size.

Example::

    data = ImageFolderDataset("photos", image_size=224)
    image, caption = data[0]                 # (3, 224, 224) float32, str
    images, captions = data.batch(range(8))  # (8, 3, 224, 224), 8 strings
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from .files import DataError, tab_lines

__all__ = ["ImageFolderDataset", "load_image"]

_HEADER = ("file", "caption")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _to_rgb(image: Image.Image, where: str) -> Image.Image:
    """``image`` as an 8-bit RGB Pillow image (see the module docstring)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "F":
        raise DataError(f"{where}: floating-point images (mode 'F') are not supported; "
                        f"save it as 8- or 16-bit")
    if mode in _SIXTEEN_BIT:
        scaled = image.point(lambda v: v / 257.0, "F") if mode == "I" else (
            image.convert("I").point(lambda v: v / 257.0, "F"))
        return scaled.convert("L").convert("RGB")
    if (mode == "P" and "transparency" in image.info) or mode in ("PA", "LA", "La", "RGBa"):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError as err:
        raise DataError(f"{where}: cannot convert image mode {mode!r} to RGB: {err}") from err


def load_image(path: str | os.PathLike) -> Tensor:
    """Decode the image at ``path`` into a (3, H, W) uint8 RGB tensor.

    EXIF orientation applied; any mode converted to RGB, alpha composited onto white,
    16-bit grayscale divided by 257; the first frame of an animation.

    Raises:
        DataError: the file is missing or unreadable, not an image Pillow can decode
            (corrupt or truncated), too large (Pillow's decompression-bomb limit), or a
            floating-point image.
    """
    return _load(Path(path), str(path))


def _load(path: Path, where: str) -> Tensor:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                opened.load()
                image = ImageOps.exif_transpose(opened)
                rgb = _to_rgb(image, where)
                rgb.load()
    except DataError:
        raise
    except FileNotFoundError as err:
        raise DataError(f"{where}: image not found: {path}") from err
    except (UnidentifiedImageError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as err:
        raise DataError(f"{where}: cannot read image {path}: {err}") from err
    except (OSError, ValueError, SyntaxError, EOFError) as err:  # truncated, corrupt data
        raise DataError(f"{where}: cannot read image {path}: {err}") from err
    w, h = rgb.size
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return data.view(h, w, 3).permute(2, 0, 1).contiguous()  # (3, H, W)


class ImageFolderDataset:
    """(image, caption) pairs from a folder of images and a ``file<TAB>caption`` TSV.

    Args:
        folder: the folder the TSV's file names are relative to.
        captions: the TSV (default ``<folder>/captions.tsv``).
        image_size: S for CLIP preprocessing (see the module docstring): images come back
            (3, S, S) float32, normalised. Not together with ``transform``.
        transform: applied to each (3, H, W) uint8 image instead (any callable).
            With neither, the uint8 tensor is returned as decoded.
        verify: decode every image now (slow for big folders) so a corrupt file is found
            before training rather than when it is first drawn.

    ``dataset[i]`` is ``(image, caption)``; ``dataset.files[i]`` the image's path,
    ``dataset.lines[i]`` its TSV line number.
    """

    def __init__(self, folder: str | os.PathLike, *, captions: str | os.PathLike | None = None,
                 image_size: int | None = None,
                 transform: Callable[[Tensor], Tensor] | None = None,
                 verify: bool = False) -> None:
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError(f"folder {str(folder)!r} is not a directory")
        tsv = folder / "captions.tsv" if captions is None else Path(captions)
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        if image_size is not None:
            if (not isinstance(image_size, int) or isinstance(image_size, bool)
                    or image_size < 1):
                raise ValueError(f"image_size must be a positive int, got {image_size!r}")
            if transform is not None:
                raise ValueError("pass image_size (CLIP preprocessing) or transform, not both")
            from .image_preprocess import preprocess_image

            def transform(image: Tensor, size: int = image_size) -> Tensor:
                return preprocess_image(image, size)  # (3, S, S) float32, normalised
        self.folder, self.tsv, self.transform = folder, tsv, transform
        self.files: list[Path] = []
        self.captions: list[str] = []
        self.lines: list[int] = []
        root = folder.resolve()
        for number, name, caption in tab_lines(tsv, "file", "caption"):
            if number == 1 and (name.strip().lower(), caption.strip().lower()) == _HEADER:
                continue
            if not name.strip():
                raise DataError(f"{tsv}:{number}: empty file name")
            if not caption.strip():
                raise DataError(f"{tsv}:{number}: empty caption for {name!r}")
            self.files.append(self._resolve(root, name, f"{tsv}:{number}"))
            self.captions.append(caption)
            self.lines.append(number)
        if not self.files:
            raise DataError(f"{tsv}: no file<TAB>caption lines in the file")
        if verify:
            for i in range(len(self)):
                self[i]

    def _resolve(self, root: Path, name: str, where: str) -> Path:
        rel = PurePosixPath(name.replace("\\", "/"))
        if rel.is_absolute() or Path(name).is_absolute() or ".." in rel.parts:
            raise DataError(f"{where}: image path {name!r} leaves the folder {self.folder} "
                            f"(absolute paths and '..' are not allowed)")
        path = self.folder.joinpath(*rel.parts)
        if not path.is_file():
            raise DataError(f"{where}: image {name!r} not found in {self.folder}")
        if not path.resolve().is_relative_to(root):
            raise DataError(f"{where}: image path {name!r} resolves outside the folder "
                            f"{self.folder} (a link?)")
        return path

    def __len__(self) -> int:
        return len(self.files)

    def __repr__(self) -> str:
        return f"ImageFolderDataset({str(self.folder)!r}, {len(self)} images)"

    def __getitem__(self, index: int) -> tuple[Tensor, str]:
        """``(image, caption)``: the image (3, H, W) uint8, or what ``transform`` returns."""
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        path = self.files[index]
        image = _load(path, f"{self.tsv}:{self.lines[index]}")
        if self.transform is not None:
            image = self.transform(image)
        return image, self.captions[index]

    def batch(self, indices: Sequence[int] | Iterable[int]) -> tuple[Tensor, list[str]]:
        """``(images (B, 3, H, W), captions)``; the images must share one size (use a
        ``transform`` that resizes)."""
        items = [self[i] for i in indices]
        if not items:
            raise ValueError("indices is empty")
        shapes = {tuple(im.shape) for im, _ in items}
        if len(shapes) > 1:
            raise ValueError(f"images of different shapes {sorted(shapes)} cannot be stacked; "
                             f"pass a transform that resizes them to one size")
        return torch.stack([im for im, _ in items]), [c for _, c in items]
