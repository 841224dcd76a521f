"""qkv: one exact attention core and the Transformers built on it.

Public API: ``qkv.attention``, ``qkv.explain``, ``qkv.masks``, ``qkv.MultiHeadAttention``,
``qkv.KVCache``, ``qkv.positions``, ``qkv.linear_attention`` (+ ``linear_attention_step``),
``qkv.models``, ``qkv.generate``; subpackages ``qkv.data`` (tasks, tokenizers),
``qkv.train`` (trainer, checkpoints, ``load_run``), ``qkv.generation`` (``translate``,
``complete``), ``qkv.viz`` (attention maps, PNG grids, HTML).
"""

from . import data, generation, masks, models, positions, train, viz
from .generation import generate
from .generation.quantize import quantize
from .modules import KVCache, MultiHeadAttention
from .ops import BACKENDS, BiasProducer, NoBackendError, attention, explain
from .ops.linear import FavorFeatures, LinearState, linear_attention, linear_attention_step
from .version import __version__

__all__ = ["BACKENDS", "BiasProducer", "FavorFeatures", "KVCache", "LinearState",
           "MultiHeadAttention", "NoBackendError", "__version__", "attention", "data", "explain",
           "generate", "generation", "linear_attention", "linear_attention_step", "masks",
           "models", "positions", "quantize", "train", "viz"]
