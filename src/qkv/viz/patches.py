"""Attention over image patches: attention rollout, and PNGs of maps drawn over images.

Shapes: L layers, B batch, H heads, T tokens = prefix tokens (the class token first) + P
patches, P = gh·gw patches in row-major order (as a ViT flattens its patch grid),
Hi / Wi image height / width in pixels.

- ``attention_rollout(attentions)``: Abnar & Zuidema (2020), "Quantifying Attention Flow in
  Transformers": per layer, average the heads, add the identity (the residual stream) and
  renormalise each row; multiply the layers, the last on the left; the class token's row
  over the patches is the map (B, gh, gw).
- ``cls_attention(attentions)``: one layer's raw class-token attention, head-averaged.
- ``overlay_attention(image, grid)``: the map blended over the image, (3, Hi, Wi) uint8.
- ``draw_patch_attention(image, grid, path)``: a PNG, the image beside the overlay.
- ``draw_image_grid(images, path, captions=..., maps=...)``: a PNG grid of images (with
  their overlays when maps are given) captioned underneath.
- ``draw_similarity(images, captions, similarity, path)``: a PNG of an image × text
  similarity matrix (CLIP's), the images as thumbnails above their columns, the texts
  labelling the rows.

Functions take tensors (e.g. ``ViT(..., output_attentions=True).attentions``), never models.
Drawing follows ``qkv.viz.plots``: matplotlib's Agg canvas (no pyplot), CJK-capable fonts,
atomic writes.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ._io import write_output
from .fonts import display_token, plot_context

__all__ = ["attention_rollout", "cls_attention", "draw_image_grid", "draw_patch_attention",
           "draw_similarity", "overlay_attention"]

_DPI = 100


def _layers(fn: str, attentions: Sequence[Tensor] | Tensor) -> tuple[Tensor, bool]:
    """(L, B, H, T, T) float64 and whether the input had a batch dimension."""
    if isinstance(attentions, Tensor):
        if attentions.dim() == 5:
            stack, batched = attentions, True
        elif attentions.dim() == 4:
            stack, batched = attentions.unsqueeze(1), False  # (L, 1, H, T, T)
        else:
            raise ValueError(f"{fn}: attentions must be (L, B, H, T, T) or one example's "
                             f"(L, H, T, T), got shape {tuple(attentions.shape)}")
    elif isinstance(attentions, Sequence) and not isinstance(attentions, (str, bytes)):
        if not attentions:
            raise ValueError(f"{fn}: attentions is empty (no layers)")
        if not all(isinstance(a, Tensor) for a in attentions):
            raise TypeError(f"{fn}: attentions must hold tensors, got "
                            f"{[type(a).__name__ for a in attentions]}")
        shapes = {tuple(a.shape) for a in attentions}
        if len(shapes) != 1 or attentions[0].dim() != 4:
            raise ValueError(f"{fn}: attentions must be L tensors of one shape (B, H, T, T), "
                             f"got shapes {[tuple(a.shape) for a in attentions]}")
        stack, batched = torch.stack([a.detach() for a in attentions]), True
    else:
        raise TypeError(f"{fn}: attentions must be a tensor or a list of tensors, got "
                        f"{type(attentions).__name__}")
    if stack.shape[-1] != stack.shape[-2] or 0 in stack.shape:
        raise ValueError(f"{fn}: each attention map must be square (T, T) self-attention, "
                         f"got shape {tuple(stack.shape[2:])} per example")
    stack = stack.detach().to("cpu", torch.float64)
    if not torch.isfinite(stack).all():
        raise ValueError(f"{fn}: attentions hold NaN or inf")
    if (stack < 0).any():
        raise ValueError(f"{fn}: attentions hold negative weights (min "
                         f"{float(stack.min()):.3g}); pass softmax probabilities")
    return stack, batched


def _grid_shape(fn: str, patches: int, grid: tuple[int, int] | None,
                num_prefix_tokens: int) -> tuple[int, int]:
    if grid is None:
        side = math.isqrt(max(patches, 0))
        if patches < 1 or side * side != patches:
            raise ValueError(f"{fn}: T - num_prefix_tokens = {patches} patches is not a "
                             f"square; pass grid=(gh, gw)")
        return side, side
    if (not isinstance(grid, (tuple, list)) or len(grid) != 2
            or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid)):
        raise ValueError(f"{fn}: grid must be (gh, gw) positive ints, got {grid!r}")
    if grid[0] * grid[1] != patches:
        raise ValueError(f"{fn}: grid {tuple(grid)} holds {grid[0] * grid[1]} patches, but "
                         f"T - num_prefix_tokens = {patches} (num_prefix_tokens="
                         f"{num_prefix_tokens})")
    return grid[0], grid[1]


def _check_prefix(fn: str, num_prefix_tokens: int) -> None:
    if (not isinstance(num_prefix_tokens, int) or isinstance(num_prefix_tokens, bool)
            or num_prefix_tokens < 1):
        raise ValueError(f"{fn}: num_prefix_tokens must be an int >= 1 (the class token "
                         f"first), got {num_prefix_tokens!r}")


def _out_dtype(attentions: Sequence[Tensor] | Tensor) -> torch.dtype:
    first = attentions if isinstance(attentions, Tensor) else attentions[0]
    return torch.float64 if first.dtype == torch.float64 else torch.float32


def attention_rollout(attentions: Sequence[Tensor] | Tensor, *,
                      grid: tuple[int, int] | None = None,
                      num_prefix_tokens: int = 1) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of the class token over the image patches.

    For each layer l: ``A_l = mean over heads``, ``Â_l = (A_l + I)`` with each row divided by
    its sum; then ``R = Â_L · … · Â_2 · Â_1`` (the first layer rightmost); the map is
    ``R[:, 0, num_prefix_tokens:]`` reshaped to the patch grid. Computed in float64.

    Args:
        attentions: L tensors (B, H, T, T) (e.g. ``ViTOutput.attentions``), or one
            (L, B, H, T, T) tensor, or one example's (L, H, T, T); rows are softmax weights.
        grid: (gh, gw) with gh·gw = T - num_prefix_tokens; default the square grid.
        num_prefix_tokens: tokens before the patches (the class token first, then e.g. a
            distillation or register tokens); default 1.

    Returns:
        (B, gh, gw) (or (gh, gw) for an (L, H, T, T) input), float32 (float64 for float64
        input): how much of the class token's final state flows from each patch. The map
        plus the class token's own share (``R[:, 0, :num_prefix_tokens]``) sums to 1.

    Raises:
        TypeError / ValueError: not a list of equal (B, H, T, T) tensors, non-square maps,
        negative or non-finite weights, a grid that does not hold T - num_prefix_tokens.
    """
    fn = "attention_rollout"
    _check_prefix(fn, num_prefix_tokens)
    stack, batched = _layers(fn, attentions)  # (L, B, H, T, T)
    t = stack.shape[-1]
    gh, gw = _grid_shape(fn, t - num_prefix_tokens, grid, num_prefix_tokens)
    eye = torch.eye(t, dtype=torch.float64)
    rollout = eye.expand(stack.shape[1], t, t)  # (B, T, T)
    for layer in stack:
        joint = layer.mean(dim=1) + eye  # (B, T, T)
        joint = joint / joint.sum(dim=-1, keepdim=True)
        rollout = joint @ rollout  # (B, T, T)
    maps = rollout[:, 0, num_prefix_tokens:].reshape(-1, gh, gw)  # (B, gh, gw)
    maps = maps.to(_out_dtype(attentions))
    return maps if batched else maps[0]


