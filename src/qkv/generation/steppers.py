"""Steppers: what the search loops call to get next-token logits, one object per model kind.

Shapes: R rows being decoded (B, or B·K with K beams), N prompt length, S source length,
L tokens so far (prompt + generated), T new tokens, V vocab size.

A stepper hides how a model is run: ``prefill()`` returns the logits (R, V) of the token after
the prompt, ``step(tokens (R,))`` feeds one token per row and returns the next logits (R, V),
``reorder(idx (R,))`` makes row r continue from row ``idx[r]`` (beam search). The cached
steppers keep a KV cache (or whatever ``new_cache`` returns); the uncached ones recompute the
whole sequence every step, the oracle the tests compare the cached paths against.
Prompt-lookup decoding also calls ``run(tokens (R, n))`` -> logits (R, n, V) (n tokens per row
in one forward pass) and ``rewind(length)`` (forget the positions from ``length`` on).

Caches follow explicit protocols: beam search calls each cache's ``reorder(idx)`` and refuses
one without it (``reorder_cache``); prompt lookup calls ``truncate(length)`` and refuses caches
that cannot roll back (``check_truncatable``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..modules.cache import WindowKVCache
from .seq2seq_engine import seq2seq_stepper

__all__ = ["GPTStepper", "Seq2SeqModuleStepper", "Seq2SeqStepper", "check_truncatable",
           "reorder_cache", "truncate_cache"]


def reorder_cache(cache: Any, idx: Tensor) -> None:
    """Make cache row r hold what row ``idx[r]`` held (beam search), in place.

    ``cache`` is what a model's ``new_cache`` returned: a list of per-layer caches (or one
    object). Every cache must implement ``reorder(idx)`` — qkv's ``KVCache``,
    ``WindowKVCache``, ``LinearCache`` and ``qkv.peft``'s ``PrefixKVCache`` do; a custom cache
    must too: nothing is reordered by guessing which of its tensors are batch-first.
    ``idx``: (R,) int64 row indices.

    Raises:
        TypeError naming ``reorder(idx)`` for a cache without it (before any cache of the
        list is touched).
    """
    caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    for i, c in enumerate(caches):
        if not callable(getattr(c, "reorder", None)):
            where = f" (layer {i})" if isinstance(cache, (list, tuple)) else ""
            raise TypeError(f"generate: beam search reorders the decoding cache, but the "
                            f"cache of type {type(c).__name__}{where} has no reorder(idx) "
                            f"method; a custom cache must implement reorder(idx) (make row r "
                            f"hold what row idx[r] held)")
    for c in caches:
        c.reorder(idx)


def truncate_cache(cache: Any, length: int) -> None:
    """Forget every position from ``length`` on in each cache of ``cache`` (a list of
    per-layer caches or one object), through its ``truncate(length)`` method.

    Raises:
        TypeError naming ``truncate(length)`` for a cache without it.
    """
    caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    if not all(callable(getattr(c, "truncate", None)) for c in caches):
        raise TypeError(f"generate: prompt_lookup_num_tokens rolls the decoding cache back, but "
                        f"a cache of type {type(caches[0]).__name__} has no truncate(length) "
                        f"method")
    for c in caches:
        c.truncate(length)


_NOT_TRUNCATABLE = ("generate: prompt_lookup_num_tokens needs decoding caches that can roll "
                    "back rejected draft tokens (truncate(length)); this model's caches are "
                    "{kind}s (a sliding-window ring buffer or a linear-attention state "
                    "cannot); decode it without prompt_lookup_num_tokens")


def check_truncatable(cache: Any, message: str = _NOT_TRUNCATABLE) -> None:
    """Raise TypeError unless every cache in ``cache`` can roll back: a ``truncate`` method,
    and not a ring buffer (``WindowKVCache``) or a summed state. ``message`` is the error,
    ``{kind}`` replaced by the offending cache's type name (default: prompt lookup's)."""
    caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    for c in caches:
        if not callable(getattr(c, "truncate", None)) or isinstance(c, WindowKVCache):
            raise TypeError(message.format(kind=type(c).__name__))


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
        self.cache = model.new_cache(rows, total) if use_cache else None

    def _mask(self) -> Tensor | None:
        return None if self.mask is None else self.mask[:, :self.length]

    def prefill(self) -> Tensor:
        """Logits (R, V) of the token after the prompt."""
        logits = self.model(self.ids, attention_mask=self._mask(), cache=self.cache)
        return logits[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,); logits (R, V) of the next position."""
        return self.run(tokens[:, None])[:, -1]

    def run(self, tokens: Tensor) -> Tensor:
        """Feed n tokens per row, (R, n); logits (R, n, V) of the position after each."""
        n = tokens.shape[1]
        self.length += n
        if self.use_cache:
            return self.model(tokens, attention_mask=self._mask(), cache=self.cache)
        self.seq[:, self.length - n:self.length] = tokens
        return self.model(self.seq[:, :self.length], attention_mask=self._mask())[:, -n:]

    def rewind(self, length: int) -> None:
        """Forget the positions from ``length`` on (rejected draft tokens)."""
        if self.use_cache:
            truncate_cache(self.cache, length)
        self.length = length

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]``."""
        if self.use_cache:
            reorder_cache(self.cache, idx)
        else:
            self.seq = self.seq.index_select(0, idx)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)


class Seq2SeqStepper:
    """A ``qkv.models.Transformer`` on the encoder-decoder decode engine
    (``qkv.generation.seq2seq_engine``; docs/ARCHITECTURE.md: Decode backends): with the
    cache, the backend ``choose_seq2seq`` picks — the model's ``Seq2SeqPlan`` on a weight
    form (``Seq2SeqPlanStepper``), or its modules (``Seq2SeqModuleStepper``) when it has no
    plan; uncached, the modules recompute the whole sequence each step (the oracle).

    Args:
        model: the Transformer.
        src: (B, S) source ids.
        src_mask: (B, S) bool, True = real token, or None (derived from ``pad_id``).
        start: the decoder's first token.
        beams: K; rows R = B·K (each source's K rows consecutive).
        max_new_tokens: T.
        use_cache: False recomputes the whole sequence each step.
        backend: force a backend by name (``SEQ2SEQ_BACKENDS``; tests, benchmarks), or None.

    ``backend`` (attribute): the name of the backend that runs; ``cache``: the
    self-attention caches (a list of ``KVCache``; None uncached); ``length``: the target
    positions fed so far. ``prefill``, ``step``, ``run``, ``rewind`` and ``reorder`` are the
    running stepper's (the protocol of ``qkv.generation.steppers``).
    """

    def __init__(self, model: nn.Module, src: Tensor, src_mask: Tensor | None, start: int,
                 beams: int, max_new_tokens: int, use_cache: bool, *,
                 backend: str | None = None) -> None:
        impl = None
        if use_cache:
            impl = seq2seq_stepper(model, src, src_mask, start, beams, max_new_tokens,
                                   backend=backend)
        elif backend not in (None, "modules"):
            raise ValueError(f"Seq2SeqStepper: use_cache=False decodes through the modules, "
                             f"not backend {backend!r}")
        if impl is None:
            impl = Seq2SeqModuleStepper(model, src, src_mask, start, beams, max_new_tokens,
                                        use_cache)
        self.impl = impl
        self.backend = impl.backend
        self.cache = getattr(impl, "cache", None)
        self.prefill, self.step, self.run = impl.prefill, impl.step, impl.run
        self.rewind, self.reorder = impl.rewind, impl.reorder

    @property
    def length(self) -> int:
        """Target positions fed so far (the start token included)."""
        return self.impl.length


class Seq2SeqModuleStepper:
    """A ``qkv.models.Transformer`` through its modules (the ``modules`` backend of
    ``qkv.generation.seq2seq_engine``, and the oracle of the others): the encoder runs once,
    the cross-attention keys/values are projected once per source (``precompute_memory_kv``)
    and repeated for the beams, the decoder's self-attention uses ``new_cache``. Uncached:
    ``model(src, tgt)`` every step.

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
        self.backend = "modules"
        self.cache = None
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
        """Logits (R, n, V) after the n tokens ``tgt`` (R, n) just placed in ``self.tgt``."""
        if self.use_cache:
            return self.model.decode(tgt, memory_kv=self.memory_kv,
                                     memory_mask=self.memory_mask, cache=self.cache)
        logits = self.model(self.src, self.tgt[:, :self.length], src_mask=self.src_mask)
        return logits[:, -tgt.shape[1]:]

    def prefill(self) -> Tensor:
        """Logits (R, V) of the first token after the start token."""
        return self._run(self.tgt[:, :1])[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,); logits (R, V) of the next position."""
        return self.run(tokens[:, None])[:, -1]

    def run(self, tokens: Tensor) -> Tensor:
        """Feed n tokens per row, (R, n); logits (R, n, V) of the position after each."""
        n = tokens.shape[1]
        self.tgt[:, self.length:self.length + n] = tokens
        self.length += n
        return self._run(tokens)

    def rewind(self, length: int) -> None:
        """Forget the positions from ``length`` on (rejected draft tokens)."""
        if self.use_cache:
            truncate_cache(self.cache, length)
        self.length = length

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (the memory is the same within a source)."""
        self.tgt = self.tgt.index_select(0, idx)
        if self.use_cache:
            reorder_cache(self.cache, idx)
