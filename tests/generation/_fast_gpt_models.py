"""Small GPTs and left-padded prompts shared by the fast-decode tests (not a test module).

Shapes: R rows, N prompt length.
"""

from __future__ import annotations

import torch

from qkv.models import GPT, GPTConfig


def tiny_gpt(**kw) -> GPT:
    """A seeded 2-layer, 32-wide GPT (vocab 48) in eval mode, its matrices drawn from
    N(0, 0.3²) so that every part matters; ``kw`` overrides ``GPTConfig`` fields."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=48, max_len=64, dim=32, num_layers=2, num_heads=4)
    cfg.update(kw)
    model = GPT(GPTConfig(**cfg))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def left_padded(rows: int = 6, n: int = 7, *, shift: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, N) left-padded prompts (pad id 0) and their bool mask: row r has its first
    ``(3r + shift) % N`` positions padded, so the rows hold 1..N real tokens."""
    torch.manual_seed(2)
    ids = torch.randint(3, 48, (rows, n))
    keep = torch.ones(rows, n, dtype=torch.bool)
    for r in range(rows):
        keep[r, :(3 * r + shift) % n] = False
    return ids * keep, keep


def spread_vectors(model: GPT) -> GPT:
    """``model`` with every vector (biases, norm weights and biases) moved off its initial
    value (zeros, ones), so that a decode path dropping one is seen; returns it."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def cases(rows: int, padded: bool, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompts (R, 7) for the backend tests: one unpadded row, or ``rows`` rows of
    ``left_padded`` (with their mask when ``padded``), ids taken mod ``vocab``."""
    ids, keep = left_padded(4, 7)
    ids = ids % vocab
    if rows == 1:
        return ids[-1:], None
    return ids[:rows], keep[:rows] if padded else None


def drive(stepper) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill a fresh stepper's caches with NaN, then: prefill, three greedy steps and a run of
    two tokens. Returns the logits (R, 1 + 3 + 2, V) and the tokens fed (R, 5)."""
    with torch.inference_mode():
        for kc in stepper.cache:
            kc.keys.fill_(float("nan"))
            kc.values.fill_(float("nan"))
        logits = [stepper.prefill()]
        fed = []
        for _ in range(3):
            fed.append(logits[-1].argmax(-1))
            logits.append(stepper.step(fed[-1]))
        pair = torch.stack([logits[-1].argmax(-1), fed[0]], dim=1)  # (R, 2)
        more = stepper.run(pair)  # (R, 2, V)
    return torch.cat([torch.stack(logits, 1), more], 1), torch.cat(
        [torch.stack(fed, 1), pair], 1)


def reference_logits(model, ids: torch.Tensor, keep: torch.Tensor | None,
                     fed: torch.Tensor) -> torch.Tensor:
    """The uncached forward's logits (R, 1 + T, V) at the positions ``drive`` returns: from
    the prompt's last position on, over the prompt ``ids`` (R, N) and the tokens ``fed``
    (R, T)."""
    seq = torch.cat([ids, fed], 1)  # (R, N + T)
    mask = None if keep is None else torch.cat(
        [keep, torch.ones_like(fed, dtype=torch.bool)], 1)
    with torch.inference_mode():
        return model(seq, attention_mask=mask)[:, ids.shape[1] - 1:]
