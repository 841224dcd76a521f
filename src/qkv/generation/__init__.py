"""Text generation: ``qkv.generate`` (greedy, sampling, beam search) for GPT and
encoder-decoder models.

Modules: ``api`` (``generate``: argument checks, dispatch), ``search`` (the greedy/sampling
and beam-search loops), ``steppers`` (how each model kind produces next-token logits, with
or without a cache; ``reorder_cache`` for beams), ``fast_gpt`` (a lean single-token decode
step for ``qkv.models.GPT``; oneDNN packed weights from 4 rows on), ``fast_int8`` (the same
for int8-quantized GPTs), the optional C kernels of those steps (``attention_kernel``: attention
over the cache; ``gemv_kernel``: one row times an (in, out) weight; ``int8_kernel``: an int8
layer; ``row_step_kernel``: a whole layer per call; built by ``c_kernels``), ``text``
(``translate`` / ``complete``: strings in, strings out, framed as ``qkv train`` trains).
"""

from .api import generate
from .search import filter_logits
from .steppers import reorder_cache
from .text import complete, complete_ids, translate, translate_ids

__all__ = ["complete", "complete_ids", "filter_logits", "generate", "reorder_cache",
           "translate", "translate_ids"]
