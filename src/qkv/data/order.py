"""The order a run reads a finite dataset in: seeded per-epoch permutations, so that the
items of any step are a pure function of (seed, position) and a resumed run reads the same.

``derived_seed(seed, k)``: the generator seed of item ``k`` (an epoch, a step) of a run
seeded ``seed``. ``hash_int(*parts)``: a stable 64-bit integer of its parts (the embedded
tasks draw each example from a generator seeded with it, and split held-out items by it).
``epoch_indices(n, start, count, seed)``: positions ``start .. start +
count - 1`` of the endless stream epoch 0, epoch 1, ... where epoch e is
``torch.randperm(n)`` drawn from a generator seeded ``derived_seed(seed, e)``.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["derived_seed", "epoch_indices", "hash_int"]


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


def hash_int(*parts: object) -> int:
    """A 64-bit integer of ``parts`` (their ``str`` joined by U+001F), the same in every
    process and Python version (blake2b, not ``hash``): the seed of an embedded task's
    example, or its held-out bucket."""
    key = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
