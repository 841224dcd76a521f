"""nn.Modules built on ``qkv.ops``: ``MultiHeadAttention`` and its ``KVCache``.

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim.
"""

from .attention import MultiHeadAttention
from .cache import KVCache

__all__ = ["KVCache", "MultiHeadAttention"]
