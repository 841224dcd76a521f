"""Fonts for token labels: DejaVu Sans (matplotlib's default) plus an installed CJK font when
there is one; a character no chosen font can draw is shown as its ``\\u`` escape instead of an
empty box, and matplotlib's "Glyph ... missing" warnings are silenced while drawing.
"""

from __future__ import annotations

import functools
import unicodedata
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["CJK_FONT_HINTS", "display_token", "display_tokens", "font_setup", "plot_context"]

#: substrings of font family names (lower case) that cover CJK ideographs, in preference order
CJK_FONT_HINTS = ("noto sans cjk", "noto serif cjk", "source han sans", "source han serif",
                  "wenquanyi", "wqy", "droid sans fallback", "sarasa", "noto sans sc",
                  "noto sans tc", "noto sans jp", "noto sans kr", "ar pl", "microsoft yahei",
                  "simhei", "simsun", "pingfang", "hiragino", "heiti", "songti", "unifont")

_BASE_FAMILY = "DejaVu Sans"


def _charmap(path: str, index: int) -> set[int]:
    from matplotlib import ft2font

    try:
        try:
            font = ft2font.FT2Font(path, face_index=index)
        except TypeError:  # matplotlib < 3.10: no face_index (first face of a .ttc)
            font = ft2font.FT2Font(path)
        return set(font.get_charmap())
    except (OSError, RuntimeError, ValueError):
        return set()


@functools.lru_cache(maxsize=1)
def font_setup() -> tuple[tuple[str, ...], frozenset[int]]:
    """``(families, covered)``: the font families to draw labels with (DejaVu Sans, then the
    first installed CJK font of ``CJK_FONT_HINTS``, if any) and the code points they cover
    together. Cached; ``font_setup.cache_clear()`` after installing a font."""
    from matplotlib import font_manager

    families = [_BASE_FAMILY]
    covered = _charmap(font_manager.findfont(_BASE_FAMILY, fallback_to_default=True), 0)
    entries = sorted(font_manager.fontManager.ttflist, key=lambda e: (e.name, e.fname))
    for hint in CJK_FONT_HINTS:
        entry = next((e for e in entries if hint in e.name.lower()), None)
        if entry is not None:
            cjk = _charmap(entry.fname, getattr(entry, "index", 0))
            if cjk:
                families.append(entry.name)
                covered |= cjk
                break
    return tuple(families), frozenset(covered)


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ch == "\r":
        return "\\r"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def display_token(token: str, covered: frozenset[int] | set[int] | None = None) -> str:
    """A token as a tick label: characters the fonts cannot draw (not in ``covered``,
    default ``font_setup()``'s) and control characters become ``\\u4e2d``-style escapes; an
    all-blank token shows its spaces as "␣" (an empty token as "''")."""
    if covered is None:
        covered = font_setup()[1]
    if token == "":
        return "''"
    out = []
    for ch in token:
        cat = unicodedata.category(ch)
        if ch == " " and not token.strip(" "):
            out.append("␣" if ord("␣") in covered else "\\x20")
        elif ch != " " and (cat[0] in "CZ" or ord(ch) not in covered):
            out.append(_escape(ch))  # control, undrawable, or an invisible non-ASCII space
        else:
            out.append(ch)
    return "".join(out)


def display_tokens(tokens: Sequence[str]) -> list[str]:
    """``display_token`` of each token with the installed fonts."""
    covered = font_setup()[1]
    return [display_token(str(t), covered) for t in tokens]


@contextmanager
def plot_context() -> Iterator[None]:
    """Within: figures are created with the label fonts and without the "Glyph missing"
    warnings (labels are escaped, but a font may still lack a glyph it claims)."""
    import matplotlib

    families, _ = font_setup()
    with matplotlib.rc_context({"font.family": list(families)}), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing", category=UserWarning)
        warnings.filterwarnings("ignore", message=r".*missing from (current )?font",
                                category=UserWarning)
        yield
