"""Decoding with a ``qkv.models.Flamingo`` whose images are bound: ``FlamingoDecoder`` (the
decoder-only interface ``qkv.generate`` drives) and its ``FlamingoCache``.

Shapes: B bound rows, R decoded rows (B, or B·K with K beams), N new tokens, S cached + new
tokens, V vocab, T image slots.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..modules.cache import KVCache
from ..modules.gated_cross_attention import MediaKV, text_time_from_ids
from .inputs import check_token_ids

__all__ = ["FlamingoCache", "FlamingoDecoder", "check_image_counts"]


def check_image_counts(counts: Tensor, slots: Tensor | int, what: str) -> None:
    """ValueError naming the first row whose ``<image>`` tokens ``counts`` (B,) exceed its
    image ``slots`` (an int, or (B,) ints); ``what`` says where the images come from."""
    over = counts > slots  # (B,)
    if bool(over.any()):
        r = int(over.nonzero()[0])
        have = slots if isinstance(slots, int) else int(slots[r])
        raise ValueError(f"Flamingo: row {r} has {int(counts[r])} <image> tokens but "
                         f"{what} {have} image(s) for it; every <image> token needs its "
                         f"image (the t-th <image> token reads images[b, t])")


class FlamingoCache:
    """Decoding state of a ``FlamingoDecoder``: the LM's per-layer caches (``layers``) and
    ``seen`` (R,) int64, the ``<image>`` tokens each row has fed so far."""

    def __init__(self, layers: list[Any], seen: Tensor) -> None:
        self.layers, self.seen = layers, seen

    @property
    def length(self) -> int:
        """Positions cached."""
        return self.layers[0].length

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (beam search); ``idx`` (R,) int64."""
        for c in self.layers:
            if callable(getattr(c, "reorder", None)):
                c.reorder(idx)
            elif isinstance(c, KVCache):  # the filled part, in place
                n = c.length
                c.keys[:, :, :n] = c.keys[:, :, :n].index_select(0, idx)
                c.values[:, :, :n] = c.values[:, :, :n].index_select(0, idx)
            else:
                raise TypeError(f"FlamingoCache: cannot reorder a {type(c).__name__}")
        self.seen = self.seen.index_select(0, idx)


class FlamingoDecoder(nn.Module):
    """A ``Flamingo`` with its images bound (``Flamingo.bind_images``): the decoder-only
    interface ``qkv.generate`` drives. ``config`` is the LM's.

    ``flamingo``: the ``qkv.models.Flamingo`` (this module does not import it, which imports
    this one): its ``lm``, ``config.image_token_id`` and ``hidden_states`` are used.

    ``forward(input_ids (R, N), attention_mask=None, cache=None)`` -> logits (R, N, V) with
    R = B, or R = B·K (each bound row repeated K times consecutively: beam search).
    ``new_cache(R, capacity)`` -> ``FlamingoCache``.

    A prompt (the first call on a fresh cache) with more ``<image>`` tokens than a row's bound
    images raises ValueError; an ``<image>`` token the model generates past them has no image
    to read, so the text from it on attends no latent (zero cross-attention), as text before
    the first image. Without a cache every call is read that way (no check): the uncached
    path ``qkv.generate(..., use_cache=False)`` returns the same tokens.
    """

    def __init__(self, flamingo: nn.Module, kvs: dict[str, MediaKV], media_mask: Tensor,
                 counts: Tensor) -> None:
        super().__init__()
        self.flamingo = flamingo
        self._kvs, self._media_mask, self._counts = kvs, media_mask, counts
        self._repeated: dict[int, tuple[dict[str, MediaKV], Tensor, Tensor]] = {}

    @property
    def config(self):
        """The LM's ``GPTConfig`` (vocab_size, max_len, positions)."""
        return self.flamingo.lm.config

    def new_cache(self, batch: int, capacity: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> FlamingoCache:
        """Empty decoding state for ``batch`` rows and ``capacity`` positions."""
        lm = self.flamingo.lm
        layers = lm.new_cache(batch, capacity, dtype=dtype, device=device)
        return FlamingoCache(layers, torch.zeros(batch, dtype=torch.long,
                                                 device=lm.embed.weight.device))

    def _rows(self, rows: int) -> tuple[dict[str, MediaKV], Tensor, Tensor]:
        b = self._counts.shape[0]
        if rows % b:
            raise ValueError(f"FlamingoDecoder: input_ids has {rows} rows; the bound images "
                             f"have {b} (rows must be B or B·K for K beams)")
        k = rows // b
        if k not in self._repeated:
            self._repeated[k] = ({n: kv.repeat_rows(k) for n, kv in self._kvs.items()},
                                 self._media_mask.repeat_interleave(k, dim=0),
                                 self._counts.repeat_interleave(k, dim=0))
        return self._repeated[k]

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                cache: FlamingoCache | None = None) -> Tensor:
        """Logits (R, N, V) of ``input_ids`` (R, N); ``attention_mask`` (R, S) covers the
        cached and new tokens (as ``GPT.forward``); ``cache`` from ``new_cache``."""
        fl = self.flamingo
        check_token_ids("FlamingoDecoder", "input_ids", input_ids, fl.lm.config.vocab_size,
                        "vocab_size")
        if cache is not None and not isinstance(cache, FlamingoCache):
            raise TypeError(f"FlamingoDecoder: cache must be the FlamingoCache from new_cache(),"
                            f" got {type(cache).__name__}")
        rows, n = input_ids.shape
        kvs, media_mask, counts = self._rows(rows)
        keep = None
        if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
            keep = attention_mask[:, attention_mask.shape[1] - n:].bool()  # (R, N)
        start = None if cache is None else cache.seen
        text_time = text_time_from_ids(input_ids, fl.config.image_token_id, keep=keep,
                                       start=start)  # (R, N)
        if cache is not None and cache.length == 0:  # the prompt: every <image> needs one
            check_image_counts(text_time[:, -1], counts, "bind_images bound")
        # an <image> past the bound ones (generated) has no image: its text attends nothing
        reads = text_time.masked_fill(text_time > counts[:, None], 0)  # (R, N)
        h = fl.hidden_states(input_ids, media_kv=kvs, text_time=reads, media_mask=media_mask,
                             attention_mask=attention_mask,
                             cache=None if cache is None else cache.layers)  # (R, N, C)
        logits = fl.lm.soft_cap(fl.lm.lm_head(h))  # (R, N, V)
        if cache is not None:
            cache.seen = text_time[:, -1].clone()
        return logits