def cls_attention(attentions: Sequence[Tensor] | Tensor, *, layer: int = -1,
                  grid: tuple[int, int] | None = None, num_prefix_tokens: int = 1) -> Tensor:
    """One layer's class-token attention over the patches, averaged over the heads.

    Args:
        attentions: as ``attention_rollout``.
        layer: which layer (negative from the end; default the last).
        grid, num_prefix_tokens: as ``attention_rollout``.

    Returns:
        (B, gh, gw) (or (gh, gw) for an (L, H, T, T) input): ``mean_h A[layer][:, h, 0,
        num_prefix_tokens:]`` on the patch grid.
    """
    fn = "cls_attention"
    _check_prefix(fn, num_prefix_tokens)
    stack, batched = _layers(fn, attentions)  # (L, B, H, T, T)
    n_layers, t = stack.shape[0], stack.shape[-1]
    if not isinstance(layer, int) or isinstance(layer, bool) or not -n_layers <= layer < n_layers:
        raise ValueError(f"{fn}: layer must be an int in [-{n_layers}, {n_layers}), got "
                         f"{layer!r}")
    gh, gw = _grid_shape(fn, t - num_prefix_tokens, grid, num_prefix_tokens)
    row = stack[layer].mean(dim=1)[:, 0, num_prefix_tokens:]  # (B, P)
    maps = row.reshape(-1, gh, gw).to(_out_dtype(attentions))  # (B, gh, gw)
    return maps if batched else maps[0]


