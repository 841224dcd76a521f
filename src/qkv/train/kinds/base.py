"""The seam between the trainer and a model kind: ``ModelKind`` and its registry.

A model kind ("transformer", "gpt", "bert-mlm", "clip", ...) is ONE object in one file of
``qkv.train.kinds``: where its data comes from, the model it builds, the batch a step feeds
it, the loss, the evaluation, how much memory a step needs and what a checkpoint holds.
The trainer, checkpoints, fine-tuning, ``TrainConfig`` and ``qkv train`` call the object and
never ask which kind it is. A new kind is a new file that subclasses ``ModelKind`` and is
registered (``register``) from ``qkv/train/kinds/__init__.py``.

Shapes: B batch (the rows of every tensor of a batch, dim 0, so that the trainer can cut a
rank's rows), N sequence length.

The life of a run, as the trainer calls the kind::

    kind = get_kind(config.model)
    kind.check_config(config)                                   # in TrainConfig, ConfigError
    data, tok, max_len, seq_len = kind.prepare_data(config)     # new run
    data = kind.load_data(config, tok, max_len)                 # resume (saved tokenizer)
    model = kind.build_model(config, tok, max_len); kind.check_model(model.config, tok, max_len)
    est = kind.estimate_memory(model, batch_size=B, seq_len=seq_len, eval_examples=...)
    batch = kind.make_batch(data.train(step * B, B), tok, step=step, seed=seed)
    for micro in split_batch(batch, K):                         # K = grad_accum (1: whole)
        total = all_reduce(sum of kind.loss_count(micro))      # known before any forward
        loss_sum, count = kind.loss(model, micro, label_smoothing=...)   # per rank
        (loss_sum * world / total).backward()                   # sync on the last only
    optimizer.step()
    kind.after_optimizer_step(model)
    metrics = kind.evaluate(model, tok, data, eval_examples)    # rank 0; under --fsdp
                                                                # every rank, unsharded
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from torch import Tensor, nn

from ...models import registry
from ..data import file_fingerprint
from ..errors import ConfigError
from ..memory import estimate_training_bytes

__all__ = ["KINDS", "ModelKind", "get_kind", "kind_of_model",
           "kind_of_model_type", "model_classes", "register"]


class ModelKind(abc.ABC):
    """One trainable model kind (see the module docstring). Subclasses set the class
    attributes and implement the abstract methods; the others have defaults.

    Attributes:
        name: ``TrainConfig.model`` ("gpt").
        default_preset: the model preset when ``TrainConfig.preset`` is None.
        model_class: the ``nn.Module`` class it trains (``load_run`` builds it).
        model_types: config.json ``model_type`` values it owns: qkv's own first, then
            foreign ones a base (``init_from``) may have ("gpt2").
        tasks: the embedded tasks only this kind trains (e.g. ("shapes",) for clip); None:
            the text tasks of ``qkv.data.TASKS``.
        data_what: what ``--data`` is for this kind (help and error messages).
        splits_batches: a step's batch may be cut into micro-batches (``--grad-accum``)
            with the same loss and gradients; False when the loss couples a batch's
            examples (a contrastive loss: the negatives would differ per micro-batch).
        reads_chat: trains on chat-formatted pairs (``TrainConfig.chat``; gpt:
            ``qkv.train.chat_data``); the others refuse ``chat``.
    """

    name: ClassVar[str]
    default_preset: ClassVar[str]
    model_class: ClassVar[type[nn.Module]]
    model_types: ClassVar[tuple[str, ...]]
    tasks: ClassVar[tuple[str, ...] | None] = None
    data_what: ClassVar[str] = "a file"
    splits_batches: ClassVar[bool] = True
    reads_chat: ClassVar[bool] = False

    # --- settings -------------------------------------------------------------------------
    def check_config(self, config: Any) -> None:
        """Refuse settings this kind cannot train (raise ``qkv.train.config.ConfigError``
        naming the field). Default: a task another kind owns (``tasks``), ``chat`` for a kind
        that does not read chat pairs (``reads_chat``) and ``grad_accum`` for one that does
        not split batches are refused."""
        if getattr(config, "grad_accum", 1) > 1 and not self.splits_batches:
            raise ConfigError("grad_accum", f"--model {self.name} cannot split a step's batch "
                                            f"into micro-batches (its loss couples the "
                                            f"batch's examples), got grad_accum "
                                            f"{config.grad_accum}; lower --batch-size instead")
        if getattr(config, "chat", False) and not self.reads_chat:
            chat = [k.name for k in KINDS.values() if k.reads_chat]
            raise ConfigError("chat", f"--model {self.name} does not train on chat-formatted "
                                      f"pairs; --chat is for --model {' / '.join(chat)}")
        task = config.task
        if task is None:
            return
        if self.tasks is not None:
            if task not in self.tasks:
                raise ConfigError("task", f"--model {self.name} trains on --task "
                                          f"{' / '.join(self.tasks)} or --data "
                                          f"({self.data_what}), got task {task!r}")
            return
        owner = next((k for k in KINDS.values() if k.tasks and task in k.tasks), None)
        if owner is not None:
            raise ConfigError("task", f"task {task!r} is trained by --model {owner.name}, "
                                      f"not --model {self.name}")

    # --- data -----------------------------------------------------------------------------
    @abc.abstractmethod
    def prepare_data(self, config: Any) -> tuple[Any, Any, int, int]:
        """A new run: ``(data, tokenizer, max_len, seq_len)``: the data (``train(start,
        count)`` gives the items of ``make_batch``, an endless deterministic stream;
        ``heldout(count)`` held-out items), a tokenizer fitted to it, the model's context
        length and the longest sequence a step holds (tokens; for the memory estimate).

        Raises ValueError naming the data when it cannot be trained on."""

    @abc.abstractmethod
    def load_data(self, config: Any, tokenizer: Any, max_len: int) -> Any:
        """The data of a run being resumed, with its saved tokenizer and context length."""

    def data_fingerprint(self, path: Any) -> dict[str, Any]:
        """``{"size", "sha256"}`` of the ``--data`` path, recorded in run.json so that a
        resume notices a changed file (default: the file's bytes)."""
        return file_fingerprint(path)

    # --- model ----------------------------------------------------------------------------
    @abc.abstractmethod
    def build_model(self, config: Any, tokenizer: Any, max_len: int) -> nn.Module:
        """The model of a new run: ``config.model_preset``, the sizes the tokenizer and the
        data need, then ``config.overrides`` (ValueError naming a bad field)."""

    def check_model(self, model_config: Any, tokenizer: Any, max_len: int) -> None:
        """Refuse a model config (after the user's overrides) that cannot take the tokenizer
        or the data (ValueError naming the ``--set`` field). Default: none."""
        return None

    def max_len_of(self, model: nn.Module) -> int:
        """The context length (tokens) of a loaded model (what ``load_data`` is given)."""
        return int(model.config.max_len)

    def estimate_memory(self, model: nn.Module, *, batch_size: int, seq_len: int,
                        eval_examples: int) -> Any:
        """A ``qkv.train.memory.MemoryEstimate`` of one step of ``batch_size`` examples on
        this process (``model`` best on the meta device). Default: the token model formula
        (``estimate_training_bytes``)."""
        return estimate_training_bytes(model, batch_size=batch_size, seq_len=seq_len,
                                       eval_examples=eval_examples)

    # --- one step -------------------------------------------------------------------------
    @abc.abstractmethod
    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        """Tensors of one batch from ``data.train(...)`` / ``data.heldout(...)`` items; every
        tensor has the B rows on dim 0. A pure function of ``items``, ``step`` and
        ``seed`` (random corruption, if any, is seeded by them)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, Tensor], *,
             label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        """``(loss_sum, count)``: a summed loss (a scalar, fp32) and the number of things it
        sums over (an int64 scalar), such that the training loss is ``sum over ranks of
        loss_sum / sum over ranks of count`` and the gradients of ``loss_sum · W / total
        count`` averaged over W ranks (DDP) are those of one process on the global batch."""

    def loss_count(self, batch: dict[str, Tensor]) -> Tensor:
        """The ``count`` that ``loss`` returns for ``batch``, known without running the model
        (an int64 scalar): gradient accumulation normalises every micro-batch by the count
        of the whole step before any forward. Default: not known (NotImplementedError)."""
        raise NotImplementedError(f"model kind {self.name!r} does not say what its loss "
                                  f"counts (ModelKind.loss_count)")

    def batch_tokens(self, batch: dict[str, Tensor], tokenizer: Any) -> int:
        """Tokens of a batch for the throughput metric (default: the non-pad ids of the
        ``src``, ``tgt_in`` and ``ids`` tensors)."""
        return sum(int((t != tokenizer.pad_id).sum()) for k, t in batch.items()
                   if k in ("src", "tgt_in", "ids"))

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Called after every optimizer step (e.g. clamp a parameter). Default: nothing."""
        return None

    # --- evaluation and checkpoints -------------------------------------------------------
    @abc.abstractmethod
    def evaluate(self, model: nn.Module, tokenizer: Any, data: Any,
                 count: int) -> dict[str, float]:
        """Metrics on ``count`` held-out examples (``eval_loss`` and the kind's own), in eval
        mode under ``torch.no_grad``; the model's training flag is restored. Runs on rank 0
        alone: it must not call collectives."""

    def checkpoint_files(self, model: nn.Module) -> dict[str, Any]:
        """Extra JSON files (name -> content) a checkpoint holds beside the model and the
        tokenizer (e.g. how images are preprocessed). Default: none."""
        return {}

    # --- fine-tuning ----------------------------------------------------------------------
    def prepare_base_data(self, config: Any, tokenizer: Any,
                          base_max_len: int | None) -> tuple[Any, int, int]:
        """``(data, max_len, seq_len)`` of a run that starts from a base (``init_from``)
        with ``tokenizer`` and context length ``base_max_len``."""
        raise ValueError(f"--model {self.name} cannot start from a base (--init-from)")

    def check_base(self, model: nn.Module, init_from: Any) -> None:
        """Refuse a loaded base this kind cannot train (ValueError). Default: none."""
        return None

    def check_base_tokenizer(self, model: nn.Module, tokenizer: Any, init_from: Any) -> None:
        """Refuse a base's tokenizer that does not fit the loaded base (CheckpointError /
        ValueError). Default: none."""
        return None

    def __repr__(self) -> str:
        return f"<model kind {self.name!r}>"


#: name -> kind, in registration order (``qkv.train.kinds`` registers the built-in ones)
KINDS: dict[str, ModelKind] = {}


def register(kind: ModelKind) -> ModelKind:
    """Add ``kind`` to the registry (its ``name`` must be new); returns it."""
    if not isinstance(kind, ModelKind):
        raise TypeError(f"kind must be a ModelKind, got {type(kind).__name__}")
    if kind.name in KINDS:
        raise ValueError(f"model kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> ModelKind:
    """The kind called ``name`` (ValueError listing the kinds otherwise)."""
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"model kind must be one of {tuple(KINDS)}, got {name!r}")
    return kind


def kind_of_model_type(model_type: Any) -> ModelKind | None:
    """The kind owning a config.json ``model_type`` ("qkv-gpt", "gpt2", ...), or None."""
    return next((k for k in KINDS.values() if model_type in k.model_types), None)


def kind_of_model(model: nn.Module) -> ModelKind:
    """The kind that trains ``model`` (an instance of its ``model_class``).

    Raises ValueError naming the class otherwise."""
    for kind in KINDS.values():
        if isinstance(model, kind.model_class):
            return kind
    names = ", ".join(k.model_class.__name__ for k in KINDS.values())
    raise ValueError(f"not a model qkv trains ({names}): {type(model).__name__}")


def model_classes() -> dict[str, type[nn.Module]]:
    """qkv's own config.json ``model_type`` -> model class, over every kind, as the one
    table of model types has it (``qkv.models.registry``; a kind's ``model_class`` names
    the same class)."""
    return {k.model_types[0]: registry.model_class(k.model_types[0]) for k in KINDS.values()}
