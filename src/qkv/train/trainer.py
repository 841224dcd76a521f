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
``qkv.train.claim`` (the run directory claimed on every rank) and ``qkv.train.resume`` (what
a resume checks: run.json's allowed changes, the data file's fingerprint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..files import CheckpointError, atomic_write, read_json
from .checkpoint import load_run, load_trainer_state, save_checkpoint
from .claim import RunDirClaim
from .config import TrainConfig
from .distributed import (
    TIMEOUT_ENV,
    barrier,
    resolve_device,
    setup_world,
    teardown_world,
)
from .finetune import BASE_JSON, attach_peft, load_base
from .kinds import get_kind
from .memory import check_estimate_fits, scale_estimate
from .metrics import METRICS, NullLog, truncate_metrics
from .resume import check_data_unchanged, data_fingerprint, resumed_config
from .rundir import (
    RunDirLock,
    check_checkpoint_agrees,
    never_saved,
    refuse_existing,
    resume_checkpoint,
)
from .sharded_checkpoint import (
    build_checkpoint_model,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
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
            self.close()  # a refused run holds no lock and leaves no process group open
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
        self.step = 0
        self.base: dict[str, str] | None = None  # base.json of a run that trains an adapter
        self.last_saved: int | None = None
        if _resume:
            self._claim.take_lock()  # before reading: no other writer may change what we check
            ckpt = resume_checkpoint(self.out, config.eval_every)
            check_checkpoint_agrees(self.out, ckpt, config)
            config = self.config = check_data_unchanged(
                config, self.out, self.kind, accept_changed=accept_changed_data,
                note=self.log if self.world.is_main else (lambda line: None))
            sharded = is_sharded_checkpoint(ckpt)
            if sharded != config.fsdp:
                raise CheckpointError(
                    f"{ckpt} is {'a sharded' if sharded else 'a plain'} checkpoint but run.json "
                    f"says fsdp={config.fsdp}: fsdp is fixed for a run; restore run.json from "
                    f"{ckpt / 'run.json'}")
            if sharded:  # weights come with the optimizer state, after sharding (below)
                from ..data import read_tokenizer

                self.model = build_checkpoint_model(ckpt)
                self.tokenizer = read_tokenizer(ckpt / "tokenizer.json")
            else:
                self.model, self.tokenizer = load_run(ckpt)  # an adapter run: base checked
            # an adapter run's base.json, checked against its base by load_run just now
            self.base = read_json(ckpt / BASE_JSON) if (ckpt / BASE_JSON).is_file() else None
            self.max_len = self.kind.max_len_of(self.model)
            self.data = self.kind.load_data(config, self.tokenizer, self.max_len)
        else:
            if (self.out / "run.json").exists() and not never_saved(self.out):
                refuse_existing(self.out)  # every rank, before any work
            if config.data is not None:  # resumable from any working directory
                data = Path(config.data).resolve()
                config = self.config = dataclasses.replace(
                    config, data=str(data), data_fingerprint=data_fingerprint(self.kind, data))
            torch.manual_seed(config.seed)
            if config.init_from is not None:
                config = self._start_from_base(config)
            else:
                self._new_model(config)
        self.model.to(self.device).train()
        if config.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        self.objective, self._sync = place_model(
            Objective(self.kind, self.model, config.label_smoothing), config=config,
            world=self.world, device=self.device, policy=self._policy)
        self.optimizer = build_optimizer(self.model, config)  # after sharding: on the shards
        if _resume:
            state = (load_sharded_checkpoint(ckpt, model=self.model, optimizer=self.optimizer)
                     if config.fsdp else load_trainer_state(ckpt, self.optimizer))
            self.step = self.last_saved = state["step"]
            if self.step >= config.steps:
                raise ValueError(f"{self.out} is already at step {self.step}; give --steps "
                                 f"greater than {self.step} to continue it")
            barrier(self.world)
            if self.world.is_main:
                truncate_metrics(self.out / METRICS, self.step)
                self._write_run_json(config)
        else:
            self._claim.claim_new()
            try:
                if self.world.is_main:
                    self._write_run_json(config)
                    (self.out / METRICS).write_text("")
                    self._claim.written.append(METRICS)
            except BaseException:
                self._claim.undo_new()
                raise
        barrier(self.world)

    def _new_model(self, config: TrainConfig) -> None:
        """A new model on new data: tokenizer fitted to it, sizes checked first."""
        kind = self.kind
        self.data, self.tokenizer, self.max_len, seq_len = kind.prepare_data(config)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            shape_only = kind.build_model(config, self.tokenizer, self.max_len)
        kind.check_model(shape_only.config, self.tokenizer, self.max_len)
        self._check_memory(shape_only, seq_len, "training")
        self.model = kind.build_model(config, self.tokenizer, self.max_len)
        self.base = None

    def _check_memory(self, model: nn.Module, seq_len: int, doing: str) -> None:
        """Refuse a step that cannot fit in memory (``qkv.train.memory``): one micro-batch
        of this process's rows at a time; parameters, gradients and optimizer state split
        over the processes under ``fsdp``; activations of checkpointed layers."""
        c = self.config
        micro = c.batch_size // self.world.size // c.grad_accum
        estimate = self.kind.estimate_memory(model, batch_size=micro, seq_len=seq_len,
                                             eval_examples=c.eval_examples)
        estimate = scale_estimate(estimate, model,
                                  shards=self.world.size if c.fsdp else 1,
                                  checkpointing=c.activation_checkpointing)
        check_estimate_fits(estimate, batch_size=micro, seq_len=seq_len, device=self.device,
                            what=f"{doing} {c.model} (max_len={self.max_len})")

    def _start_from_base(self, config: TrainConfig) -> TrainConfig:
        """The base of ``init_from`` (its tokenizer and max_len), the adapter of ``peft``
        attached; data and memory checked. Returns the config with the base's absolute path."""
        base = load_base(config.init_from, config.model)
        config = self.config = dataclasses.replace(config, init_from=str(base.path))
        self.data, self.max_len, seq_len = self.kind.prepare_base_data(config, base.tokenizer,
                                                                       base.max_len)
        self.model, self.tokenizer = base.model, base.tokenizer
        if config.peft is not None:
            self.base = base.info()
        if config.peft is not None:
            attach_peft(self.model, config.peft)
        self._check_memory(self.model, seq_len, "fine-tuning")
        return config

    def _write_run_json(self, config: TrainConfig) -> None:
        """run.json: the settings --resume continues (with the new total steps)."""
        text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
        atomic_write(self.out / "run.json", lambda tmp: Path(tmp).write_text(text))
        self._claim.written.append("run.json")

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
