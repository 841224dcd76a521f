"""Input checks shared by the functional attention entry points (``attention``,
``linear_attention``): q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["check_qkv", "shape_of"]


def shape_of(t: Tensor) -> tuple[int, ...]:
    """A tensor's shape as a plain tuple, for error messages."""
    return tuple(t.shape)


def check_qkv(fn: str, q, k, v) -> None:
    """Raise TypeError/ValueError, prefixed with ``fn``, unless q, k, v are 4-D floating
    tensors of one dtype and device with matching B, Hkv dividing H, S and D."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (B, H, N/S, D), got shape "
                             f"{shape_of(t)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{fn}: {name} must be a floating tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"{fn}: batch sizes differ: q {shape_of(q)}, k {shape_of(k)}, "
                         f"v {shape_of(v)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{fn}: k and v must have the same heads Hkv: k {shape_of(k)}, "
                         f"v {shape_of(v)}")
    if k.shape[1] == 0 or h % k.shape[1] != 0:
        raise ValueError(f"{fn}: query heads H={h} must be a multiple of key/value heads "
                         f"Hkv={k.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{fn}: k and v must have the same length S: k {shape_of(k)}, "
                         f"v {shape_of(v)}")
    if k.shape[3] != d:
        raise ValueError(f"{fn}: q and k head dims differ: q {shape_of(q)}, k {shape_of(k)}")
