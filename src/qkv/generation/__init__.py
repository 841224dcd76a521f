"""Text generation: ``qkv.generate`` (greedy, sampling, beam search, prompt lookup,
speculative decoding) for GPT and encoder-decoder models, and the decode engine behind it.

Modules: ``api`` (``generate``: argument checks, dispatch), ``search`` (the greedy/sampling
and beam-search loops), ``prompt_lookup`` and ``speculative`` (draft-and-verify loops),
``steppers`` (the generic steppers: a model through its own modules, cached or not; the
encoder-decoder one; ``reorder_cache`` for beams). The decode engine: ``plan``
(``DecodePlan``: a model's layers as named weight records), ``backends`` (the ways to decode a
plan, each declaring what it supports), ``engine`` (``decoder_stepper``, ``explain``),
``stepper`` (``PlanStepper``: one stepper for every backend), ``torch_layer`` (the layer in
torch ops, once) over ``linears`` (dense, oneDNN-packed, int8 weights), ``c_layer`` (the layer
as one C call), ``prefill`` (a padded prompt on its real tokens), and the optional C kernels
(``attention_kernel``, ``gemv_kernel``, ``int8_kernel``, ``row_step_kernel``; built by
``c_kernels``). The encoder-decoder's engine: ``seq2seq_plan`` (``Seq2SeqPlan``, with the
encoder's ``EncoderPlan``), ``seq2seq_layers`` (the decoder layer once over ``linears``),
``seq2seq_encoder``, ``seq2seq_stepper``, ``seq2seq_engine`` (the backend choice,
``explain_seq2seq``). ``text``: ``translate`` / ``complete``, strings in and out. ``chat``: chat
templates rendered as transformers renders them (``render_chat``, ``chat_prompt_ids``), the
stop tokens of a model directory (``stop_token_ids``, ``read_generation_config``) and
``chat`` (a conversation in, the answer out; the name ``qkv.generation.chat`` is that
function: import the module's other names with ``from qkv.generation.chat import ...``).
``processors``: HF's logits processors (no_repeat_ngram_size, bad_words_ids, min_length,
forced bos/eos, renormalize_logits) that ``generate`` applies. ``settings``: a checkpoint's
generation_config.json as ``generate``'s arguments (``read_generation_settings``,
``GenerationSettings``).
"""

from ..models.generation_settings import GenerationSettings, read_generation_settings
from .api import generate
from .chat import (
    ChatTemplateError,
    chat,
    chat_prompt_ids,
    read_chat_template,
    read_generation_config,
    read_special_tokens,
    render_chat,
    stop_token_ids,
)
from .engine import explain
from .search import filter_logits
from .steppers import reorder_cache
from .text import complete, complete_ids, translate, translate_ids

__all__ = ["ChatTemplateError", "GenerationSettings", "chat", "chat_prompt_ids", "complete",
           "complete_ids", "explain", "filter_logits", "generate", "read_chat_template",
           "read_generation_config", "read_generation_settings", "read_special_tokens",
           "render_chat", "reorder_cache", "stop_token_ids", "translate", "translate_ids"]
