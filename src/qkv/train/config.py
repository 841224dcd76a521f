"""``TrainConfig``: every setting of a training run, stored as RUN/run.json so that
``qkv train --resume RUN`` continues exactly the same run. (``ConfigError``, which it raises
naming the field, is defined in ``qkv.train.errors``.)"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .errors import ConfigError
from .kinds import KINDS, get_kind
from .schedules import SCHEDULES

__all__ = ["BPE_MIN_VOCAB", "DEFAULT_PRESETS", "SEED_MAX", "TOKENIZERS", "ConfigError",
           "TrainConfig"]

TOKENIZERS = ("char", "bpe")
#: the smallest BPE vocabulary: 4 specials + the 256 byte tokens
BPE_MIN_VOCAB = 260
#: the largest seed (torch's generators take 64-bit seeds; derived seeds wrap modulo 2**64)
SEED_MAX = 2**63 - 1
#: (field, low, high, low open, high open) of the float settings; None: unbounded
_FLOAT_RANGES: tuple[tuple[str, float, float | None, bool, bool], ...] = (
    ("lr", 0.0, None, True, False),
    ("min_lr_ratio", 0.0, 1.0, False, False),
    ("weight_decay", 0.0, None, False, False),
    ("adam_eps", 0.0, None, True, False),
    ("label_smoothing", 0.0, 1.0, False, True),
    ("clip_norm", 0.0, None, False, False),
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: Any, low: float, high: float | None, low_open: bool,
              high_open: bool) -> bool:
    """A finite real number (not a bool) in the range; False for NaN, inf, strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value):
        return False
    if value < low or (low_open and value == low):
        return False
    return high is None or not (value > high or (high_open and value == high))


