"""Synthetic image-caption pairs: coloured shapes on light backgrounds, captioned in English
and Chinese, with (colour, shape) combinations held out of training.

Shapes: B batch, H image height, W image width (H = W = ``image_size``).

Every image holds one shape kind in one colour:

- one object (probability 1/2): a ``size`` ("small" / "large") at a ``position`` ("left",
  "right", "top", "bottom", "centre"): "a small red circle on the left" / "左边一个小红圆";
- two or three small objects (1/4 each) in distinct cells of a 3×3 grid: "two blue squares"
  / "两个蓝色正方形" (labels: ``size`` "small", ``position`` None).

``SHAPES`` (5) × ``COLOURS`` (6) = 30 ``COMBINATIONS``. Backgrounds are a solid light colour,
a linear gradient between two light colours, or a light colour with per-pixel noise; every
background pixel has all three channels >= 180 (of 255) while every shape colour has a
channel <= 50, so a background never takes a shape's colour. Shape colours vary by up to
±10 per channel around ``COLOUR_RGB``. Shapes are drawn with Pillow at 4× and box-filtered
down (``antialias=True``, the default) or drawn directly at 1× (hard edges).

Splits hold out six (colour, shape) combinations, ``heldout_combinations(seed)``: the six
colours shuffled, paired with the five shapes shuffled plus one more shape, so that each
colour is held out exactly once, each shape at least once, and training still shows every
colour with four shapes and every shape with at least four colours.

- "train" and "valid": only the 24 combinations that are not held out (valid is a different
  stream of images of the same distribution);
- "test": only the 6 held-out combinations (zero-shot / compositional generalisation).

Example ``i`` of ``(seed, split)`` is drawn from its own ``random.Random`` seeded with a
BLAKE2 hash of ``("qkv.data.shapes", seed, split, i)`` (noise from a ``torch.Generator``
seeded from it): no global RNG is touched, any example can be made without the ones before
it, and the same index gives the same pixels and caption on every machine.

Example::

    train = ShapesDataset("train", size=50_000, language="both")
    image, caption, labels = train[0]       # (3, 32, 32) float32 in [0, 1], str, dict
    batch = train.batch(range(256))         # images (256, 3, 32, 32), 256 captions
    prompts = class_prompts(language="zh")  # 30 prompts, in COMBINATIONS order
"""

from __future__ import annotations

import math
import operator
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from PIL import Image, ImageDraw
from torch import Tensor

from .order import hash_int

__all__ = ["BACKGROUNDS", "COLOURS", "COLOUR_RGB", "COLOUR_ZH", "COMBINATIONS", "LANGUAGES",
           "POSITIONS", "PROMPT_TEMPLATES", "SHAPES", "SHAPE_ZH", "SIZES", "SPLITS",
           "ShapesBatch", "ShapesDataset", "caption_for", "class_prompts", "heldout_combinations"]

#: shape kinds, in label order
SHAPES = ("circle", "square", "triangle", "star", "cross")
#: colours, in label order
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
#: every (colour, shape), colour-major: the order of ``class_prompts``
COMBINATIONS = tuple((c, s) for c in COLOURS for s in SHAPES)
SIZES = ("small", "large")
POSITIONS = ("left", "right", "top", "bottom", "centre")
BACKGROUNDS = ("solid", "gradient", "noise")
LANGUAGES = ("en", "zh", "both")
SPLITS = ("train", "valid", "test")
#: default number of examples per split (images are made on demand; any size is cheap)
DEFAULT_SIZES = {"train": 100_000, "valid": 1_000, "test": 1_000}

#: the centre RGB of each colour (each has a channel <= 40; images jitter it by <= 10)
COLOUR_RGB = {"red": (220, 30, 30), "green": (30, 150, 50), "blue": (30, 70, 220),
              "yellow": (235, 200, 20), "purple": (140, 40, 190), "orange": (245, 130, 20)}
#: Chinese colour names (short form; the full form adds 色: 红 -> 红色)
COLOUR_ZH = {"red": "红", "green": "绿", "blue": "蓝", "yellow": "黄", "purple": "紫",
             "orange": "橙"}