def _image_u8(fn: str, image: object) -> np.ndarray:
    """(Hi, Wi, 3) uint8 of a (3, Hi, Wi) tensor (uint8, or float in [0, 1]) or PIL image."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with matplotlib
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    if not isinstance(image, Tensor):
        raise TypeError(f"{fn}: image must be a (3, H, W) tensor or a PIL image, got "
                        f"{type(image).__name__}")
    if image.dim() != 3 or image.shape[0] not in (1, 3) or 0 in image.shape:
        raise ValueError(f"{fn}: image must be (3, H, W) (or (1, H, W)), got shape "
                         f"{tuple(image.shape)}")
    image = image.detach().to("cpu")
    if image.dtype == torch.uint8:
        u8 = image
    elif image.dtype.is_floating_point:
        if not torch.isfinite(image).all():
            raise ValueError(f"{fn}: image holds NaN or inf")
        lo, hi = float(image.min()), float(image.max())
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise ValueError(f"{fn}: a float image must hold values in [0, 1], got "
                             f"[{lo:.3g}, {hi:.3g}] (undo the normalisation first)")
        u8 = (image.to(torch.float64).clamp(0, 1) * 255).round().to(torch.uint8)
    else:
        raise TypeError(f"{fn}: image must be uint8 or floating point, got {image.dtype}")
    return u8.expand(3, -1, -1).permute(1, 2, 0).contiguous().numpy()  # (Hi, Wi, 3)


def _grid_array(fn: str, grid: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(grid, Tensor):
        arr = grid.detach().to("cpu", torch.float64).numpy()
    elif isinstance(grid, np.ndarray):
        arr = grid.astype(np.float64)
    else:
        raise TypeError(f"{fn}: grid must be a (gh, gw) tensor or array, got "
                        f"{type(grid).__name__}")
    if arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(f"{fn}: grid must be a (gh, gw) map, got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError(f"{fn}: grid must hold finite non-negative weights")
    return arr


def _overlay(fn: str, image: object, grid: Tensor | np.ndarray, alpha: float,
             cmap: str) -> np.ndarray:
    import matplotlib

    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ValueError(f"{fn}: alpha must be a number in [0, 1], got {alpha!r}")
    try:
        colormap = matplotlib.colormaps[cmap]
    except (KeyError, TypeError):
        raise ValueError(f"{fn}: cmap must be a matplotlib colormap name, got {cmap!r}") from None
    img = _image_u8(fn, image).astype(np.float64)  # (Hi, Wi, 3)
    arr = _grid_array(fn, grid)  # (gh, gw)
    hi, wi = img.shape[:2]
    gh, gw = arr.shape
    rows = (2 * np.arange(hi) + 1) * gh // (2 * hi)  # the patch row each pixel centre is in
    cols = (2 * np.arange(wi) + 1) * gw // (2 * wi)
    peak = arr.max()
    weight = arr / peak if peak > 0 else arr  # (gh, gw) in [0, 1]
    up = weight[np.ix_(rows, cols)]  # (Hi, Wi): patch (i, j) covers its block of pixels
    colour = colormap(up)[..., :3] * 255.0  # (Hi, Wi, 3)
    a = alpha * up[..., None]
    return np.round(img * (1 - a) + colour * a).astype(np.uint8)  # (Hi, Wi, 3)


def overlay_attention(image: object, grid: Tensor | np.ndarray, *, alpha: float = 0.6,
                      cmap: str = "inferno") -> Tensor:
    """A patch map blended over its image.

    Args:
        image: (3, Hi, Wi) uint8, or float in [0, 1] (un-normalised), or a PIL image.
        grid: (gh, gw) non-negative weights (e.g. one row of ``attention_rollout``); a
            pixel takes the weight of the patch its centre falls in (patch (i, j) covers
            rows ``[i·Hi/gh, (i+1)·Hi/gh)`` and the matching columns).
        alpha: opacity of the strongest patch; a patch of weight w (divided by the map's
            maximum) is blended with opacity ``alpha · w``, so a zero patch leaves the image
            untouched.
        cmap: a matplotlib colormap name; the colour of a patch is ``cmap(w)``.

    Returns:
        (3, Hi, Wi) uint8.
    """
    out = _overlay("overlay_attention", image, grid, alpha, cmap)
    return torch.from_numpy(out).permute(2, 0, 1).contiguous()  # (3, Hi, Wi)


def _caption_text(caption: str, width: int) -> str:
    """A caption as drawable text (``display_token``: escapes for glyphs no font has),
    wrapped to ``width`` characters, at most three lines."""
    shown = display_token(str(caption)) if str(caption) else ""
    lines = textwrap.wrap(shown, width=width, break_long_words=True) or [""]
    if len(lines) > 3:
        lines = [*lines[:2], lines[2][: width - 1] + "…"]
    return "\n".join(lines)


def _save(fig, path: str | os.PathLike) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return write_output(path, lambda tmp: fig.savefig(tmp, format="png", dpi=_DPI))


def draw_patch_attention(image: object, grid: Tensor | np.ndarray, path: str | os.PathLike,
                         *, title: str | None = None, alpha: float = 0.6,
                         cmap: str = "inferno") -> Path:
    """Write a PNG: the image, and beside it the (gh, gw) patch map drawn over it.

    Args:
        image: (3, Hi, Wi) uint8, float in [0, 1], or a PIL image.
        grid: (gh, gw) non-negative weights (e.g. ``attention_rollout(...)[0]``).
        path: the PNG to write (parent folders are created; written atomically).
        title: a title above the two panels (CJK drawn when a font has it).
        alpha, cmap: as ``overlay_attention``.

    Returns:
        ``path`` as a ``Path``.
    """
    fn = "draw_patch_attention"
    base = _image_u8(fn, image)  # (Hi, Wi, 3)
    over = _overlay(fn, image, grid, alpha, cmap)  # (Hi, Wi, 3)
    arr = _grid_array(fn, grid)
    with plot_context():
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.0, 3.2 + (0.4 if title else 0.0)), layout="constrained")
        left, right = fig.subplots(1, 2)
        left.imshow(base, interpolation="nearest")
        left.set_title("image", fontsize=9)
        right.imshow(over, interpolation="nearest")
        right.set_title(f"attention ({arr.shape[0]}×{arr.shape[1]} patches)", fontsize=9)
        for ax in (left, right):
            ax.set_xticks([])
            ax.set_yticks([])
        fig.colorbar(ScalarMappable(Normalize(0.0, max(float(arr.max()), 1e-12)), cmap=cmap),
                     ax=right, shrink=0.8, label="attention")
        if title:
            fig.suptitle(display_token(title), parse_math=False)
        return _save(fig, path)


def draw_image_grid(images: Tensor | Sequence[object], path: str | os.PathLike, *,
                    captions: Sequence[str] | None = None,
                    maps: Tensor | Sequence[Tensor] | None = None,
                    columns: int | None = None, title: str | None = None,
                    alpha: float = 0.6, cmap: str = "inferno") -> Path:
    """Write a PNG grid of images, each captioned underneath, with its patch map drawn over
    it when ``maps`` is given.

    Args:
        images: (B, 3, Hi, Wi) (uint8 or float in [0, 1]) or B images as ``overlay_attention``
            takes.
        path: the PNG to write (parent folders are created; written atomically).
        captions: B strings (e.g. predicted captions), wrapped to three lines.
        maps: (B, gh, gw) patch maps (e.g. ``attention_rollout(...)``), or None.
        columns: images per row (default ``ceil(sqrt(B))``, at most 8).
        title: a title above the grid.
        alpha, cmap: as ``overlay_attention``.

    Returns:
        ``path`` as a ``Path``.
    """
    fn = "draw_image_grid"
    items = _image_list(images, fn)
    n = len(items)
    if n == 0:
        raise ValueError(f"{fn}: images is empty")
    if captions is not None:
        if isinstance(captions, (str, bytes)) or not isinstance(captions, Sequence):
            raise TypeError(f"{fn}: captions must be a list of strings, got "
                            f"{type(captions).__name__}")
        if len(captions) != n:
            raise ValueError(f"{fn}: {len(captions)} captions for {n} images")
    if maps is not None and len(maps) != n:
        raise ValueError(f"{fn}: {len(maps)} maps for {n} images")
    if columns is None:
        columns = min(8, math.ceil(math.sqrt(n)))
    if not isinstance(columns, int) or isinstance(columns, bool) or columns < 1:
        raise ValueError(f"{fn}: columns must be a positive int, got {columns!r}")
    columns = min(columns, n)
    rows = math.ceil(n / columns)
    pictures = [_image_u8(fn, im) if maps is None else _overlay(fn, im, maps[i], alpha, cmap)
                for i, im in enumerate(items)]
    cell_w, cell_h = 1.9, 1.9 + (0.55 if captions is not None else 0.0)
    width, height = columns * cell_w, rows * cell_h + (0.4 if title else 0.0)
    with plot_context():
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(rows, columns, squeeze=False)
        for k, ax in enumerate(axes.flat):
            ax.set_xticks([])
            ax.set_yticks([])
            if k >= n:
                ax.set_axis_off()
                continue
            ax.imshow(pictures[k], interpolation="nearest")
            if captions is not None:
                ax.set_xlabel(_caption_text(captions[k], 28), fontsize=7, parse_math=False)
        if title:
            fig.suptitle(display_token(title), parse_math=False)
        return _save(fig, path)


def draw_similarity(images: Tensor | Sequence[object], captions: Sequence[str],
                    similarity: Tensor | np.ndarray, path: str | os.PathLike, *,
                    title: str | None = None, cmap: str = "viridis") -> Path:
    """Write a PNG of an image × text similarity matrix (as OpenAI's CLIP notebook draws
    it): one column per image, its thumbnail above the column, one row per text, each cell
    coloured by and labelled with its value.

    Args:
        images: (B, 3, Hi, Wi) (uint8 or float in [0, 1]) or B images as
            ``overlay_attention`` takes.
        captions: K strings (the rows' labels).
        similarity: (B, K) values, e.g. cosine similarities of image and text embeddings;
            drawn transposed (texts are rows).
        path: the PNG to write (parent folders are created; written atomically).
        title: a title above the matrix. cmap: a matplotlib colormap name.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError / ValueError naming ``images``, ``captions`` or ``similarity``: wrong
        types, a similarity that is not (B, K) or not finite.
    """
    import matplotlib

    fn = "draw_similarity"
    items = _image_list(images, fn)
    if isinstance(captions, (str, bytes)) or not isinstance(captions, Sequence):
        raise TypeError(f"{fn}: captions must be a list of strings, got "
                        f"{type(captions).__name__}")
    if isinstance(similarity, Tensor):
        sim = similarity.detach().to("cpu", torch.float64).numpy()
    elif isinstance(similarity, np.ndarray):
        sim = similarity.astype(np.float64)
    else:
        raise TypeError(f"{fn}: similarity must be a (B, K) tensor or array, got "
                        f"{type(similarity).__name__}")
    b, k = len(items), len(captions)
    if b == 0 or k == 0:
        raise ValueError(f"{fn}: need at least one image and one caption, got {b} and {k}")
    if sim.shape != (b, k):
        raise ValueError(f"{fn}: similarity must be (B, K) = ({b}, {k}) for {b} images and "
                         f"{k} captions, got shape {tuple(sim.shape)}")
    if not np.isfinite(sim).all():
        raise ValueError(f"{fn}: similarity holds NaN or inf")
    try:
        colormap = matplotlib.colormaps[cmap]
    except (KeyError, TypeError):
        raise ValueError(f"{fn}: cmap must be a matplotlib colormap name, got {cmap!r}") from None
    pictures = [_image_u8(fn, im) for im in items]  # (Hi, Wi, 3) each
    labels = [display_token(str(c)) for c in captions]
    lo, hi = float(sim.min()), float(sim.max())
    cell = 0.42  # inches per matrix cell; the text labels take about 3.2 inches
    width = 3.2 + cell * b
    height = 1.2 + cell * k + (0.4 if title else 0.0)
    with plot_context():
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.subplots()
        ax.imshow(sim.T, cmap=colormap, vmin=lo, vmax=hi, interpolation="nearest",
                  aspect="auto")  # the figure's size makes the cells about square
        mid = (lo + hi) / 2
        for i in range(b):
            for j in range(k):
                ax.text(i, j, f"{sim[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if sim[i, j] > mid else "white")
            ax.imshow(pictures[i], extent=(i - 0.45, i + 0.45, -0.6, -1.5),
                      interpolation="nearest", aspect="auto")
        ax.set_xlim(-0.5, b - 0.5)
        ax.set_ylim(k - 0.5, -1.6)
        ax.set_xticks([])
        ax.set_yticks(range(k), labels, fontsize=7)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        if title:
            ax.set_title(display_token(title), fontsize=9, parse_math=False)
        return _save(fig, path)


def _image_list(images, fn: str) -> list:
    """A (B, 3, H, W) tensor or a sequence of images -> a list of B images; errors name
    ``fn``."""
    if isinstance(images, Tensor):
        if images.dim() != 4:
            raise ValueError(f"{fn}: images must be (B, 3, H, W), got shape "
                             f"{tuple(images.shape)}")
        return list(images)
    if isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
        return list(images)
    raise TypeError(f"{fn}: images must be a (B, 3, H, W) tensor or a list of images, got "
                    f"{type(images).__name__}")
