"""``qkv.data.order``: the reading order of a finite dataset. Oracle: the per-epoch
permutations drawn here from generators seeded by the formula typed in again
(seed · 1 000 003 + epoch, modulo 2^64), laid end to end."""

from __future__ import annotations

import pytest
import torch

from qkv.data.order import derived_seed, epoch_indices


def stream(n: int, seed: int, epochs: int) -> list[int]:
    out: list[int] = []
    for e in range(epochs):
        g = torch.Generator().manual_seed((seed * 1_000_003 + e) % 2**64)
        out += torch.randperm(n, generator=g).tolist()
    return out


@pytest.mark.parametrize(("n", "start", "count"), [(1, 0, 3), (2, 1, 5), (17, 0, 17),
                                                   (17, 10, 40), (113, 200, 7)])
def test_positions_of_the_endless_stream_of_epochs(n, start, count):
    full = stream(n, seed=5, epochs=(start + count) // n + 1)
    assert epoch_indices(n, start, count, 5) == full[start:start + count]


def test_each_epoch_is_a_permutation_and_seeds_differ():
    for e in range(3):
        assert sorted(epoch_indices(23, 23 * e, 23, 0)) == list(range(23))
    assert epoch_indices(23, 0, 23, 0) != epoch_indices(23, 0, 23, 1)
    assert epoch_indices(23, 0, 23, 0) != epoch_indices(23, 23, 23, 0)  # epochs differ


def test_derived_seed_wraps_into_64_bits():
    assert derived_seed(3, 4) == 3 * 1_000_003 + 4
    big = derived_seed(2**63, 1)
    assert 0 <= big < 2**64 and big == (2**63 * 1_000_003 + 1) % 2**64
    torch.Generator().manual_seed(big)  # accepted by torch
