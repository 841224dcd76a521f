"""Public position-encoding namespace.

Absolute (added to embeddings or applied to q/k): ``Sinusoidal``, ``Learned``, ``RoPE``.
Relative (bias producers, passed as ``bias=`` to ``qkv.attention`` / ``MultiHeadAttention``):
``ALiBi``, ``T5Bias``, ``ShawRelative``.
"""

from .modules.positions import Learned, RoPE, Sinusoidal, positions_from_mask
from .modules.relative import ALiBi, ShawRelative, T5Bias, alibi_slopes, t5_bucket

__all__ = ["ALiBi", "Learned", "RoPE", "ShawRelative", "Sinusoidal", "T5Bias", "alibi_slopes",
           "positions_from_mask", "t5_bucket"]
