"""The training loop behind ``qkv train`` and ``qkv demo``.

``Trainer(config, out_dir).run()`` trains a Transformer, GPT or BERT on a task or file, logs
each step to RUN/metrics.jsonl, evaluates and checkpoints every ``eval_every`` steps (see
``qkv.train.checkpoint`` for the run-directory layout), and stops with ``TrainingError`` on
a non-finite loss or gradient. ``Trainer.resume(out_dir, steps=M)`` continues a run so that
its losses and final weights are bit-identical (CPU) to an uninterrupted run of M steps.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..models import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
from ..models.hub import CheckpointError, atomic_write, read_json
from .checkpoint import find_checkpoint, load_run, load_trainer_state, save_checkpoint
from .config import TrainConfig
from .data import make_batch
from .distributed import all_reduce_sum, barrier, resolve_device, setup_world, teardown_world
from .evaluate import evaluate
from .loss import token_loss
from .schedules import lr_multiplier
from .setup import load_data, prepare_data

__all__ = ["Trainer", "TrainingError", "build_model"]

METRICS = "metrics.jsonl"


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient); the message names the step and
    the last good checkpoint."""


class _Objective(nn.Module):
    """The model plus its loss, so that DistributedDataParallel sees one forward.
    ``forward(batch)`` returns (summed loss over predicted tokens, their count)."""

    def __init__(self, kind: str, model: nn.Module, label_smoothing: float) -> None:
        super().__init__()
        self.kind, self.model, self.label_smoothing = kind, model, label_smoothing

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        loss, count, _, _ = token_loss(self.kind, self.model, batch,
                                       label_smoothing=self.label_smoothing)
        return loss, count


def build_model(config: TrainConfig, vocab_size: int, max_len: int, pad_id: int) -> nn.Module:
    """The model of a run: the config's preset, the vocabulary and context length derived
    from the data, then the user's ``overrides``."""
    base: dict[str, Any]
    if config.model == "transformer":
        base = dict(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, max_len=max_len,
                    share_embeddings=True, pad_id=pad_id)
        cfg = TransformerConfig.from_name(config.model_preset, **{**base, **config.overrides})
        return Transformer(cfg)
    if config.model == "gpt":
        base = dict(vocab_size=vocab_size, max_len=max_len)
        return GPT(GPTConfig.from_name(config.model_preset, **{**base, **config.overrides}))
    base = dict(vocab_size=vocab_size, max_len=max_len, pad_token_id=pad_id, with_pooler=False)
    return BERT(BERTConfig.from_name(config.model_preset, **{**base, **config.overrides}))


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not biases, norms or embedding tables)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in tables else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps)


