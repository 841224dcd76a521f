"""Training: ``Trainer`` (the loop behind ``qkv train`` / ``qkv demo``), ``TrainConfig``,
learning-rate schedules, atomic safetensors + JSON checkpoints, ``load_run`` for a run
directory, and data parallelism under torchrun.

Public names: ``Trainer``, ``TrainConfig``, ``TrainingError``, ``load_run``,
``find_checkpoint``, ``save_checkpoint``, ``load_trainer_state``, ``lr_multiplier``,
``SCHEDULES``, ``translate``, ``complete``, ``exact_match``, ``build_model``.
"""

from .checkpoint import find_checkpoint, load_run, load_trainer_state, save_checkpoint
from .config import TrainConfig
from .evaluate import complete, exact_match, translate
from .schedules import SCHEDULES, lr_multiplier
from .trainer import Trainer, TrainingError, build_model

__all__ = ["SCHEDULES", "TrainConfig", "Trainer", "TrainingError", "build_model", "complete",
           "exact_match", "find_checkpoint", "load_run", "load_trainer_state", "lr_multiplier",
           "save_checkpoint", "translate"]
