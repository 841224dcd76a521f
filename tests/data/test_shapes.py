"""``qkv.data.shapes``: synthetic coloured-shape images with English / Chinese captions.

Shapes: B batch, H = W image side.

Oracles written apart from the generator: a caption parser (regular expressions over the
words, independent of the generator's tables), pixel analysis of the rendered images
(background = every channel >= 180, shapes have a channel <= 50; centroids, connected
components, bounding-box fill ratios, nearest palette colour), and the global RNG states.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch

from qkv.data import (
    COLOURS,
    COMBINATIONS,
    SHAPES,
    ShapesDataset,
    class_prompts,
    heldout_combinations,
)
from qkv.data.shapes import COLOUR_RGB, caption_for

# --- an independent caption parser -------------------------------------------------------
EN_ONE = re.compile(r"a (small|large) (red|green|blue|yellow|purple|orange) "
                    r"(circle|square|triangle|star|cross) "
                    r"(on the left|on the right|at the top|at the bottom|in the centre)")
EN_MANY = re.compile(r"(two|three) (red|green|blue|yellow|purple|orange) "
                     r"(circles|squares|triangles|stars|crosses)")
ZH_ONE = re.compile(r"(左边|右边|上边|下边|中间)一个([小大])([红绿蓝黄紫橙])"
                    r"(圆|正方形|三角形|星|十字)")
ZH_MANY = re.compile(r"([两三])个([红绿蓝黄紫橙])色(圆形|正方形|三角形|星形|十字形)")
ZH_COLOUR = dict(zip("红绿蓝黄紫橙", ["red", "green", "blue", "yellow", "purple", "orange"],
                     strict=True))
ZH_SHAPE = {"圆": "circle", "圆形": "circle", "正方形": "square", "三角形": "triangle",
            "星": "star", "星形": "star", "十字": "cross", "十字形": "cross"}
EN_POS = {"on the left": "left", "on the right": "right", "at the top": "top",
          "at the bottom": "bottom", "in the centre": "centre"}
ZH_POS = {"左边": "left", "右边": "right", "上边": "top", "下边": "bottom", "中间": "centre"}


def parse(caption: str) -> dict:
    """The labels a caption states (count 2-3: no size, no position)."""
    if m := EN_ONE.fullmatch(caption):
        return {"language": "en", "count": 1, "size": m[1], "colour": m[2], "shape": m[3],
                "position": EN_POS[m[4]]}
    if m := EN_MANY.fullmatch(caption):
        shape = m[3][:-2] if m[3].endswith("sses") else m[3][:-1]
        return {"language": "en", "count": {"two": 2, "three": 3}[m[1]], "colour": m[2],
                "shape": shape, "size": None, "position": None}
    if m := ZH_ONE.fullmatch(caption):
        return {"language": "zh", "count": 1, "size": {"小": "small", "大": "large"}[m[2]],
                "colour": ZH_COLOUR[m[3]], "shape": ZH_SHAPE[m[4]], "position": ZH_POS[m[1]]}
    if m := ZH_MANY.fullmatch(caption):
        return {"language": "zh", "count": {"两": 2, "三": 3}[m[1]], "colour": ZH_COLOUR[m[2]],
                "shape": ZH_SHAPE[m[3]], "size": None, "position": None}
    raise AssertionError(f"caption not in the grammar: {caption!r}")


# --- pixel analysis ----------------------------------------------------------------------
def shape_mask(image: torch.Tensor) -> torch.Tensor:
    """(H, W) bool: pixels that are not background (some channel well below 180)."""
    u8 = image if image.dtype == torch.uint8 else (image * 255).round()
    return u8.to(torch.int64).amin(0) < 115


def components(mask: torch.Tensor, *, min_pixels: int = 3) -> int:
    """Number of 4-connected components of a boolean (H, W) mask with at least
    ``min_pixels`` pixels (plain BFS; a star's tip can be a lone pixel at 32 px)."""
    h, w = mask.shape
    seen = [[False] * w for _ in range(h)]
    m = mask.tolist()
    count = 0
    for y0 in range(h):
        for x0 in range(w):
            if m[y0][x0] and not seen[y0][x0]:
                size = 0
                stack = [(y0, x0)]
                seen[y0][x0] = True
                while stack:
                    y, x = stack.pop()
                    size += 1
                    for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                        if 0 <= yy < h and 0 <= xx < w and m[yy][xx] and not seen[yy][xx]:
                            seen[yy][xx] = True
                            stack.append((yy, xx))
                count += size >= min_pixels
    return count


# reference colours of the names, chosen here (not the generator's palette)
NAMED_RGB = {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255),
             "yellow": (255, 215, 0), "purple": (128, 0, 160), "orange": (255, 140, 0)}


