"""One self-contained HTML page to explore attention maps interactively.

Shapes: L layers, H heads, N query length, S key length.

The page has no network dependency: no CDN, no external font, script, style sheet or URL;
the weights travel inline as JSON (rounded to ``decimals``) in a
``<script type="application/json">`` element, and plain JavaScript draws them. Tokens are
JSON-escaped (``<``, ``>``, ``&``, ``/`` become ``\\u003c``-style escapes, so a token such
as ``</script>`` cannot end the data block) and are put on the page with ``textContent``,
never as HTML.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from ._io import write_output

__all__ = ["attention_html", "page_data"]

_LABELS = {"cross": ("target (queries)", "source (keys)")}


def _shape(x: object) -> object:
    return tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__


def _rounded(t: Tensor, decimals: int) -> list:
    scale = 10.0 ** decimals
    return ((t.detach().to("cpu", torch.float64) * scale).round() / scale).tolist()


def page_data(maps: Mapping[str, Tensor], *, tokens: Mapping[str, tuple[Sequence[str],
              Sequence[str]]], title: str | None = None, decimals: int = 4,
              layer: int | None = None, head: int | None = None) -> dict:
    """The JSON object ``attention_html`` embeds (see there for the arguments):
    ``{"title", "decimals", "initial": {"map", "layer", "head"}, "maps": [{"name",
    "queries", "keys", "query_label", "key_label", "layers", "heads", "w" (L, H, N, S)
    nested lists, "mean" (L, N, S) the mean over heads}]}``; weights rounded to
    ``decimals``; ``head`` -1 in "initial" means the mean over heads."""
    fn = "attention_html"
    if not isinstance(maps, Mapping) or not maps:
        raise ValueError(f"{fn}: maps must be a non-empty dict of (L, H, N, S) tensors, got "
                         f"{type(maps).__name__}")
    if not isinstance(decimals, int) or not 1 <= decimals <= 8:
        raise ValueError(f"{fn}: decimals must be an int in [1, 8], got {decimals!r}")
    out = []
    for name, w in maps.items():
        if (not isinstance(w, Tensor) or w.dim() != 4 or 0 in w.shape
                or not w.dtype.is_floating_point):
            raise ValueError(f"{fn}: map {name!r} must be a float (L, H, N, S) tensor, got "
                             f"{_shape(w)}")
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{fn}: map {name!r} holds NaN or inf")
        if name not in tokens:
            raise ValueError(f"{fn}: tokens has no entry for map {name!r} (give "
                             f"tokens[{name!r}] = (query_tokens, key_tokens))")
        pair = tokens[name]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{fn}: tokens[{name!r}] must be (query_tokens, key_tokens)")
        q, k = ([str(t) for t in side] for side in pair)
        n_layers, n_heads, n, s = w.shape
        if (len(q), len(k)) != (n, s):
            raise ValueError(f"{fn}: map {name!r} is (L, H, N, S) = {tuple(w.shape)} but "
                             f"tokens[{name!r}] has {len(q)} query and {len(k)} key tokens")
        q_label, k_label = _LABELS.get(name, ("queries", "keys"))
        out.append({"name": str(name), "queries": q, "keys": k, "query_label": q_label,
                    "key_label": k_label, "layers": n_layers, "heads": n_heads,
                    "w": _rounded(w, decimals),
                    "mean": _rounded(w.to(torch.float64).mean(dim=1), decimals)})
    first = out[0]
    n_layers, n_heads = first["layers"], first["heads"]
    if layer is not None and not (isinstance(layer, int) and -n_layers <= layer < n_layers):
        raise ValueError(f"{fn}: layer must be in [-{n_layers}, {n_layers}), got {layer!r}")
    if head is not None and not (isinstance(head, int) and -n_heads <= head < n_heads):
        raise ValueError(f"{fn}: head must be in [-{n_heads}, {n_heads}), got {head!r}")
    initial = {"map": 0, "layer": n_layers - 1 if layer is None else layer % n_layers,
               "head": -1 if head is None else head % n_heads}
    return {"title": title or "attention", "decimals": decimals, "initial": initial,
            "maps": out}


def _json_for_script(data: dict) -> str:
    """JSON that is safe inside ``<script>``: no ``<``, ``>``, ``&``, ``/`` or line separators
    appear literally (they only ever occur inside JSON strings, where escapes are valid)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("/", "\\/"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def attention_html(maps: Mapping[str, Tensor], *,
                   tokens: Mapping[str, tuple[Sequence[str], Sequence[str]]],
                   path: str | os.PathLike, title: str | None = None, decimals: int = 4,
                   layer: int | None = None, head: int | None = None) -> Path:
    """Write one self-contained HTML page to explore attention maps.

    The page picks a map ("encoder", "decoder", "cross", ...), a layer and a head (or the
    mean over heads). Hovering a query token shades each key token with intensity = its
    weight and prints the weights; hovering a key shows which queries attend to it; a
    click pins the selection. A heatmap table shows the whole (N, S) matrix. For
    cross-attention the rows are the target (queries) and the source (keys).

    Args:
        maps: ``{name: (L, H, N, S)}``, e.g. ``attention_maps(model, ids, ...)``.
        tokens: ``{name: (query_tokens, key_tokens)}`` with N and S strings, e.g.
            ``token_labels(maps, input_tokens=..., target_tokens=...)``.
        path: the HTML file to write (parent folders are created; written atomically).
        title: the page title.
        decimals: weights are stored rounded to this many decimals (default 4).
        layer, head: the view the page opens on (default: the last layer, the mean over
            heads); negative indices count from the end.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: a map that is not a finite float (L, H, N, S) tensor, tokens missing or
        of the wrong length, ``layer``/``head`` out of range.
    """
    data = page_data(maps, tokens=tokens, title=title, decimals=decimals, layer=layer,
                     head=head)
    from ._page import CSS, JS

    page = (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(data['title'])}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        f"<h1>{html.escape(data['title'])}</h1>\n"
        "<div id=\"controls\">\n"
        "<label>map <select id=\"map\"></select></label>\n"
        "<label>layer <select id=\"layer\"></select></label>\n"
        "<label>head <select id=\"head\"></select></label>\n"
        "<label><input type=\"checkbox\" id=\"relative\"> colours relative to the largest "
        "weight shown</label>\n</div>\n"
        "<p class=\"hint\">Hover a query token: each key token is shaded by the weight the "
        "query gives it (numbers below the keys). Hover a key: the queries attending to it. "
        "Click to pin, click again to release.</p>\n"
        "<div class=\"row\"><div class=\"label\" id=\"query-label\"></div>"
        "<div class=\"tokens\" id=\"queries\"></div></div>\n"
        "<div class=\"row\"><div class=\"label\" id=\"key-label\"></div>"
        "<div class=\"tokens\" id=\"keys\"></div></div>\n"
        "<div id=\"info\"></div>\n<div id=\"matrix-box\"><table id=\"matrix\"></table></div>\n"
        f"<script type=\"application/json\" id=\"qkv-data\">{_json_for_script(data)}</script>\n"
        f"<script>{JS}</script>\n</body>\n</html>\n")
    return write_output(path, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
