"""``qkv.viz.patches``: attention rollout over image patches and its PNGs.

Shapes: L layers, B batch, H heads, T tokens (class token first), P = gh·gw patches.

Oracles: a plain-Python rollout (nested loops over lists, float64) written from the paper's
recipe, closed forms for constructed attention patterns (identity, uniform, a chain of
single-token attentions that pins the multiplication order and the row-major grid), and
hand-computed blends for the overlays.
"""

from __future__ import annotations

import warnings

import matplotlib
import matplotlib.image
import numpy as np
import pytest
import torch

from qkv.viz import (
    attention_rollout,
    cls_attention,
    draw_image_grid,
    draw_patch_attention,
    draw_similarity,
    overlay_attention,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def stochastic(*shape: int, seed: int = 0, zeros: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.softmax(3 * torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)
    if zeros:  # some weights exactly 0 (masked keys), rows renormalised
        w = w * (torch.rand(*shape, generator=g, dtype=torch.float64) > 0.3)
        w[..., 0] += 1e-3
        w = w / w.sum(-1, keepdim=True)
    return w


def rollout_oracle(layers: list[torch.Tensor], prefix: int = 1) -> list[list[float]]:
    """Abnar & Zuidema by hand: mean heads, + I, rows / row sums, R = A_L ... A_1; row 0."""
    b_size, heads, t, _ = layers[0].shape
    out = []
    for b in range(b_size):
        rows = [[1.0 if i == j else 0.0 for j in range(t)] for i in range(t)]
        for layer in layers:
            a = layer[b].tolist()
            m = [[sum(a[h][i][j] for h in range(heads)) / heads + (1.0 if i == j else 0.0)
                  for j in range(t)] for i in range(t)]
            m = [[v / sum(row) for v in row] for row in m]
            rows = [[sum(m[i][k] * rows[k][j] for k in range(t)) for j in range(t)]
                    for i in range(t)]
        out.append(rows[0][prefix:])
    return out


@pytest.mark.parametrize(("b", "h", "grid", "layers", "zeros"), [
    (2, 3, (2, 3), 4, False), (1, 1, (4, 4), 2, True), (3, 2, (1, 5), 1, False),
    (1, 4, (3, 2), 6, True),
])
def test_rollout_matches_the_hand_written_oracle(b, h, grid, layers, zeros):
    t = 1 + grid[0] * grid[1]
    maps = [stochastic(b, h, t, t, seed=s, zeros=zeros) for s in range(layers)]
    got = attention_rollout(maps, grid=grid)
    assert got.shape == (b, *grid) and got.dtype == torch.float64
    want = torch.tensor(rollout_oracle(maps), dtype=torch.float64).view(b, *grid)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # float32 input: float32 output, same values to float32 precision
    got32 = attention_rollout([m.float() for m in maps], grid=grid)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, atol=1e-6, rtol=1e-5)
    # the same layers as one (L, B, H, T, T) tensor, and one example as (L, H, T, T)
    torch.testing.assert_close(attention_rollout(torch.stack(maps), grid=grid), got)
    one = attention_rollout(torch.stack([m[-1] for m in maps]), grid=grid)
    assert one.shape == grid
    torch.testing.assert_close(one, got[-1])


def test_rollout_with_two_prefix_tokens():
    maps = [stochastic(2, 2, 2 + 9, 2 + 9, seed=s) for s in range(3)]
    got = attention_rollout(maps, num_prefix_tokens=2)
    want = torch.tensor(rollout_oracle(maps, prefix=2), dtype=torch.float64).view(2, 3, 3)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_rollout_known_cases():
    t, layers = 1 + 6, 3
    eye = torch.eye(t, dtype=torch.float64).expand(2, 4, t, t)
    # every token attends to itself: nothing flows from the patches to the class token
    assert torch.equal(attention_rollout([eye] * layers, grid=(2, 3)),
                       torch.zeros(2, 2, 3, dtype=torch.float64))
    # uniform attention U (idempotent): (I/2 + U/2)^L = I/2^L + (1 - 1/2^L) U
    uniform = torch.full((1, 2, t, t), 1.0 / t, dtype=torch.float64)
    got = attention_rollout([uniform] * layers, grid=(2, 3))
    torch.testing.assert_close(got, torch.full((1, 2, 3), (1 - 0.5**layers) / t,
                                               dtype=torch.float64))
    # heads are averaged: one uniform head and one identity head = 0.75 I + 0.25 U per layer
    mixed = torch.stack([uniform[0, 0], torch.eye(t, dtype=torch.float64)])[None]
    one_layer = attention_rollout([mixed], grid=(2, 3))
    torch.testing.assert_close(one_layer, torch.full((1, 2, 3), 0.25 / t, dtype=torch.float64))
    # a chain: the class token reads patch k (token 1+k) in layer 2, which read patch m in
    # layer 1: R[0] = e0/2 + e_k/4 + e_m/4; reversed order would give e0/2 + e_k/2
    k, m = 4, 1  # patches (1, 1) and (0, 1) of a 2 x 3 grid
    first = torch.eye(t, dtype=torch.float64)
    first[1 + k] = 0
    first[1 + k, 1 + m] = 1
    second = torch.eye(t, dtype=torch.float64)
    second[0] = 0
    second[0, 1 + k] = 1
    got = attention_rollout([first[None, None], second[None, None]], grid=(2, 3))
    want = torch.zeros(1, 2, 3, dtype=torch.float64)
    want[0, 1, 1], want[0, 0, 1] = 0.25, 0.25  # row-major: patch p at (p // 3, p % 3)
    torch.testing.assert_close(got, want)


def test_cls_attention_is_the_head_mean_of_one_layer():
    maps = [stochastic(2, 3, 1 + 4, 1 + 4, seed=s) for s in range(3)]
    got = cls_attention(maps)
    want = sum(maps[-1][:, h, 0, 1:] for h in range(3)) / 3
    torch.testing.assert_close(got, want.view(2, 2, 2))
    torch.testing.assert_close(cls_attention(maps, layer=0),
                               maps[0][:, :, 0, 1:].mean(1).view(2, 2, 2))
    with pytest.raises(ValueError, match="layer"):
        cls_attention(maps, layer=3)


@pytest.mark.parametrize(("attentions", "kwargs", "error", "pattern"), [
    ([], {}, ValueError, "empty"),
    ("maps", {}, TypeError, "attentions"),
    ([np.ones((1, 1, 5, 5))], {}, TypeError, "tensors"),
    ([torch.ones(1, 1, 5, 5) / 5, torch.ones(1, 1, 6, 6) / 6], {}, ValueError, "one shape"),
    ([torch.ones(1, 5, 5)], {}, ValueError, r"\(B, H, T, T\)"),
    ([torch.ones(1, 1, 5, 4)], {}, ValueError, "square"),
    ([torch.ones(1, 1, 7, 7) / 7], {}, ValueError, "6 patches is not a square; pass grid"),
    ([torch.ones(1, 1, 7, 7) / 7], {"grid": (2, 2)}, ValueError, "holds 4 patches"),
    ([torch.ones(1, 1, 7, 7) / 7], {"grid": (2, -3)}, ValueError, "grid"),
    ([torch.ones(1, 1, 5, 5) / 5], {"num_prefix_tokens": 0}, ValueError, "num_prefix"),
    ([-torch.ones(1, 1, 5, 5)], {}, ValueError, "negative"),
    ([torch.full((1, 1, 5, 5), float("nan"))], {}, ValueError, "NaN"),
    (torch.ones(2, 2, 2), {}, ValueError, r"\(L, B, H, T, T\)"),
])
def test_rollout_bad_inputs(attentions, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        attention_rollout(attentions, **kwargs)


# --- overlays and PNGs -------------------------------------------------------------------
def cmap_rgb(value: float, name: str = "inferno") -> np.ndarray:
    return np.asarray(matplotlib.colormaps[name](value)[:3]) * 255.0


def test_overlay_blends_each_patch_over_its_pixels():
    image = torch.full((3, 8, 12), 128, dtype=torch.uint8)
    image[0] = 40  # not grey: the blend must keep the channels apart
    grid = torch.zeros(2, 3)
    grid[1, 2], grid[0, 0] = 2.0, 1.0  # divided by the maximum: 1.0 and 0.5
    out = overlay_attention(image, grid, alpha=0.6).permute(1, 2, 0).numpy().astype(float)
    base = image.permute(1, 2, 0).numpy().astype(float)
    hot = np.round(base[0, 0] * 0.4 + cmap_rgb(1.0) * 0.6)
    warm = np.round(base[0, 0] * 0.7 + cmap_rgb(0.5) * 0.3)
    assert np.array_equal(out[4:, 8:], np.broadcast_to(hot, (4, 4, 3)))
    assert np.array_equal(out[:4, :4], np.broadcast_to(warm, (4, 4, 3)))
    untouched = np.ones((8, 12), bool)
    untouched[4:, 8:] = untouched[:4, :4] = False
    assert np.array_equal(out[untouched], base[untouched])  # weight 0: the image itself
    # a float image in [0, 1] and a PIL image give the same pixels
    from PIL import Image

    same = overlay_attention(image.float() / 255, grid, alpha=0.6)
    pil = overlay_attention(Image.fromarray(image.permute(1, 2, 0).numpy()), grid, alpha=0.6)
    assert torch.equal(same, pil) and np.array_equal(same.permute(1, 2, 0).numpy(), out)


def test_overlay_on_sizes_that_do_not_divide():
    grid = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    out = overlay_attention(torch.zeros(3, 7, 5, dtype=torch.uint8), grid, alpha=1.0)
    hot = np.zeros((7, 5), bool)
    for y in range(7):
        for x in range(5):  # the patch each pixel centre falls in
            hot[y, x] = int((y + 0.5) * 2 / 7) == 0 and int((x + 0.5) * 2 / 5) == 0
    assert np.array_equal(out.sum(0).numpy() > 0, hot)


def read_png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_MAGIC
    return (matplotlib.image.imread(path)[..., :3] * 255).round()  # (height, width, 3)


def test_draw_patch_attention_writes_the_overlay(tmp_path):
    image = torch.full((3, 32, 32), 200, dtype=torch.uint8)
    grid = torch.zeros(4, 4)
    grid[3, 0] = 1.0
    path = draw_patch_attention(image, grid, tmp_path / "deep" / "one.png", title="左边一个小红圆")
    pixels = read_png(path).reshape(-1, 3)
    hot = np.round(200 * 0.4 + cmap_rgb(1.0) * 0.6)
    assert (np.abs(pixels - hot).max(1) <= 1).sum() > 100  # the hot patch is drawn, large
    assert pixels.std() > 0 and not list(tmp_path.glob("deep/*.tmp*"))


def test_draw_image_grid_with_captions_and_maps(tmp_path):
    images = torch.rand(5, 3, 16, 16)
    captions = ["a small red circle on the left", "左边一个小红圆", "$x$ </b>", "", "x" * 80]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = draw_image_grid(images, tmp_path / "plain.png", captions=captions, columns=5)
        maps = draw_image_grid(images, tmp_path / "maps.png", captions=captions,
                               maps=torch.rand(5, 2, 2), title="预测")
        bare = draw_image_grid(list(images[:2]), tmp_path / "bare.png")
    assert not [w for w in caught if "Glyph" in str(w.message) or "font" in str(w.message)]
    wide, square, small = read_png(plain), read_png(maps), read_png(bare)
    assert wide.shape[1] > square.shape[1] > small.shape[1]  # 5, 3 and 2 columns
    assert not np.array_equal(wide[: small.shape[0], : small.shape[1]], small)


@pytest.mark.parametrize(("call", "error", "pattern"), [
    (lambda p: draw_image_grid(torch.rand(2, 3, 4, 4), p, captions=["one"]), ValueError,
     "1 captions for 2 images"),
    (lambda p: draw_image_grid(torch.rand(2, 3, 4, 4), p, maps=torch.rand(3, 2, 2)),
     ValueError, "3 maps for 2 images"),
    (lambda p: draw_image_grid([], p), ValueError, "empty"),
    (lambda p: draw_image_grid(torch.rand(3, 4, 4), p), ValueError, r"\(B, 3, H, W\)"),
    (lambda p: draw_image_grid(torch.rand(2, 3, 4, 4), p, columns=0), ValueError, "columns"),
    (lambda p: draw_image_grid("cat.png", p), TypeError, "draw_image_grid: images must be"),
    (lambda p: draw_similarity(torch.rand(3, 4, 4), ["a"], torch.rand(1, 1), p), ValueError,
     r"draw_similarity: images must be \(B, 3, H, W\)"),
    (lambda p: draw_similarity(7, ["a"], torch.rand(1, 1), p), TypeError,
     "draw_similarity: images must be"),
    (lambda p: draw_patch_attention(torch.rand(3, 4, 4) * 3, torch.rand(2, 2), p),
     ValueError, r"\[0, 1\]"),
    (lambda p: draw_patch_attention(torch.rand(4, 4, 3), torch.rand(2, 2), p), ValueError,
     r"\(3, H, W\)"),
    (lambda p: draw_patch_attention(torch.rand(3, 4, 4), torch.rand(4), p), ValueError,
     r"\(gh, gw\)"),
    (lambda p: draw_patch_attention(torch.rand(3, 4, 4), -torch.rand(2, 2), p), ValueError,
     "non-negative"),
    (lambda p: overlay_attention(torch.rand(3, 4, 4), torch.rand(2, 2), alpha=2), ValueError,
     "alpha"),
    (lambda p: overlay_attention(torch.rand(3, 4, 4), torch.rand(2, 2), cmap="nope"),
     ValueError, "cmap"),
    (lambda p: overlay_attention(torch.ones(3, 4, 4, dtype=torch.int32), torch.rand(2, 2)),
     TypeError, "uint8"),
])
def test_drawing_bad_inputs(tmp_path, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