class Trainer:
    """One training run (see the module docstring).

    Args:
        config: the ``TrainConfig``.
        out_dir: the run directory (created; must not already hold a run unless resuming).
        progress: show a progress bar (rank 0 only).
        log: a function taking one line of text (rank 0 only; default: print).
        device: "cpu" (default), "cuda", "cuda:N" or "auto" (CUDA when available); under
            torchrun "cuda" means each rank's ``cuda:LOCAL_RANK`` and the backend is nccl.

    Build with ``Trainer(config, out)`` for a new run or ``Trainer.resume(out, steps=M)``.
    ``run()`` trains up to ``config.steps`` and returns the final evaluation.

    Training is fp32, on one device per process; checkpoints are device-independent (the
    CPU RNG state, and the CUDA one when training on CUDA, are saved with them).

    The run owns torch's global RNG (what dropout draws from): a new run seeds it with
    ``config.seed``, a resumed one restores the checkpoint's state, and neither restores the
    caller's state afterwards. Under torchrun every rank starts from the same seed (the
    checkpoint holds rank 0's RNG state, so a resumed run stays bit-identical).
    """

    def __init__(self, config: TrainConfig, out_dir: str | Path, *, progress: bool = True,
                 log: Any = print, device: str | torch.device | None = "cpu",
                 _resume: bool = False) -> None:
        self.config, self.out = config, Path(out_dir)
        self.progress, self.log = progress, log
        self.device = resolve_device(device)
        self.world = setup_world(self.device)
        try:
            self._setup(config, _resume)
        except BaseException:
            teardown_world(self.world)  # a refused run must not leave the process group open
            raise

    def _setup(self, config: TrainConfig, _resume: bool) -> None:
        if config.batch_size % self.world.size:
            raise ValueError(f"batch_size {config.batch_size} is not divisible by the "
                             f"{self.world.size} processes")
        self.step = 0
        self.last_saved: int | None = None
        if _resume:
            try:
                ckpt = find_checkpoint(self.out)
            except CheckpointError:
                if not (self.out / "run.json").exists():
                    raise
                raise CheckpointError(
                    f"{self.out} has no checkpoint yet: the run stopped before its first save "
                    f"(one every eval_every={config.eval_every} steps); start it again with "
                    f"another --out, or delete {self.out}") from None
            self.model, self.tokenizer = load_run(ckpt)
            self.max_len = int(self.model.config.max_len)
            self.data = load_data(config, self.tokenizer, self.max_len)
        else:
            if (self.out / "run.json").exists():  # every rank checks, before anyone writes
                raise ValueError(f"{self.out} already holds a run; continue it with qkv train "
                                 f"--resume {self.out}, or choose another directory")
            if config.data is not None:  # resumable from any working directory
                config = TrainConfig.from_dict({**config.to_dict(),
                                                "data": str(Path(config.data).resolve())})
                self.config = config
            torch.manual_seed(config.seed)
            self.data, self.tokenizer, self.max_len = prepare_data(config)
            self.model = build_model(config, self.tokenizer.vocab_size, self.max_len,
                                     self.tokenizer.pad_id)
        self.model.to(self.device).train()
        self.objective: nn.Module = _Objective(config.model, self.model, config.label_smoothing)
        if self.world.size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.objective = nn.parallel.DistributedDataParallel(self.objective, device_ids=ids)
        self.optimizer = _optimizer(self.model, config)
        if _resume:
            state = load_trainer_state(ckpt, self.optimizer)
            self.step = self.last_saved = state["step"]
            if self.step >= config.steps:
                raise ValueError(f"{self.out} is already at step {self.step}; give --steps "
                                 f"greater than {self.step} to continue it")
            if self.world.is_main:
                _truncate_metrics(self.out / METRICS, self.step)
        barrier(self.world)
        if self.world.is_main:  # run.json: the settings --resume continues (new total steps)
            self.out.mkdir(parents=True, exist_ok=True)
            text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
            atomic_write(self.out / "run.json", lambda tmp: Path(tmp).write_text(text))
            if not _resume:
                (self.out / METRICS).write_text("")

    @classmethod
    def resume(cls, out_dir: str | Path, *, steps: int | None = None, progress: bool = True,
               log: Any = print, device: str | torch.device | None = "cpu") -> Trainer:
        """Continue the run in ``out_dir`` from its checkpoint, up to ``steps`` optimizer steps
        in total (default: the run's own ``steps``)."""
        out_dir = Path(out_dir)
        try:
            data = read_json(out_dir / "run.json")
        except (OSError, ValueError, CheckpointError) as exc:
            raise CheckpointError(f"{out_dir}: cannot resume: {exc}") from exc
        config = TrainConfig.from_dict(data)
        if steps is not None and steps != config.steps:
            if config.schedule == "cosine":
                log(f"note: the cosine schedule is re-stretched from {config.steps} to {steps} "
                    f"total steps; later learning rates differ from those of a run started "
                    f"with --steps {steps}")
            config = TrainConfig.from_dict({**config.to_dict(), "steps": steps})
        return cls(config, out_dir, progress=progress, log=log, device=device, _resume=True)

    # --- one step -----------------------------------------------------------------------------
    def _batch(self, step: int) -> dict[str, Tensor]:
        """The batch of optimizer step ``step`` (0-based) for this rank: its rows of the global
        batch, built whole on every rank (same padding width, same MLM corruption), so that N
        processes compute exactly the sums one process would."""
        c, w = self.config, self.world
        batch = make_batch(c.model, self.data.train(step * c.batch_size, c.batch_size),
                           self.tokenizer, step=step, seed=c.seed)
        per_rank = c.batch_size // w.size
        rows = slice(w.rank * per_rank, (w.rank + 1) * per_rank)
        return {k: t[rows].to(self.device) for k, t in batch.items()}

    def _lr(self, step: int) -> float:
        c = self.config
        return c.lr * lr_multiplier(step, schedule=c.schedule, warmup=c.warmup, total=c.steps,
                                    min_ratio=c.min_lr_ratio)

    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns its metrics (loss, lr, grad_norm, tokens)."""
        batch = self._batch(self.step)
        lr = self._lr(self.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, count = self.objective(batch)
        total = all_reduce_sum(count, self.world).clamp(min=1)
        (loss_sum * (self.world.size / total)).backward()  # DDP averages over ranks
        loss = (all_reduce_sum(loss_sum.detach(), self.world) / total).item()
        self.step += 1
        if not math.isfinite(loss):
            self._stop(f"loss is {loss}")
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.config.clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.clip_norm).item()
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
        if not math.isfinite(norm):
            self._stop(f"the gradient norm is {norm}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = sum(int((t != self.tokenizer.pad_id).sum()) for k, t in batch.items()
                     if k in ("src", "tgt_in", "ids"))
        return {"loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens * self.world.size}

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
        try:
            with (self.out / METRICS).open("a") if main else _Null() as metrics:
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
        finally:
            if bar is not None:
                bar.close()
            teardown_world(self.world)
        return result

    def _evaluate_and_save(self, metrics: Any) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.world.is_main:
            result = {"step": self.step, **evaluate(self.config.model, self.model,
                                                    self.tokenizer, self.data,
                                                    self.config.eval_examples)}
            metrics.write(json.dumps(result) + "\n")
            metrics.flush()
            save_checkpoint(self.out, model=self.model, tokenizer=self.tokenizer,
                            optimizer=self.optimizer, step=self.step,
                            run_info=self.config.to_dict(),
                            data_position=self.step * self.config.batch_size)
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in result.items())
            self.log(f"[eval] {shown}")
        self.last_saved = self.step
        barrier(self.world)
        return result


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def write(self, text: str) -> None:
        return None

    def flush(self) -> None:
        return None


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines logged after the checkpoint's step (the resumed run logs them again),
    and a partial last line a killed process may have left."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            keep.append(line)
    text = "".join(line + "\n" for line in keep)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
