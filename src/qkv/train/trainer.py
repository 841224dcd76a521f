"""The training loop behind ``qkv train`` and ``qkv demo``.

``Trainer(config, out_dir).run()`` trains a model of one of the kinds of ``qkv.train.kinds``
(Transformer, GPT, BERT on a task or file; CLIP on image-caption pairs), logs
each step to RUN/metrics.jsonl, evaluates and checkpoints every ``eval_every`` steps (see
``qkv.train.checkpoint`` for the run-directory layout), and stops with ``TrainingError`` on
a non-finite loss or gradient. ``Trainer.resume(out_dir, steps=M)`` continues a run so that
its losses and final weights are bit-identical (CPU) to an uninterrupted run of M steps.

Scale (``TrainConfig``): ``fsdp`` shards the model, its gradients and the optimizer state
over the processes with FSDP2 (``qkv.train.sharding.shard_model``, after the model is on its
device and before the optimizer is built), evaluates on every rank with the parameters
gathered (``unsharded``) and writes DCP sharded checkpoints from every rank
(``qkv.train.sharded_checkpoint``) that resume on any number of processes; without it,
several processes use DDP. ``grad_accum`` runs a step as K micro-batches with one gradient
sync (``accumulate_gradients``), ``activation_checkpointing`` recomputes each layer in
backward, ``precision`` bf16 computes in bf16 on CUDA and on CPUs with native bf16 (FSDP2's
mixed-precision policy, or ``torch.autocast`` without ``fsdp``). ``fsdp`` and ``precision``
are fixed for a run; ``grad_accum`` and ``activation_checkpointing`` may change on resume.

Stopping: Ctrl-C (SIGINT) or SIGTERM (what ``kill``, a job scheduler or torchrun send) while
a Trainer is set up or runs ends it the same way: ``RunInterrupted`` (a ``KeyboardInterrupt``)
saying at which step and naming the last checkpoint, after the same clean-up (the lock
released, the process group left). SIGTERM is turned into that exception only in the main
thread and only where its handler is the default one (which would end the process with no
clean-up); the previous handler is back when the Trainer's call returns.

A run directory has one writer at a time: the Trainer holds ``qkv.train.rundir.RunDirLock``
from before its first write until ``run()`` ends. Everything that can be checked is checked
before anything is written (settings, model config against tokenizer and data, memory,
run.json against the checkpoint, the data file's fingerprint): a refusal leaves no trace.

The trainer never asks which kind it trains: data, model, batch, loss, evaluation, memory
estimate and what follows an optimizer step come from the kind object
(``qkv.train.kinds.get_kind(config.model)``). Beside this loop: ``qkv.train.step`` (one
optimizer step: objective, placement over the processes, optimizer, batch rows, precision),
``qkv.train.rundir`` (the run directory claimed on every rank, and what a run writes first)
and ``qkv.train.resume`` (every check and load of a resume, one call: ``open_run``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .begin import RunStart, begin_run
from .checkpoint import save_checkpoint
from .config import TrainConfig
from .distributed import (
    TIMEOUT_ENV,
    barrier,
    resolve_device,
    setup_world,
    teardown_world,
)
from .kinds import get_kind
from .resume import Resumed, open_run, resumed_config
from .rundir import METRICS, NullLog, RunDirClaim, RunDirLock
from .sharded_checkpoint import save_sharded_checkpoint
from .sharding import apply_activation_checkpointing, precision_policy, unsharded
from .step import (
    Objective,
    TrainingError,
    build_optimizer,
    collective_failure,
    forward,
    optimizer_step,
    place_model,
    rank_batch,
    step_lr,
)

__all__ = ["RunInterrupted", "Trainer", "TrainingError", "build_model"]


class RunInterrupted(KeyboardInterrupt):
    """A Trainer stopped by Ctrl-C (SIGINT) or SIGTERM, after its clean-up (lock released,
    process group left). ``str()`` is one line: the signal, the step, the last checkpoint
    (or that none was written) and how to continue; ``signum`` is the signal's number
    (``128 + signum`` is the conventional exit status)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class _Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM while ``_sigterm_interrupts`` is in force."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While in force (main thread only), SIGTERM raises ``_Terminated`` — a
    ``KeyboardInterrupt``, so the clean-up Ctrl-C gets runs (``finally`` blocks, the lock
    released) instead of the process ending on the spot with ``.lock`` left behind. Only
    where SIGTERM's handler is the default: a handler of the caller's own (or SIG_IGN) is
    left alone. A second SIGTERM while the first is handled ends the process as by default.
    The previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM: end at once
        raise _Terminated()

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_of(interrupt: KeyboardInterrupt) -> int:
    if isinstance(interrupt, RunInterrupted):
        return interrupt.signum
    return int(signal.SIGTERM if isinstance(interrupt, _Terminated) else signal.SIGINT)


