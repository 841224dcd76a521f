"""qkv: one exact attention core and the Transformers built on it.

Public API: ``qkv.attention``, ``qkv.masks``, ``qkv.MultiHeadAttention``, ``qkv.positions``.
"""

from . import masks, models, positions
from .modules import KVCache, MultiHeadAttention
from .ops import BACKENDS, BiasProducer, NoBackendError, attention, explain

__version__ = "0.1.0"

__all__ = ["BACKENDS", "BiasProducer", "KVCache", "MultiHeadAttention", "NoBackendError",
           "__version__", "attention", "explain", "masks", "models", "positions"]
