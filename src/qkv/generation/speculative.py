"""Speculative decoding with a draft model (``qkv.generate(..., draft_model=d)``): a small
model proposes k tokens one step at a time, the target model checks all k in one forward
pass with its cache, and an accept rule keeps a prefix of them plus one token of the
target's own. Greedy: the output is the target's greedy output, token for token. Sampling:
every token is distributed exactly as plain sampling from the target would draw it.
(Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling".)

Shapes: R rows, N prompt length, T new tokens (at most ``max_new_tokens``), k draft tokens
in a round (k <= ``num_draft_tokens``, and a round never passes T), m tokens emitted in a
round (1 <= m <= k + 1), V vocab size (one vocabulary for both models).

**A round.** The draft first reads the emitted tokens it has not seen (the last round's
final token, or its last two when it kept every draft token), then proposes d_1..d_k: greedy,
the argmax of its logits; sampling, a draw from q_i, the draft's distribution after the same
processing plain sampling applies (``search.filter_logits``: temperature, top-k, top-p, then
softmax). The target reads its one unseen token and d_1..d_k in one ``run``: k + 1 logits,
the distributions p_1..p_{k+1} (p_1 from the prefill in the first round). Greedy keeps the
longest prefix of the draft equal to the target's argmax, then the target's argmax after it.
Sampling keeps d_i with probability min(1, p_i(d_i) / q_i(d_i)) while every earlier one was
kept; at the first rejection it draws from norm(max(0, p_i - q_i)) (``residual``); when all k
are kept it draws the bonus token from p_{k+1}. Each emitted token x is then distributed as
p given the tokens before it (the papers' Theorem), for any draft.

**Batches.** All rows share one cache length (``qkv.KVCache``), so every row emits the same
m tokens per round: m = the fewest (kept prefix + 1) among the running rows, except that a
row whose kept tokens contain a stop token no longer limits m (it is finished; the rest is
padding). A row that kept more emits only its first m, all kept draft tokens, and redoes the
rest in the next round; cutting a row at a length set by the other rows (whose draws are
independent of its own) keeps each of its tokens distributed as p. Both steppers rewind
(``rewind(length)``) to the tokens they have seen that were emitted.

Draft lengths never let a round pass ``max_new_tokens``, so the caches hold N + T positions.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from .engine import decoder_stepper
from .search import argmax_rows, filter_logits
from .steppers import GPTStepper, check_truncatable

__all__ = ["Verifier", "acceptance", "residual", "speculative_accept", "speculative_decode",
           "speculative_generate", "verifier_stepper"]


class Verifier(Protocol):
    """What the loop needs from each model (``qkv.generation.stepper.PlanStepper``,
    ``qkv.generation.steppers.GPTStepper``)."""

    length: int

    def prefill(self) -> Tensor: ...
    def step(self, tokens: Tensor) -> Tensor: ...
    def run(self, tokens: Tensor) -> Tensor: ...
    def rewind(self, length: int) -> None: ...


def verifier_stepper(model: nn.Module, ids: Tensor, keep: Tensor | None, capacity: int,
                     *, tokens_per_pass: int = 1) -> Verifier:
    """A cached stepper over ``model`` that can feed several tokens per row (``run``) and
    roll back (``rewind``): the decode engine's (``qkv.generation.engine.decoder_stepper``:
    the model's plan on the first backend that fits, else the generic ``GPTStepper``).

    With ``tokens_per_pass`` > 1 (the target, which verifies k + 1 tokens per ``run``), the
    engine skips the backends that feed one token per call (the C layer: ``run(n)`` is n
    calls, so verifying would cost what n plain steps cost; ``multi_token=True``); the draft
    (``tokens_per_pass=1``) keeps the engine's choice.

    Args:
        model: a decoder-only model.
        ids: (R, N) left-padded prompts.
        keep: (R, N) bool, True = real token, or None when nothing is padded.
        capacity: positions the caches hold (N + every token fed later).
        tokens_per_pass: the tokens a typical ``run`` feeds per row.
    """
    return decoder_stepper(model, ids, keep, capacity, multi_token=tokens_per_pass > 1)


def _check_rollback(stepper: Verifier, who: str) -> None:
    """TypeError unless the stepper's caches can forget rejected draft tokens."""
    if not isinstance(stepper, GPTStepper):
        return  # a plan stepper writes its KVCache buffers itself; rewind moves its length
    check_truncatable(stepper.cache, (
        f"generate: speculative decoding rolls the {who}'s cache back over rejected draft "
        f"tokens, but its caches are {{kind}}s (a sliding-window ring buffer or a "
        f"linear-attention state cannot roll back); decode without draft_model"))


