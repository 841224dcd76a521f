"""Steppers: what the search loops call to get next-token logits, one object per model kind.

Shapes: R rows being decoded (B, or B·K with K beams), N prompt length, S source length,
L tokens so far (prompt + generated), T new tokens, V vocab size.

A stepper hides how a model is run: ``prefill()`` returns the logits (R, V) of the token after
the prompt, ``step(tokens (R,))`` feeds one token per row and returns the next logits (R, V),
``reorder(idx (R,))`` makes row r continue from row ``idx[r]`` (beam search). The cached
steppers keep a KV cache (or whatever ``new_cache`` returns); the uncached ones recompute the
whole sequence every step, the oracle the tests compare the cached paths against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..modules.cache import KVCache

__all__ = ["GPTStepper", "Seq2SeqStepper", "reorder_cache"]


def _reorder_object(obj: Any, idx: Tensor) -> None:
    """Index every batch-first tensor attribute of ``obj`` (and the tensor fields of a
    NamedTuple attribute, e.g. a ``LinearState``) by ``idx`` along dim 0."""
    rows = idx.shape[0]
    try:
        items = list(vars(obj).items())
    except TypeError:
        raise TypeError(f"generate: cannot reorder a cache of type {type(obj).__name__} for "
                        f"beam search (give it a reorder(idx) method)") from None

    def pick(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == rows:
            return t.index_select(0, idx)
        return t

    for name, val in items:
        if isinstance(val, Tensor):
            setattr(obj, name, pick(val))
        elif isinstance(val, tuple) and hasattr(val, "_fields"):
            setattr(obj, name, type(val)(*(pick(t) for t in val)))


def reorder_cache(cache: Any, idx: Tensor) -> None:
    """Make cache row r hold what row ``idx[r]`` held (beam search), in place.

    ``cache`` is what a model's ``new_cache`` returned: a list of per-layer caches (or one
    object). A cache with a ``reorder(idx)`` method is asked to do it; a ``qkv.KVCache``
    (and its subclasses) has its key/value buffers indexed along the batch dim; any other
    object has its batch-first tensor attributes (and NamedTuple states such as
    ``qkv.LinearState``) indexed. ``idx``: (R,) int64 row indices.
    """
    for c in cache if isinstance(cache, (list, tuple)) else (cache,):
        fn = getattr(c, "reorder", None)
        if callable(fn):
            fn(idx)
        elif type(c) is KVCache:  # only the filled part, in place
            n = c.length
            c.keys[:, :, :n] = c.keys[:, :, :n].index_select(0, idx)
            c.values[:, :, :n] = c.values[:, :, :n].index_select(0, idx)
        else:
            _reorder_object(c, idx)


class GPTStepper:
    """A decoder-only model through its public interface: ``model(ids, attention_mask=,
    cache=)`` -> logits (R, N, V) and ``model.new_cache(R, capacity)``.

    Args:
        model: the decoder.
        ids: (R, N) left-padded prompts.
        keep: (R, N) bool, True = real token, or None when nothing is padded.
        max_new_tokens: T (sizes the cache and the uncached sequence buffer).
        use_cache: False recomputes the whole sequence each step.
    """

    def __init__(self, model: nn.Module, ids: Tensor, keep: Tensor | None,
                 max_new_tokens: int, use_cache: bool) -> None:
        self.model = model
        rows, n = ids.shape
        self.length = n
        self.use_cache = use_cache
        self.total = total = n + max_new_tokens
        self.mask = None
        if keep is not None:  # grows by one real position per step: preallocate
            self.mask = torch.ones(rows, total, dtype=torch.bool, device=ids.device)
            self.mask[:, :n] = keep
        self.seq = None
        self.ids = ids
        if not use_cache:
            self.seq = torch.zeros(rows, total, dtype=ids.dtype, device=ids.device)
            self.seq[:, :n] = ids
        self.cache = None

    def _mask(self) -> Tensor | None:
        return None if self.mask is None else self.mask[:, :self.length]

    def prefill(self) -> Tensor:
        """Logits (R, V) of the token after the prompt."""
        if self.use_cache:
            self.cache = self.model.new_cache(self.ids.shape[0], self.total)
        logits = self.model(self.ids, attention_mask=self._mask(), cache=self.cache)
        return logits[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,); logits (R, V) of the next position."""
        self.length += 1
        if self.use_cache:
            logits = self.model(tokens[:, None], attention_mask=self._mask(), cache=self.cache)
        else:
            self.seq[:, self.length - 1] = tokens
            logits = self.model(self.seq[:, :self.length], attention_mask=self._mask())
        return logits[:, -1]

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]``."""
        if self.use_cache:
            reorder_cache(self.cache, idx)
        else:
            self.seq = self.seq.index_select(0, idx)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)


class Seq2SeqStepper:
    """A ``qkv.models.Transformer``: the encoder runs once, the cross-attention keys/values
    are projected once per source (``precompute_memory_kv``) and repeated for the beams, the
    decoder's self-attention uses ``new_cache``. Uncached: ``model(src, tgt)`` every step.

    Args:
        model: the Transformer.
        src: (B, S) source ids.
        src_mask: (B, S) bool, True = real token, or None (derived from ``pad_id``).
        start: the decoder's first token.
        beams: K; rows R = B·K (each source repeated K times, consecutively).
        max_new_tokens: T.
        use_cache: False recomputes the whole sequence each step.
    """

    def __init__(self, model: nn.Module, src: Tensor, src_mask: Tensor | None, start: int,
                 beams: int, max_new_tokens: int, use_cache: bool) -> None:
        self.model = model
        self.use_cache = use_cache
        rows = src.shape[0] * beams
        self.tgt = torch.full((rows, 1 + max_new_tokens), start, dtype=torch.long,
                              device=src.device)
        self.length = 1
        if use_cache:
            memory, self.memory_mask = model.encode(src, src_mask=src_mask)
            kv = model.precompute_memory_kv(memory)  # once per source
            if beams > 1:
                self.memory_mask = self.memory_mask.repeat_interleave(beams, dim=0)
                kv = [(k.repeat_interleave(beams, dim=0), v.repeat_interleave(beams, dim=0))
                      for k, v in kv]
            self.memory_kv = kv
            self.cache = model.new_cache(rows, 1 + max_new_tokens)
        else:
            self.src = src.repeat_interleave(beams, dim=0) if beams > 1 else src
            self.src_mask = (None if src_mask is None else
                             src_mask.repeat_interleave(beams, dim=0) if beams > 1 else src_mask)

    def _run(self, tgt: Tensor) -> Tensor:
        if self.use_cache:
            logits = self.model.decode(tgt, memory_kv=self.memory_kv,
                                       memory_mask=self.memory_mask, cache=self.cache)
        else:
            logits = self.model(self.src, self.tgt[:, :self.length], src_mask=self.src_mask)
        return logits[:, -1]

    def prefill(self) -> Tensor:
        """Logits (R, V) of the first token after the start token."""
        return self._run(self.tgt[:, :1])

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,); logits (R, V) of the next position."""
        self.tgt[:, self.length] = tokens
        self.length += 1
        return self._run(tokens[:, None])

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (the memory is the same within a source)."""
        self.tgt = self.tgt.index_select(0, idx)
        if self.use_cache:
            reorder_cache(self.cache, idx)
