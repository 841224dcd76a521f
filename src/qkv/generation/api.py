"""``qkv.generate``: greedy, sampled and beam-search decoding for GPT and encoder-decoder
models.

Shapes: B batch, N prompt length, S source length, K beams, T new tokens, V vocab size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..models.generation_settings import GenerationSettings
from ..models.transformer import Transformer
from .defaults import FROM_MODEL, Default, model_settings, resolve_arguments
from .engine import decoder_stepper
from .lookup_stream import StreamColumns, StreamedText
from .processors import LogitsProcessors, make_processors
from .prompt_lookup import DEFAULT_NGRAM, NgramIndex, prompt_lookup_greedy
from .search import beam_search, greedy_or_sample
from .speculative import speculative_generate
from .steppers import GPTStepper, Seq2SeqStepper, check_truncatable

__all__ = ["generate"]


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def _int(name: str, value: Any, low: int, *, none: bool = False) -> None:
    if value is None and none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"generate: {name} must be an int >= {low}"
                         f"{' or None' if none else ''}, got {value!r}")


def _real(name: str, value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise ValueError(f"generate: {name} must be a finite number, got {value!r}")
    return float(value)


def _token(name: str, value: Any, vocab: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 <= value < vocab):
        raise ValueError(f"generate: {name} must be a token id in [0, {vocab}) or None, "
                         f"got {value!r}")


def _stop_ids(value: Any) -> tuple[int, ...] | None:
    """``eos_token_id`` as a tuple of ids (one id, or several stop tokens), or None."""
    if value is None:
        return None
    ids = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(ids, (tuple, list)) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise TypeError(f"generate: eos_token_id must be a token id, a non-empty list of ids "
                        f"or None, got {value!r}")
    return tuple(ids)


def _check_args(num_beams, length_penalty, do_sample, temperature, top_k, top_p, generator,
                use_cache, max_new_tokens) -> None:
    _int("max_new_tokens", max_new_tokens, 1)
    _int("num_beams", num_beams, 1)
    _real("length_penalty", length_penalty)
    for name, val in (("do_sample", do_sample), ("use_cache", use_cache)):
        if not isinstance(val, bool):
            raise TypeError(f"generate: {name} must be a bool, got {val!r}")
    if _real("temperature", temperature) <= 0:
        raise ValueError(f"generate: temperature must be > 0, got {temperature!r} (for "
                         f"greedy decoding use do_sample=False)")
    _int("top_k", top_k, 1, none=True)
    if top_p is not None and not 0.0 < _real("top_p", top_p) <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generate: generator must be a torch.Generator, "
                        f"got {type(generator).__name__}")
    if do_sample and num_beams > 1:
        raise ValueError(f"generate: do_sample=True with num_beams={num_beams} is not "
                         f"supported (sample with num_beams=1, or search without sampling)")
    if not do_sample:
        unused = [f"{n}={v!r}" for n, v, default in (
            ("temperature", temperature, 1.0), ("top_k", top_k, None), ("top_p", top_p, None))
            if v != default]
        if unused:
            names = " and ".join([", ".join(unused[:-1]), unused[-1]] if unused[1:] else unused)
            raise ValueError(f"generate: {names} {'apply' if unused[1:] else 'applies'} only "
                             f"when sampling; pass do_sample=True")


def _check_ids(input_ids: Any) -> Tensor:
    if (not isinstance(input_ids, Tensor) or input_ids.dim() != 2
            or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex
            or input_ids.dtype == torch.bool):
        got = (f"{_shape(input_ids)} {input_ids.dtype}" if isinstance(input_ids, Tensor)
               else _shape(input_ids))
        raise ValueError(f"generate: input_ids must be an integer tensor (B, N), got {got}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must have at least one row and one token, "
                         f"got {_shape(input_ids)}")
    return input_ids.long()


def _check_mask(mask: Any, ids: Tensor) -> Tensor:
    if (not isinstance(mask, Tensor) or mask.dtype.is_floating_point or mask.dtype.is_complex
            or _shape(mask) != _shape(ids)):
        got = f"{_shape(mask)} {mask.dtype}" if isinstance(mask, Tensor) else _shape(mask)
        raise ValueError(f"generate: attention_mask must be a bool/int tensor shaped like "
                         f"input_ids {_shape(ids)} (1 = real token), got {got}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("generate: attention_mask must hold only 0 and 1")
    return mask.to(device=ids.device, dtype=torch.bool)


def _gpt_keep(mask: Tensor | None, ids: Tensor) -> Tensor | None:
    """The (B, N) keep mask of a left-padded prompt, None when nothing is padded."""
    if mask is None:
        return None
    keep = _check_mask(mask, ids)
    empty = ~keep.any(dim=1)
    if bool(empty.any()):
        raise ValueError(f"generate: row {int(empty.nonzero()[0])} of attention_mask has no "
                         f"real token")
    if bool((keep[:, :-1] & ~keep[:, 1:]).any()):
        row = int((keep[:, :-1] & ~keep[:, 1:]).any(dim=1).nonzero()[0])
        raise ValueError(f"generate: attention_mask row {row} is not left-padded (a 0 after "
                         f"a 1); decoder-only generation appends after the last column, so "
                         f"pad prompts on the left")
    return None if bool(keep.all()) else keep


def generate(model: nn.Module, input_ids: Tensor, *,
             max_new_tokens: int = Default(None),
             attention_mask: Tensor | None = None, num_beams: int = Default(1),
             length_penalty: float = Default(1.0),
             early_stopping: bool | str = Default(False),
             do_sample: bool = Default(False), temperature: float = Default(1.0),
             top_k: int | None = Default(None), top_p: float | None = Default(None),
             eos_token_id: int | Sequence[int] | None = Default(None),
             pad_token_id: int | None = Default(None),
             decoder_start_token_id: int | None = Default(None),
             no_repeat_ngram_size: int | None = Default(None),
             min_length: int | None = Default(None),
             min_new_tokens: int | None = Default(None),
             bad_words_ids: Sequence[Sequence[int]] | None = Default(None),
             forced_bos_token_id: int | None = Default(None),
             forced_eos_token_id: int | Sequence[int] | None = Default(None),
             renormalize_logits: bool = Default(False),
             settings: GenerationSettings | str | os.PathLike | None = FROM_MODEL,
             generator: torch.Generator | None = None, use_cache: bool = True,
             prompt_lookup_num_tokens: int | None = None,
             max_matching_ngram_size: int | None = None,
             draft_model: nn.Module | None = None, num_draft_tokens: int = 5,
             streamer: Callable[[Tensor], object] | None = None) -> Tensor:
    """Generate tokens with a decoder-only model (``qkv.models.GPT``, or anything with its
    interface) or an encoder-decoder ``qkv.models.Transformer``.

    **The checkpoint's settings are the defaults.** A model ``qkv.models.from_pretrained``
    loaded from a HuggingFace directory carries that directory's generation settings
    (``model.generation_settings``: generation_config.json, else config.json's generation
    fields, ``qkv.models.generation_settings``), and every decoding argument from
    ``max_new_tokens`` to ``renormalize_logits`` that the call does not pass takes the
    file's value, as transformers' ``generate`` does: ``max_length`` counted as HF counts it
    (a decoder-only model's prompt width, an encoder-decoder's start token), the file's
    sampling filters only when the call samples (with HF's ``top_k`` 50 where the file sets
    none). An argument passed, even at the value shown below, overrides the file;
    ``settings=None`` decodes with qkv's defaults alone. ``qkv.generation.explain`` says
    which values come from the file.

    Args:
        model: a ``GPT``-like decoder — ``model(ids, attention_mask=, cache=)`` -> logits
            (B, N, V) and ``model.new_cache(batch, capacity)`` — or a ``Transformer``. Its
            train/eval mode is left as it is (call ``model.eval()`` first for deterministic
            output when it has dropout).
        input_ids: decoder-only: the prompts (B, N), left-padded, with ``attention_mask``.
            Transformer: the source ids (B, S), right-padded with ``config.pad_id``.
        max_new_tokens: the most tokens to generate per row (T); required unless the
            settings give it (their ``max_new_tokens`` or ``max_length``).
        attention_mask: (B, N) or (B, S) bool/int, 1 = real token. Decoder-only: the
            padding must be on the left. Transformer: default ``input_ids != pad_id``.
        num_beams: K; 1 is greedy (or sampling), K > 1 beam search.
        length_penalty: beam search ranks finished hypotheses by ``sum of log-probs /
            length ** length_penalty`` (length = new tokens, eos included), as HF.
        early_stopping: beam search's stopping rule, HF's three: False (default) stops a
            batch item once its best running beam, scored at the current length, cannot beat
            its worst of K finished hypotheses; "never" scores it at ``max_new_tokens``
            instead when length_penalty > 0; True also stops an item as soon as it has K
            finished hypotheses (``qkv.generation.search.beam_search``). Unused by greedy
            decoding and sampling (as length_penalty).
        do_sample: sample from the (filtered) softmax instead of taking the argmax.
        temperature, top_k, top_p: sampling filters, applied in this order (HF's): logits /
            temperature, keep the ``top_k`` most likely tokens, keep the smallest set whose
            probability reaches ``top_p``. Only with ``do_sample=True``.
        eos_token_id: a stop token, or a list of them: a row that produces one is finished
            (its later tokens are ``pad_token_id``). GPT default: None (always T tokens);
            Transformer default: ``config.eos_id``.
        pad_token_id: fills rows after their eos. GPT default: (the first) ``eos_token_id``;
            Transformer
            default ``config.pad_id``.
        decoder_start_token_id: Transformer only, the first decoder token (default
            ``config.bos_id``).
        no_repeat_ngram_size, min_length, min_new_tokens, bad_words_ids,
        forced_bos_token_id, forced_eos_token_id, renormalize_logits: HF's logits processors
            of the same names, applied with HF's rules and in HF's order to greedy decoding,
            sampling (before temperature, top_k, top_p; renormalize_logits after them) and
            beam search (to each step's log-softmax, before the beams' scores are added):
            ``qkv.generation.processors``. They see a row's tokens so far as HF's
            ``input_ids``: a GPT's prompt as given (left padding included) then its new
            tokens; a Transformer's start token then its new tokens. In brief:
            ``no_repeat_ngram_size`` n >= 1: no n-gram occurs twice in those tokens (0 or
            None: off); ``min_length``: no stop token while those tokens number fewer than it
            (HF's count: a GPT's prompt width, a Transformer's start token included);
            ``min_new_tokens``: none before that many new tokens (replaces ``min_length``, as
            HF); both do nothing without a stop token; ``bad_words_ids``: a list of token-id
            sequences never generated (a one-token one that is a stop token is dropped, as
            HF); ``forced_bos_token_id``: the first token after a one-token prefix (a
            Transformer's first new token); ``forced_eos_token_id`` (an id or several): the
            token of the last step (the ``max_new_tokens``-th); ``renormalize_logits``:
            log-softmax after all of them.
        settings: the generation settings that give the defaults above: the model's own
            (``model.generation_settings``, when it carries any), a ``GenerationSettings``,
            a model directory to read them from, or None for none.
        generator: a ``torch.Generator`` for reproducible sampling.
        use_cache: False recomputes the whole sequence each step (slow; the tests' oracle).
        prompt_lookup_num_tokens: k >= 1 turns on prompt-lookup decoding (greedy only): each
            step drafts up to k tokens copied from the prompt (the source, for a Transformer)
            or the text generated so far where its last n-gram occurred before, and verifies
            them in one forward pass; the tokens are greedy's, in fewer passes when the
            output copies its input (``qkv.generation.prompt_lookup``). None: off.
        max_matching_ngram_size: the longest n-gram looked up (default 2, as HF); only with
            ``prompt_lookup_num_tokens``.
        draft_model: a small decoder-only model with the same vocabulary turns on
            speculative decoding (greedy or sampling; decoder-only models, no beams, no prompt
            lookup, ``use_cache=True``): each round it proposes up to ``num_draft_tokens``
            tokens, the model checks them in one forward pass and keeps a prefix plus one
            token of its own. Greedy: the model's greedy tokens; sampling: each token
            distributed as plain sampling draws it (temperature, top_k, top_p alike), in fewer
            forward passes of the model when the draft often agrees with it
            (``qkv.generation.speculative``). None: off.
        num_draft_tokens: k >= 1, the most tokens the draft proposes per round (default 5);
            only with ``draft_model``.
        streamer: a callable that receives the new tokens as they are produced: once per
            new output column, with that column (B,) int64 on the output's device (the
            token each row produced, ``pad_token_id`` in rows that have finished), so that
            its T calls stacked along dim 1 equal the returned new tokens (``out[:, N:]``
            for a GPT, ``out[:, 1:]`` for a Transformer: neither the prompt nor the start
            token is streamed). Greedy and sampling call it after every step; prompt
            lookup after every column of a verified block (a block's columns arrive one
            call each, in a burst). Beam search refuses it (a beam's tokens are only final
            when the search ends; HF refuses too), and so does speculative decoding (its
            rounds emit their tokens inside the loop). What it returns is ignored; what it
            raises ends the call.

    Returns:
        GPT: (B, N + T) int64, the prompt then the new tokens (as HF's ``generate``);
        Transformer: (B, 1 + T), the start token then the new tokens. T <= max_new_tokens:
        generation stops once every row has finished; beam search returns each input's best
        hypothesis.

    Beam search follows HuggingFace's ``generate(num_beams=K)`` with the same
    ``early_stopping`` (see ``qkv.generation.search.beam_search``); with the same weights and
    arguments it returns HF's tokens, as greedy decoding does with the processors. Decoding
    runs under ``torch.inference_mode()``; a
decoder-only model decodes through the decode engine (``qkv.generation.engine``): its
``DecodePlan`` on the first backend that supports it (``qkv.generation.explain(model,
batch=...)`` says which, and why the others refuse), else through its own modules. A
backend's weight copies (transposed, oneDNN-packed) are made by this call from the weights as
they are now and freed when it returns: nothing is kept between calls, so a weight edited in
any way (even in place through ``.data`` or numpy) is decoded as edited by the next call.

    Raises:
        TypeError for a model of another kind or an argument of the wrong type; ValueError
        for a bad value (num_beams < 1, top_p outside (0, 1], temperature <= 0, sampling
        options without do_sample, do_sample with beams, a token id outside the vocabulary,
        right-padded GPT prompts, more positions than the model's ``max_len``,
        ``prompt_lookup_num_tokens`` < 1 or with beams or sampling, an ``early_stopping``
        other than True, False or "never", a bad processor argument, a processor (any of
        them, renormalize_logits included) with prompt lookup or ``draft_model``, whose
        verification compares the model's unprocessed argmax); TypeError for prompt
        lookup on a model whose caches cannot roll back (sliding-window, linear attention);
        ValueError for ``draft_model`` with beams, prompt lookup, an encoder-decoder,
        ``use_cache=False`` or another vocabulary size, or ``num_draft_tokens`` not an int >= 1;
        TypeError for a ``streamer`` that is not callable, ValueError for one with beams or
        ``draft_model``.
    """
    prompt_length = input_ids.shape[1] if isinstance(input_ids, Tensor) and \
        input_ids.dim() == 2 else None
    values = resolve_arguments(
        model_settings(model, settings),
        dict(max_new_tokens=max_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
             early_stopping=early_stopping, do_sample=do_sample, temperature=temperature,
             top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
             decoder_start_token_id=decoder_start_token_id,
             no_repeat_ngram_size=no_repeat_ngram_size, min_length=min_length,
             min_new_tokens=min_new_tokens, bad_words_ids=bad_words_ids,
             forced_bos_token_id=forced_bos_token_id, forced_eos_token_id=forced_eos_token_id,
             renormalize_logits=renormalize_logits),
        encoder_decoder=isinstance(model, Transformer), prompt_length=prompt_length)
    return _generate(model, input_ids, attention_mask=attention_mask, generator=generator,
                     use_cache=use_cache, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                     max_matching_ngram_size=max_matching_ngram_size, draft_model=draft_model,
                     num_draft_tokens=num_draft_tokens, streamer=streamer, **values)


def _generate(model: nn.Module, input_ids: Tensor, *, max_new_tokens: int,
              attention_mask: Tensor | None, num_beams: int, length_penalty: float,
              early_stopping: bool | str, do_sample: bool, temperature: float,
              top_k: int | None, top_p: float | None,
              eos_token_id: int | Sequence[int] | None, pad_token_id: int | None,
              decoder_start_token_id: int | None, no_repeat_ngram_size: int | None,
              min_length: int | None, min_new_tokens: int | None,
              bad_words_ids: Sequence[Sequence[int]] | None, forced_bos_token_id: int | None,
              forced_eos_token_id: int | Sequence[int] | None, renormalize_logits: bool,
              generator: torch.Generator | None, use_cache: bool,
              prompt_lookup_num_tokens: int | None, max_matching_ngram_size: int | None,
              draft_model: nn.Module | None, num_draft_tokens: int,
              streamer: Callable[[Tensor], object] | None) -> Tensor:
    """``generate`` with every argument decided (``qkv.generation.defaults``)."""
    _check_args(num_beams, length_penalty, do_sample, temperature, top_k, top_p, generator,
                use_cache, max_new_tokens)
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"generate: early_stopping must be True, False or \"never\", got "
                         f"{early_stopping!r}")
    procs = dict(no_repeat_ngram_size=no_repeat_ngram_size, min_length=min_length,
                 min_new_tokens=min_new_tokens, bad_words_ids=bad_words_ids,
                 forced_bos_token_id=forced_bos_token_id,
                 forced_eos_token_id=forced_eos_token_id,
                 renormalize_logits=renormalize_logits)
    lookup = _check_lookup(prompt_lookup_num_tokens, max_matching_ngram_size, num_beams,
                           do_sample)
    draft = _check_draft(draft_model, num_draft_tokens, model, num_beams, lookup, use_cache)
    _check_streamer(streamer, num_beams, draft)
    ids = _check_ids(input_ids)
    eos_token_id = _stop_ids(eos_token_id)
    if isinstance(model, Transformer):
        out = _generate_seq2seq(model, ids, attention_mask, max_new_tokens, num_beams,
                                length_penalty, do_sample, temperature, top_k, top_p,
                                eos_token_id, pad_token_id, decoder_start_token_id, generator,
                                use_cache, lookup, streamer, early_stopping=early_stopping,
                                procs=procs)
    elif isinstance(model, nn.Module) and callable(getattr(model, "new_cache", None)):
        if decoder_start_token_id is not None:
            raise ValueError("generate: decoder_start_token_id is for encoder-decoder models; "
                             "a decoder-only model continues its prompt")
        out = _generate_decoder(model, ids, attention_mask, max_new_tokens, num_beams,
                                length_penalty, do_sample, temperature, top_k, top_p,
                                eos_token_id, pad_token_id, generator, use_cache, lookup,
                                draft, streamer, early_stopping=early_stopping, procs=procs)
    else:
        raise TypeError(f"generate: model must be a qkv.models.GPT (or a decoder with "
                        f"forward(ids, attention_mask=, cache=) and new_cache(batch, "
                        f"capacity)) or a qkv.models.Transformer, got {type(model).__name__}")
    return out.clone()  # a normal tensor, not an inference tensor


def _check_streamer(streamer: Any, num_beams: int, draft: Any) -> None:
    """TypeError for a streamer that is not callable; ValueError where nothing can stream."""
    if streamer is None:
        return
    if not callable(streamer):
        raise TypeError(f"generate: streamer must be a callable taking each new column of "
                        f"tokens (B,), got {type(streamer).__name__}")
    if num_beams > 1:
        raise ValueError(f"generate: streamer cannot be used with num_beams={num_beams}: a "
                         f"beam's tokens are only final when the search ends (as HF's "
                         f"generate); stream with num_beams=1")
    if draft is not None:
        raise ValueError("generate: streamer is not supported with draft_model (speculative "
                         "decoding emits its tokens inside its rounds); stream without "
                         "draft_model, or with prompt_lookup_num_tokens")


def _check_lookup(k: Any, ngram: Any, num_beams: int, do_sample: bool
                  ) -> tuple[int, int] | None:
    """``(k, max n-gram)`` for prompt-lookup decoding, or None when it is off."""
    if k is None:
        if ngram is not None:
            raise ValueError(f"generate: max_matching_ngram_size={ngram!r} only applies with "
                             f"prompt_lookup_num_tokens")
        return None
    _int("prompt_lookup_num_tokens", k, 1, none=True)
    _int("max_matching_ngram_size", ngram, 1, none=True)
    if num_beams > 1 or do_sample:
        what = f"num_beams={num_beams}" if num_beams > 1 else "do_sample=True"
        raise ValueError(f"generate: prompt_lookup_num_tokens={k} is greedy decoding only; it "
                         f"cannot be combined with {what}")
    return k, DEFAULT_NGRAM if ngram is None else ngram


def _check_draft(draft_model: Any, k: Any, model: Any, num_beams: int,
                 lookup: tuple[int, int] | None, use_cache: bool) -> tuple[nn.Module, int] | None:
    """``(draft model, num_draft_tokens)`` for speculative decoding, or None when it is off."""
    if draft_model is None:
        if k != 5:
            raise ValueError(f"generate: num_draft_tokens={k!r} only applies with draft_model")
        return None
    _int("num_draft_tokens", k, 1)
    for what, bad in (("an encoder-decoder model", isinstance(model, Transformer)),
                      (f"num_beams={num_beams}", num_beams > 1),
                      ("prompt_lookup_num_tokens", lookup is not None),
                      ("use_cache=False", not use_cache)):
        if bad:
            raise ValueError(f"generate: draft_model (speculative decoding, decoder-only "
                             f"models with the cache) cannot be combined with {what}")
    if (not isinstance(draft_model, nn.Module) or isinstance(draft_model, Transformer)
            or not callable(getattr(draft_model, "new_cache", None))):
        raise TypeError(f"generate: draft_model must be a decoder-only model like "
                        f"qkv.models.GPT (forward(ids, attention_mask=, cache=) and "
                        f"new_cache(batch, capacity)), got {type(draft_model).__name__}")
    ours = getattr(getattr(draft_model, "config", None), "vocab_size", None)
    theirs = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(ours, int) and isinstance(theirs, int) and ours != theirs:
        raise ValueError(f"generate: draft_model has vocab_size {ours}, the target {theirs}: "
                         f"speculative decoding needs one vocabulary")
    return draft_model, k


def _lookup(stepper, segments: list[list[list[int]]], lookup: tuple[int, int],
            max_new_tokens: int, eos, pad: int, device: torch.device,
            streamer: Callable[[Tensor], object] | None = None) -> Tensor:
    """Prompt-lookup greedy decoding: one lookup text (a list of segments) per row."""
    k, ngram = lookup
    cache = getattr(stepper, "cache", None)
    if cache is not None:
        check_truncatable(cache)
    if streamer is None:
        texts = [NgramIndex(ngram, segs) for segs in segments]
    else:
        columns = StreamColumns(len(segments), eos, pad, device, streamer)
        texts = [StreamedText(ngram, segs, columns, r) for r, segs in enumerate(segments)]
    eos = None if eos is None else torch.tensor(eos, dtype=torch.long, device=device)
    return prompt_lookup_greedy(stepper, texts, max_new_tokens, num_tokens=k, eos=eos,
                                pad=pad, device=device)


def _search(stepper, rows: int, num_beams: int, max_new_tokens: int, length_penalty: float,
            do_sample: bool, temperature: float, top_k, top_p, eos, pad: int, generator,
            device: torch.device, streamer=None, *, early_stopping: bool | str = False,
            processors: LogitsProcessors | None = None, prefix: Tensor | None = None
            ) -> Tensor:
    eos = None if eos is None else torch.tensor(eos, dtype=torch.long, device=device)
    if num_beams > 1:
        return beam_search(stepper, rows, num_beams, max_new_tokens,
                           length_penalty=length_penalty, eos=eos, pad=pad, device=device,
                           early_stopping=early_stopping, processors=processors,
                           prefix=prefix)
    return greedy_or_sample(stepper, rows, max_new_tokens, do_sample=do_sample,
                            temperature=temperature, top_k=top_k, top_p=top_p, eos=eos,
                            pad=pad, generator=generator, device=device, streamer=streamer,
                            processors=processors, prefix=prefix)


def _processors(procs: dict, vocab: int | None, prefix_length: int, max_new_tokens: int,
                eos: tuple[int, ...] | None, device: torch.device, lookup, draft
                ) -> LogitsProcessors | None:
    """The call's logits processors (None when none is on); ValueError where prompt lookup
    or speculative decoding would have to verify drafts against processed scores."""
    processors = make_processors(vocab=vocab, prefix_length=prefix_length,
                                 max_new_tokens=max_new_tokens, eos=eos, device=device, **procs)
    if processors is not None and (lookup is not None or draft is not None):
        on = ", ".join(f"{k}={v!r}" for k, v in procs.items() if v not in (None, False, 0))
        what = "prompt_lookup_num_tokens" if lookup is not None else "draft_model"
        raise ValueError(f"generate: {what} verifies drafts against the model's unprocessed "
                         f"scores and cannot be combined with logits processors ({on}); "
                         f"decode without {what}")
    return processors


def _generate_decoder(model, ids, attention_mask, max_new_tokens, num_beams, length_penalty,
                      do_sample, temperature, top_k, top_p, eos, pad, generator,
                      use_cache, lookup, draft=None, streamer=None, *,
                      early_stopping: bool | str = False, procs: dict | None = None) -> Tensor:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for name, val in (*(("eos_token_id", e) for e in eos or ()), ("pad_token_id", pad)):
            _token(name, val, vocab)
    pad = (eos[0] if eos is not None else 0) if pad is None else pad
    processors = _processors(procs or {}, vocab if isinstance(vocab, int) else None,
                             ids.shape[1], max_new_tokens, eos, ids.device, lookup, draft)
    with torch.inference_mode():
        keep = _gpt_keep(attention_mask, ids)
        batch, n = ids.shape
        max_len = getattr(config, "max_len", None)
        if getattr(config, "positions", None) == "learned" and isinstance(max_len, int):
            longest = n if keep is None else int(keep.sum(dim=1).max())
            if longest + max_new_tokens - 1 > max_len:
                raise ValueError(f"generate: a prompt of {longest} tokens + max_new_tokens="
                                 f"{max_new_tokens} needs {longest + max_new_tokens - 1} "
                                 f"positions, beyond the model's max_len={max_len}")
        rows_ids, rows_keep = ids, keep
        if num_beams > 1:
            rows_ids = ids.repeat_interleave(num_beams, dim=0)
            rows_keep = None if keep is None else keep.repeat_interleave(num_beams, dim=0)
        if draft is not None:  # builds its own two steppers
            new = speculative_generate(model, draft[0], ids, keep, max_new_tokens,
                                       num_tokens=draft[1], do_sample=do_sample,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       eos=eos, pad=pad, generator=generator)
            return torch.cat((ids, new), dim=1)
        if use_cache:  # the decode engine: the model's plan on the first backend that fits
            # (prompt lookup verifies k + 1 tokens per pass: a backend that feeds them in one)
            stepper = decoder_stepper(model, rows_ids, rows_keep, n + max_new_tokens,
                                      multi_token=lookup is not None)
        else:  # the whole sequence every step: the oracle
            stepper = GPTStepper(model, rows_ids, rows_keep, max_new_tokens, use_cache)
        if lookup is not None:
            real = ids.tolist() if keep is None else [
                row[k].tolist() for row, k in zip(ids, keep, strict=True)]
            new = _lookup(stepper, [[r] for r in real], lookup, max_new_tokens, eos, pad,
                          ids.device, streamer)
            return torch.cat((ids, new), dim=1)
        new = _search(stepper, batch, num_beams, max_new_tokens, length_penalty, do_sample,
                      temperature, top_k, top_p, eos, pad, generator, ids.device, streamer,
                      early_stopping=early_stopping, processors=processors, prefix=rows_ids)
        return torch.cat((ids, new), dim=1)


def _generate_seq2seq(model, src, attention_mask, max_new_tokens, num_beams, length_penalty,
                      do_sample, temperature, top_k, top_p, eos, pad, start, generator,
                      use_cache, lookup, streamer=None, *, early_stopping: bool | str = False,
                      procs: dict | None = None) -> Tensor:
    c = model.config
    eos = (c.eos_id,) if eos is None else eos
    pad = c.pad_id if pad is None else pad
    start = c.bos_id if start is None else start
    for name, val in (*(("eos_token_id", e) for e in eos), ("pad_token_id", pad),
                      ("decoder_start_token_id", start)):
        _token(name, val, c.tgt_vocab_size)
    if c.absolute_positions and max_new_tokens > c.max_len:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} needs decoder positions "
                         f"beyond the model's max_len={c.max_len}")
    processors = _processors(procs or {}, c.tgt_vocab_size, 1, max_new_tokens, eos,
                             src.device, lookup, None)
    with torch.inference_mode():
        src_mask = None if attention_mask is None else _check_mask(attention_mask, src)
        stepper = Seq2SeqStepper(model, src, src_mask, start, num_beams, max_new_tokens,
                                 use_cache)
        if lookup is not None:
            keep = src != c.pad_id if src_mask is None else src_mask
            segments = [[row[k].tolist(), [start]] for row, k in zip(src, keep, strict=True)]
            new = _lookup(stepper, segments, lookup, max_new_tokens, eos, pad, src.device,
                          streamer)
        else:
            prefix = torch.full((src.shape[0] * num_beams, 1), start, dtype=torch.long,
                                device=src.device)  # (R, 1) the decoder start token
            new = _search(stepper, src.shape[0], num_beams, max_new_tokens, length_penalty,
                          do_sample, temperature, top_k, top_p, eos, pad, generator,
                          src.device, streamer, early_stopping=early_stopping,
                          processors=processors, prefix=prefix)
        first = torch.full((src.shape[0], 1), start, dtype=torch.long, device=src.device)
        return torch.cat((first, new), dim=1)
