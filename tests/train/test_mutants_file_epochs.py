"""File data read past its first epoch: each epoch is a fresh shuffle of every training item.

``PairData`` (a TSV's pairs) and ``TextData`` (a plain text's windows) serve an endless stream,
shuffled per epoch by a generator seeded with (seed, epoch). Checked without re-deriving the
shuffle: every epoch holds each item exactly once, consecutive epochs come in different orders
(for 24 items two independent shuffles coincide with probability 1/24!), the stream read in
pieces across epoch boundaries equals it read at once, and the same seed gives the same stream.
"""

from __future__ import annotations

from qkv.train.data import PairData, TextData

N = 24


def _pairs(seed: int = 7) -> PairData:
    pairs = [(f"src{i}", f"tgt{i}") for i in range(N + 1)]
    return PairData.from_file(pairs, seed=seed, heldout_fraction=0.01)  # one pair held out


def test_pair_file_reshuffles_every_epoch():
    data = _pairs()
    n = len(data.pairs)
    assert n == N
    stream = data.train(0, 4 * n)
    epochs = [stream[e * n:(e + 1) * n] for e in range(4)]
    for e, items in enumerate(epochs):
        assert sorted(items) == sorted(data.pairs), f"epoch {e} is not one of each pair"
    for e in range(3):
        assert epochs[e] != epochs[e + 1], f"epochs {e} and {e + 1} in the same order"
    pieces = data.train(0, n - 5) + data.train(n - 5, 11) + data.train(n + 6, 3 * n - 6)
    assert pieces == stream
    assert _pairs().train(0, 4 * n) == stream


def test_text_file_reshuffles_every_epoch():
    window = 4
    ids = list(range(1000, 1000 + N * window + 1 + 40))
    data = TextData.from_ids(ids, window=window, seed=3)
    n = (len(data.ids) - 1) // window  # windows per epoch
    assert n >= 8
    stream = data.train(0, 3 * n)  # (3n, window + 1)
    firsts = [stream[e * n:(e + 1) * n, 0].tolist() for e in range(3)]
    every = sorted(int(data.ids[i * window]) for i in range(n))
    for e, items in enumerate(firsts):
        assert sorted(items) == every, f"epoch {e} is not one of each window"
    assert firsts[0] != firsts[1] and firsts[1] != firsts[2]
    assert data.train(n - 2, 5).tolist() == stream[n - 2:n + 3].tolist()
