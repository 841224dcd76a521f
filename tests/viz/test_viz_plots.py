"""``qkv.viz`` PNG plots and token-label fonts.

Shapes: L layers, H heads, N query length, S key length.

The files must be real PNGs (magic bytes; matplotlib reads them back), grow with the grid,
draw the same pixels for (H, N, S) as for its mean over heads, keep tick labels to what
fits, and never emit "Glyph missing" warnings, even for Chinese tokens without a CJK font.
"""

from __future__ import annotations

import warnings

import matplotlib.image
import numpy as np
import pytest
import torch
from matplotlib import font_manager

from qkv.viz import display_token, font_setup, plot_alignment, plot_attention_grid
from qkv.viz.plots import _ticks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def weights(*shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape), dim=-1)


def read_png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_MAGIC
    return matplotlib.image.imread(path)  # (height, width, 4)


def test_grid_is_a_png_that_grows_with_the_grid(tmp_path):
    w = weights(2, 4, 5, 6)
    q, k = [f"q{i}" for i in range(5)], [f"k{j}" for j in range(6)]
    one = plot_attention_grid(w, query_tokens=q, key_tokens=k, path=tmp_path / "one.png",
                              layers=[1], heads=[-1])
    full = plot_attention_grid(w, query_tokens=q, key_tokens=k, path=tmp_path / "a/full.png",
                               title="all")
    small, big = read_png(one), read_png(full)
    assert big.shape[0] > small.shape[0] and big.shape[1] > 2 * small.shape[1]
    assert small.shape[2] == 4 and small.std() > 0  # not a blank image


def test_cjk_and_hostile_tokens_draw_without_glyph_warnings(tmp_path):
    tokens = ["猫", "它", "$x$", "</script>", " ", "\x00", "🙂", "a" * 40]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = plot_attention_grid(weights(1, 2, 8, 8), query_tokens=tokens,
                                   key_tokens=tokens, path=tmp_path / "cjk.png",
                                   title="注意力 $x$")
        plot_alignment(weights(8, 8), source_tokens=tokens, target_tokens=tokens,
                       path=tmp_path / "align.png", title="对齐")
    assert not [w for w in caught if "Glyph" in str(w.message) or "font" in str(w.message)]
    read_png(path)


def test_alignment_of_heads_is_the_mean_over_heads(tmp_path):
    w = weights(4, 3, 5).double()  # (H, N, S)
    src, tgt = list("abcde"), list("xyz")
    a = plot_alignment(w, source_tokens=src, target_tokens=tgt, path=tmp_path / "h.png")
    b = plot_alignment(w.mean(0), source_tokens=src, target_tokens=tgt,
                       path=tmp_path / "m.png")
    c = plot_alignment(w[0], source_tokens=src, target_tokens=tgt, path=tmp_path / "0.png")
    assert np.array_equal(read_png(a), read_png(b))
    assert not np.array_equal(read_png(a), read_png(c))


def test_long_axes_label_only_what_fits():
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    labels = [f"t{i}" for i in range(300)]
    _ticks(ax, labels, "x", 5.0)
    _ticks(ax, labels[:10], "y", 5.0)
    fit = int(5.0 * 72 / (7.0 * 1.4))  # 36 labels of 7 pt in 5 inches
    shown = [t.get_text() for t in ax.get_xticklabels()]
    assert 2 <= len(shown) <= fit and shown[0] == "t0" and shown[1] == "t9"
    assert [t.get_text() for t in ax.get_yticklabels()] == labels[:10]  # all fit


def test_large_grid_stays_under_the_pixel_cap(tmp_path):
    n = 200
    toks = [str(i) for i in range(n)]
    path = plot_attention_grid(weights(1, 2, n, n), query_tokens=toks, key_tokens=toks,
                               path=tmp_path / "big.png")
    img = read_png(path)
    assert max(img.shape[:2]) <= 12000 and img.shape[1] > 900


def test_display_token_escapes_what_the_fonts_cannot_draw():
    covered = {ord(c) for c in "abc␣"}
    assert display_token("猫a", covered) == "\\u732ba"
    assert display_token("猫", covered | {ord("猫")}) == "猫"
    assert display_token("🙂", covered) == "\\U0001f642"
    assert display_token("a\x00\n", covered) == "a\\x00\\n"
    assert display_token("  ", covered) == "␣␣"
    assert display_token("", covered) == "''"
    assert display_token("a\u00a0b", covered) == "a\\xa0b"  # an invisible space, shown


def test_an_installed_cjk_font_is_used(monkeypatch):
    """A font whose family name looks CJK joins DejaVu Sans; its glyphs count as covered
    (the "CJK font" here is DejaVu Sans registered under another name, so the test runs
    where no CJK font is installed)."""
    dejavu = font_manager.findfont("DejaVu Sans")
    fake = font_manager.FontEntry(fname=dejavu, name="Noto Sans CJK SC")
    monkeypatch.setattr(font_manager.fontManager, "ttflist",
                        [*font_manager.fontManager.ttflist, fake])
    font_setup.cache_clear()
    try:
        families, covered = font_setup()
        assert len(families) == 2 and families[0] == "DejaVu Sans"
        assert "cjk" in families[1].lower()  # "noto sans cjk" is the first hint
        assert ord("a") in covered
    finally:
        font_setup.cache_clear()


def test_bad_inputs_name_the_argument(tmp_path):
    p = tmp_path / "x.png"
    with pytest.raises(ValueError, match="query_tokens has 2 tokens, the weights need 3"):
        plot_attention_grid(weights(1, 1, 3, 3), query_tokens=["a", "b"],
                            key_tokens=list("abc"), path=p)
    with pytest.raises(ValueError, match="2-D or 3-D or 4-D"):
        plot_attention_grid(weights(1, 1, 1, 3, 3), query_tokens=["a"], key_tokens=["a"],
                            path=p)
    with pytest.raises(ValueError, match="NaN"):
        plot_alignment(torch.full((2, 2), float("nan")), source_tokens=["a", "b"],
                       target_tokens=["a", "b"], path=p)
    with pytest.raises(ValueError, match="heads must be indices"):
        plot_attention_grid(weights(1, 2, 2, 2), query_tokens=["a", "b"],
                            key_tokens=["a", "b"], path=p, heads=[2])
    with pytest.raises(TypeError, match="source_tokens must be a list"):
        plot_alignment(weights(2, 2), source_tokens="ab", target_tokens=["a", "b"], path=p)
    assert not p.exists()
