"""Attention visualisation for any qkv model.

Shapes: L layers, H heads, N query length, S key length.

- ``attention_maps(model, input_ids, target_ids=...)``: ``{name: (L, H, N, S)}`` for one
  example ("encoder", "decoder", "cross" — whichever the model has).
- ``token_labels(maps, input_tokens=..., target_tokens=...)``: each map's (query, key) tokens.
- ``plot_attention_grid(weights, ...)``: a PNG, layers × heads heatmaps.
- ``plot_alignment(weights, ...)``: a PNG, one (cross-)attention alignment.
- ``attention_html(maps, tokens=..., path=...)``: one self-contained interactive HTML page.
- Image patches (``qkv.viz.patches``): ``attention_rollout(attentions)`` (L × (B, H, T, T)
  -> (B, gh, gw)), ``cls_attention``, ``overlay_attention``, ``draw_patch_attention(image,
  grid, path)``, ``draw_image_grid(images, path, captions=..., maps=...)``,
  ``draw_similarity(images, captions, similarity, path)`` (a CLIP image × text matrix).

Example::

    maps = attention_maps(model, src_ids, target_ids=tgt_ids)
    tokens = token_labels(maps, input_tokens=src_tokens, target_tokens=tgt_tokens)
    plot_attention_grid(maps["cross"], query_tokens=tgt_tokens, key_tokens=src_tokens,
                        path="cross.png")
    attention_html(maps, tokens=tokens, path="attention.html")

matplotlib is imported only when a plot is drawn.
"""

from .fonts import display_token, font_setup
from .html import attention_html
from .maps import MAP_NAMES, attention_maps, token_labels
from .patches import (
    attention_rollout,
    cls_attention,
    draw_image_grid,
    draw_patch_attention,
    draw_similarity,
    overlay_attention,
)
from .plots import plot_alignment, plot_attention_grid

__all__ = ["MAP_NAMES", "attention_html", "attention_maps", "display_token", "font_setup",
           "plot_alignment", "plot_attention_grid", "token_labels"]
__all__ += ["attention_rollout", "cls_attention", "draw_image_grid", "draw_patch_attention",
            "draw_similarity", "overlay_attention"]