def dominant_colour(image: torch.Tensor) -> str:
    """The colour name nearest to most solid shape pixels."""
    u8 = (image * 255).round().to(torch.float64)  # (3, H, W)
    solid = u8.amin(0) < 70  # well inside a shape (anti-aliased edges excluded)
    pixels = u8[:, solid].T  # (K, 3)
    names = list(NAMED_RGB)
    palette = torch.tensor([NAMED_RGB[c] for c in names], dtype=torch.float64)  # (6, 3)
    nearest = torch.cdist(pixels, palette).argmin(1)
    return names[Counter(nearest.tolist()).most_common(1)[0][0]]


def test_deterministic_per_seed_split_index_and_no_global_rng():
    py_state, torch_state = random.getstate(), torch.get_rng_state()
    a = ShapesDataset("train", size=64, language="both")
    b = ShapesDataset("train", size=64, language="both")
    ba = a.batch(range(64))
    assert torch.equal(ba.images, b.batch(range(64)).images)
    assert ba.captions == b.batch(range(64)).captions
    # any index alone equals the batch row (counter-based, not sequential)
    img, cap, lab = a[37]
    assert torch.equal(img, ba.images[37]) and cap == ba.captions[37] and lab == ba.labels[37]
    assert a[-1][1] == ba.captions[63]
    assert random.getstate() == py_state and torch.equal(torch.get_rng_state(), torch_state)
    # other seed / split: other images
    other_seed = ShapesDataset("train", size=64, seed=1, language="both").batch(range(64))
    other_split = ShapesDataset("valid", size=64, language="both").batch(range(64))
    assert not torch.equal(other_seed.images, ba.images)
    assert not torch.equal(other_split.images, ba.images)
    assert ba.images.shape == (64, 3, 32, 32) and ba.images.dtype == torch.float32
    assert float(ba.images.min()) >= 0.0 and float(ba.images.max()) <= 1.0


def test_uint8_and_float_images_agree():
    f = ShapesDataset("valid", size=8)
    u = ShapesDataset("valid", size=8, dtype=torch.uint8)
    for i in range(8):
        assert u[i][0].dtype == torch.uint8
        assert torch.equal(u[i][0].float() / 255, f[i][0])


def test_captions_agree_with_labels_in_both_languages():
    ds = ShapesDataset("train", size=400, language="both")
    languages = Counter()
    for i in range(len(ds)):
        caption, labels = ds.describe(i)
        assert ds[i][1] == caption
        parsed = parse(caption)
        languages[parsed["language"]] += 1
        assert parsed["language"] == labels["language"]
        for key in ("colour", "shape", "count"):
            assert parsed[key] == labels[key], (caption, labels)
        if labels["count"] == 1:
            assert (parsed["size"], parsed["position"]) == (labels["size"], labels["position"])
        else:
            assert labels["size"] == "small" and labels["position"] is None
    assert min(languages["en"], languages["zh"]) > 120  # "both" mixes the two
    for language in ("en", "zh"):
        ds = ShapesDataset("test", size=50, language=language)
        assert all(parse(ds.describe(i)[0])["language"] == language for i in range(50))


def test_chinese_captions_are_well_formed():
    ds = ShapesDataset("train", size=200, language="zh")
    seen = set()
    for i in range(len(ds)):
        caption = ds.describe(i)[0]
        assert all("\u4e00" <= ch <= "\u9fff" for ch in caption), caption  # CJK only
        seen.add(caption)
    assert any(ZH_MANY.fullmatch(c) for c in seen) and any(ZH_ONE.fullmatch(c) for c in seen)
    # the examples, word for word
    one = {"colour": "red", "shape": "circle", "count": 1, "size": "small", "position": "left"}
    two = {"colour": "blue", "shape": "square", "count": 2, "size": "small", "position": None}
    assert caption_for(one, "en") == "a small red circle on the left"
    assert caption_for(one, "zh") == "左边一个小红圆"
    assert caption_for(two, "en") == "two blue squares"
    assert caption_for(two, "zh") == "两个蓝色正方形"