class _Vocabulary:
    """What ``build_model`` knows of a tokenizer: its size and qkv's special ids."""

    bos_id, eos_id, unk_id = 1, 2, 3

    def __init__(self, vocab_size: int, pad_id: int) -> None:
        self.vocab_size, self.pad_id = vocab_size, pad_id


def build_model(config: TrainConfig, vocab_size: int, max_len: int, pad_id: int) -> nn.Module:
    """The model of a run: the config's preset, the vocabulary and context length derived
    from the data, then the user's ``overrides`` (``ModelKind.build_model`` of
    ``config.model``, for a tokenizer of ``vocab_size`` ids with qkv's special ids)."""
    return get_kind(config.model).build_model(config, _Vocabulary(vocab_size, pad_id), max_len)


class Trainer:
    """One training run (see the module docstring).

    Args:
        config: the ``TrainConfig``.
        out_dir: the run directory (created; must not already hold a run unless resuming —
            a directory whose run stopped before its first checkpoint may be started over).
        progress: show a progress bar (rank 0 only).
        log: a function taking one line of text (rank 0 only; default: print).
        device: "cpu" (default), "cuda", "cuda:N" or "auto" (CUDA when available); under
            torchrun "cuda" means each rank's ``cuda:LOCAL_RANK`` and the backend is nccl.
        lock: a ``qkv.train.rundir.RunDirLock`` on ``out_dir`` the caller already holds (e.g.
            a demo that writes more files after training); the Trainer then neither takes nor
            releases the lock. Default: the Trainer takes it (rank 0) and releases it when
            ``run()`` ends, on ``close()``, or when refused.
        force_precision: train in ``config.precision`` bf16 on a CPU where bf16 is not
            native (``qkv.train.precision``; refused otherwise, with the measured bf16 and
            fp32 matmul speeds, before anything is written).

    Build with ``Trainer(config, out)`` for a new run or ``Trainer.resume(out, steps=M)``.
    ``run()`` trains up to ``config.steps`` and returns the final evaluation; it leaves the
    process group it joined, and sets ``group_outlives_run`` when the group could not be
    freed (a sharded model: gloo's threads then run on, and a process that exits through the
    interpreter's shutdown may abort; end it with ``os._exit`` as ``qkv train`` does, see
    ``qkv.train.distributed``).

    Before anything is written, a new run checks everything it can: the settings (in
    ``TrainConfig``), the data, the model config against the tokenizer and the data's lengths,
    and that one step fits in memory (``qkv.train.memory``); only then is the directory
    created and locked. A resume takes the lock first, then checks that run.json agrees with
    the checkpoint's copy and that the data file is unchanged (``accept_changed_data``), and
    only then rewrites run.json. Whatever is refused leaves the directory as it was.

    Training is fp32 (or bf16 compute with fp32 master weights: ``precision``), on one
    device per process; checkpoints are device-independent (the CPU RNG state, and the CUDA
    one when training on CUDA, are saved with them).

    The run owns torch's global RNG (what dropout draws from): a new run seeds it with
    ``config.seed``, a resumed one restores the checkpoint's state, and neither restores the
    caller's state afterwards. Under torchrun every rank starts from the same seed (the
    checkpoint holds rank 0's RNG state, so a resumed run stays bit-identical).
    """

    def __init__(self, config: TrainConfig, out_dir: str | Path, *, progress: bool = True,
                 log: Any = print, device: str | torch.device | None = "cpu",
                 lock: RunDirLock | None = None, force_precision: bool = False,
                 _resume: bool = False, _accept_changed_data: bool = False) -> None:
        self.config, self.out = config, Path(out_dir)
        self.kind = get_kind(config.model)
        self.progress, self.log = progress, log
        if lock is not None and (not lock.held or lock.run_dir.resolve() != self.out.resolve()):
            raise ValueError(f"lock must be a held RunDirLock on {self.out}, got {lock!r}")
        self.device = resolve_device(device)
        # refused before anything else (and before any process group): bf16 on a CPU
        # without native bf16 (probed once per process)
        self._policy = precision_policy(config.precision, self.device, force=force_precision)
        self._force_precision = force_precision
        #: set by run(): a process group whose gloo threads outlive it (see teardown_world)
        self.group_outlives_run = False
        self.world = setup_world(self.device, group=config.fsdp)
        self._claim = RunDirClaim(self.out, self.world, lock=lock, log=log)
        try:
            with _sigterm_interrupts():
                self._setup(config, _resume, _accept_changed_data)
        except BaseException as exc:
            self._claim.release()  # a refused run holds no lock and leaves no process group open
            teardown_world(self.world, clean=False)
            if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, RunInterrupted):
                signum = _signal_of(exc)
                raise RunInterrupted(
                    f"interrupted by {signal.Signals(signum).name} while setting up the run "
                    f"in {self.out}, before training began", signum) from None
            raise

    def close(self) -> None:
        """Release the run-directory lock if this Trainer took it (``run()`` does this when it
        ends); idempotent."""
        self._claim.release()

    # --- setting up ---------------------------------------------------------------------------
    def _setup(self, config: TrainConfig, _resume: bool, accept_changed_data: bool) -> None:
        if config.batch_size % self.world.size:
            raise ValueError(f"batch_size {config.batch_size} is not divisible by the "
                             f"{self.world.size} processes")
        if config.batch_size % (self.world.size * config.grad_accum):
            raise ValueError(f"batch_size {config.batch_size} is not divisible by the "
                             f"{self.world.size} processes x grad_accum {config.grad_accum}: "
                             f"each process cuts its rows into grad_accum equal micro-batches")
        self.step, self.last_saved = 0, None
        if _resume:  # the lock taken, everything checked, the checkpoint's model loaded
            start: RunStart = open_run(
                config, self.out, kind=self.kind, claim=self._claim,
                accept_changed_data=accept_changed_data,
                note=self.log if self.world.is_main else (lambda line: None))
        else:
            self._claim.refuse_held()  # every rank, before any work
            start = begin_run(config, self.kind, processes=self.world.size, device=self.device)
        config = self.config = start.config
        self.model, self.tokenizer, self.data = start.model, start.tokenizer, start.data
        #: base.json of a run that trains an adapter (saved with its checkpoints), else None
        self.max_len, self.base = start.max_len, start.base
        self.model.to(self.device).train()
        if config.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        self.objective, self._sync = place_model(
            Objective(self.kind, self.model, config.label_smoothing), config=config,
            world=self.world, device=self.device, policy=self._policy)
        self.optimizer = build_optimizer(self.model, config)  # after sharding: on the shards
        if isinstance(start, Resumed):
            self.step = self.last_saved = start.restore(self.model, self.optimizer)
            barrier(self.world)  # every rank loaded its state before rank 0 rewrites
            self._claim.continue_from(self.step, config.to_dict())
        else:
            self._claim.start_new(config.to_dict())
        barrier(self.world)

    @classmethod
    def resume(cls, out_dir: str | Path, *, steps: int | None = None, progress: bool = True,
               log: Any = print, device: str | torch.device | None = "cpu",
               accept_changed_data: bool = False, lock: RunDirLock | None = None,
               grad_accum: int | None = None, activation_checkpointing: bool | None = None,
               fsdp: bool | None = None, precision: str | None = None,
               force_precision: bool = False) -> Trainer:
        """Continue the run in ``out_dir`` from its checkpoint, up to ``steps`` optimizer steps
        in total (default: the run's own ``steps``). ``grad_accum`` and
        ``activation_checkpointing`` may change (the same math; run.json records the new
        values); ``fsdp`` and ``precision``, if given, must be the run's own. A ``fsdp`` run
        resumes on any number of processes (its checkpoint is resharded on load).

        Refused, with nothing written: another process holds the directory
        (``RunDirBusyError``), run.json disagrees with the checkpoint's copy (anything but
        ``steps``, ``grad_accum``, ``activation_checkpointing``), ``fsdp`` / ``precision``
        differ from the run's, or the data file changed since the run began (unless
        ``accept_changed_data``; run.json then records the new file's fingerprint)."""
        out_dir = Path(out_dir)
        config = resumed_config(out_dir, steps=steps, grad_accum=grad_accum,
                                activation_checkpointing=activation_checkpointing, fsdp=fsdp,
                                precision=precision, log=log)
        return cls(config, out_dir, progress=progress, log=log, device=device, lock=lock,
                   force_precision=force_precision, _resume=True,
                   _accept_changed_data=accept_changed_data)

    # --- one step -----------------------------------------------------------------------------
    def _batch(self, step: int) -> dict[str, Tensor]:
        """This rank's rows of the global batch of optimizer step ``step`` (0-based)."""
        return rank_batch(self.kind, self.data, self.tokenizer, config=self.config,
                          world=self.world, step=step, device=self.device)

    def train_step(self) -> dict[str, float]:
        """One optimizer step (``qkv.train.step.optimizer_step``); returns its metrics (loss,
        lr, grad_norm, tokens)."""
        batch = self._batch(self.step)
        lr = step_lr(self.config, self.step + 1)

        def stop(what: str) -> None:  # the step counts from when its loss is known
            self.step += 1
            self._stop(what)

        loss, norm = optimizer_step(
            batch, lr=lr, forward=self._forward, sync=self._sync, model=self.model,
            optimizer=self.optimizer, config=self.config, world=self.world, kind=self.kind,
            stop=stop)
        self.step += 1
        self.kind.after_optimizer_step(self.model)
        tokens = self.kind.batch_tokens(batch, self.tokenizer)
        return {"loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens * self.world.size}

    def _forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return forward(self.objective, batch, config=self.config, device=self.device)

    def _stop(self, what: str) -> None:
        where = (f"the last good checkpoint is {self.out / 'checkpoint'} (step "
                 f"{self.last_saved})" if self.last_saved is not None
                 else "no checkpoint was written yet")
        raise TrainingError(f"step {self.step}: {what}; training stopped, {where}")

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train up to ``config.steps``; returns the final evaluation (rank 0; {} elsewhere)."""
        c, main = self.config, self.world.is_main
        bar = None
        if self.progress and main:
            from tqdm.auto import tqdm

            bar = tqdm(total=c.steps, initial=self.step, unit="step", dynamic_ncols=True,
                       leave=False)
        result: dict[str, Any] = {}
        t0, tokens = time.perf_counter(), 0
        clean = False
        try:
            with _sigterm_interrupts(), (
                    (self.out / METRICS).open("a") if main else NullLog()) as metrics:
                while self.step < c.steps:
                    m = self.train_step()
                    tokens += m["tokens"]
                    elapsed = time.perf_counter() - t0
                    m["tokens_per_s"] = round(tokens / max(elapsed, 1e-9), 1)
                    if main:  # a line per step, flushed: a kill loses at most a partial one
                        metrics.write(json.dumps({"step": self.step, **m}) + "\n")
                        metrics.flush()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}",
                                        tok_s=f"{m['tokens_per_s']:.0f}", refresh=False)
                    if self.step % c.eval_every == 0 or self.step == c.steps:
                        result = self._evaluate_and_save(metrics)
            clean = True
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (_sigterm_interrupts)
            raise self._interrupted(_signal_of(exc)) from None
        except RuntimeError as exc:
            if not (self.world.size > 1 and collective_failure(exc)):
                raise
            raise TrainingError(
                f"step {self.step}: rank {self.world.rank} lost the other processes (one "
                f"stopped, or did not answer within the process group's timeout, "
                f"{TIMEOUT_ENV}): {str(exc).strip().splitlines()[0] if str(exc) else exc!r}"
            ) from exc
        finally:
            if bar is not None:
                bar.close()
            self.close()
            freed = teardown_world(self.world, clean=clean, release=self._release_group)
            self.group_outlives_run = (self.world.size > 1 or self.world.own_group) and not freed
        return result

    def _interrupted(self, signum: int) -> RunInterrupted:
        """The interruption of ``run()`` by signal ``signum``: the step, the last checkpoint."""
        name = signal.Signals(signum).name
        if self.last_saved is not None:
            where = (f"the last checkpoint is {self.out / 'checkpoint'} (step "
                     f"{self.last_saved}): continue with qkv train --resume {self.out}")
        else:
            where = (f"no checkpoint was written yet (one every eval_every="
                     f"{self.config.eval_every} steps): nothing to resume; the same command "
                     f"starts the run over")
        return RunInterrupted(f"interrupted by {name} at step {self.step} of "
                              f"{self.config.steps}; {where}", signum)

    def _release_group(self) -> None:
        """Drop the DDP wrapper (the plain model stays), which holds the process group, so
        that leaving the group frees it (``qkv.train.distributed.teardown_world``). A sharded
        model is kept: torch's DTensor caches hold the group for the process's life anyway."""
        if isinstance(self.objective, nn.parallel.DistributedDataParallel):
            self.objective = self._sync = self.objective.module

    def _evaluate_and_save(self, metrics: Any) -> dict[str, Any]:
        if self.config.fsdp:
            return self._evaluate_and_save_sharded(metrics)
        result: dict[str, Any] = {}
        if self.world.is_main:
            result = {"step": self.step, **self.kind.evaluate(
                self.model, self.tokenizer, self.data, self.config.eval_examples)}
            save_checkpoint(self.out, model=self.model, tokenizer=self.tokenizer,
                            optimizer=self.optimizer, step=self.step,
                            run_info=self.config.to_dict(),
                            data_position=self.step * self.config.batch_size, base=self.base,
                            extra_files=self.kind.checkpoint_files(self.model))
            self.last_saved = self.step  # before the log line that announces it
            self._log_evaluation(metrics, result)
        self.last_saved = self.step
        barrier(self.world)
        return result

    def _evaluate_and_save_sharded(self, metrics: Any) -> dict[str, Any]:
        """Under FSDP: every rank evaluates with the whole parameters gathered (the same
        numbers on every rank; no collective inside the evaluation), every rank writes its
        shard of the checkpoint; rank 0 logs."""
        with unsharded(self.model):
            result = {"step": self.step, **self.kind.evaluate(
                self.model, self.tokenizer, self.data, self.config.eval_examples)}
        save_sharded_checkpoint(self.out, model=self.model, optimizer=self.optimizer,
                                step=self.step, data_position=self.step * self.config.batch_size,
                                tokenizer=self.tokenizer, run_info=self.config.to_dict(),
                                extra_files=self.kind.checkpoint_files(self.model))
        self.last_saved = self.step
        if not self.world.is_main:
            return {}
        self._log_evaluation(metrics, result)
        return result

    def _log_evaluation(self, metrics: Any, result: dict[str, Any]) -> None:
        # logged after the save: an evaluation row in metrics.jsonl means a checkpoint of
        # that step was complete (what resume's messages rely on)
        metrics.write(json.dumps(result) + "\n")
        metrics.flush()
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in result.items())
        self.log(f"[eval] {shown}")