def acceptance(p_draft: Tensor, q_draft: Tensor) -> Tensor:
    """The probability of keeping each draft token, min(1, p(x) / q(x)), from the target's
    p(x) and the draft's q(x) > 0 at the drafted tokens x: any shape, elementwise."""
    return (p_draft / q_draft).clamp(max=1.0)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """The distribution a rejected draft token is replaced from, norm(max(0, p - q)), for
    distributions p, q (R, V) -> (R, V). A row whose positive part sums to 0 (p == q up to
    rounding: a rejection there has probability 0 in exact arithmetic) returns p."""
    extra = (p - q).clamp(min=0.0)
    total = extra.sum(dim=-1, keepdim=True)  # (R, 1)
    return torch.where(total > 0, extra / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def speculative_accept(p: Tensor, q: Tensor, draft: Tensor,
                       generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """The sampling accept rule of a round, every row at once.

    Args:
        p: (R, k + 1, V) the target's distributions at the k draft positions and the bonus.
        q: (R, k, V) the draft's distributions the tokens were drawn from.
        draft: (R, k) int64 draft tokens, ``draft[:, i]`` drawn from ``q[:, i]``.
        generator: the source of the k uniforms per row and the one draw per row.

    Returns:
        ``(hits, token)``, both (R,) int64: how many leading draft tokens were kept (token i
        with probability ``acceptance(p_i(d_i), q_i(d_i))``, each while all before it were),
        and the token after them: from ``residual(p_h, q_h)`` at the first rejection h, from
        p_{k+1} when all k were kept.
    """
    rows, k1, vocab = p.shape
    k = k1 - 1
    p_draft = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # (R, k)
    q_draft = q.gather(-1, draft[..., None]).squeeze(-1)  # (R, k)
    u = torch.rand(rows, k, generator=generator, dtype=p.dtype, device=p.device)
    kept = u < acceptance(p_draft, q_draft)  # (R, k)
    hits = kept.long().cumprod(dim=1).sum(dim=1)  # (R,)
    # q is 0 at the bonus position: residual(p_{k+1}, 0) = p_{k+1}
    q_bonus = torch.cat((q, q.new_zeros(rows, 1, vocab)), dim=1)  # (R, k + 1, V)
    at = hits[:, None, None].expand(rows, 1, vocab)
    dist = residual(p.gather(1, at).squeeze(1), q_bonus.gather(1, at).squeeze(1))  # (R, V)
    token = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return hits, token


def speculative_decode(target: Verifier, draft: Verifier, max_new_tokens: int, *,
                       num_tokens: int, do_sample: bool, temperature: float,
                       top_k: int | None, top_p: float | None, eos: Tensor | None, pad: int,
                       generator: torch.Generator | None, device: torch.device,
                       stats: dict | None = None) -> Tensor:
    """Greedy or sampled decoding of ``target`` with proposals from ``draft`` (see the module
    docstring). Both steppers hold the same prompts and have not been prefilled.

    Args:
        target, draft: prefill / step / run (R, n) -> (R, n, V) / rewind, with ``length``.
        max_new_tokens: T.
        num_tokens: the most draft tokens per round (``num_draft_tokens``), >= 1.
        do_sample, temperature, top_k, top_p: as ``search.greedy_or_sample``.
        eos: (E,) stop token ids, or None.
        pad: fills rows after their eos.
        generator: for every random draw (sampling only).
        device: of the output.
        stats: if a dict, filled with ``rounds`` (target forwards after the prefill),
            ``draft_passes`` (draft forwards after its prefill), and, summed over the rows
            running at each round, ``drafted`` (draft tokens proposed), ``accepted`` (kept by
            the accept rule) and ``emitted`` (of those, emitted: fewer where rows disagree).

    Returns:
        The new tokens (R, T'), T' <= T (fewer when every row ended); greedy: equal to
        ``greedy_or_sample``'s.

    Raises:
        ValueError when the two models' logits have different vocabulary sizes.
    """
    t_logits = target.prefill()  # (R, V)
    d_logits = draft.prefill()  # (R, V)
    rows, vocab = t_logits.shape
    if d_logits.shape[-1] != vocab:
        raise ValueError(f"generate: draft_model gives logits over {d_logits.shape[-1]} "
                         f"tokens, the target over {vocab}: speculative decoding needs one "
                         f"vocabulary")
    prompt, d_prompt = target.length, draft.length
    out = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
    seq = out.clone()  # the tokens as drawn (fed to the models; ``out`` pads finished rows)
    finished = torch.zeros(rows, dtype=torch.bool, device=device) if eos is not None else None
    done = t_fed = d_fed = 0  # tokens emitted; of them, seen by the target / the draft
    cols = torch.arange(num_tokens + 1, device=device)  # (k + 1,)
    if stats is not None:
        stats.update(rounds=0, draft_passes=0, drafted=0, accepted=0, emitted=0)

    def dist(logits: Tensor) -> Tensor:  # what plain sampling draws from: (M, V) -> (M, V)
        return filter_logits(logits, temperature=temperature, top_k=top_k,
                             top_p=top_p).softmax(dim=-1)

    while done < max_new_tokens:
        k = min(num_tokens, max_new_tokens - done - 1)  # a round emits <= k + 1 tokens
        proposals, qs = [], []
        if k and d_fed < done:  # the emitted tokens the draft has not read
            d_logits = draft.run(seq[:, d_fed:done])[:, -1]
            if stats is not None:
                stats["draft_passes"] += 1
        for i in range(k):
            if do_sample:
                qs.append(dist(d_logits))
                tok = torch.multinomial(qs[-1], 1, generator=generator).squeeze(1)  # (R,)
            else:
                tok = argmax_rows(d_logits)  # (R,)
            proposals.append(tok)
            if i + 1 < k:
                d_logits = draft.step(tok)
                if stats is not None:
                    stats["draft_passes"] += 1
        drafted = (torch.stack(proposals, dim=1) if k else
                   torch.empty(rows, 0, dtype=torch.long, device=device))  # (R, k)
        if t_fed == done:  # the first round: p_1 comes from the prefill
            logits = t_logits[:, None]  # (R, 1, V)
            if k:
                logits = torch.cat((logits, target.run(drafted)), dim=1)
        else:  # the last round's final token, then the draft
            logits = target.run(torch.cat((seq[:, t_fed:done], drafted), dim=1))
        # logits (R, k + 1, V): p_1 .. p_{k+1}
        if stats is not None:
            stats["rounds"] += int(logits.shape[1] > 1 or t_fed < done)
        if do_sample:
            p = dist(logits.reshape(rows * (k + 1), vocab)).view(rows, k + 1, vocab)
            q = torch.stack(qs, dim=1) if k else p[:, :0]  # (R, k, V)
            hits, nxt = speculative_accept(p, q, drafted, generator)
        else:
            pred = argmax_rows(logits.reshape(rows * (k + 1), vocab)).view(rows, k + 1)
            hits = (pred[:, :k] == drafted).long().cumprod(dim=1).sum(dim=1)  # (R,)
            nxt = pred.gather(1, hits[:, None]).squeeze(1)  # (R,)
        cand = torch.cat((drafted, nxt[:, None]), dim=1)  # (R, k + 1)
        cand.scatter_(1, hits[:, None], nxt[:, None])  # the kept prefix, then the new token
        known = hits + 1  # (R,) tokens each row got: the kept prefix + the new token
        limits = torch.ones(rows, dtype=torch.bool, device=device)
        if finished is not None:  # a finished row, or one that finishes now, does not limit
            stop = torch.isin(cand, eos) & (cols[None, :k + 1] < known[:, None])
            limits = ~finished & ~stop.any(dim=1)
        m = int(known[limits].min()) if bool(limits.any()) else k + 1
        if stats is not None:
            running = k * (rows if finished is None else int((~finished).sum()))
            stats["drafted"] += running
            alive = slice(None) if finished is None else ~finished
            stats["accepted"] += int(hits[alive].sum())
            stats["emitted"] += int(hits[alive].clamp(max=m - 1).sum())
        for j in range(m):
            tok = cand[:, j]
            seq[:, done] = tok
            if finished is not None:
                tok = tok.masked_fill(finished, pad)
                finished |= torch.isin(tok, eos)
            out[:, done] = tok
            done += 1
            if finished is not None and bool(finished.all()):
                return out[:, :done]
        # the target read every emitted token but the last, then the rest of d_1..d_k
        t_fed = done - 1
        target.rewind(prompt + t_fed)
        if k:  # the draft read the old ``done`` tokens and d_1..d_{k-1}: keep the emitted
            d_fed = done - m + min(m - 1, k - 1)
            draft.rewind(d_prompt + d_fed)
    return out


def speculative_generate(model: nn.Module, draft_model: nn.Module, ids: Tensor,
                         keep: Tensor | None, max_new_tokens: int, *, num_tokens: int,
                         do_sample: bool, temperature: float, top_k: int | None,
                         top_p: float | None, eos: tuple[int, ...] | None, pad: int,
                         generator: torch.Generator | None,
                         stats: dict | None = None) -> Tensor:
    """``speculative_decode`` over steppers for the two models (``verifier_stepper``).

    Args:
        model: the target decoder; draft_model: the draft (same vocabulary).
        ids: (R, N) left-padded prompts; keep: (R, N) bool or None.
        max_new_tokens, num_tokens, do_sample, temperature, top_k, top_p, pad, generator,
        stats: as ``speculative_decode``; eos: stop token ids or None.

    Returns:
        The new tokens (R, T'), T' <= ``max_new_tokens``.

    Raises:
        ValueError for a draft with learned positions too few for the prompt and the new
        tokens; TypeError for a model whose caches cannot roll back.
    """
    c = getattr(draft_model, "config", None)
    max_len = getattr(c, "max_len", None)
    if getattr(c, "positions", None) == "learned" and isinstance(max_len, int):
        # the draft reads the prompt and at most T - 2 emitted tokens
        need = (ids.shape[1] if keep is None else int(keep.sum(dim=1).max())) \
            + max(0, max_new_tokens - 2)
        if need > max_len:
            raise ValueError(f"generate: draft_model needs {need} positions for this prompt "
                             f"and max_new_tokens={max_new_tokens}, beyond its "
                             f"max_len={max_len}")
    capacity = ids.shape[1] + max_new_tokens
    target = verifier_stepper(model, ids, keep, capacity, tokens_per_pass=num_tokens + 1)
    _check_rollback(target, "model")
    draft = verifier_stepper(draft_model, ids, keep, capacity)
    _check_rollback(draft, "draft_model")
    stops = None if eos is None else torch.tensor(eos, dtype=torch.long, device=ids.device)
    return speculative_decode(target, draft, max_new_tokens, num_tokens=num_tokens,
                              do_sample=do_sample, temperature=temperature, top_k=top_k,
                              top_p=top_p, eos=stops, pad=pad, generator=generator,
                              device=ids.device, stats=stats)