#: Chinese shape names (full form; captions of one object use 圆 / 星 / 十字 for short)
SHAPE_ZH = {"circle": "圆形", "square": "正方形", "triangle": "三角形", "star": "星形",
            "cross": "十字形"}
_SHAPE_ZH_SHORT = {"circle": "圆", "square": "正方形", "triangle": "三角形", "star": "星",
                   "cross": "十字"}
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars",
           "cross": "crosses"}
_POSITION_EN = {"left": "on the left", "right": "on the right", "top": "at the top",
                "bottom": "at the bottom", "centre": "in the centre"}
_POSITION_ZH = {"left": "左边", "right": "右边", "top": "上边", "bottom": "下边", "centre": "中间"}
_SIZE_ZH = {"small": "小", "large": "大"}
_COUNT_EN = {2: "two", 3: "three"}
_COUNT_ZH = {2: "两", 3: "三"}

#: zero-shot prompt templates per language; ``{colour}`` and ``{shape}`` are filled in
PROMPT_TEMPLATES = {
    "en": ("a photo of a {colour} {shape}", "a {colour} {shape}",
           "a picture of a {colour} {shape}"),
    "zh": ("一张{colour}{shape}的照片", "一个{colour}{shape}", "{colour}{shape}"),
}

# geometry, as fractions of the image side
_RADIUS = {"small": 0.13, "large": 0.22}  # circumradius of a shape
_CENTRE = {"left": (0.28, 0.5), "right": (0.72, 0.5), "top": (0.5, 0.28),
           "bottom": (0.5, 0.72), "centre": (0.5, 0.5)}
_JITTER = 0.04  # along the stated axis (0.06 across it; 0.01 in a grid cell, so that small
#                  shapes in neighbouring cells stay >= 0.05 of the side apart)
_SUPERSAMPLE = 4
_BG_MIN, _BG_LOW, _BG_HIGH, _NOISE = 180, 195, 250, 12  # background channel bounds


class ShapesBatch(NamedTuple):
    """``images`` (B, 3, H, W) in the dataset's dtype, ``captions`` (B strings), ``labels``
    (B dicts as ``ShapesDataset.__getitem__``)."""

    images: Tensor
    captions: list[str]
    labels: list[dict[str, Any]]


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def heldout_combinations(seed: int = 0) -> tuple[tuple[str, str], ...]:
    """The six (colour, shape) combinations held out of "train" / "valid" for ``seed``, in
    ``COMBINATIONS`` order.

    The colours are shuffled and paired with the shapes shuffled plus one more shape drawn at
    random (BLAKE2-seeded ``random.Random``): each colour is held out once, each shape once
    or twice, and no colour or shape is held out with all its partners. For seed 0 this is
    ``(red, cross), (green, square), (blue, circle), (yellow, triangle), (purple, triangle),
    (orange, star)`` (a test pins it, so it never changes silently).
    """
    _check_int("seed", seed)
    rng = random.Random(hash_int("qkv.data.shapes/heldout", seed))
    colours = list(COLOURS)
    rng.shuffle(colours)
    shapes = list(SHAPES)
    rng.shuffle(shapes)
    shapes.append(rng.choice(SHAPES))
    chosen = set(zip(colours, shapes, strict=True))
    return tuple(c for c in COMBINATIONS if c in chosen)


