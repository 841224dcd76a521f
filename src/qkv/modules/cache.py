"""Key/value cache for incremental (token-by-token) decoding.

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim, Dv value head dim (= D unless given).

A ``KVCache`` holds preallocated key and value buffers (B, Hkv, capacity, D|Dv). A decoding
step writes the new keys/values after the ones already there and attends over the filled
part ``[:length]``; nothing is reallocated or concatenated while decoding. Every batch row
shares one ``length`` (pad prompts to a common length and mask the padding with
``qkv.masks.Padding(keep=...)``).

The cache is an inference tool: writing a tensor that requires grad while autograd is
recording raises (run decoding under ``torch.no_grad()`` or ``torch.inference_mode()``).
A cache created inside ``torch.inference_mode()`` can only be written inside it (torch's rule
for inference tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


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
        keys: (B, Hkv, capacity, D) buffer; only ``keys[:, :, :length]`` is meaningful.
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
        for name, val in (("batch", batch), ("num_kv_heads", num_kv_heads),
                          ("capacity", capacity), ("head_dim", head_dim),
                          ("value_dim", value_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"KVCache: {name} must be a positive int, got {val!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not dtype.is_floating_point:
            raise TypeError(f"KVCache: dtype must be a floating dtype, got {dtype}")
        self.keys = torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype,
                                device=device)  # (B, Hkv, capacity, D)
        self.values = torch.zeros(batch, num_kv_heads, capacity, value_dim, dtype=dtype,
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

    def _check(self, k: Tensor, v: Tensor, start: int) -> int:
        for name, t, last in (("k", k, self.head_dim), ("v", v, self.value_dim)):
            if not isinstance(t, Tensor):
                raise TypeError(f"KVCache: {name} must be a torch.Tensor, got {type(t).__name__}")
            want = (self.batch, self.num_kv_heads, "n", last)
            if (t.dim() != 4 or t.shape[0] != self.batch or t.shape[1] != self.num_kv_heads
                    or t.shape[3] != last):
                raise ValueError(f"KVCache: {name} must have shape (B, Hkv, n, D) = {want}, "
                                 f"got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"KVCache: {name} has dtype {t.dtype}, the cache holds "
                                f"{self.dtype}")
            if torch.is_grad_enabled() and t.requires_grad:
                raise RuntimeError(f"KVCache: {name} requires grad; the cache is for inference "
                                   f"— decode under torch.no_grad() or torch.inference_mode()")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"KVCache: k and v lengths differ: k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
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

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
                f"length={self.length}, capacity={self.capacity}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, dtype={self.dtype}, device={self.device})")
