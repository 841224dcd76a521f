"""Training: ``Trainer`` (the loop behind ``qkv train`` / ``qkv demo``), ``TrainConfig``,
learning-rate schedules, atomic safetensors + JSON checkpoints, ``load_run`` for a run
directory, and data parallelism under torchrun. What differs between model kinds
(transformer, gpt, bert-mlm, clip: data, model, batch, loss, evaluation) is one object per
kind in ``qkv.train.kinds`` (``get_kind(name)``), which the trainer calls.

Public names: ``Trainer``, ``TrainConfig``, ``TrainingError``, ``load_run``,
``find_checkpoint``, ``save_checkpoint``, ``load_trainer_state``, ``lr_multiplier``,
``SCHEDULES``, ``exact_match``, ``build_model``, ``RunDirLock`` / ``RunDirBusyError`` (one
writer per run directory). (Decoding strings with a trained model:
``qkv.generation.translate`` / ``complete``.)
"""

from .checkpoint import find_checkpoint, load_run, load_trainer_state, save_checkpoint
from .config import TrainConfig
from .evaluate import exact_match
from .rundir import RunDirBusyError, RunDirLock
from .schedules import SCHEDULES, lr_multiplier
from .trainer import Trainer, TrainingError, build_model

__all__ = ["SCHEDULES", "RunDirBusyError", "RunDirLock", "TrainConfig", "Trainer",
           "TrainingError", "build_model", "exact_match", "find_checkpoint", "load_run",
           "load_trainer_state", "lr_multiplier", "save_checkpoint"]
