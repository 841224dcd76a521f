"""Search loops over a stepper: greedy / sampling, and beam search (HuggingFace's rules).

Shapes: B batch, K beams, R = B·K rows, V vocab size, T new tokens (at most
``max_new_tokens``), M candidates kept per beam-search step (2K, more with several stop
tokens).

Both loops return the new tokens only, (B, T); rows that ended (eos) are filled with the pad
id after their eos. The loops stop early once every row has ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from .processors import LogitsProcessors

__all__ = ["ARGMAX_BLOCK", "ARGMAX_MIN_ROWS", "LSE_MIN_VOCAB", "LSE_ROWS", "argmax_rows",
           "beam_search", "filter_logits", "greedy_or_sample", "logsumexp_rows", "top_rows"]

_NEG = -1.0e9  # HF's "impossible" score: added, never a fill (sums stay comparable)


class Stepper(Protocol):
    """What the loops need from a model (see ``qkv.generation.steppers``)."""

    def prefill(self) -> Tensor: ...
    def step(self, tokens: Tensor) -> Tensor: ...
    def reorder(self, idx: Tensor) -> None: ...


def _block_maxima(logits: Tensor, blocks: int) -> Tensor:
    """The maximum of each of the first ``blocks`` whole blocks of ``ARGMAX_BLOCK`` columns
    of logits (R, V) -> (R, blocks): the first level of ``argmax_rows`` and ``top_rows``."""
    whole = logits[:, :blocks * ARGMAX_BLOCK]
    return whole.unflatten(1, (blocks, ARGMAX_BLOCK)).amax(dim=-1)  # (R, blocks)


def argmax_rows(logits: Tensor) -> Tensor:
    """``logits.argmax(dim=-1)`` for logits (R, V) -> (R,) int64: the first index of each
    row's largest value (NaN counts as the largest, as in ``argmax``).

    From ``ARGMAX_MIN_ROWS`` rows and ``2 · ARGMAX_BLOCK`` columns on CPU it works in two
    levels: the maximum of each block of ``ARGMAX_BLOCK`` columns (``amax``, vectorised), the
    first block holding the row's largest (``argmax`` over V / 128 block maxima; the columns
    past the last whole block are one more, last, candidate), then ``argmax`` inside that
    block. torch's CPU ``argmax`` over a long last dimension is not vectorised; this is
    several times faster at decode sizes (BENCHMARKS.md, "Inference at the machine's limit").
    Exact: the first block holding the maximum holds its first index, and a NaN (``amax``
    propagates it, ``argmax`` takes it as the largest) leads both levels to the first NaN."""
    rows, vocab = logits.shape
    blocks = vocab // ARGMAX_BLOCK
    if (rows < ARGMAX_MIN_ROWS or blocks < 2 or logits.device.type != "cpu"
            or not logits.dtype.is_floating_point):
        return logits.argmax(dim=-1)
    whole = blocks * ARGMAX_BLOCK
    best = _block_maxima(logits, blocks)  # (R, V // 128)
    tail = logits[:, whole:]  # (R, V % 128) columns past the last whole block
    if tail.shape[1]:
        best = torch.cat([best, tail.amax(dim=-1, keepdim=True)], dim=1)  # (R, V // 128 + 1)
    block = best.argmax(dim=-1)  # (R,) the first block holding the row's largest value
    start = block.clamp(max=blocks - 1) * ARGMAX_BLOCK  # (R,) the chosen block's first column
    cols = start[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)  # (R, 128)
    first = start + logits.gather(1, cols).argmax(dim=-1)  # (R,)
    if tail.shape[1]:
        first = torch.where(block == blocks, whole + tail.argmax(dim=-1), first)
    return first


ARGMAX_BLOCK = 128
"""Columns per block in ``argmax_rows``' first level (64-512 measured within noise)."""
ARGMAX_MIN_ROWS = 4
"""Fewest rows for which ``argmax_rows`` takes the two-level path."""


