"""Text generation: ``qkv.generate`` (greedy, sampling, beam search) for GPT and
encoder-decoder models.

Modules: ``api`` (``generate``: argument checks, dispatch), ``search`` (the greedy/sampling
and beam-search loops), ``steppers`` (how each model kind produces next-token logits, with
or without a cache; ``reorder_cache`` for beams), ``fast_gpt`` (a lean single-token decode
step for ``qkv.models.GPT``).
"""

from .api import generate
from .search import filter_logits
from .steppers import reorder_cache

__all__ = ["filter_logits", "generate", "reorder_cache"]
