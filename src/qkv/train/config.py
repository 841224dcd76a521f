"""``TrainConfig``: every setting of a training run, stored as RUN/run.json so that
``qkv train --resume RUN`` continues exactly the same run."""

from __future__ import annotations

import dataclasses
from typing import Any

from .data import MODEL_KINDS
from .schedules import SCHEDULES

__all__ = ["DEFAULT_PRESETS", "TOKENIZERS", "TrainConfig"]

TOKENIZERS = ("char", "bpe")
#: the model preset used when ``preset`` is None
DEFAULT_PRESETS = {"transformer": "transformer-tiny", "gpt": "gpt-tiny", "bert-mlm": "bert-tiny"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (JSON-serialisable; ``from_dict`` rejects unknown keys).

    Args:
        model: "transformer" (encoder-decoder on pairs), "gpt" (language model; pairs become
            bos + source + eos + target + eos) or "bert-mlm" (masked language model).
        preset: the model config preset (default per model: ``DEFAULT_PRESETS``);
        overrides: model config fields by name (``--set dim=256``), applied after the
            vocabulary size and context length qkv derives from the data.
        task: an embedded generated task ("dates", "copy", "reverse", "sort", "addition"), or
        data: a file: TSV source<TAB>target pairs, or plain text (gpt / bert-mlm only).
        tokenizer: "char" or "bpe" (trained on the data with the ``tokenizers`` library,
            ``bpe_vocab_size`` entries).
        steps: optimizer steps of the whole run. batch_size: examples per step (global,
            split across processes under torchrun).
        lr: peak learning rate; schedule "inverse_sqrt" (the paper's), "cosine" or
            "constant", after ``warmup`` linear warm-up steps; ``min_lr_ratio``: cosine's end.
        weight_decay, betas, adam_eps: AdamW (decay not applied to biases, norms, embeddings).
        label_smoothing: the paper's 0.1 by default. clip_norm: global grad-norm clip (0: off).
        eval_every: steps between evaluations (and checkpoints); eval_examples: held-out
            examples per evaluation.
        max_len: longest sequence in tokens (text windows for language models); None: derived
            from the task or file.
        seed: model initialisation, dropout, data order and MLM corruption.
    """

    model: str = "transformer"
    preset: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    task: str | None = "dates"
    data: str | None = None
    tokenizer: str = "char"
    bpe_vocab_size: int = 1000
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    schedule: str = "inverse_sqrt"
    warmup: int = 100
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 200
    eval_examples: int = 200
    max_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODEL_KINDS:
            raise ValueError(f"model must be one of {MODEL_KINDS}, got {self.model!r}")
        if (self.task is None) == (self.data is None):
            raise ValueError("give exactly one of a task (--task) or a data file (--data)")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_examples", "bpe_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.clip_norm < 0:
            raise ValueError(f"clip_norm must be >= 0 (0: no clipping), got {self.clip_norm}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    @property
    def model_preset(self) -> str:
        """``preset``, or the model kind's default."""
        return self.preset or DEFAULT_PRESETS[self.model]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (run.json)."""
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of ``to_dict``; unknown keys are errors (a run.json from elsewhere)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}")
        return cls(**data)