def _an(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def class_prompts(template: str | None = None, *, language: str = "en") -> list[str]:
    """One prompt per (colour, shape) of ``COMBINATIONS`` (all 30, colour-major).

    Args:
        template: text with ``{colour}`` and ``{shape}`` (other braces are kept as typed);
            default ``PROMPT_TEMPLATES[language][0]``: "a photo of a {colour} {shape}" /
            "一张{colour}{shape}的照片". In English "a {colour}" becomes "an {colour}" before
            a vowel ("a photo of an orange star"); Chinese uses the full names (红色, 圆形).
        language: "en" or "zh".

    Returns:
        30 strings; prompt ``k`` names ``COMBINATIONS[k]``.
    """
    if language not in ("en", "zh"):
        raise ValueError(f"language must be 'en' or 'zh' for class_prompts, got {language!r}")
    if template is None:
        template = PROMPT_TEMPLATES[language][0]
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    if "{colour}" not in template or "{shape}" not in template:
        raise ValueError(f"template must contain {{colour}} and {{shape}}, got {template!r}")
    prompts = []
    for colour, shape in COMBINATIONS:
        if language == "en":
            # "a {colour}" -> "an orange" before a vowel; the article keeps its case
            text = re.sub(r"\b([Aa]) \{colour\}",
                          lambda m, c=colour: m.group(1) + _an(c)[1:] + " " + c, template)
            text = text.replace("{colour}", colour).replace("{shape}", shape)
        else:
            text = template.replace("{colour}", COLOUR_ZH[colour] + "色")
            text = text.replace("{shape}", SHAPE_ZH[shape])
        prompts.append(text)
    return prompts


def caption_for(labels: dict[str, Any], language: str) -> str:
    """The caption of ``labels`` (a dict as ``ShapesDataset`` gives) in "en" or "zh"."""
    colour, shape, count = labels["colour"], labels["shape"], labels["count"]
    if count == 1:
        size, position = labels["size"], labels["position"]
        if language == "en":
            return f"a {size} {colour} {shape} {_POSITION_EN[position]}"
        return (f"{_POSITION_ZH[position]}一个{_SIZE_ZH[size]}{COLOUR_ZH[colour]}"
                f"{_SHAPE_ZH_SHORT[shape]}")
    if language == "en":
        return f"{_COUNT_EN[count]} {colour} {PLURAL[shape]}"
    return f"{_COUNT_ZH[count]}个{COLOUR_ZH[colour]}色{SHAPE_ZH[shape]}"


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """Vertices of ``shape`` with circumradius ``r`` around (cx, cy); None for a circle."""
    if shape == "square":
        h = r / math.sqrt(2.0) * 1.05
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":  # pointing up; centroid at (cx, cy + r/8) so it sits centred
        cy += r / 8
        return [(cx + r * math.cos(a), cy + r * math.sin(a))
                for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if shape == "star":  # five points, inner radius 0.45 r
        return [(cx + rr * math.cos(a), cy + rr * math.sin(a))
                for k in range(10)
                for rr, a in [(r if k % 2 == 0 else 0.45 * r, -math.pi / 2 + k * math.pi / 5)]]
    if shape == "cross":  # a plus sign, arms 0.36 r wide on each side of the axis
        a, w = r * 0.95, r * 0.36
        return [(cx - w, cy - a), (cx + w, cy - a), (cx + w, cy - w), (cx + a, cy - w),
                (cx + a, cy + w), (cx + w, cy + w), (cx + w, cy + a), (cx - w, cy + a),
                (cx - w, cy + w), (cx - a, cy + w), (cx - a, cy - w), (cx - w, cy - w)]
    return None


class ShapesDataset:
    """Synthetic (image, caption, labels) examples of one split; see the module docstring.

    Args:
        split: "train", "valid" (both: combinations not held out) or "test" (held out).
        size: number of examples (default ``DEFAULT_SIZES[split]``); images are drawn on
            demand, so a large size costs nothing up front.
        image_size: H = W in pixels (16..1024; default 32).
        seed: selects the images (and, with ``heldout=None``, the held-out combinations).
        language: "en", "zh", or "both" (each example's caption language is a fair coin of
            its own hash; ``labels["language"]`` says which).
        heldout: (colour, shape) pairs kept out of train/valid and making up test; default
            ``heldout_combinations(seed)``. An empty tuple holds nothing out (then "test" is
            refused: it would be empty).
        antialias: draw at 4× and box-filter down (soft edges); False draws hard edges.
        dtype: ``torch.uint8`` (0..255) or a floating dtype (values k/255 in [0, 1]; default
            float32).

    ``dataset[i]`` is ``(image (3, H, W), caption, labels)`` with labels ``{"colour",
    "shape", "count" (1-3), "size" ("small" / "large"), "position" (one of POSITIONS, None
    for 2-3 objects), "background" (one of BACKGROUNDS), "language" ("en" / "zh"),
    "heldout" (bool)}``.
    """

    def __init__(self, split: str = "train", *, size: int | None = None, image_size: int = 32,
                 seed: int = 0, language: str = "en",
                 heldout: Iterable[tuple[str, str]] | None = None, antialias: bool = True,
                 dtype: torch.dtype = torch.float32) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        size = DEFAULT_SIZES[split] if size is None else _check_int("size", size)
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        _check_int("image_size", image_size)
        if not 16 <= image_size <= 1024:
            raise ValueError(f"image_size must be in 16..1024, got {image_size}")
        _check_int("seed", seed)
        if language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {language!r}")
        if not isinstance(antialias, bool):
            raise TypeError(f"antialias must be a bool, got {type(antialias).__name__}")
        if not isinstance(dtype, torch.dtype) or not (dtype == torch.uint8
                                                      or dtype.is_floating_point):
            raise ValueError(f"dtype must be torch.uint8 or a floating dtype, got {dtype!r}")
        if heldout is None:
            held = heldout_combinations(seed)
        else:
            if isinstance(heldout, (str, bytes)) or not isinstance(heldout, Iterable):
                raise TypeError(f"heldout must be (colour, shape) pairs, got {heldout!r}")
            pairs = [tuple(p) if isinstance(p, (tuple, list)) else p for p in heldout]
            bad = [p for p in pairs if p not in COMBINATIONS]
            if bad:
                raise ValueError(f"heldout holds {bad[0]!r}, not a (colour, shape) pair of "
                                 f"COLOURS {COLOURS} and SHAPES {SHAPES}")
            held = tuple(c for c in COMBINATIONS if c in set(pairs))
        combos = held if split == "test" else tuple(c for c in COMBINATIONS if c not in held)
        if not combos:
            raise ValueError(f"split {split!r} has no (colour, shape) combinations with "
                             f"heldout={held!r}")
        self.split, self.size, self.image_size, self.seed = split, size, image_size, seed
        self.language, self.antialias, self.dtype = language, antialias, dtype
        self.heldout: tuple[tuple[str, str], ...] = held
        self.combinations: tuple[tuple[str, str], ...] = combos
        side = torch.linspace(0.5 / image_size, 1 - 0.5 / image_size, image_size,
                              dtype=torch.float64)
        self._ys, self._xs = torch.meshgrid(side, side, indexing="ij")  # (H, W) each

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return (f"ShapesDataset({self.split!r}, size={self.size}, image_size={self.image_size}"
                f", seed={self.seed}, language={self.language!r})")

    def _index(self, index: object) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int, got {type(index).__name__}") from None
        if isinstance(index, bool):
            raise TypeError("index must be an int, got bool")
        if not -self.size <= i < self.size:
            raise IndexError(f"index {i} out of range for {self.size} examples")
        return i % self.size

    def _draw(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(labels, render parameters) of example ``i``."""
        rng = random.Random(hash_int("qkv.data.shapes", self.seed, self.split, i))
        colour, shape = rng.choice(self.combinations)
        count = 1 if rng.random() < 0.5 else rng.choice((2, 3))
        if count == 1:
            size, position = rng.choice(SIZES), rng.choice(POSITIONS)
            x, y = _CENTRE[position]
            along, across = rng.uniform(-_JITTER, _JITTER), rng.uniform(-0.06, 0.06)
            if position in ("left", "right"):
                x, y = x + along, y + across
            elif position in ("top", "bottom"):
                x, y = x + across, y + along
            else:
                x, y = x + along, y + rng.uniform(-_JITTER, _JITTER)
            centres = [(x, y)]
        else:
            size, position = "small", None
            cells = rng.sample(range(9), count)
            centres = [((c % 3 + 0.5) / 3 + rng.uniform(-0.01, 0.01),
                        (c // 3 + 0.5) / 3 + rng.uniform(-0.01, 0.01)) for c in cells]
        background = rng.choice(BACKGROUNDS)
        bg = [tuple(rng.randint(_BG_LOW, _BG_HIGH) for _ in range(3)) for _ in range(2)]
        angle = rng.uniform(0.0, 2 * math.pi)
        rgb = tuple(v + rng.randint(-10, 10) for v in COLOUR_RGB[colour])
        language = self.language
        if language == "both":
            language = "en" if rng.random() < 0.5 else "zh"
        noise_seed = rng.getrandbits(62)
        labels = {"colour": colour, "shape": shape, "count": count, "size": size,
                  "position": position, "background": background, "language": language,
                  "heldout": (colour, shape) in self.heldout}
        params = {"centres": centres, "radius": _RADIUS[size], "bg": bg, "angle": angle,
                  "rgb": rgb, "noise_seed": noise_seed}
        return labels, params

    def _background(self, labels: dict[str, Any], params: dict[str, Any]) -> Tensor:
        """(3, H, W) float64 in 0..255, every channel >= _BG_MIN."""
        n = self.image_size
        c0 = torch.tensor(params["bg"][0], dtype=torch.float64).view(3, 1, 1)
        kind = labels["background"]
        if kind == "solid":
            return c0.expand(3, n, n)
        if kind == "gradient":
            c1 = torch.tensor(params["bg"][1], dtype=torch.float64).view(3, 1, 1)
            a = params["angle"]
            t = (self._xs - 0.5) * math.cos(a) + (self._ys - 0.5) * math.sin(a)  # (H, W)
            t = (t - t.min()) / (t.max() - t.min())
            return c0 * (1 - t) + c1 * t  # (3, H, W)
        gen = torch.Generator().manual_seed(params["noise_seed"])
        noise = torch.rand(3, n, n, generator=gen, dtype=torch.float64) * 2 - 1
        return (c0 + _NOISE * noise).clamp(_BG_MIN, 255)

    def _coverage(self, shape: str, params: dict[str, Any]) -> Tensor:
        """(H, W) float64 in [0, 1]: the fraction of each pixel the shapes cover."""
        n = self.image_size
        ss = _SUPERSAMPLE if self.antialias else 1
        side = n * ss
        mask = Image.new("L", (side, side), 0)
        draw = ImageDraw.Draw(mask)
        r = params["radius"] * side
        for x, y in params["centres"]:
            cx, cy = x * side, y * side
            poly = _polygon(shape, cx, cy, r)
            if poly is None:
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
            else:
                draw.polygon(poly, fill=255)
        if ss > 1:
            mask = mask.resize((n, n), Image.Resampling.BOX)
        cov = torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8)
        return cov.view(n, n).to(torch.float64) / 255.0  # (H, W)

    def describe(self, index: int) -> tuple[str, dict[str, Any]]:
        """``(caption, labels)`` of example ``index`` without drawing its image."""
        labels, _ = self._draw(self._index(index))
        return caption_for(labels, labels["language"]), labels

    def __getitem__(self, index: int) -> tuple[Tensor, str, dict[str, Any]]:
        """``(image (3, H, W), caption, labels)`` of example ``index`` (negative from the end)."""
        labels, params = self._draw(self._index(index))
        alpha = self._coverage(labels["shape"], params)  # (H, W)
        bg = self._background(labels, params)  # (3, H, W)
        rgb = torch.tensor(params["rgb"], dtype=torch.float64).view(3, 1, 1)
        image = (bg * (1 - alpha) + rgb * alpha).round().clamp(0, 255).to(torch.uint8)
        if self.dtype != torch.uint8:
            image = image.to(self.dtype) / 255
        return image, caption_for(labels, labels["language"]), labels

    def batch(self, indices: Sequence[int] | range) -> ShapesBatch:
        """``ShapesBatch(images (B, 3, H, W), captions, labels)`` of examples ``indices``."""
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
            raise TypeError(f"indices must be a sequence of ints, got {type(indices).__name__}")
        items = [self[i] for i in indices]
        if not items:
            raise ValueError("indices is empty")
        images = torch.stack([im for im, _, _ in items])  # (B, 3, H, W)
        return ShapesBatch(images, [c for _, c, _ in items], [lab for _, _, lab in items])
