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