def test_heldout_combinations():
    held = heldout_combinations(0)
    assert held == (("red", "cross"), ("green", "square"), ("blue", "circle"),
                    ("yellow", "triangle"), ("purple", "triangle"), ("orange", "star"))
    for seed in range(20):
        held = heldout_combinations(seed)
        assert len(set(held)) == 6 and set(held) <= set(COMBINATIONS)
        assert sorted(c for c, _ in held) == sorted(COLOURS)  # each colour once
        shapes = Counter(s for _, s in held)
        assert set(shapes) == set(SHAPES) and max(shapes.values()) == 2
    assert len({heldout_combinations(s) for s in range(20)}) > 10


def test_heldout_never_in_train_or_valid_and_all_in_test():
    held = set(heldout_combinations(0))
    for split in ("train", "valid"):
        ds = ShapesDataset(split, size=1500)
        combos = {(lab["colour"], lab["shape"]) for lab in (ds.describe(i)[1]
                                                            for i in range(len(ds)))}
        assert not combos & held
        assert combos == set(COMBINATIONS) - held  # every other combination appears
    test = ShapesDataset("test", size=300)
    labels = [test.describe(i)[1] for i in range(len(test))]
    assert {(lab["colour"], lab["shape"]) for lab in labels} == held
    assert all(lab["heldout"] for lab in labels)
    # a custom held-out set, and none at all
    custom = ShapesDataset("train", size=300, heldout=[("red", "circle")])
    assert all((lab["colour"], lab["shape"]) != ("red", "circle")
               for lab in (custom.describe(i)[1] for i in range(300)))
    assert ShapesDataset("train", size=10, heldout=()).heldout == ()


@pytest.mark.parametrize("antialias", [True, False])
def test_pixels_show_the_stated_colour_position_and_count(antialias):
    ds = ShapesDataset("train", size=600, antialias=antialias)
    n = ds.image_size
    ys, xs = torch.meshgrid(torch.arange(n) + 0.5, torch.arange(n) + 0.5, indexing="ij")
    positions = Counter()
    for i in range(len(ds)):
        image, caption, labels = ds[i]
        mask = shape_mask(image)
        assert mask.sum() >= 12, caption
        assert dominant_colour(image) == labels["colour"], caption
        if labels["count"] > 1:
            assert components(mask) == labels["count"], caption
            continue
        assert components(mask) == 1, caption
        cx = float(xs[mask].mean()) / n
        cy = float(ys[mask].mean()) / n
        where = labels["position"]
        positions[where] += 1
        if where == "left":
            assert cx < 0.4 and abs(cy - 0.5) < 0.12, (caption, cx, cy)
        elif where == "right":
            assert cx > 0.6 and abs(cy - 0.5) < 0.12, (caption, cx, cy)
        elif where == "top":
            assert cy < 0.4 and abs(cx - 0.5) < 0.12, (caption, cx, cy)
        elif where == "bottom":
            assert cy > 0.6 and abs(cx - 0.5) < 0.12, (caption, cx, cy)
        else:
            assert abs(cx - 0.5) < 0.1 and abs(cy - 0.5) < 0.1, (caption, cx, cy)
        # the background far from the shape is light: never a shape's colour
        far = (xs / n - cx) ** 2 + (ys / n - cy) ** 2 > (0.26 + 2 / n) ** 2
        assert int((image * 255).round()[:, far].amin()) >= 180, caption
    assert set(positions) == {"left", "right", "top", "bottom", "centre"}


