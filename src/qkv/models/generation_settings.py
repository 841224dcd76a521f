"""A checkpoint's generation settings, read as transformers reads them, for ``qkv.generate``.
``qkv.models.from_pretrained`` keeps those of an HF directory on the model it loads
(``model.generation_settings``), and ``qkv.generate`` takes them as its defaults.

``read_generation_settings(directory)`` reads ``generation_config.json``; where a directory
has none, the generation fields of ``config.json`` (older checkpoints, e.g. BART's: what
transformers 5.x falls back to, ``GenerationConfig.from_pretrained(directory,
config_file_name="config.json")``, top-level fields only). ``GenerationSettings
.generate_kwargs`` turns them into ``qkv.generate``'s keyword arguments, with HF's defaults
and counts (HF's ``max_length`` counts the decoder start token of an encoder-decoder and the
prompt of a decoder-only model; ``max_new_tokens`` does not).

Every field transformers' ``GenerationConfig`` knows falls in one of three groups:

- honoured (``GenerationSettings``' fields, passed to ``generate``);
- without effect on the tokens (caching, compilation, assisted-decoding speed knobs, what
  ``generate`` returns besides the tokens, file metadata): ignored;
- not implemented by qkv (repetition penalties, other sampling filters, diverse or
  constrained beam search, ...): accepted at its neutral value (``null``, or the value that
  turns it off; a sampling filter also whenever ``do_sample`` is not true), a
  ``CheckpointError`` otherwise, since it would change the output.

A field transformers does not know is ignored with a one-line warning naming it and the file
(transformers keeps it as an unused attribute); in config.json, whose other fields describe
the model, only the generation fields are read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any

from ..files import CheckpointError, read_json

__all__ = ["GenerationSettings", "read_generation_settings", "settings_of_directory"]

_FILE = "generation_config.json"
_HF_TOP_K = 50  # transformers' default top_k when sampling (GenerationConfig defaults)

#: Fields read but without effect on the tokens qkv generates.
_NO_EFFECT = frozenset({
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config",
    "disable_compile", "prompt_lookup_num_tokens", "max_matching_ngram_size",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "assistant_early_exit",
    "assistant_ensemble_weight", "speculation_type", "is_assistant", "low_memory",
    "prefill_chunk_size", "continuous_batching_config", "use_mtp", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "transformers_version", "_from_model_config", "_commit_hash"})

#: Unimplemented sampling filters: without effect unless do_sample is true (HF's warpers).
_SAMPLING_ONLY = frozenset({"typical_p", "min_p", "top_h", "epsilon_cutoff", "eta_cutoff"})


def _cutoff_off(v: Any) -> bool:  # HF applies epsilon/eta cutoffs only for 0 < v < 1
    return _number(v) and not 0.0 < v < 1.0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: Fields qkv does not implement -> whether a (non-null) value is neutral (turns it off).
_UNSUPPORTED: dict[str, Any] = {
    "repetition_penalty": lambda v: _number(v) and v == 1.0,
    "encoder_repetition_penalty": lambda v: _number(v) and v == 1.0,
    "encoder_no_repeat_ngram_size": lambda v: _number(v) and v == 0,
    "typical_p": lambda v: _number(v) and v >= 1.0,
    "min_p": lambda v: False,
    "top_h": lambda v: False,
    "epsilon_cutoff": _cutoff_off,
    "eta_cutoff": _cutoff_off,
    "diversity_penalty": lambda v: _number(v) and v == 0.0,
    "num_beam_groups": lambda v: _number(v) and v == 1,
    "penalty_alpha": lambda v: _number(v) and v == 0.0,
    "dola_layers": lambda v: False,
    "constraints": lambda v: False,
    "force_words_ids": lambda v: False,
    "sequence_bias": lambda v: False,
    "suppress_tokens": lambda v: v == [],
    "begin_suppress_tokens": lambda v: v == [],
    "exponential_decay_length_penalty": lambda v: False,
    "guidance_scale": lambda v: _number(v) and v == 1.0,
    "remove_invalid_values": lambda v: v is False,
    "watermarking_config": lambda v: False,
    "num_return_sequences": lambda v: _number(v) and v == 1,
    "stop_strings": lambda v: v == [],
    "max_time": lambda v: False,
    "token_healing": lambda v: v is False,
}


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """The honoured generation fields of a checkpoint (each None where the file leaves it
    unset), as ``read_generation_settings`` read them.

    Args:
        source: the file read (generation_config.json, else config.json), None if neither.
        num_beams: K >= 1.
        max_length: HF's total length (see ``generate_kwargs``); max_new_tokens: T >= 1
            (takes precedence, as in HF).
        min_length, min_new_tokens, no_repeat_ngram_size: counts >= 0.
        length_penalty: a finite number. early_stopping: True, False or "never".
        bad_words_ids: token-id sequences. forced_bos_token_id: one id.
        forced_eos_token_id, eos_token_id: one id or several (a tuple).
        renormalize_logits, do_sample: bools. temperature, top_p: finite numbers; top_k: an
            int >= 0 (0: off).
        pad_token_id, bos_token_id, decoder_start_token_id: one id each.
        refused: why the file cannot be honoured (``settings_of_directory`` keeps the
            error instead of raising it: ``qkv.generate`` raises it when it would use these
            settings), None when it can.
        sampling_filters: the file's sampling filters qkv does not implement, set to a value
            that filters (``typical_p``, ``min_p``, ...), which the file's own
            ``do_sample`` (not true) leaves off: a call that turns sampling on is refused
            (``qkv.generate``), since transformers would then apply them.
    """

    source: Path | None = None
    num_beams: int | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    renormalize_logits: bool | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    decoder_start_token_id: int | None = None
    sampling_filters: tuple[str, ...] = ()
    refused: str | None = None

    def generate_kwargs(self, encoder_decoder: bool, *, prompt_length: int | None = None,
                        do_sample: bool | None = None) -> dict[str, Any]:
        """``qkv.generate``'s keyword arguments for these settings, as HF's ``generate``
        applies them with no arguments of its own: the fields that are set, plus

        - ``max_new_tokens``: the file's, else from ``max_length`` as HF counts it: ``max_length
          - 1`` for an encoder-decoder (its decoder start token counts), ``max_length -
          prompt_length`` for a decoder-only model (its prompt's padded width N counts; left
          out without ``prompt_length``); absent when the file sets neither (HF would then
          generate its library default of 20; qkv asks the caller);
        - ``decoder_start_token_id`` (encoder-decoder only; else left out): the file's, else
          its ``bos_token_id`` (HF's fallback);
        - the sampling arguments only where sampling is on (``do_sample``, else the
          file's): ``temperature`` and ``top_p`` where they filter, ``top_k`` = the file's
          (0: off), else HF's default 50.

        Args:
            encoder_decoder: True for a ``qkv.models.Transformer``.
            prompt_length: N, the prompts' padded width (decoder-only with ``max_length``).
            do_sample: whether the call samples when the caller decided it (its argument
                over the file's ``do_sample``); None: the file's.

        Raises:
            ValueError: ``max_length`` leaves no new token (a prompt as long as it).
        """
        kw: dict[str, Any] = {}
        new = self.max_new_tokens
        if new is None and self.max_length is not None:
            before = 1 if encoder_decoder else prompt_length
            if before is not None:
                new = self.max_length - before
                if new < 1:
                    what = ("the decoder start token" if encoder_decoder
                            else f"a prompt of {prompt_length} tokens")
                    raise ValueError(f"{self.source}: max_length={self.max_length} leaves no "
                                     f"new token after {what}")
        if new is not None:
            kw["max_new_tokens"] = new
        for name in ("num_beams", "min_length", "min_new_tokens", "length_penalty",
                     "early_stopping", "no_repeat_ngram_size", "forced_bos_token_id",
                     "renormalize_logits", "pad_token_id"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        for name in ("eos_token_id", "forced_eos_token_id"):
            if getattr(self, name) is not None:
                kw[name] = list(getattr(self, name))
        if self.bad_words_ids is not None:
            kw["bad_words_ids"] = [list(w) for w in self.bad_words_ids]
        start = (self.decoder_start_token_id if self.decoder_start_token_id is not None
                 else self.bos_token_id)
        if encoder_decoder and start is not None:
            kw["decoder_start_token_id"] = start
        if self.do_sample is not None:
            kw["do_sample"] = self.do_sample
        if do_sample if do_sample is not None else self.do_sample:
            if self.temperature is not None and self.temperature != 1.0:
                kw["temperature"] = self.temperature
            top_k = _HF_TOP_K if self.top_k is None else self.top_k
            if top_k > 0:
                kw["top_k"] = top_k
            if self.top_p is not None and self.top_p < 1.0:
                kw["top_p"] = self.top_p
        return kw


_HONOURED = frozenset(f.name for f in dataclasses.fields(GenerationSettings)) - {
    "source", "sampling_filters", "refused"}


def read_generation_settings(directory: str | os.PathLike) -> GenerationSettings:
    """The generation settings of a model directory: ``generation_config.json``, else
    ``config.json``'s generation fields (module docstring); all None when neither exists.

    Raises:
        CheckpointError (one line, naming the file and the field): a malformed value (a
        count that is not an int >= 0, an id that is not an int >= 0, an ``early_stopping``
        other than true/false/"never", ...), a field qkv does not implement set to a value
        that is not neutral, or ``do_sample`` with ``num_beams`` > 1 (beam sampling).

    Warns:
        UserWarning: a field of generation_config.json that transformers does not know (it is
        ignored).
    """
    directory = Path(directory)
    path, model_config = directory / _FILE, False
    if not path.exists():
        path, model_config = directory / "config.json", True
        if not path.exists():
            return GenerationSettings()
    data = read_json(path)
    sampling = data.get("do_sample") is True  # the other sampling filters act only then
    values: dict[str, Any] = {}
    filters: list[str] = []
    for name, value in data.items():
        if name in _HONOURED:
            if value is not None:
                values[name] = _parse(path, name, value)
        elif name in _UNSUPPORTED:
            if name in _SAMPLING_ONLY and not sampling:
                if value is not None and not _UNSUPPORTED[name](value):
                    filters.append(name)
                continue
            if value is not None and not _UNSUPPORTED[name](value):
                raise CheckpointError(f"{path}: {name}={value!r:.60} is not supported by qkv "
                                      f"(it would change the output); only its neutral value "
                                      f"or null is accepted")
        elif name in _NO_EFFECT or model_config:
            continue
        else:
            warnings.warn(f"{path}: unknown generation field {name!r} ignored", stacklevel=2)
    settings = GenerationSettings(source=path, sampling_filters=tuple(filters), **values)
    _check_sampling(path, settings)
    return settings


def settings_of_directory(directory: str | os.PathLike) -> GenerationSettings:
    """``read_generation_settings(directory)``, except that a file qkv cannot honour (a
    field it does not implement set to a value that is not neutral, a malformed value) is
    kept as ``GenerationSettings(source=file, refused=the error)`` instead of raised: the
    model loads (``qkv.models.from_pretrained``), and ``qkv.generate`` refuses to decode
    with these settings, naming the field, unless the call passes ``settings=None``."""
    try:
        return read_generation_settings(directory)
    except CheckpointError as exc:
        path = Path(directory) / _FILE
        source = path if path.exists() else Path(directory) / "config.json"
        return GenerationSettings(source=source, refused=str(exc))


def _check_sampling(path: Path, s: GenerationSettings) -> None:
    if not s.do_sample:
        return
    if s.num_beams is not None and s.num_beams > 1:
        raise CheckpointError(f"{path}: do_sample=true with num_beams={s.num_beams} (beam "
                              f"sampling) is not supported by qkv")
    if s.temperature is not None and s.temperature <= 0:
        raise CheckpointError(f"{path}: temperature must be > 0 when sampling, got "
                              f"{s.temperature!r}")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise CheckpointError(f"{path}: top_p must be in (0, 1] when sampling, got {s.top_p!r}")


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _ids(v: Any) -> tuple[int, ...] | None:
    if _is_id(v):
        return (v,)
    if isinstance(v, list) and v and all(_is_id(i) for i in v):
        return tuple(v)
    return None


_COUNTS = {"num_beams": 1, "max_length": 1, "max_new_tokens": 1, "min_length": 0,
           "min_new_tokens": 0, "no_repeat_ngram_size": 0, "top_k": 0}


def _parse(path: Path, name: str, v: Any) -> Any:
    """An honoured field's value, checked; CheckpointError naming file and field."""
    want = None
    if name in _COUNTS:
        if isinstance(v, int) and not isinstance(v, bool) and v >= _COUNTS[name]:
            return v
        want = f"an int >= {_COUNTS[name]}"
    elif name in ("length_penalty", "temperature", "top_p"):
        if _number(v):
            return float(v)
        want = "a finite number"
    elif name in ("do_sample", "renormalize_logits"):
        if isinstance(v, bool):
            return v
        want = "true or false"
    elif name == "early_stopping":
        if isinstance(v, bool) or v == "never":
            return v
        want = 'true, false or "never"'
    elif name in ("eos_token_id", "forced_eos_token_id"):
        if _ids(v) is not None:
            return _ids(v)
        want = "a token id >= 0 or a non-empty list of them"
    elif name == "bad_words_ids":
        if isinstance(v, list) and v and all(_ids(w) is not None and isinstance(w, list)
                                             for w in v):
            return tuple(tuple(w) for w in v)
        want = "a non-empty list of non-empty lists of token ids"
    else:  # pad_token_id, bos_token_id, decoder_start_token_id, forced_bos_token_id
        if _is_id(v):
            return v
        want = "a token id >= 0"
    raise CheckpointError(f"{path}: {name} must be {want} or null, got {v!r:.60}")
