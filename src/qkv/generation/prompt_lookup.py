"""Prompt-lookup decoding (``qkv.generate(..., prompt_lookup_num_tokens=k)``): greedy
decoding that drafts up to k tokens by copying what followed the latest earlier occurrence
of the text's last n-gram, checks the whole draft in one forward pass with the cache, keeps
the longest prefix that greedy decoding would have produced (plus the model's own next
token), and rolls the cache back over the rest. The output is greedy's, token for token;
copy-heavy outputs (a translation that copies digits or names from its source, code, quotes)
take fewer forward passes. (Saxena 2023, "Prompt Lookup Decoding"; HuggingFace
``generate(prompt_lookup_num_tokens=k)``, whose ``max_matching_ngram_size`` default, 2, is
kept.)

Shapes: R rows, T new tokens (at most ``max_new_tokens``), d draft tokens in a step (d <= k),
m tokens accepted in a step (1 <= m <= d + 1), V vocab size.

**What is looked up.** Per row: decoder-only models, the prompt's real tokens (padding left
out) followed by the generated ones; encoder-decoder models, the source's real tokens, then
(as a separate text: no n-gram spans the two) the decoder's start token and the generated
ones. For n = ``max_matching_ngram_size`` down to 1, the last n tokens are looked up among the
earlier n-grams of that text; the latest earlier occurrence wins (HuggingFace takes the
earliest; for a copy the two coincide, and the latest follows what was said most recently);
the draft is the up to k tokens that followed it, cut after a stop token. An index of every
n-gram's latest continuation is kept up to date token by token, so a lookup costs O(n).

**Batches.** Every row of a batch shares one cache length (``qkv.KVCache``), so all rows
advance together: a step drafts d = the shortest draft among the rows still running (0 when
some row has no match: a plain greedy step), verifies d + 1 positions for every row, and
accepts m = the fewest tokens any running row got right (its matching draft prefix + the
model's next token), except that a row whose accepted tokens contain a stop token no longer
limits m (it is finished; what follows is padding). Rows that got more right recompute the
rest in the next step. The output is still greedy's for every row; the speed-up shrinks as
rows disagree (per-row cache lengths would keep it, at the cost of a ragged cache).

Draft lengths never let a step pass ``max_new_tokens``, so the caches need no room beyond
plain greedy's.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["DEFAULT_NGRAM", "NgramIndex", "prompt_lookup_greedy"]

DEFAULT_NGRAM = 2  # HuggingFace's max_matching_ngram_size default


class Verifier(Protocol):
    """What the loop needs from a model (``qkv.generation.steppers`` /
    ``qkv.generation.stepper.PlanStepper``)."""

    length: int

    def prefill(self) -> Tensor: ...
    def step(self, tokens: Tensor) -> Tensor: ...
    def run(self, tokens: Tensor) -> Tensor: ...
    def rewind(self, length: int) -> None: ...


class NgramIndex:
    """One row's lookup text and, for every n-gram (n <= ``ngram``) that has a token after
    it, where its latest occurrence's continuation starts.

    Args:
        ngram: the longest n-gram matched (``max_matching_ngram_size``).
        segments: the texts to start with (token id lists); no n-gram spans two of them.
    """

    def __init__(self, ngram: int, segments: list[list[int]]) -> None:
        self.ngram = ngram
        self.tokens: list[int] = []
        self.seg_start = 0  # where the current segment starts in ``tokens``
        self.next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        for i, seg in enumerate(segments):
            if i:
                self.seg_start = len(self.tokens)
            for tok in seg:
                self.append(tok)

    def append(self, tok: int) -> None:
        """Add a token at the end of the current segment."""
        toks, p = self.tokens, len(self.tokens)
        for n in range(1, self.ngram + 1):  # the n-grams ending just before the new token
            if p - n < self.seg_start:
                break
            self.next[tuple(toks[p - n:p])] = p
        toks.append(tok)

    def draft(self, k: int, stops: frozenset[int]) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix n-gram (n = ``ngram`` .. 1), cut after the first stop token; [] when
        nothing matches."""
        toks, p = self.tokens, len(self.tokens)
        for n in range(min(self.ngram, p - self.seg_start), 0, -1):
            start = self.next.get(tuple(toks[p - n:]))
            if start is not None:
                out = toks[start:start + k]
                for i, tok in enumerate(out):
                    if tok in stops:
                        return out[:i + 1]
                return out
        return []


