"""HuggingFace's logits processors that checkpoints' generation configs use, with HF's
semantics and in HF's order (``transformers`` 5.x ``GenerationMixin._get_logits_processor``).

Shapes: R rows being decoded (B, or B·K with K beams), P tokens before the first new one
(decoder-only: the prompt's padded width N; encoder-decoder: 1, the decoder start token),
L = P + t tokens so far (t of them new), V vocab size, T = ``max_new_tokens``.

Each step the search loops hand ``LogitsProcessors.apply`` the scores (R, V) of the next
token — greedy and sampling: the model's logits; beam search: their log-softmax, before the
beams' running scores are added (as HF) — and, where a processor reads it, the tokens so far
(R, L): the prompt as given (left padding included) then the new tokens for a decoder-only
model, the start token then the new tokens for an encoder-decoder, exactly HF's ``input_ids``
at that step. In HF's order:

1. ``no_repeat_ngram_size`` n: a token that would complete an n-gram already present in the
   row's tokens so far gets -inf (``NoRepeatNGramLogitsProcessor``).
2. ``bad_words``: a one-token sequence's token always gets -inf; a longer sequence's last
   token gets -inf where the row's tokens so far end with the rest of it
   (``NoBadWordsLogitsProcessor``: one-token sequences equal to a stop token are dropped).
3. ``min_length``: the stop tokens get -inf while L < min_length (``MinLengthLogitsProcessor``,
   and ``MinNewTokensLengthLogitsProcessor`` as HF's ``min_length = P + min_new_tokens``;
   nothing without stop tokens, as HF).
4. ``forced_bos_token_id``: when L == 1 (an encoder-decoder's first new token; a decoder-only
   model only after a one-token prompt) every other token gets -inf and it gets 0
   (``ForcedBOSTokenLogitsProcessor``).
5. ``forced_eos_token_id`` (one or several ids): likewise at the last step, L == P + T - 1
   (``ForcedEOSTokenLogitsProcessor`` with HF's ``max_length = P + max_new_tokens``).

Then the sampling filters (temperature, top-k, top-p: ``qkv.generation.search
.filter_logits``), then ``LogitsProcessors.normalize``: ``renormalize_logits`` takes the
log-softmax of the result (``LogitNormalization``, always HF's last processor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["LogitsProcessors", "make_processors"]

_INF = float("inf")


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_id(name: str, value: Any, vocab: int | None) -> None:
    if not _is_id(value) or (vocab is not None and value >= vocab):
        where = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise ValueError(f"generate: {name} must be a token id in {where}, got {value!r}")


def _count(name: str, value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"generate: {name} must be an int >= 0 or None, got {value!r}")
    return value


def _words(value: Any, vocab: int | None) -> tuple[tuple[int, ...], ...]:
    """``bad_words_ids`` as a tuple of token-id tuples (checked)."""
    if value is None:
        return ()
    ok = (isinstance(value, (list, tuple)) and value
          and all(isinstance(w, (list, tuple)) and w and all(_is_id(i) for i in w)
                  for w in value))
    if not ok:
        raise ValueError(f"generate: bad_words_ids must be a non-empty list of non-empty "
                         f"lists of token ids, got {value!r}")
    words = tuple(tuple(w) for w in value)
    if vocab is not None:
        for w in words:
            for i in w:
                if i >= vocab:
                    raise ValueError(f"generate: bad_words_ids holds the token id {i}, "
                                     f"outside the vocabulary [0, {vocab}) (in {list(w)})")
    return words


class LogitsProcessors:
    """The active processors of one ``generate`` call (see the module's docstring for each
    one's rule, and ``make_processors`` for the arguments).

    Args:
        prefix_length: P, the tokens before the first new one.
        max_new_tokens: T.
        eos: the stop tokens, or None.
        no_repeat_ngram_size: n >= 1, or 0 (off).
        bad_words: the banned sequences (stop-token singletons already dropped).
        min_length: the stop tokens are banned while L < min_length (0: off).
        forced_bos_token_id: the first token after a one-token prefix, or None.
        forced_eos_token_id: the ids forced at the last step, or None.
        renormalize: log-softmax after every processor and filter.
        device: where the token-id tensors live (the model's logits' device).
    """

    def __init__(self, *, prefix_length: int, max_new_tokens: int,
                 eos: tuple[int, ...] | None, no_repeat_ngram_size: int,
                 bad_words: tuple[tuple[int, ...], ...], min_length: int,
                 forced_bos_token_id: int | None,
                 forced_eos_token_id: tuple[int, ...] | None, renormalize: bool,
                 device: torch.device) -> None:
        self.prefix_length, self.max_length = prefix_length, prefix_length + max_new_tokens
        self.ngram = no_repeat_ngram_size
        self.bad_words = bad_words
        self.min_length = min_length if eos else 0
        self.forced_bos, self.forced_eos = forced_bos_token_id, forced_eos_token_id
        self.renormalize = renormalize
        long = dict(dtype=torch.long, device=device)
        self._eos = None if not eos else torch.tensor(eos, **long)  # (E,)
        self._forced_eos = None if forced_eos_token_id is None else torch.tensor(
            forced_eos_token_id, **long)
        single = [w[0] for w in bad_words if len(w) == 1]
        self._single = torch.tensor(single, **long) if single else None  # (W1,)
        groups: dict[int, list[tuple[int, ...]]] = {}
        for w in bad_words:
            if len(w) > 1:
                groups.setdefault(len(w) - 1, []).append(w)
        # per prefix length p: (the prefixes (G, p), their last tokens (G,))
        self._multi = [(torch.tensor([w[:-1] for w in ws], **long),
                        torch.tensor([w[-1] for w in ws], **long)) for ws in groups.values()]
        self._largest_id = max([i for w in bad_words for i in w]
                               + [forced_bos_token_id or 0, *(forced_eos_token_id or ())])

    @property
    def needs_history(self) -> bool:
        """Whether ``apply`` reads the tokens so far (not only their count)."""
        return self.ngram > 0 or bool(self._multi)

    @property
    def changes_tokens(self) -> bool:
        """Whether a processor other than ``renormalize`` is on (the ones that change which
        token greedy decoding picks)."""
        return bool(self.ngram or self.bad_words or self.min_length
                    or self.forced_bos is not None or self.forced_eos is not None)

    def apply(self, tokens: Tensor | None, length: int, scores: Tensor) -> Tensor:
        """The processed scores (R, V) fp32 (a new tensor) of the next token after ``length``
        tokens; ``tokens`` (R, L) int64: the rows' tokens so far (only read when
        ``needs_history``; None otherwise)."""
        scores = scores.float()
        vocab = scores.shape[-1]
        if self._largest_id >= vocab:
            raise ValueError(f"generate: a processor's token id {self._largest_id} is outside "
                             f"the model's vocabulary [0, {vocab})")
        if self.ngram and length >= self.ngram:
            scores = scores.masked_fill(_ngram_bans(tokens, self.ngram, vocab), -_INF)
        if self.bad_words:
            scores = self._ban_words(tokens, scores)
        if self._eos is not None and length < self.min_length:
            scores = scores.index_fill(1, self._eos, -_INF)
        if self.forced_bos is not None and length == 1:
            scores = torch.full_like(scores, -_INF)
            scores[:, self.forced_bos] = 0.0
        if self._forced_eos is not None and length == self.max_length - 1:
            scores = torch.full_like(scores, -_INF)
            scores[:, self._forced_eos] = 0.0
        return scores

    def normalize(self, scores: Tensor) -> Tensor:
        """``renormalize_logits``: the log-softmax of ``scores`` (R, V); else ``scores``."""
        return scores.log_softmax(dim=-1) if self.renormalize else scores

    def _ban_words(self, tokens: Tensor | None, scores: Tensor) -> Tensor:
        if self._single is not None:
            scores = scores.index_fill(1, self._single, -_INF)
        rows, vocab = scores.shape
        for prefixes, last in self._multi:  # (G, p), (G,)
            p = prefixes.shape[1]
            if tokens is None or p > tokens.shape[1]:  # longer than the context: HF skips
                continue
            match = (tokens[:, None, -p:] == prefixes).all(dim=-1)  # (R, G)
            cols = torch.where(match, last, vocab)  # unmatched -> a spare column
            banned = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=scores.device)
            banned.scatter_(1, cols, True)
            scores = scores.masked_fill(banned[:, :vocab], -_INF)
        return scores


def _ngram_bans(tokens: Tensor, n: int, vocab: int) -> Tensor:
    """(R, V) bool: the tokens that would repeat an n-gram of ``tokens`` (R, L), L >= n: every
    window of n tokens whose first n - 1 equal the row's last n - 1 bans its last token."""
    length = tokens.shape[1]
    suffix = tokens[:, length + 1 - n:]  # (R, n - 1)
    windows = tokens.unfold(1, n, 1)  # (R, L - n + 1, n)
    match = (windows[..., :-1] == suffix[:, None, :]).all(dim=-1)  # (R, L - n + 1)
    cols = torch.where(match, windows[..., -1].clamp(max=vocab), vocab)
    banned = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.bool, device=tokens.device)
    banned.scatter_(1, cols, True)
    return banned[:, :vocab]