def top_rows(logits: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The ``m`` largest values of each row of logits (R, V) and their columns, each (R, m),
    as ``logits.topk(m, dim=-1)`` (values in descending order; which of equal values is
    taken may differ, as it may between topk's own kernels).

    On CPU, from ``2 · m`` whole blocks of ``ARGMAX_BLOCK`` columns on, in two levels: the
    maximum of each whole block (``amax``, vectorised), the ``m`` blocks with the largest
    maxima, then ``topk`` over their m · ``ARGMAX_BLOCK`` columns and the columns past the
    last whole block. Exact: a block holding one of the row's m largest values has a maximum
    at least the m-th largest, so at most m blocks (ties aside) hold them all. torch's
    ``topk`` over a long row is several times slower (BENCHMARKS.md, "Translation with T5 /
    Marian checkpoints (issue 24)")."""
    rows, vocab = logits.shape
    blocks = vocab // ARGMAX_BLOCK
    if blocks < 2 * m or logits.device.type != "cpu" or not logits.dtype.is_floating_point:
        return logits.topk(m, dim=-1)
    whole = blocks * ARGMAX_BLOCK
    chosen = _block_maxima(logits, blocks).topk(m, dim=-1).indices  # (R, m) blocks
    cols = (chosen[:, :, None] * ARGMAX_BLOCK
            + torch.arange(ARGMAX_BLOCK, device=logits.device)).flatten(1)  # (R, m·128)
    tail = torch.arange(whole, vocab, device=logits.device).expand(rows, vocab - whole)
    cols = torch.cat((cols, tail), dim=1)  # (R, m·128 + V % 128), no column twice
    values, at = logits.gather(1, cols).topk(m, dim=-1)
    return values, cols.gather(1, at)


def logsumexp_rows(logits: Tensor, row_max: Tensor) -> Tensor:
    """``torch.logsumexp(logits, dim=-1, keepdim=True)`` for logits (R, V) whose row maxima
    row_max (R, 1) are known -> (R, 1): row_max + log(sum(exp(logits - row_max))), an
    infinite maximum counting as 0 (as torch does).

    On CPU from ``LSE_MIN_VOCAB`` columns on, ``LSE_ROWS`` rows at a time through one small
    buffer that stays in cache: torch's one-call ``logsumexp`` over (64, 65001) writes and
    reads its intermediates through memory and takes about three times as long
    (BENCHMARKS.md, "Translation with T5 / Marian checkpoints (issue 24)"). The same sums,
    row by row, as one call over the whole tensor (within 3e-7 relative of fp64, tested)."""
    rows, vocab = logits.shape
    shift = torch.where(row_max.isinf(), torch.zeros_like(row_max), row_max)  # (R, 1)
    if vocab < LSE_MIN_VOCAB or logits.device.type != "cpu":
        return torch.logsumexp(logits, dim=-1, keepdim=True)
    buf = logits.new_empty(min(LSE_ROWS, rows), vocab)
    sums = logits.new_empty(rows, 1)
    for i in range(0, rows, LSE_ROWS):
        part = buf[:min(LSE_ROWS, rows - i)]
        torch.sub(logits[i:i + LSE_ROWS], shift[i:i + LSE_ROWS], out=part).exp_()
        torch.sum(part, dim=-1, keepdim=True, out=sums[i:i + LSE_ROWS])
    return sums.log_().add_(shift)


LSE_ROWS = 2
"""Rows per pass in ``logsumexp_rows`` (2 measured fastest of 1, 2, 4, 8, 16 at V = 65001)."""
LSE_MIN_VOCAB = 4096
"""Fewest columns for which ``logsumexp_rows`` works through its buffer."""


def _top_continuations(logits: Tensor, run_scores: Tensor, m: int
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """Beam search's step without processors: of the K·V continuations of each batch item,
    the m with the largest summed log-probability ``run_scores + log_softmax(logits)``, by
    the top m of each beam's raw logits (R, V) and each row's logsumexp (the m best of an
    item are among the m best of their beams; log_softmax keeps a row's order), never the
    full (B, K·V) sums. run_scores (B, K) -> scores, source beams, tokens, each (B, m)."""
    batch, k = run_scores.shape
    logits = logits.float()
    per = min(m, logits.shape[-1])  # a vocabulary smaller than m gives all it has
    values, tokens = top_rows(logits, per)  # (R, per)
    logp = values - logsumexp_rows(logits, values[:, :1])  # (R, per)
    sums = (logp.view(batch, k, per) + run_scores[:, :, None]).view(batch, k * per)
    scores, pick = sums.topk(m, dim=-1)  # (B, m)
    return scores, pick // per, tokens.view(batch, k * per).gather(1, pick)


def filter_logits(logits: Tensor, *, temperature: float, top_k: int | None,
                  top_p: float | None) -> Tensor:
    """Sampling filters, in HuggingFace's order: logits (R, V) / temperature, then keep the
    ``top_k`` largest, then the smallest set of most likely tokens whose probability reaches
    ``top_p`` (at least one token). Dropped tokens get -inf. Returns fp32 (R, V).

    Top-p runs HF's ``TopPLogitsWarper``'s ops, so that the kept set is HF's also where the
    cumulative probability lands exactly on ``top_p`` (there fp32 rounding decides, e.g.
    4/9, 2/9, 2/9, 1/9 at 6/9 keeps 2): the probabilities sorted ascending (stable: of tied
    tokens the later id ranks higher, as HF's on CPU), their cumulative sum from the least
    likely, every token whose sum is <= 1 - top_p dropped — the least likely tokens of total
    mass at most 1 - top_p, so the kept ones reach top_p."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (R, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, stable=True)  # (R, V) ascending
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # mass of this and less likely
        drop_sorted = cum <= 1.0 - top_p  # the rest (>= top_p) is kept
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def greedy_or_sample(stepper: Stepper, rows: int, max_new_tokens: int, *, do_sample: bool,
                     temperature: float, top_k: int | None, top_p: float | None,
                     eos: Tensor | None, pad: int, generator: torch.Generator | None,
                     device: torch.device,
                     streamer: Callable[[Tensor], object] | None = None,
                     processors: LogitsProcessors | None = None,
                     prefix: Tensor | None = None) -> Tensor:
    """Greedy (argmax) or sampled decoding; returns the new tokens (R, T), T <=
    ``max_new_tokens`` (fewer when every row reached ``eos``). ``streamer``, if given, is
    called after each step with that step's tokens (R,) int64, the output column just
    written (``pad`` in rows that have ended), so that its T calls stacked along dim 1 are
    the returned tensor.

    ``processors`` (``qkv.generation.processors``), if given, process each step's logits
    before the sampling filters and the argmax, as HF's ``_sample``: ``apply`` on the fp32
    logits, then (sampling) ``filter_logits``, then ``normalize``. They see the tokens so far
    (R, P + t): ``prefix`` (R, P) int64 (the prompt, or the decoder start token) then the new
    ones (rows that ended hold ``pad``, as in HF)."""
    width = 0 if prefix is None else prefix.shape[1]  # P
    seq = torch.full((rows, width + max_new_tokens), pad, dtype=torch.long, device=device)
    if prefix is not None:
        seq[:, :width] = prefix
    out = seq[:, width:]  # (R, T) a view: the new tokens
    history = processors is not None and processors.needs_history
    finished = torch.zeros(rows, dtype=torch.bool, device=device) if eos is not None else None
    logits = stepper.prefill()
    for t in range(max_new_tokens):
        if processors is not None:
            logits = processors.apply(seq[:, :width + t] if history else None, width + t,
                                      logits)
        if do_sample:
            scores = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
            if processors is not None:
                scores = processors.normalize(scores)
            tokens = torch.multinomial(scores.softmax(dim=-1), 1,
                                       generator=generator).squeeze(1)  # (R,)
        else:
            if processors is not None:
                logits = processors.normalize(logits)
            tokens = argmax_rows(logits)  # (R,)
        if finished is not None:
            tokens = tokens.masked_fill(finished, pad)
            finished |= torch.isin(tokens, eos)
        out[:, t] = tokens
        if streamer is not None:
            streamer(tokens.clone())  # its own copy: the loop feeds ``tokens`` on
        if finished is not None and bool(finished.all()):
            return out[:, :t + 1]
        if t + 1 < max_new_tokens:
            logits = stepper.step(tokens)
    return out


def _gather(t: Tensor, idx: Tensor) -> Tensor:
    """t (B, M, ...) indexed along dim 1 by idx (B, J) -> (B, J, ...)."""
    shape = idx.shape + t.shape[2:]
    return t.gather(1, idx.reshape(*idx.shape, *([1] * (t.dim() - 2))).expand(shape))


def beam_search(stepper: Stepper, batch: int, beams: int, max_new_tokens: int, *,
                length_penalty: float, eos: Tensor | None, pad: int,
                device: torch.device, early_stopping: bool | str = False,
                processors: LogitsProcessors | None = None,
                prefix: Tensor | None = None) -> Tensor:
    """Beam search with HuggingFace's rules (``transformers`` 5.x ``_beam_search``): each
    step keeps the top M = max(2, 1 + E)·K continuations of the K·V candidates by summed
    log-probability (E: the number of stop tokens in ``eos``, so that K of them can continue
    even when every stop token is among the best of every beam); those among the first K that
    end in ``eos`` (or reach ``max_new_tokens``) become finished hypotheses scored ``sum /
    T_h ** length_penalty`` (T_h: the hypothesis' new tokens, eos included); the best K
    unfinished continue. K finished hypotheses are kept per batch item.

    ``early_stopping`` (HF's three settings): False, a batch item stops once its best running
    score divided by the current length ** length_penalty cannot beat its worst kept
    hypothesis; "never", the same test with the longest possible length (``max_new_tokens``)
    when length_penalty > 0 (with length_penalty <= 0 as False); True, as False, and also an
    item takes no more hypotheses once it has K, and the search ends when every item has K.

    ``processors`` (``qkv.generation.processors``), if given, process each step's
    log-softmax (R, V) before the running scores are added, as HF: ``apply`` then
    ``normalize``; they see each beam's tokens so far (R, P + t): ``prefix`` (R, P) int64
    (the prompt, or the decoder start token, per row) then the beam's new tokens.

    Returns the best hypothesis of each batch item, (B, T): T = the longest of them; shorter
    ones are filled with ``pad``.
    """
    k = beams
    rows = batch * k
    width = 0 if prefix is None else prefix.shape[1]  # P
    history = processors is not None and processors.needs_history
    running = torch.full((batch, k, max_new_tokens), pad, dtype=torch.long, device=device)
    run_scores = torch.zeros(batch, k, dtype=torch.float32, device=device)
    run_scores[:, 1:] = _NEG  # only beam 0 expands at first: the K rows start identical
    done_seqs = running.clone()
    done_scores = torch.full((batch, k), _NEG, dtype=torch.float32, device=device)
    done_flags = torch.zeros(batch, k, dtype=torch.bool, device=device)
    done_lens = torch.zeros(batch, k, dtype=torch.long, device=device)
    open_items = torch.ones(batch, 1, dtype=torch.bool, device=device)  # may still improve
    n_stop = 0 if eos is None else int(eos.numel())
    keep_m = max(2, 1 + n_stop) * k  # M: HF's beams_to_keep
    top_k_mask = torch.arange(keep_m, device=device) < k  # (M,)
    offsets = (torch.arange(batch, device=device) * k)[:, None]  # (B, 1)
    # "never" with a positive penalty: the best score a running beam may reach, at full length
    never = early_stopping == "never" and length_penalty > 0.0
    logits = stepper.prefill()
    for t in range(max_new_tokens):
        if processors is None:
            top_scores, src_beam, tokens = _top_continuations(logits, run_scores, keep_m)
        else:
            vocab = logits.shape[-1]
            logp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
            so_far = (torch.cat((prefix, running.view(rows, max_new_tokens)[:, :t]), dim=1)
                      if history else None)  # (R, P + t)
            logp = processors.normalize(processors.apply(so_far, width + t, logp))
            logp = (logp.view(batch, k, vocab) + run_scores[:, :, None]).view(batch, k * vocab)
            top_scores, top_idx = logp.topk(keep_m, dim=-1)  # (B, M)
            src_beam = top_idx // vocab
            tokens = top_idx % vocab
        cand = _gather(running, src_beam)  # (B, M, T)
        cand[:, :, t] = tokens
        if t + 1 == max_new_tokens:
            hits = torch.ones_like(tokens, dtype=torch.bool)
        elif eos is not None:
            hits = torch.isin(tokens, eos)
        else:
            hits = torch.zeros_like(tokens, dtype=torch.bool)
        # the best K continuations that did not end
        alive_scores = top_scores + hits.float() * _NEG
        keep = alive_scores.topk(k, dim=-1).indices  # (B, K)
        running = _gather(cand, keep)
        run_scores = _gather(alive_scores, keep)
        run_src = _gather(src_beam, keep)
        # hypotheses that ended among the first K candidates join the finished ones (not
        # where early_stopping=True and the item already has K)
        just = hits & top_k_mask
        scores = top_scores / float((t + 1) ** length_penalty)
        if early_stopping is True:
            scores = scores + done_flags.all(dim=1, keepdim=True).float() * _NEG
        scores = scores + (~open_items).float() * _NEG + (~just).float() * _NEG
        m_scores = torch.cat((done_scores, scores), dim=1)
        best = m_scores.topk(k, dim=-1).indices
        done_seqs = _gather(torch.cat((done_seqs, cand), dim=1), best)
        done_scores = _gather(m_scores, best)
        done_flags = _gather(torch.cat((done_flags, just), dim=1), best)
        done_lens = _gather(torch.cat((done_lens, torch.full_like(tokens, t + 1)), dim=1), best)
        # can a running beam still beat the worst kept hypothesis?
        length = max_new_tokens if never else t + 1
        best_possible = run_scores[:, :1] / float(length ** length_penalty)
        worst = torch.where(done_flags, done_scores.min(dim=1, keepdim=True).values, _NEG)
        open_items = open_items & (best_possible > worst).any(dim=-1, keepdim=True)
        if (not bool(open_items.any()) or bool(hits.all())
                or (early_stopping is True and bool(done_flags.all()))):
            break
        stepper.reorder((run_src + offsets).reshape(rows))
        logits = stepper.step(running[:, :, t].reshape(rows))
    length = int(done_lens[:, 0].max())
    return done_seqs[:, 0, :length]
