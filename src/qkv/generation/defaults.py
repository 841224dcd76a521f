"""The defaults of ``qkv.generate``'s decoding arguments: the model's generation settings
where they set one (a model ``qkv.models.from_pretrained`` loaded from an HF directory
carries its generation_config.json, else config.json's generation fields, as
``model.generation_settings``), else qkv's own. An argument the caller passes always wins,
as transformers' ``generate(**kwargs)`` updates its generation config with them.

``Default(value)`` marks an argument the caller left out (its repr is the plain default,
so ``help(qkv.generate)`` reads as usual); ``resolve_arguments`` turns the arguments into
the values a call decodes with, and ``describe_settings`` says which came from the file
(``explain`` and the CLI print it).

Shapes: N the prompts' padded width (decoder-only ``max_length`` counts it).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..models.generation_settings import GenerationSettings, read_generation_settings

__all__ = ["FROM_MODEL", "Default", "describe_settings", "model_settings",
           "resolve_arguments"]


class Default:
    """The default of a ``generate`` argument the caller did not pass: ``value`` unless the
    model's generation settings set that argument."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


class _FromModel:
    """``settings``' default: the model's own (``model.generation_settings``), if any."""

    def __repr__(self) -> str:
        return "model.generation_settings"


FROM_MODEL: Any = _FromModel()

def model_settings(model: nn.Module, settings: Any = FROM_MODEL) -> GenerationSettings | None:
    """The generation settings a call on ``model`` uses: ``settings`` (a
    ``GenerationSettings``, or a model directory to read them from), the model's own for
    ``FROM_MODEL`` (None when it carries none), None for None.

    Raises:
        TypeError: ``settings`` of another kind (or a model attribute that is not a
        ``GenerationSettings``). CheckpointError: a directory whose settings do not read."""
    if settings is FROM_MODEL:
        settings = getattr(model, "generation_settings", None)
    elif isinstance(settings, (str, os.PathLike)):
        settings = read_generation_settings(settings)
    if settings is not None and not isinstance(settings, GenerationSettings):
        raise TypeError(f"generate: settings must be a GenerationSettings, a model directory "
                        f"or None, got {type(settings).__name__}")
    return settings


def resolve_arguments(settings: GenerationSettings | None, arguments: dict[str, Any], *,
                      encoder_decoder: bool, prompt_length: int | None) -> dict[str, Any]:
    """The values of ``generate``'s settable arguments (those ``GenerationSettings
    .generate_kwargs`` may give) that a call decodes with.

    An argument passed (not a ``Default``) is taken as it is; else the settings' value
    (``settings.generate_kwargs``: HF's counts for ``max_length``; the sampling filters only
    when the call samples, with HF's ``top_k`` 50 where the file sets none), else the
    ``Default``'s. ``do_sample`` is decided first (the caller's, else the file's): a file's
    ``temperature`` / ``top_k`` / ``top_p`` apply only to a call that samples.

    Args:
        arguments: each settable name -> the caller's value or a ``Default``.
        encoder_decoder: True for a ``qkv.models.Transformer``.
        prompt_length: N (a decoder-only model's ``max_length`` counts its prompt), or None.

    Raises:
        ValueError: settings that cannot be honoured (``GenerationSettings.refused``); no
        ``max_new_tokens`` from the caller or the settings; the settings' ``max_length``
        leaves no new token; a call that samples where the file sets a
        sampling filter qkv does not implement (``GenerationSettings.sampling_filters``).
    """
    passed = {k: v for k, v in arguments.items() if not isinstance(v, Default)}
    from_file: dict[str, Any] = {}
    if settings is not None and settings.refused is not None:
        raise ValueError(f"generate: the model's generation settings cannot be honoured: "
                         f"{settings.refused}; pass settings=None to decode with qkv's "
                         f"defaults and your own arguments instead")
    if settings is not None and settings.source is not None:
        sample = passed.get("do_sample")
        from_file = settings.generate_kwargs(encoder_decoder, prompt_length=prompt_length,
                                             do_sample=sample)
        samples = sample if sample is not None else from_file.get("do_sample", False)
        if samples and settings.sampling_filters:
            raise ValueError(f"generate: sampling with {settings.source}'s "
                             f"{', '.join(settings.sampling_filters)} (set there, applied by "
                             f"transformers when sampling) is not supported by qkv; pass "
                             f"settings=None to decode without the file's settings")
    values = {name: value if name in passed else from_file.get(name, value.value)
              for name, value in arguments.items()}
    if values["max_new_tokens"] is None:
        where = (f"; {settings.source} sets neither max_new_tokens nor max_length "
                 f"(transformers would stop at its default max_length=20)"
                 if settings is not None and settings.source is not None else "")
        raise ValueError(f"generate: max_new_tokens is required{where}")
    return values


def describe_settings(settings: GenerationSettings | None, *, encoder_decoder: bool,
                      prompt_length: int | None = None) -> str:
    """One line: the decoding arguments the settings give a call that passes none of them
    (what ``qkv.generate`` takes from the file), or that there are none."""
    if settings is None or settings.source is None:
        return "settings: none (qkv's defaults)"
    if settings.refused is not None:
        return f"settings: cannot be honoured ({settings.refused}): generate refuses them"
    kw = settings.generate_kwargs(encoder_decoder, prompt_length=prompt_length)
    if not kw:
        return f"settings: {settings.source} (sets none of generate's arguments)"
    shown = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"settings: from {settings.source}: {shown} (arguments passed override them)"
