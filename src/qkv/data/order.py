"""The order a run reads a finite dataset in: seeded per-epoch permutations, so that the
items of any step are a pure function of (seed, position) and a resumed run reads the same.

``derived_seed(seed, k)``: the generator seed of item ``k`` (an epoch, a step) of a run
seeded ``seed``. ``epoch_indices(n, start, count, seed)``: positions ``start .. start +
count - 1`` of the endless stream epoch 0, epoch 1, ... where epoch e is
``torch.randperm(n)`` drawn from a generator seeded ``derived_seed(seed, e)``.
"""

from __future__ import annotations

import torch

__all__ = ["derived_seed", "epoch_indices"]


def derived_seed(seed: int, k: int) -> int:
    """The generator seed of item ``k`` (an epoch, a step) of a run seeded ``seed``, wrapped
    into torch's 64-bit seed range (unchanged for every seed where it did not overflow)."""
    return (seed * 1_000_003 + k) % 2**64


def epoch_indices(n: int, start: int, count: int, seed: int) -> list[int]:
    """Items ``start .. start + count - 1`` of the concatenation of per-epoch permutations of
    range(n), epoch e shuffled by a generator seeded with (seed, e)."""
    out: list[int] = []
    perms: dict[int, list[int]] = {}
    for pos in range(start, start + count):
        epoch, i = divmod(pos, n)
        if epoch not in perms:
            g = torch.Generator().manual_seed(derived_seed(seed, epoch))
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        out.append(perms[epoch][i])
    return out
