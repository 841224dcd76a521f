"""Training: ``Trainer`` (the loop behind ``qkv train`` / ``qkv demo``), ``TrainConfig``,
learning-rate schedules, atomic safetensors + JSON checkpoints, ``load_run`` for a run
directory, and data parallelism under torchrun. What differs between model kinds
(transformer, gpt, bert-mlm, clip: data, model, batch, loss, evaluation) is one object per
kind in ``qkv.train.kinds`` (``get_kind(name)``), which the trainer calls.

Public names: ``Trainer``, ``TrainConfig``, ``TrainingError``, ``load_run``,
``find_checkpoint``, ``save_checkpoint``, ``load_trainer_state``, ``lr_multiplier``,
``SCHEDULES``, ``exact_match``, ``build_model``, ``RunDirLock`` / ``RunDirBusyError`` (one
writer per run directory). (Decoding strings with a trained model:
``qkv.generation.translate`` / ``complete``.) Importing it registers the readers of the
checkpoints only training writes — sharded (``--fsdp``: sharded.json) and adapter runs
(adapter_config.json) — with ``qkv.models.from_pretrained``.
"""

from ..files import ADAPTER_MARK, FSDP_MARK
from ..models.registry import register_directory_reader
from .checkpoint import find_checkpoint, load_run, load_trainer_state, save_checkpoint
from .config import TrainConfig
from .evaluate import exact_match
from .finetune import read_adapter_run
from .rundir import RunDirBusyError, RunDirLock
from .schedules import SCHEDULES, lr_multiplier
from .sharded_checkpoint import read_sharded_checkpoint
from .trainer import Trainer, TrainingError, build_model

# the checkpoints only qkv.train can read, through qkv.models.from_pretrained (and load_run)
register_directory_reader(FSDP_MARK, read_sharded_checkpoint)
register_directory_reader(ADAPTER_MARK, read_adapter_run)

__all__ = ["SCHEDULES", "RunDirBusyError", "RunDirLock", "TrainConfig", "Trainer",
           "TrainingError", "build_model", "exact_match", "find_checkpoint", "load_run",
           "load_trainer_state", "lr_multiplier", "save_checkpoint"]
