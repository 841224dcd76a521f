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
- a missing image, or one that is not a regular file (a FIFO, a link to a device; checked
  when the dataset is built);
- an image Pillow cannot decode (when it is loaded). ``verify="quick"`` (what training uses)
  checks every image when the dataset is built, cheaply (``check_image``): its header
  (format, size, mode, Pillow's decompression-bomb limit), a PNG's chunk checksums to its
  end, a JPEG that does not end on its end-of-image marker decoded at 1/8 scale, any other
  format decoded; one error names the first bad image and how many more there are.
  ``verify=True`` decodes every image in full.

``load_image(path)`` decodes one image to a (3, H, W) uint8 RGB tensor: the EXIF orientation
is applied; grayscale, palette, CMYK and other modes are converted to RGB; an alpha channel
(RGBA, LA, a palette with transparency) is composited onto white; 16-bit grayscale is
scaled to 8 bits (divided by 257). Floating-point images (mode "F") are refused, and so is
an image over Pillow's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, about 89
Mpx; raise it to read larger ones). ``qkv attention --image`` reads its image with it too.

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
import stat
import struct
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from .files import DataError, file_kind, tab_lines

__all__ = ["ImageFolderDataset", "check_image", "load_image"]

_HEADER = ("file", "caption")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _check_mode(mode: str, where: str) -> None:
    if mode == "F":
        raise DataError(f"{where}: floating-point images (mode 'F') are not supported; "
                        f"save it as 8- or 16-bit")


def _to_rgb(image: Image.Image, where: str) -> Image.Image:
    """``image`` as an 8-bit RGB Pillow image (see the module docstring)."""
    mode = image.mode
    if mode == "RGB":
        return image
    _check_mode(mode, where)
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
    16-bit grayscale divided by 257; the first frame of an animation. What training reads a
    folder's images with, and ``qkv attention --image``.

    Raises:
        DataError: the file is missing or not a regular file, not an image Pillow can
            decode (corrupt or truncated), too large (Pillow's decompression-bomb limit,
            ``PIL.Image.MAX_IMAGE_PIXELS``), or a floating-point image; one line naming it.
    """
    return _load(Path(path), None)


def _label(path: Path, where: str | None) -> str:
    """The start of an image's error: ``[WHERE: ]cannot read image PATH``."""
    return f"{where}: cannot read image {path}" if where else f"cannot read image {path}"


def _opened(path: Path, where: str | None) -> Image.Image:
    """The Pillow image at ``path`` opened lazily (its header read), a regular file checked
    first. Call inside ``_reading``."""
    label = _label(path, where)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as err:
        prefix = f"{where}: " if where else ""
        raise DataError(f"{prefix}image not found: {path} (no such file)") from err
    except OSError as err:
        raise DataError(f"{label}: {err.strerror or err}") from err
    if not stat.S_ISREG(mode):
        raise DataError(f"{label}: not a regular file but {file_kind(mode)}")
    try:
        return Image.open(path)
    except UnidentifiedImageError as err:
        raise DataError(f"{label}: not an image Pillow can read ({err})") from err


