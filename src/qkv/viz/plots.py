"""PNG heatmaps of attention weights: a layer × head grid, and one alignment map.

Shapes: L layers, H heads, N query length, S key length.

Drawn on matplotlib's Agg canvas (``Figure`` + ``FigureCanvasAgg``: no pyplot, no global
backend switch, works without a display). Token labels go through ``fonts.display_token``
(a CJK font when one is installed, ``\\u`` escapes otherwise); long axes show every k-th
token so labels never overlap. Files are written atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ._io import write_output
from .fonts import display_token, display_tokens, plot_context

__all__ = ["plot_alignment", "plot_attention_grid"]

_FONT_PT = 7.0  # tick label size
_MAX_LABEL = 14  # characters of a tick label before "…"
_MAX_PIXELS = 12000  # longest side of a PNG; the dpi drops to stay under it
_DPI = 100


def _array(fn: str, weights: Tensor | np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """weights as a float64 numpy array with one of ``dims`` dimensions, finite."""
    if isinstance(weights, Tensor):
        arr = weights.detach().to("cpu", torch.float64).numpy()
    elif isinstance(weights, np.ndarray):
        arr = weights.astype(np.float64)
    else:
        raise TypeError(f"{fn}: weights must be a tensor or numpy array, got "
                        f"{type(weights).__name__}")
    if arr.ndim not in dims or 0 in arr.shape:
        raise ValueError(f"{fn}: weights must be a non-empty {' or '.join(f'{d}-D' for d in dims)}"
                         f" array, got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{fn}: weights hold NaN or inf (shape {tuple(arr.shape)})")
    return arr


def _labels(fn: str, name: str, tokens: Sequence[str], n: int) -> list[str]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{fn}: {name} must be a list of strings, got {type(tokens).__name__}")
    if len(tokens) != n:
        raise ValueError(f"{fn}: {name} has {len(tokens)} tokens, the weights need {n}")
    out = display_tokens([str(t) for t in tokens])
    return [t if len(t) <= _MAX_LABEL else t[:_MAX_LABEL - 1] + "…" for t in out]


def _pick(fn: str, name: str, chosen: Sequence[int] | None, total: int) -> list[int]:
    if chosen is None:
        return list(range(total))
    picked = []
    for i in chosen:
        if not isinstance(i, int) or isinstance(i, bool) or not -total <= i < total:
            raise ValueError(f"{fn}: {name} must be indices in [-{total}, {total}), got "
                             f"{list(chosen)!r}")
        picked.append(i % total)
    if not picked:
        raise ValueError(f"{fn}: {name} is empty")
    return picked


def _ticks(ax, labels: Sequence[str], axis: str, room_in: float, *, show: bool = True,
           fontsize: float = _FONT_PT) -> None:
    """Tick every k-th position so that the labels fit in ``room_in`` inches; label them
    (mathtext off: a token like "$x$" shows as typed) when ``show``."""
    fit = max(2, int(room_in * 72 / (fontsize * 1.4)))
    step = max(1, math.ceil(len(labels) / fit))
    idx = list(range(0, len(labels), step))
    shown = [labels[i] for i in idx] if show else [""] * len(idx)
    if axis == "x":
        ax.set_xticks(idx, labels=shown, fontsize=fontsize, rotation=90, parse_math=False)
    else:
        ax.set_yticks(idx, labels=shown, fontsize=fontsize, parse_math=False)


def _save(fig, path: str | os.PathLike, width_in: float, height_in: float) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    dpi = min(_DPI, _MAX_PIXELS / max(width_in, height_in))
    return write_output(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))


def plot_attention_grid(weights: Tensor | np.ndarray, *, query_tokens: Sequence[str],
                        key_tokens: Sequence[str], path: str | os.PathLike,
                        title: str | None = None, layers: Sequence[int] | None = None,
                        heads: Sequence[int] | None = None) -> Path:
    """Write a PNG grid of attention heatmaps: one row per layer, one column per head.

    Args:
        weights: (L, H, N, S) attention weights (e.g. ``attention_maps(...)["encoder"]``);
            (H, N, S) is one layer, (N, S) one head.
        query_tokens: N display strings (the rows of each heatmap).
        key_tokens: S display strings (the columns).
        path: the PNG to write (parent folders are created; written atomically).
        title: a title above the grid.
        layers, heads: which layers / heads to draw (indices, negative from the end);
            default all. Rows and columns are labelled with the original indices.

    Every panel shares one colour scale, 0 to the largest weight drawn. Panels grow with N
    and S up to 5 inches; when a side has more tokens than fit, every k-th is labelled.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError / ValueError: weights not 2-4-D or not finite, token counts that differ
        from N / S, out-of-range layer or head indices.
    """
    fn = "plot_attention_grid"
    arr = _array(fn, weights, (2, 3, 4))
    arr = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)  # (L, H, N, S)
    n_layers, n_heads, n, s = arr.shape
    q_labels = _labels(fn, "query_tokens", query_tokens, n)
    k_labels = _labels(fn, "key_tokens", key_tokens, s)
    rows = _pick(fn, "layers", layers, n_layers)
    cols = _pick(fn, "heads", heads, n_heads)
    sel = arr[np.ix_(rows, cols)]  # (L', H', N, S)
    longest = max(n, s)
    side = min(max(1.8, 0.14 * longest), 5.0)  # inches of the panel's longer side
    pw, ph = max(1.2, side * s / longest), max(1.2, side * n / longest)
    width = len(cols) * pw + 2.0
    height = len(rows) * ph + 1.5 + (0.4 if title else 0.0)
    with plot_context():
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(len(rows), len(cols), squeeze=False)
        vmax = max(float(sel.max()), 1e-12)
        image = None
        for r, layer in enumerate(rows):
            for c, head in enumerate(cols):
                ax = axes[r, c]
                image = ax.imshow(sel[r, c], vmin=0.0, vmax=vmax, cmap="viridis",
                                  aspect="auto", interpolation="nearest")
                if r == 0:
                    ax.set_title(f"head {head}", fontsize=9)
                if c == 0:
                    ax.set_ylabel(f"layer {layer}", fontsize=9)
                _ticks(ax, k_labels, "x", pw, show=r == len(rows) - 1)
                _ticks(ax, q_labels, "y", ph, show=c == 0)
        fig.colorbar(image, ax=axes, shrink=min(1.0, 0.3 + 0.7 / len(rows)),
                     label="attention weight")
        if title:
            fig.suptitle(display_token(title), parse_math=False)
        return _save(fig, path, width, height)


def plot_alignment(weights: Tensor | np.ndarray, *, source_tokens: Sequence[str],
                   target_tokens: Sequence[str], path: str | os.PathLike,
                   title: str | None = None, annotate: bool | None = None) -> Path:
    """Write one PNG heatmap of a (cross-)attention alignment: target tokens (rows, the
    queries) against source tokens (columns, the keys).

    Args:
        weights: (N, S), or (H, N, S) averaged over the heads (e.g. the last layer of
            ``attention_maps(...)["cross"]``: ``maps["cross"][-1]``).
        source_tokens: S display strings.
        target_tokens: N display strings.
        path: the PNG to write (parent folders are created; written atomically).
        title: a title above the map.
        annotate: print each weight in its cell; default: when cells are large enough.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError / ValueError: weights not 2-D/3-D or not finite, token counts that differ
        from N / S.
    """
    fn = "plot_alignment"
    arr = _array(fn, weights, (2, 3))
    if arr.ndim == 3:
        arr = arr.mean(axis=0)  # (N, S)
    n, s = arr.shape
    t_labels = _labels(fn, "target_tokens", target_tokens, n)
    s_labels = _labels(fn, "source_tokens", source_tokens, s)
    cell = max(0.12, min(0.45, 12.0 / max(n, s)))  # inches per token
    if annotate is None:
        annotate = cell >= 0.35
    width, height = s * cell + 2.5, n * cell + 2.0 + (0.4 if title else 0.0)
    with plot_context():
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.subplots()
        vmax = max(float(arr.max()), 1e-12)
        image = ax.imshow(arr, vmin=0.0, vmax=vmax, cmap="viridis", aspect="auto",
                          interpolation="nearest")
        _ticks(ax, s_labels, "x", s * cell, fontsize=9)
        _ticks(ax, t_labels, "y", n * cell, fontsize=9)
        ax.set_xlabel("source (keys)")
        ax.set_ylabel("target (queries)")
        if annotate:
            for i in range(n):
                for j in range(s):
                    v = arr[i, j]
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if v > 0.6 * vmax else "white")
        fig.colorbar(image, ax=ax, label="attention weight")
        if title:
            ax.set_title(display_token(title), parse_math=False)
        return _save(fig, path, width, height)
