"""Strings in, strings out: decode lists of texts with a trained model and its ``qkv.data``
tokenizer, framed the way ``qkv train`` trains (``qkv.train.data``), or with a HuggingFace
encoder-decoder checkpoint and its own tokenizer:

- ``translate``: an encoder-decoder reads source + eos; its output starts at bos and ends
  before eos. With an HF directory's tokenizer (``qkv.data.load_seq2seq_tokenizer``: one
  with ``encode_target``) the source is framed by the tokenizer itself, the decoder starts
  at the model's ``bos_id`` (its ``decoder_start_token_id``), and the directory's
  generation settings (``settings=``) are the defaults: the outputs of transformers'
  ``model.generate(**tokenizer(texts, padding=True))`` + ``batch_decode(...,
  skip_special_tokens=True)``.
- ``complete``: a GPT trained on pairs reads bos + prompt + eos and answers up to eos
  (``framed=True``); a GPT trained on plain text continues the prompt (``framed=False``).
- ``translate_ids`` / ``complete_ids``: the same on one batch of already framed token ids.

Batches of ``batch_size`` texts; decoding options are those of ``qkv.generate``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..models.generation_settings import GenerationSettings
from .api import generate
from .defaults import FROM_MODEL, model_settings

__all__ = ["complete", "complete_ids", "translate", "translate_ids"]

DEFAULT_MAX_NEW_TOKENS = 100


def _until(ids: list[int], eos: int | Sequence[int]) -> list[int]:
    """``ids`` cut before the first of the ``eos`` ids."""
    ends = {eos} if isinstance(eos, int) else set(eos)
    return next((ids[:i] for i, t in enumerate(ids) if t in ends), ids)


def translate_ids(model: nn.Module, rows: list[list[int]], *, pad_id: int, bos_id: int,
                  eos_id: int | Sequence[int], max_new_tokens: int,
                  stop_tokens: Sequence[int] = (), **decoding: Any) -> list[list[int]]:
    """One batch of an encoder-decoder's outputs for framed source ids (each ending in eos):
    the new ids of each row, cut before its first eos (the start token left out).

    Args:
        rows: B framed sources, right-padded here with ``pad_id`` to (B, S).
        bos_id: the decoder's start token. eos_id: one id or several (each ends an output).
        decoding: ``qkv.generate`` options (``pad_token_id`` too; default ``pad_id``)."""
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    src = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=device)  # (B, S)
    keep = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    ends = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    decoding.setdefault("pad_token_id", pad_id)
    ids = generate(model, src, attention_mask=keep, max_new_tokens=max_new_tokens,
                   eos_token_id=[*ends, *stop_tokens], decoder_start_token_id=bos_id,
                   **decoding)  # (B, 1 + T)
    return [_until(row[1:], ends) for row in ids.tolist()]


def complete_ids(model: nn.Module, rows: list[list[int]], *, pad_id: int, eos_id: int,
                 max_new_tokens: int, stop_tokens: Sequence[int] = (),
                 **decoding: Any) -> list[list[int]]:
    """One batch of a decoder's continuations of prompt ids (left-padded here): the new ids
    of each row, cut before its first eos. ``decoding``: ``qkv.generate`` options."""
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)  # (B, N)
    keep = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    res = generate(model, ids, attention_mask=keep, max_new_tokens=max_new_tokens,
                   eos_token_id=[eos_id, *stop_tokens], pad_token_id=pad_id,
                   **decoding)  # (B, N + T)
    return [_until(row[width:], eos_id) for row in res.tolist()]


def translate(model: nn.Module, tokenizer: Any, sources: list[str], *,
              max_new_tokens: int | None = None, batch_size: int = 64,
              stop_tokens: Sequence[int] = (),
              settings: GenerationSettings | str | os.PathLike | None = FROM_MODEL,
              **decoding: Any) -> list[str]:
    """Outputs of an encoder-decoder ``Transformer`` for source strings.

    Two kinds of tokenizer:

    - a ``qkv.data`` tokenizer of a ``qkv train`` run: each source encoded as source + eos,
      the decoder started at the tokenizer's bos;
    - the tokenizer of an HF encoder-decoder directory (``qkv.data.load_seq2seq_tokenizer``;
      told apart by its ``encode_target``): ``tokenizer.encode`` frames the source itself
      (T5 / Marian ``text </s>``, BART ``<s> text </s>``), and the decoder starts at the
      model's ``config.bos_id`` (the checkpoint's ``decoder_start_token_id``), as
      transformers' ``generate``.

    Each output is cut before its first eos and decoded with special tokens dropped.

    Args:
        model, tokenizer: e.g. ``qkv.train.load_run(run)``, or
            ``qkv.models.from_pretrained(DIR)`` and ``load_seq2seq_tokenizer(DIR)``.
        sources: texts (right padding within a batch).
        max_new_tokens: longest output; default the settings' (``max_new_tokens``, else
            ``max_length`` - 1, as HF counts it), else the decoder's position limit
            (``max_len`` - 1 with absolute positions), at most 100.
        batch_size: sources decoded together.
        stop_tokens: ids that end an output besides eos (kept in the output).
        settings: the checkpoint's generation settings, the defaults of every decoding
            option: the model's own (``model.generation_settings``, which
            ``qkv.models.from_pretrained`` keeps from an HF directory), a
            ``GenerationSettings`` or a model directory to read them from
            (``qkv.models.generation_settings.read_generation_settings``:
            generation_config.json, else config.json), None for none — num_beams,
            length_penalty, early_stopping,
            no_repeat_ngram_size, bad_words_ids (opus-mt's never-generate-pad),
            forced_eos_token_id, renormalize_logits, eos / pad / decoder start ids, ...
            Options given here (``max_new_tokens``, ``decoding``) override them.
        decoding: ``qkv.generate`` options (``num_beams``, ``length_penalty``, sampling,
            the logits processors).

    Raises:
        ValueError: a source longer than the model's ``max_len`` (absolute positions), or
            what ``qkv.generate`` refuses.
        CheckpointError: a ``settings`` directory whose generation settings do not read.
    """
    c = model.config
    limit = c.max_len if c.absolute_positions else None
    chosen = model_settings(model, settings)
    options = {} if chosen is None else chosen.generate_kwargs(
        encoder_decoder=True, do_sample=decoding.get("do_sample"))
    options.update(decoding)
    if max_new_tokens is not None:
        options["max_new_tokens"] = max_new_tokens
    budget = options.pop("max_new_tokens", None) or min(DEFAULT_MAX_NEW_TOKENS,
                                                        (limit or 10**9) - 1)
    frames = callable(getattr(tokenizer, "encode_target", None))  # an HF directory's
    start = options.pop("decoder_start_token_id", c.bos_id if frames else tokenizer.bos_id)
    ends = options.pop("eos_token_id", None) or [tokenizer.eos_id]
    ends = [ends] if isinstance(ends, int) else list(ends)
    out: list[str] = []
    for first in range(0, len(sources), batch_size):
        texts = sources[first:first + batch_size]
        rows = [tokenizer.encode(s) if frames else [*tokenizer.encode(s), tokenizer.eos_id]
                for s in texts]
        width = max(len(r) for r in rows)
        if limit is not None and width > limit:
            raise ValueError(f"an input of {width} tokens (with eos) is longer than the model's "
                             f"max_len={limit}")
        new = translate_ids(model, rows, pad_id=tokenizer.pad_id, bos_id=start, eos_id=ends,
                            max_new_tokens=budget, stop_tokens=stop_tokens, settings=None,
                            **options)
        out += [tokenizer.decode(ids) for ids in new]
    return out


def complete(model: nn.Module, tokenizer: Any, prompts: list[str], *, framed: bool = True,
             max_new_tokens: int | None = None, batch_size: int = 64,
             stop_tokens: Sequence[int] = (), **decoding: Any) -> list[str]:
    """A GPT's answers (``framed``: prompt read as bos + prompt + eos, answer up to eos) or
    continuations (plain text: the prompt as given + continuation) for prompt strings.

    Args:
        model, tokenizer: e.g. ``qkv.train.load_run(run)``.
        prompts: texts, left-padded within a batch.
        framed: True for a GPT trained on a pair task, False for one trained on text.
        max_new_tokens: default: what the context (``max_len``) leaves, at most 100; more
            than it leaves is a ValueError.
        batch_size: prompts decoded together.
        stop_tokens: ids that end an output besides eos (kept in the output).
        decoding: ``qkv.generate`` options (``num_beams``, ``do_sample``, ``temperature``,
            ``top_k``, ``top_p``, ``generator``, ...).

    Raises:
        ValueError: an empty plain-text prompt, or a prompt that leaves no room in
        ``max_len``.
    """
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        texts = prompts[start:start + batch_size]
        rows = [([tokenizer.bos_id, *tokenizer.encode(p), tokenizer.eos_id] if framed
                 else tokenizer.encode(p)) for p in texts]
        if any(not r for r in rows):
            raise ValueError("a prompt is empty: a GPT trained on text needs at least one "
                             "token to continue")
        width = max(len(r) for r in rows)
        room = model.config.max_len - width + 1
        if room < 1:
            raise ValueError(f"a prompt of {width} tokens does not fit the model's max_len="
                             f"{model.config.max_len}")
        if max_new_tokens is not None and max_new_tokens > room:
            raise ValueError(f"max_new_tokens={max_new_tokens}: a prompt of {width} tokens "
                             f"leaves room for {room} in the model's max_len="
                             f"{model.config.max_len}")
        budget = max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, room)
        new = complete_ids(model, rows, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                           max_new_tokens=budget, stop_tokens=stop_tokens, **decoding)
        out += [tokenizer.decode(ids) if framed else text + _continuation(tokenizer, prompt, ids)
                for ids, prompt, text in zip(new, rows, texts, strict=True)]
    return out


def _continuation(tokenizer: Any, prompt: list[int], new: list[int]) -> str:
    """The text that ``new`` ids add after ``prompt`` ids: decoded together (so that a
    tokenizer joining pieces across the boundary joins them as in one text) less the
    prompt's own decoding; the prompt is shown to the user as typed, not as decoded (which
    drops characters the tokenizer does not know)."""
    whole, head = tokenizer.decode(prompt + new), tokenizer.decode(prompt)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)