def make_processors(*, vocab: int | None, prefix_length: int, max_new_tokens: int,
                    eos: tuple[int, ...] | None, device: torch.device,
                    no_repeat_ngram_size: int | None = None, min_length: int | None = None,
                    min_new_tokens: int | None = None,
                    bad_words_ids: Sequence[Sequence[int]] | None = None,
                    forced_bos_token_id: int | None = None,
                    forced_eos_token_id: int | Sequence[int] | None = None,
                    renormalize_logits: bool = False) -> LogitsProcessors | None:
    """Check ``generate``'s processor arguments and build them; None when none is on.

    Args:
        vocab: V where the model says it (token ids are checked against it), else None.
        prefix_length, max_new_tokens, eos, device: as ``LogitsProcessors``.
        no_repeat_ngram_size: n >= 1 (0 or None: off).
        min_length: HF's, counting the P prefix tokens (0 or None: off).
        min_new_tokens: new tokens before a stop token may come; when given it replaces
            ``min_length`` by P + min_new_tokens (HF's precedence).
        bad_words_ids: sequences of token ids never generated.
        forced_bos_token_id, forced_eos_token_id: see the module's docstring.
        renormalize_logits: bool.

    Raises:
        ValueError naming the argument for a bad value (a negative count, a token id outside
        the vocabulary, an empty or non-list ``bad_words_ids``); TypeError for a
        ``renormalize_logits`` that is not a bool.
    """
    ngram = _count("no_repeat_ngram_size", no_repeat_ngram_size)
    minimum = _count("min_length", min_length)
    if min_new_tokens is not None:
        minimum = prefix_length + _count("min_new_tokens", min_new_tokens)
    words = _words(bad_words_ids, vocab)
    if eos:  # HF drops the one-token sequences that are a stop token
        words = tuple(w for w in words if not (len(w) == 1 and w[0] in eos))
    if forced_bos_token_id is not None:
        _check_id("forced_bos_token_id", forced_bos_token_id, vocab)
    forced_eos = None
    if forced_eos_token_id is not None:
        forced_eos = ((forced_eos_token_id,) if _is_id(forced_eos_token_id)
                      else forced_eos_token_id)
        if not isinstance(forced_eos, (list, tuple)) or not forced_eos:
            raise ValueError(f"generate: forced_eos_token_id must be a token id, a non-empty "
                             f"list of them or None, got {forced_eos_token_id!r}")
        for i in forced_eos:
            _check_id("forced_eos_token_id", i, vocab)
        forced_eos = tuple(forced_eos)
    if not isinstance(renormalize_logits, bool):
        raise TypeError(f"generate: renormalize_logits must be a bool, got "
                        f"{renormalize_logits!r}")
    processors = LogitsProcessors(
        prefix_length=prefix_length, max_new_tokens=max_new_tokens, eos=eos,
        no_repeat_ngram_size=ngram, bad_words=words, min_length=minimum,
        forced_bos_token_id=forced_bos_token_id, forced_eos_token_id=forced_eos,
        renormalize=renormalize_logits, device=device)
    return processors if processors.changes_tokens or renormalize_logits else None
