"""qkv: one exact attention core and the Transformers built on it.

Public API: ``qkv.attention``, ``qkv.masks``, ``qkv.MultiHeadAttention``, ``qkv.positions``,
``qkv.linear_attention``, ``qkv.models``.
"""

from . import masks, models, positions
from .generation import generate
from .modules import KVCache, MultiHeadAttention
from .ops import BACKENDS, BiasProducer, NoBackendError, attention, explain
from .ops.linear import FavorFeatures, LinearState, linear_attention, linear_attention_step

__version__ = "0.1.0"

__all__ = ["BACKENDS", "BiasProducer", "FavorFeatures", "KVCache", "LinearState",
           "MultiHeadAttention", "NoBackendError", "__version__", "attention", "explain",
           "generate", "linear_attention", "linear_attention_step", "masks", "models", "positions"]