class _reading:
    """Pillow's errors while an image is opened or decoded -> one-line ``DataError``s; the
    decompression-bomb warning (an image over ``Image.MAX_IMAGE_PIXELS``) is an error."""

    def __init__(self, path: Path, where: str | None) -> None:
        self.path, self.where = path, where
        self._warnings = warnings.catch_warnings()

    def __enter__(self) -> None:
        self._warnings.__enter__()
        warnings.simplefilter("error", Image.DecompressionBombWarning)

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> bool:
        self._warnings.__exit__(kind, err, tb)
        if err is None or isinstance(err, DataError):
            return False
        label = _label(self.path, self.where)
        if isinstance(err, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
            raise DataError(f"{label}: too large for Pillow's decompression-bomb limit of "
                            f"{Image.MAX_IMAGE_PIXELS} pixels (PIL.Image.MAX_IMAGE_PIXELS; "
                            f"downscale it or raise the limit): {err}") from err
        if isinstance(err, PermissionError):
            raise DataError(f"{label}: {err.strerror or err}") from err
        if isinstance(err, (OSError, ValueError, SyntaxError, EOFError, struct.error)):
            # truncated or corrupt data
            raise DataError(f"{label}: truncated or corrupt ({err})") from err
        return False


def _load(path: Path, where: str | None) -> Tensor:
    with _reading(path, where):
        opened = _opened(path, where)
        with opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
            rgb = _to_rgb(image, where or str(path))
            rgb.load()
    w, h = rgb.size
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return data.view(h, w, 3).permute(2, 0, 1).contiguous()  # (3, H, W)


def _ends_jpeg(path: Path) -> bool:
    """Whether the file's last two bytes are JPEG's end-of-image marker (FF D9)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 2:
            return False
        f.seek(-2, os.SEEK_END)
        return f.read(2) == b"\xff\xd9"


def check_image(path: str | os.PathLike, *, where: str | None = None) -> tuple[int, int]:
    """Check, cheaply, that ``load_image(path)`` will decode the image; returns its
    (width, height) as stored.

    Reads the header (format, size, mode; refuses a floating-point image and one over
    Pillow's decompression-bomb limit, as ``load_image``); a PNG's chunks are read to the
    end with their CRCs checked (no decompression: finds a truncated or damaged file); a
    JPEG not ending on its end-of-image marker (a truncated one) is decoded at 1/8 scale
    (what fails in full fails so); any other format is decoded. Corruption inside a JPEG's
    entropy-coded data that ends normally is found only by decoding it (``load_image``).

    Raises:
        DataError: as ``load_image``, one line starting with ``where`` when given.
    """
    path = Path(path)
    with _reading(path, where):
        opened = _opened(path, where)
        with opened:
            _check_mode(opened.mode, where or str(path))
            w, h = opened.size
            if opened.format == "PNG":
                opened.verify()
            elif opened.format == "JPEG":
                if not _ends_jpeg(path):
                    opened.draft("RGB", (max(1, w // 8), max(1, h // 8)))
                    opened.load()
            else:
                opened.load()
    return w, h


class ImageFolderDataset:
    """(image, caption) pairs from a folder of images and a ``file<TAB>caption`` TSV.

    Args:
        folder: the folder the TSV's file names are relative to.
        captions: the TSV (default ``<folder>/captions.tsv``).
        image_size: S for CLIP preprocessing (see the module docstring): images come back
            (3, S, S) float32, normalised. Not together with ``transform``.
        transform: applied to each (3, H, W) uint8 image instead (any callable).
            With neither, the uint8 tensor is returned as decoded.
        verify: check every image now, so that a bad file is found before training
            rather than when it is first drawn: ``"quick"`` checks each file cheaply
            (``check_image``: header, size, mode, a PNG's checksums, a truncated JPEG),
            ``True`` decodes every image (slow for big folders), ``False`` (default)
            checks only that the files exist. One error names the first bad image (its
            TSV line) and how many more are bad.

    ``dataset[i]`` is ``(image, caption)``; ``dataset.files[i]`` the image's path,
    ``dataset.lines[i]`` its TSV line number.
    """

    def __init__(self, folder: str | os.PathLike, *, captions: str | os.PathLike | None = None,
                 image_size: int | None = None,
                 transform: Callable[[Tensor], Tensor] | None = None,
                 verify: bool | str = False) -> None:
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
        if verify not in (False, True, "quick"):
            raise ValueError(f"verify must be False, True or 'quick', got {verify!r}")
        if verify:
            self._verify(full=verify is True)

    def _verify(self, *, full: bool) -> None:
        """Check every image once (the first line naming it): decoded in full, or
        ``check_image``; raise the first error, with how many other images are bad."""
        first: dict[Path, int] = {}
        for i, path in enumerate(self.files):
            first.setdefault(path, i)
        bad: list[tuple[int, DataError]] = []  # (TSV line, error)
        for path, i in first.items():
            try:
                if full:
                    self[i]
                else:
                    check_image(path, where=f"{self.tsv}:{self.lines[i]}")
            except DataError as err:
                bad.append((self.lines[i], err))
        if bad:
            more = ""
            if len(bad) > 1:
                lines = ", ".join(str(line) for line, _ in bad[1:6])
                more = (f" (and {len(bad) - 1} more bad image(s), at lines {lines}"
                        f"{', ...' if len(bad) > 6 else ''})")
            raise DataError(f"{bad[0][1]}{more}") from bad[0][1]

    def _resolve(self, root: Path, name: str, where: str) -> Path:
        rel = PurePosixPath(name.replace("\\", "/"))
        if rel.is_absolute() or Path(name).is_absolute() or ".." in rel.parts:
            raise DataError(f"{where}: image path {name!r} leaves the folder {self.folder} "
                            f"(absolute paths and '..' are not allowed)")
        path = self.folder.joinpath(*rel.parts)
        if not path.is_file():
            try:
                mode = path.stat().st_mode
            except OSError:
                raise DataError(f"{where}: image {name!r} not found in {self.folder}") from None
            link = " (a link)" if path.is_symlink() else ""
            raise DataError(f"{where}: image {name!r} in {self.folder} is not a regular file "
                            f"but {file_kind(mode)}{link}")
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
