"""nn.Modules built on ``qkv.ops``: ``MultiHeadAttention`` and its ``KVCache`` (or
``WindowKVCache`` for sliding-window attention), ``LinearAttention`` and its ``LinearCache``;
Flamingo's ``PerceiverResampler`` and ``GatedCrossAttentionBlock``.

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim.
"""

from .attention import MultiHeadAttention
from .cache import KVCache, LinearCache, WindowKVCache
from .gated_cross_attention import GatedCrossAttentionBlock, MediaKV
from .linear_attention import LinearAttention
from .resampler import PerceiverResampler

__all__ = ["KVCache", "LinearAttention", "LinearCache", "MultiHeadAttention", "WindowKVCache"]
__all__ += ["GatedCrossAttentionBlock", "MediaKV", "PerceiverResampler"]
