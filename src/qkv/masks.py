"""Public mask namespace: ``qkv.masks.Causal``, ``qkv.masks.Padding``, ... (True = may attend)."""

from .ops.masks import And, Causal, DenseMask, Mask, Padding, as_mask

__all__ = ["And", "Causal", "DenseMask", "Mask", "Padding", "as_mask"]