def prompt_lookup_greedy(stepper: Verifier, texts: list[NgramIndex], max_new_tokens: int, *,
                         num_tokens: int, eos: Tensor | None, pad: int,
                         device: torch.device, stats: dict | None = None) -> Tensor:
    """Greedy decoding with prompt-lookup drafts (see the module docstring).

    Args:
        stepper: prefill / step / run (R, n) -> (R, n, V) / rewind, with ``length``.
        texts: one ``NgramIndex`` per row, holding the row's lookup text so far.
        max_new_tokens: T.
        num_tokens: k >= 1, the most draft tokens per step.
        eos: (E,) stop token ids, or None.
        pad: fills rows after their eos.
        device: of the output.
        stats: if a dict, filled with ``passes`` (forward passes after the prefill),
            ``drafted`` / ``accepted`` (draft tokens verified / kept, summed over rows) and
            ``blocks``: per verification, ``(first new-token index, d, m, hits per row)``
            (hits: the row's matching draft prefix; -1 for a row already finished).

    Returns:
        The new tokens (R, T'), T' <= T (fewer when every row ended), equal to
        ``greedy_or_sample``'s.
    """
    rows = len(texts)
    out = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
    stops = frozenset() if eos is None else frozenset(eos.tolist())
    finished = [False] * rows
    done = 0  # tokens emitted per row
    last: Tensor | None = None  # (R,) the emitted tokens not yet fed

    def emit(tokens: Tensor) -> bool:
        """Record columns of greedy tokens (R, m) (masking finished rows); True when every
        row has finished."""
        nonlocal done, last
        m = tokens.shape[1]
        values = tokens.tolist()
        end = 0  # the columns up to the last stop token of a row finishing in this block
        for r in range(rows):
            for j in range(m):
                if finished[r]:
                    values[r][j] = pad
                    continue
                tok = values[r][j]
                texts[r].append(tok)
                finished[r] = tok in stops
                if finished[r]:
                    end = max(end, j + 1)
        block = torch.tensor(values, dtype=torch.long, device=device)  # (R, m)
        if all(finished):  # greedy stops at the column where its last row finished
            m = end
            block = block[:, :m]
        out[:, done:done + m] = block
        done += m
        last = block[:, -1]
        return all(finished)

    if stats is not None:
        stats.update(passes=0, drafted=0, accepted=0, blocks=[])
    if emit(stepper.prefill().argmax(dim=-1)[:, None]):
        return out[:, :done]
    while done < max_new_tokens:
        budget = min(num_tokens, max_new_tokens - done - 1)  # a step emits <= d + 1 tokens
        running = [r for r in range(rows) if not finished[r]]
        drafts = {r: texts[r].draft(budget, stops) for r in running} if budget else {}
        d = min((len(v) for v in drafts.values()), default=0)
        if stats is not None:
            stats["passes"] += 1
        if d == 0:
            if emit(stepper.step(last).argmax(dim=-1)[:, None]):
                break
            continue
        draft = torch.full((rows, d), pad, dtype=torch.long, device=device)  # (R, d)
        for r, v in drafts.items():
            draft[r] = torch.tensor(v[:d], dtype=torch.long)
        start = stepper.length
        pred = stepper.run(torch.cat((last[:, None], draft), dim=1)).argmax(dim=-1)  # (R, d+1)
        hits = (pred[:, :d] == draft).long().cumprod(dim=1).sum(dim=1).tolist()  # (R,)
        preds = pred.tolist()
        m = d + 1
        for r in running:
            known = hits[r] + 1  # the matching draft prefix, then the model's own token
            if not any(tok in stops for tok in preds[r][:known]):
                m = min(m, known)
        if stats is not None:
            stats["drafted"] += d * len(running)
            stats["accepted"] += (m - 1) * len(running)
            stats["blocks"].append((done, d, m, [hits[r] if r in drafts else -1
                                                 for r in range(rows)]))
        # positions start .. start + m - 1 hold the fed tokens greedy would have fed
        stepper.rewind(start + m)
        if emit(pred[:, :m]):
            break
    return out[:, :done]