def test_pixels_show_the_stated_shape_and_size():
    """At 128 px without anti-aliasing, the fill ratio of a lone shape's bounding box tells
    the shapes apart (star .38, triangle .5, cross .61, circle .79, square 1.0), and a large
    shape covers more pixels than any small one of the same kind."""
    expected = {"star": 0.38, "triangle": 0.5, "cross": 0.61, "circle": 0.785, "square": 1.0}
    ds = ShapesDataset("train", size=150, image_size=128, antialias=False, heldout=())
    areas = {}
    seen = Counter()
    for i in range(len(ds)):
        caption, labels = ds.describe(i)
        if labels["count"] != 1:
            continue
        mask = shape_mask(ds[i][0])
        rows, cols = mask.any(1).nonzero(), mask.any(0).nonzero()
        box = (int(rows.max() - rows.min()) + 1) * (int(cols.max() - cols.min()) + 1)
        fill = float(mask.sum()) / box
        guess = min(expected, key=lambda s: abs(expected[s] - fill))
        assert guess == labels["shape"], (caption, fill)
        seen[labels["shape"]] += 1
        areas.setdefault((labels["shape"], labels["size"]), []).append(int(mask.sum()))
    assert set(seen) == set(SHAPES)
    for shape in SHAPES:
        if (shape, "small") in areas and (shape, "large") in areas:
            assert min(areas[shape, "large"]) > 1.8 * max(areas[shape, "small"])


def test_palette_is_far_from_any_background():
    for rgb in COLOUR_RGB.values():
        assert min(rgb) + 10 <= 50  # jitter <= 10; backgrounds are >= 180 in every channel


def test_class_prompts_cover_every_combination():
    en = class_prompts()
    assert len(en) == len(set(en)) == 30 == len(COMBINATIONS)
    for (colour, shape), text in zip(COMBINATIONS, en, strict=True):
        article = "an" if colour == "orange" else "a"
        assert text == f"a photo of {article} {colour} {shape}"
    zh = class_prompts(language="zh")
    assert zh[0] == "一张红色圆形的照片" and len(set(zh)) == 30
    for (colour, shape), text in zip(COMBINATIONS, zh, strict=True):
        m = re.fullmatch(r"一张([红绿蓝黄紫橙])色(圆形|正方形|三角形|星形|十字形)的照片", text)
        assert m and (ZH_COLOUR[m[1]], ZH_SHAPE[m[2]]) == (colour, shape)
    custom = class_prompts("A {colour} {shape} {{literal}}")
    assert custom[-1] == "An orange cross {{literal}}" and custom[0] == "A red circle {{literal}}"


def test_batch_shapes_and_dtype():
    ds = ShapesDataset("test", size=10, image_size=48)
    batch = ds.batch([0, 3, 9])
    assert batch.images.shape == (3, 3, 48, 48) and len(batch.captions) == 3
    assert batch.labels[1] == ds[3][2]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"split": "dev"}, ValueError, "split"),
    ({"size": -1}, ValueError, "size"),
    ({"size": 2.5}, TypeError, "size"),
    ({"image_size": 8}, ValueError, "image_size"),
    ({"image_size": True}, TypeError, "image_size"),
    ({"seed": "0"}, TypeError, "seed"),
    ({"language": "fr"}, ValueError, "language"),
    ({"heldout": [("pink", "circle")]}, ValueError, "heldout"),
    ({"heldout": "red circle"}, TypeError, "heldout"),
    ({"heldout": list(COMBINATIONS)}, ValueError, "no .colour, shape. combinations"),
    ({"split": "test", "heldout": ()}, ValueError, "no .colour, shape. combinations"),
    ({"dtype": torch.int32}, ValueError, "dtype"),
    ({"antialias": 1}, TypeError, "antialias"),
])
def test_bad_arguments_are_named(kwargs, error, pattern):
    kwargs = dict(kwargs)
    split = kwargs.pop("split", "train")
    with pytest.raises(error, match=pattern):
        ShapesDataset(split, **kwargs)


def test_bad_indices_and_prompt_arguments():
    ds = ShapesDataset("train", size=5)
    with pytest.raises(IndexError, match="5"):
        ds[5]
    with pytest.raises(IndexError):
        ds[-6]
    with pytest.raises(TypeError, match="index"):
        ds["1"]
    with pytest.raises(ValueError, match="empty"):
        ds.batch([])
    assert list(iter(ds.describe(i)[0] for i in range(5)))  # negative-free iteration
    assert len(list(ds)) == 5  # the sequence protocol stops at IndexError
    with pytest.raises(ValueError, match="language"):
        class_prompts(language="both")
    with pytest.raises(ValueError, match="template"):
        class_prompts("a photo of a {color} {shape}")
    with pytest.raises(TypeError, match="template"):
        class_prompts(3)
    with pytest.raises(TypeError, match="seed"):
        heldout_combinations("0")