def _range_text(low: float, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
#: the model preset used when ``preset`` is None, per model kind (``qkv.train.kinds``)
DEFAULT_PRESETS = {name: kind.default_preset for name, kind in KINDS.items()}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (JSON-serialisable; ``from_dict`` rejects unknown keys).

    Args:
        model: "transformer" (encoder-decoder on pairs), "gpt" (language model; pairs become
            bos + source + eos + target + eos), "bert-mlm" (masked language model) or
            "clip" (contrastive image-text model on image-caption pairs); each is a model
            kind of ``qkv.train.kinds`` (``MODEL_KINDS``).
        preset: the model config preset (default per model: ``DEFAULT_PRESETS``);
        overrides: model config fields by name (``--set dim=256``), applied after the
            vocabulary size and context length qkv derives from the data.
        task: an embedded generated task ("dates", "copy", "reverse", "sort", "addition",
            "dates-long"; "shapes": synthetic image-caption pairs, clip only — clip trains
            on no text task), or
        data: a file: TSV source<TAB>target pairs, or plain text (gpt / bert-mlm only); for
            clip a folder of images with captions.tsv (``qkv.data.ImageFolderDataset``);
            with ``chat``, a TSV of input<TAB>output lines or a ``.jsonl`` of
            ``{"messages": [...]}`` conversations.
        chat: train a gpt on chat-formatted pairs of ``data`` (``qkv.train.chat_data``):
            each conversation rendered with the chat template of the base (``init_from``,
            needed), then the answer and the template's end-of-turn token; the loss counts
            the answer and that token only. Fixed for a run.
        tokenizer: "char" or "bpe" (trained on the data with the ``tokenizers`` library,
            ``bpe_vocab_size`` entries).
        steps: optimizer steps of the whole run. batch_size: examples per step (global,
            split across processes under torchrun).
        lr: peak learning rate; schedule "inverse_sqrt" (the paper's), "cosine" or
            "constant", after ``warmup`` linear warm-up steps; ``min_lr_ratio``: cosine's end.
        weight_decay, betas, adam_eps: AdamW (decay not applied to biases, norms, embeddings).
        label_smoothing: the paper's 0.1 by default (token kinds; clip's contrastive loss
            has none). clip_norm: global grad-norm clip (0: off).
        eval_every: steps between evaluations (and checkpoints); eval_examples: held-out
            examples per evaluation.
        max_len: longest sequence in tokens (text windows for language models; clip: the
            text tower's context); None: derived from the task or file.
        seed: model initialisation, dropout, data order and MLM corruption; 0..``SEED_MAX``.
        data_fingerprint: ``{"size": bytes, "sha256": hex}`` of ``data``, recorded by the
            ``Trainer`` when the run starts so that a resume notices a changed file (None for
            tasks, and in run.json files written before qkv recorded it).
        init_from: start from a trained base instead of a new model: a qkv run or checkpoint
            directory, or a HuggingFace GPT-2 / BERT directory ``qkv.models.from_hf`` loads
            (with a tokenizer.json qkv reads). The base fixes the architecture, tokenizer
            and max_len: ``preset`` and ``overrides`` are refused with it, ``tokenizer`` /
            ``bpe_vocab_size`` are not used, ``max_len`` may only narrow the base's;
            ``model`` must be the base's kind. Stored as an absolute path. See
            ``qkv.train.finetune``.
        peft: train only an adapter added to the base: ``{"kind": "lora", **LoraConfig
            fields}``, ``{"kind": "adapters", **AdapterConfig fields}`` or ``{"kind":
            "prefix", **PrefixConfig fields}`` (``qkv.peft``); stored with every field
            spelled out. Needs ``init_from`` (a frozen random model has nothing to adapt).
            None with ``init_from``: full fine-tuning. (Neither works with clip yet.)
        fsdp: shard parameters, gradients and optimizer state across the processes with
            FSDP2 (``qkv.train.sharding``) and write sharded (DCP) checkpoints that resume on
            any number of processes (``qkv.train.sharded_checkpoint``); also in one process.
            Fixed for a run (the checkpoint format).
        grad_accum: K micro-batches per optimizer step, run one after another with one
            gradient sync: each process's ``batch_size / processes`` rows are cut into K
            parts (``batch_size`` must divide by processes x K). The losses and gradients are
            those of the whole batch at once (up to summation order). May change on resume.
            Refused (> 1) by kinds whose loss couples a batch's examples (clip).
        activation_checkpointing: keep only each layer's input and recompute the layer in
            backward (non-reentrant ``torch.utils.checkpoint``): less memory, the same
            gradients, ~1/3 more compute. May change on resume.
        precision: "fp32", or "bf16" (parameters computed in bf16, fp32 master weights,
            optimizer state and gradient reductions; FSDP2's ``MixedPrecisionPolicy`` under
            ``fsdp``, ``torch.autocast`` otherwise). "fp16" is refused for training (it needs
            loss scaling, which qkv train does not apply). bf16 runs on CUDA, and on a CPU
            where it is native (``qkv.train.precision``: bf16 matmul instructions, and a
            probe finding bf16 matmuls no slower than fp32); on another CPU it is refused,
            with the probe's figures, unless forced (``Trainer(force_precision=True)``).
            Fixed for a run.

    Every number is checked when the config is made (finite, in range, the right type);
    ``ConfigError`` (a ``ValueError``) names the field and its value.
    """

    model: str = "transformer"
    preset: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    task: str | None = "dates"
    data: str | None = None
    chat: bool = False
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
    data_fingerprint: dict[str, Any] | None = None
    init_from: str | None = None
    peft: dict[str, Any] | None = None
    fsdp: bool = False
    grad_accum: int = 1
    activation_checkpointing: bool = False
    precision: str = "fp32"

    def __post_init__(self) -> None:
        def bad(name: str, what: str) -> ConfigError:
            return ConfigError(name, f"{name} must be {what}, got {getattr(self, name)!r}")

        if self.model not in KINDS:
            raise bad("model", f"one of {tuple(KINDS)}")
        if (self.task is None) == (self.data is None):
            raise ConfigError("task", "give exactly one of a task (--task) or a data file "
                                      "(--data)")
        for name in ("preset", "task", "data"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(name, "a string or None")
        if not isinstance(self.chat, bool):
            raise bad("chat", "true or false")
        if not isinstance(self.overrides, dict):
            raise bad("overrides", "a dict of model config fields")
        if self.tokenizer not in TOKENIZERS:
            raise bad("tokenizer", f"one of {TOKENIZERS}")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"one of {SCHEDULES}")
        for name in ("steps", "batch_size", "eval_every", "eval_examples"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "a positive integer")
        if not _is_int(self.bpe_vocab_size) or self.bpe_vocab_size < BPE_MIN_VOCAB:
            raise bad("bpe_vocab_size", f"an integer >= {BPE_MIN_VOCAB} (4 specials + 256 "
                                        f"bytes)")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise bad("warmup", "an integer >= 0")
        if self.max_len is not None and (not _is_int(self.max_len) or self.max_len < 2):
            raise bad("max_len", "an integer >= 2 (or None: derived from the data)")
        if not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX:
            raise bad("seed", f"an integer in 0..{SEED_MAX}")
        # floats: finite first, so that NaN never slips through a comparison
        for name, low, high, low_open, high_open in _FLOAT_RANGES:
            value = getattr(self, name)
            if not _in_range(value, low, high, low_open, high_open):
                raise bad(name, "a finite number " + _range_text(low, high, low_open, high_open))
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(_in_range(b, 0.0, 1.0, False, True) for b in betas)):
            raise bad("betas", "two finite numbers in [0, 1)")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        fp = self.data_fingerprint
        if fp is not None and not (
                isinstance(fp, dict) and set(fp) == {"size", "sha256"} and _is_int(fp["size"])
                and isinstance(fp["sha256"], str) and len(fp["sha256"]) == 64):
            raise bad("data_fingerprint", 'None or {"size": bytes, "sha256": 64 hex digits}')
        self._check_scale()
        self._check_finetune()
        get_kind(self.model).check_config(self)  # e.g. a task of another kind

    def _check_scale(self) -> None:
        from .sharding import PRECISIONS

        for name in ("fsdp", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"{name} must be true or false, got "
                                        f"{getattr(self, name)!r}")
        if not _is_int(self.grad_accum) or self.grad_accum < 1:
            raise ConfigError("grad_accum", f"grad_accum must be a positive integer, got "
                                            f"{self.grad_accum!r}")
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"grad_accum {self.grad_accum} does not divide "
                                            f"batch_size {self.batch_size} (each micro-batch "
                                            f"takes batch_size / (processes x grad_accum) "
                                            f"examples per process)")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", f"precision must be one of {tuple(PRECISIONS)}, "
                                           f"got {self.precision!r}")
        if self.precision == "fp16":
            raise ConfigError("precision", "precision 'fp16' needs loss scaling against "
                                           "gradient underflow, which qkv train does not "
                                           "apply: use 'bf16' (same memory, fp32's range)")
        if self.fsdp and self.peft is not None:
            raise ConfigError("fsdp", "fsdp with an adapter (peft) is not supported yet: its "
                                      "checkpoint holds the adapter only; train it without "
                                      "--fsdp")

    def _check_finetune(self) -> None:
        if self.init_from is not None and (not isinstance(self.init_from, str)
                                           or not self.init_from):
            raise ConfigError("init_from", f"init_from must be a directory path (a str) or "
                                           f"None, got {self.init_from!r}")
        if self.init_from is not None:
            given = [n for n in ("preset", "overrides") if getattr(self, n)]
            if given:
                raise ConfigError(given[0], f"{given[0]} {getattr(self, given[0])!r} cannot be "
                                            f"combined with init_from: the base "
                                            f"{self.init_from} fixes the architecture")
        if self.peft is None:
            return
        if self.init_from is None:
            raise ConfigError("peft", "peft needs init_from (a trained base): an adapter on a "
                                      "randomly initialised, frozen model has nothing to adapt")
        from .finetune import normalise_peft

        try:
            object.__setattr__(self, "peft", normalise_peft(self.peft))
        except ValueError as exc:
            raise ConfigError("peft", str(exc)) from None

    @property
    def model_preset(self) -> str:
        """``preset``, or the model kind's default."""
        return self.preset or get_kind(self.model).default_preset

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
