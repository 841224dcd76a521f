"""Caches for incremental (token-by-token) decoding: ``KVCache``, ``WindowKVCache``
(sliding-window attention) and ``LinearCache`` (linear attention).

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim, Dv value head dim (= D unless given), W window, D' feature dim.

A ``KVCache`` holds preallocated key and value buffers (B, Hkv, capacity, D|Dv). A decoding
step writes the new keys/values after the ones already there and attends over the filled
part ``[:length]``; nothing is reallocated or concatenated while decoding. Every batch row
shares one ``length`` (pad prompts to a common length and mask the padding with
``qkv.masks.Padding(keep=...)``).

A ``WindowKVCache`` serves sliding-window attention (``qkv.masks.SlidingWindow(W)``): a
ring buffer of the last W - 1 positions (all a future query can see besides itself), so its
memory is O(W) however many tokens are decoded. ``length`` still counts every position
(absolute positions, for RoPE); ``append`` returns the kept positions + the new ones.

A ``LinearCache`` holds the constant-size ``qkv.LinearState`` of causal linear attention.

Each cache answers ``key_length(n)``: how many keys the attention over n new positions sees
(what a key-padding mask must cover), and ``nbytes``: the memory it holds.

Each cache implements ``reorder(idx)`` (row r becomes what row ``idx[r]`` was): beam search
calls it, and refuses a cache object without it (``qkv.generation.reorder_cache``) rather
than guess which of its tensors are batch-first. A ``KVCache`` also implements
``truncate(length)`` (forget the positions from ``length`` on), which prompt-lookup decoding
uses to roll back rejected draft tokens; a ``WindowKVCache`` cannot (its ring buffer has
overwritten them) and a ``LinearCache`` has summed them into its state.

The caches are an inference tool: writing a tensor that requires grad while autograd is
recording raises (run decoding under ``torch.no_grad()`` or ``torch.inference_mode()``).
A cache created inside ``torch.inference_mode()`` can only be written inside it (torch's rule
for inference tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.linear import LinearState

__all__ = ["KVCache", "LinearCache", "WindowKVCache"]


def _check_positive(cls: str, **values: object) -> None:
    for name, val in values.items():
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{cls}: {name} must be a positive int, got {val!r}")


def _check_reorder(cls: str, idx: object, batch: int) -> None:
    if (not isinstance(idx, Tensor) or idx.dim() != 1 or idx.shape[0] != batch
            or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool):
        got = (f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, Tensor)
               else type(idx).__name__)
        raise ValueError(f"{cls}: reorder idx must be a (B,) = ({batch},) integer tensor of "
                         f"row indices, got {got}")
    if batch and (int(idx.min()) < 0 or int(idx.max()) >= batch):
        raise ValueError(f"{cls}: reorder idx must hold rows in [0, {batch}), got "
                         f"{idx.tolist()}")


def _check_dtype(cls: str, dtype: torch.dtype | None) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{cls}: dtype must be a floating dtype, got {dtype}")
    return dtype


class KVCache:
    """Preallocated key/value buffers for one attention layer.

    Args:
        batch: B.
        num_kv_heads: Hkv.
        capacity: the most positions the cache can hold (prompt + generated tokens).
        head_dim: D, the key head dim.
        value_dim: Dv, the value head dim (default D).
        dtype: buffer dtype (default torch's default dtype); writes must match it.
        device: buffer device (default CPU).

    Attributes:
        keys: (B, Hkv, capacity, D) buffer; only ``keys[:, :, :length]`` is meaningful (the
            rest is uninitialised memory).
        values: (B, Hkv, capacity, Dv) buffer.

    Example::

        cache = KVCache(1, 8, 256, 64)          # or mha.new_cache(1, 256)
        out = mha(prompt, cache=cache, causal=True)            # prefill, (B, N, C)
        out = mha(next_token, cache=cache, causal=True)        # one step, (B, 1, C)
    """

    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        _check_positive("KVCache", batch=batch, num_kv_heads=num_kv_heads, capacity=capacity,
                        head_dim=head_dim, value_dim=value_dim)
        dtype = _check_dtype("KVCache", dtype)
        # uninitialised: every position is written before it is read (zeroing a batch-16
        # cache cost ~2 % of a short generation here)
        self.keys = torch.empty(batch, num_kv_heads, capacity, head_dim, dtype=dtype,
                                device=device)  # (B, Hkv, capacity, D)
        self.values = torch.empty(batch, num_kv_heads, capacity, value_dim, dtype=dtype,
                                  device=device)  # (B, Hkv, capacity, Dv)
        self._length = 0

    @property
    def length(self) -> int:
        """Positions filled so far (the key length S of the next attention, before its write)."""
        return self._length

    @property
    def capacity(self) -> int:
        """The most positions the cache can hold."""
        return self.keys.shape[2]

    @property
    def batch(self) -> int:
        """B."""
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        """Hkv."""
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        """D."""
        return self.keys.shape[3]

    @property
    def value_dim(self) -> int:
        """Dv."""
        return self.values.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        """The buffers' dtype."""
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        """The buffers' device."""
        return self.keys.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.keys.nbytes + self.values.nbytes

    def key_length(self, n: int) -> int:
        """Keys an attention over ``n`` new positions sees once they are appended:
        ``length + n`` (a key-padding mask covers that many)."""
        return self._length + n

    def _check_tensors(self, k: Tensor, v: Tensor) -> None:
        cls = type(self).__name__
        for name, t, last in (("k", k, self.head_dim), ("v", v, self.value_dim)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{cls}: {name} must be a torch.Tensor, got {type(t).__name__}")
            want = (self.batch, self.num_kv_heads, "n", last)
            if (t.dim() != 4 or t.shape[0] != self.batch or t.shape[1] != self.num_kv_heads
                    or t.shape[3] != last):
                raise ValueError(f"{cls}: {name} must have shape (B, Hkv, n, D) = {want}, "
                                 f"got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"{cls}: {name} has dtype {t.dtype}, the cache holds "
                                f"{self.dtype}")
            if torch.is_grad_enabled() and t.requires_grad:
                raise RuntimeError(f"{cls}: {name} requires grad; the cache is for inference "
                                   f"— decode under torch.no_grad() or torch.inference_mode()")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"{cls}: k and v lengths differ: k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")

    def _check(self, k: Tensor, v: Tensor, start: int) -> int:
        self._check_tensors(k, v)
        if not isinstance(start, int) or isinstance(start, bool) or not (
                0 <= start <= self._length):
            raise ValueError(f"KVCache: start must be an int in [0, length={self._length}] "
                             f"(no gaps), got {start!r}")
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KVCache: writing {k.shape[2]} positions at {start} would fill "
                             f"{end} > capacity {self.capacity}; allocate a larger cache")
        return end

    def write(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write keys/values at positions ``[start, start + n)``; the cache then holds
        ``start + n`` positions (anything after them is dropped: ``start < length`` rewinds).

        Args:
            k: (B, Hkv, n, D) keys.
            v: (B, Hkv, n, Dv) values.
            start: first position written, ``0 <= start <= length``.

        Returns:
            ``(keys, values)``: the filled part, views (B, Hkv, start + n, D|Dv).

        Raises:
            ValueError past capacity, on a gap, or on a shape mismatch; TypeError on a dtype
            mismatch; RuntimeError if ``k``/``v`` require grad while autograd records.
        """
        end = self._check(k, v, start)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self._length = end
        return self.get()

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write (B, Hkv, n, D|Dv) keys/values after the filled part; returns the filled
        part ``(keys, values)``, views (B, Hkv, length, D|Dv)."""
        return self.write(k, v, self._length)

    def get(self) -> tuple[Tensor, Tensor]:
        """The filled part: ``(keys (B, Hkv, length, D), values (B, Hkv, length, Dv))``."""
        return self.keys[:, :, :self._length], self.values[:, :, :self._length]

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated)."""
        self._length = 0

    def truncate(self, length: int) -> None:
        """Keep positions ``[0, length)`` and forget the rest (``0 <= length <= self.length``):
        prompt-lookup decoding rolls back the draft tokens its verification rejected. The
        next write starts at ``length``.

        Raises:
            ValueError for a length outside ``[0, self.length]``.
        """
        if not isinstance(length, int) or isinstance(length, bool) or not (
                0 <= length <= self._length):
            raise ValueError(f"{type(self).__name__}: truncate length must be an int in "
                             f"[0, length={self._length}], got {length!r}")
        self._length = length

    def reorder(self, idx: Tensor) -> None:
        """Make batch row r hold what row ``idx[r]`` held (beam search), in place; ``idx``
        (B,) integer row indices. Only the filled positions are moved.

        Raises:
            ValueError for an ``idx`` that is not (B,) integers in ``[0, B)``.
        """
        _check_reorder(type(self).__name__, idx, self.batch)
        n = self._length
        self.keys[:, :, :n] = self.keys[:, :, :n].index_select(0, idx)
        self.values[:, :, :n] = self.values[:, :, :n].index_select(0, idx)

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
                f"length={self.length}, capacity={self.capacity}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, dtype={self.dtype}, device={self.device})")


class WindowKVCache(KVCache):
    """Ring-buffer key/value cache for sliding-window attention: O(W) memory per layer.

    A query at position p sees keys ``p - W < j <= p`` (``qkv.masks.SlidingWindow(W,
    causal=True)``), so the cache keeps only the last W - 1 positions: ``keys``/``values``
    are (B, Hkv, W - 1, D|Dv) ring buffers (position p in slot ``p % (W - 1)``) and never
    grow. ``append`` returns the kept positions followed by the new ones, in order:
    ``(B, Hkv, key_length(n), D|Dv)``; attend over them with ``SlidingWindow(W,
    causal=True)`` (bottom-right aligned: the new queries are the last n keys). When
    ``kept + n <= W`` every returned key is inside every new query's window, so a plain
    causal mask gives the same result.

    Args:
        batch: B.
        num_kv_heads: Hkv.
        window: W >= 1 (W = 1: each query sees only itself; nothing is kept).
        head_dim: D.
        capacity: the most positions (prompt + generated) it accepts, or None for no limit.
            It bounds ``length`` only — memory stays W - 1 positions (fewer when capacity
            is smaller).
        value_dim, dtype, device: as for ``KVCache``.

    Attributes:
        keys: (B, Hkv, slots, D) ring buffer, slots = min(W - 1, capacity).
        values: (B, Hkv, slots, Dv).

    ``length`` counts every position appended (absolute positions continue from it, e.g.
    for RoPE); ``kept`` is how many the buffers hold. Writes only append (no rewind).
    """

    def __init__(self, batch: int, num_kv_heads: int, window: int, head_dim: int, *,
                 capacity: int | None = None, value_dim: int | None = None,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        _check_positive("WindowKVCache", batch=batch, num_kv_heads=num_kv_heads, window=window,
                        head_dim=head_dim, value_dim=value_dim)
        if capacity is not None:
            _check_positive("WindowKVCache", capacity=capacity)
        dtype = _check_dtype("WindowKVCache", dtype)
        slots = window - 1 if capacity is None else min(window - 1, capacity)
        self.keys = torch.zeros(batch, num_kv_heads, slots, head_dim, dtype=dtype,
                                device=device)  # (B, Hkv, slots, D)
        self.values = torch.zeros(batch, num_kv_heads, slots, value_dim, dtype=dtype,
                                  device=device)  # (B, Hkv, slots, Dv)
        self.window = window
        self._limit = capacity
        self._length = 0

    @property
    def capacity(self) -> int | None:
        """The most positions it accepts (None: no limit); memory does not depend on it."""
        return self._limit

    @property
    def slots(self) -> int:
        """Positions the ring buffers hold: min(W - 1, capacity)."""
        return self.keys.shape[2]

    @property
    def kept(self) -> int:
        """Positions held now: min(length, slots)."""
        return min(self._length, self.slots)

    def key_length(self, n: int) -> int:
        """Keys ``append`` of ``n`` positions returns: ``kept + n``."""
        return self.kept + n

    def _check(self, k: Tensor, v: Tensor, start: int) -> int:
        self._check_tensors(k, v)
        if start != self._length or isinstance(start, bool):
            raise ValueError(f"WindowKVCache: start must be length={self._length} (writes only "
                             f"append: positions before the window are gone), got {start!r}")
        end = start + k.shape[2]
        if self._limit is not None and end > self._limit:
            raise ValueError(f"WindowKVCache: writing {k.shape[2]} positions at {start} would "
                             f"fill {end} > capacity {self._limit}; allocate a larger cache")
        return end

    def _ordered(self, buf: Tensor, first: int, count: int) -> Tensor:
        """Positions ``[first, first + count)`` of a ring buffer, in order (B, Hkv, count, ·)."""
        if count == 0:
            return buf[:, :, :0]
        a = first % self.slots
        if a + count <= self.slots:
            return buf[:, :, a:a + count]
        return torch.cat([buf[:, :, a:], buf[:, :, :a + count - self.slots]], dim=2)

    def _store(self, buf: Tensor, t: Tensor, first: int) -> None:
        """Write ``t`` (B, Hkv, c, ·), c <= slots, as positions ``[first, first + c)``."""
        c = t.shape[2]
        a = first % self.slots
        head = min(c, self.slots - a)
        buf[:, :, a:a + head] = t[:, :, :head]
        if c > head:
            buf[:, :, :c - head] = t[:, :, head:]

    def write(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Append at ``start == length`` (the only write a ring buffer allows); see
        ``append``."""
        end = self._check(k, v, start)
        n, m = k.shape[2], self.kept
        old_k, old_v = self.get()  # (B, Hkv, m, D|Dv)
        keys = torch.cat([old_k, k], dim=2) if m else k  # (B, Hkv, m + n, D)
        values = torch.cat([old_v, v], dim=2) if m else v  # (B, Hkv, m + n, Dv)
        take = min(self.slots, m + n)
        if take:
            self._store(self.keys, keys[:, :, m + n - take:], end - take)
            self._store(self.values, values[:, :, m + n - take:], end - take)
        self._length = end
        return keys, values

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, Hkv, n, D|Dv) keys/values; returns the keys/values the n new queries
        attend over: the ``kept`` cached positions then the new ones, (B, Hkv, kept + n,
        D|Dv) (new tensors, or ``k``/``v`` themselves when nothing is kept; the buffers keep
        the last ``slots`` positions)."""
        return self.write(k, v, self._length)

    def get(self) -> tuple[Tensor, Tensor]:
        """The kept positions in order: ``(keys (B, Hkv, kept, D), values (B, Hkv, kept,
        Dv))`` — positions ``length - kept .. length - 1``."""
        m = self.kept
        first = self._length - m
        return (self._ordered(self.keys, first, m), self._ordered(self.values, first, m))

    def truncate(self, length: int) -> None:
        """Not possible: the ring buffers have overwritten what a rollback would need.

        Raises:
            TypeError always (prompt-lookup decoding needs caches that can roll back).
        """
        raise TypeError(f"WindowKVCache cannot truncate (to {length!r}): its ring buffers keep "
                        f"only the last {self.slots} positions, so a rollback cannot restore "
                        f"the ones it overwrote")

    def reorder(self, idx: Tensor) -> None:
        """Make batch row r hold what row ``idx[r]`` held (beam search); ``idx`` (B,) int."""
        _check_reorder(type(self).__name__, idx, self.batch)
        self.keys.copy_(self.keys.index_select(0, idx))
        self.values.copy_(self.values.index_select(0, idx))

    def __repr__(self) -> str:
        return (f"WindowKVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
                f"window={self.window}, length={self.length}, kept={self.kept}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, dtype={self.dtype}, device={self.device})")


class LinearCache:
    """The decoding state of one causal linear-attention layer: constant size.

    Holds a ``qkv.LinearState`` (kv (B, H, D', Dv), z (B, H, D'), FAVOR+ ``log_scale``
    (B, H)), fp32 (fp64 for fp64 inputs) whatever the model dtype, and ``length``, the
    positions summed so far. ``LinearAttention`` reads ``state`` and calls ``update``;
    memory does not grow with the number of tokens decoded.

    Args:
        batch: B.
        num_heads: H (the state is per query head, even with grouped-query keys).
        feature_dim: D' (D for "elu", m for "favor").
        value_dim: Dv.
        capacity: the most positions it accepts, or None for no limit (memory does not
            depend on it).
    """

    def __init__(self, batch: int, num_heads: int, feature_dim: int, value_dim: int, *,
                 capacity: int | None = None) -> None:
        _check_positive("LinearCache", batch=batch, num_heads=num_heads,
                        feature_dim=feature_dim, value_dim=value_dim)
        if capacity is not None:
            _check_positive("LinearCache", capacity=capacity)
        self.batch, self.num_heads = batch, num_heads
        self.feature_dim, self.value_dim = feature_dim, value_dim
        self.capacity = capacity
        self.state: LinearState | None = None
        self._length = 0

    @property
    def length(self) -> int:
        """Positions summed into the state so far."""
        return self._length

    def key_length(self, n: int) -> int:
        """``length + n``: a key-padding mask covers every position, cached and new."""
        return self._length + n

    @property
    def nbytes(self) -> int:
        """Bytes of the state (0 before the first update)."""
        if self.state is None:
            return 0
        return sum(t.nbytes for t in self.state if t is not None)

    def check_room(self, n: int) -> None:
        """Raise ValueError if ``n`` more positions would pass ``capacity``."""
        if self.capacity is not None and self._length + n > self.capacity:
            raise ValueError(f"LinearCache: {n} positions at {self._length} would pass "
                             f"capacity {self.capacity}; allocate a larger cache")

    def update(self, state: LinearState, n: int) -> None:
        """Replace the state by ``state`` (after summing ``n`` more positions)."""
        if not isinstance(state, LinearState):
            raise TypeError(f"LinearCache: state must be a LinearState, got "
                            f"{type(state).__name__}")
        want = (self.batch, self.num_heads, self.feature_dim, self.value_dim)
        if tuple(state.kv.shape) != want:
            raise ValueError(f"LinearCache: state.kv must be (B, H, D', Dv) = {want}, got "
                             f"{tuple(state.kv.shape)}")
        if torch.is_grad_enabled() and state.kv.requires_grad:
            raise RuntimeError("LinearCache: the state requires grad; the cache is for "
                               "inference — decode under torch.no_grad() or "
                               "torch.inference_mode()")
        self.check_room(n)
        self.state = state
        self._length += n

    def reorder(self, idx: Tensor) -> None:
        """Make batch row r hold what row ``idx[r]`` held (beam search); ``idx`` (B,) int."""
        _check_reorder(type(self).__name__, idx, self.batch)
        if self.state is not None:
            self.state = LinearState(*(None if t is None else t.index_select(0, idx)
                                       for t in self.state))

    def reset(self) -> None:
        """Forget every position."""
        self.state = None
        self._length = 0

    def __repr__(self) -> str:
        return (f"LinearCache(batch={self.batch}, num_heads={self.num_heads}, "
                f"feature_dim={self.feature_dim}, value_dim={self.value_dim}, "
                f"length={self.length}, capacity={self.capacity})")
