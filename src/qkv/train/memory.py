"""Will a training run fit in memory? A cheap estimate, checked before anything is allocated.

``estimate_training_bytes`` counts, for a model described on the ``meta`` device (no memory
used) and one optimizer step of ``batch_size`` sequences of ``seq_len`` tokens, in fp32
(4 bytes a number):

- parameters P: ``4 P`` bytes each for the weights, and for the trainable ones (all, unless
  an adapter froze the base) their gradients and AdamW's two moments (16 P bytes in all for
  a model that trains whole), plus the model's buffers;
- position tables built lazily at the first forward (``Sinusoidal(max_len=...)``): about
  24 bytes per ``max_len x C`` entry while the table is computed (fp64 angles, sin, cos, the
  fp32 result);
- activations kept for the backward pass: ``10 x B x N x C`` numbers per layer (the input,
  the norms, q, k, v, the attention output and the residuals) plus ``2 x B x N x F`` per
  layer for the feed-forward's hidden width F, over all layers L (encoder + decoder);
- one layer's attention scores, ``B x H x N x N`` numbers (the softmax of one layer alive at
  a time; backends that keep every layer's need more, flash-style kernels less);
- the output logits and their gradient, ``2 x B x N x V`` numbers;
- the held-out examples an evaluation builds at once: about ``200 + 2 N`` bytes each
  (Python strings of a pair and its prediction).

Under ``--fsdp`` over W processes and with ``--activation-checkpointing``
(``scale_estimate``):

- parameters: each process keeps 1/W of the weights, gradients and AdamW moments
  (``16 P / W`` bytes for a model that trains whole), plus the whole parameters of the
  groups gathered at once: the root group (embeddings, final norm, head: not resharded after
  forward) and two layers (the one computing and the one prefetched), ``4 x (P_root +
  2 P_layer)``; buffers are not sharded;
- activations with checkpointing: per layer only its input, ``B x N x C`` numbers, plus one
  layer's full activations while it is recomputed: the plain figure times
  ``1 / (10 + 2 F / C) + 1 / L``.

An adapter (``TrainConfig.peft``) is counted before it is built: its parameters, from its
config and the base's shapes (``qkv.peft.adapter_shapes``), at 16 bytes each (fp32 weight,
gradient and AdamW's two moments), against the memory available once the base is loaded
(``check_adapter_fits``); the whole step, adapter included, is then checked as above.

The estimate errs low on purpose (it leaves out the allocator's slack, the optimizer's
temporaries, evaluation), so a refusal means the run certainly cannot fit; a run that passes
can still run out of memory. ``available_bytes`` reads ``MemAvailable`` from /proc/meminfo,
else ``os.sysconf``; for a CUDA device the free device memory; None when unknown (the check
is then skipped).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryEstimate", "adapter_bytes", "available_bytes", "check_adapter_fits",
           "check_estimate_fits", "check_step_fits", "check_training_fits",
           "estimate_stacks_bytes", "estimate_training_bytes", "format_bytes",
           "scale_estimate"]

FP32 = 4


class MemoryEstimate(dict):
    """Bytes by part ("parameters", "tables", "activations", "scores", "logits",
    "evaluation"); ``total``."""

    @property
    def total(self) -> int:
        """Sum of the parts, in bytes."""
        return int(sum(self.values()))


def format_bytes(n: float) -> str:
    """``n`` bytes as "12.3 GiB", "512 MiB" or "3 KiB"."""
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:,.0f} MiB"
    return f"{n / 2**10:,.0f} KiB"


def _widths(config: Any) -> tuple[int, int, int, int, int]:
    """(C, F, H, L, V) of a qkv model config: width, feed-forward width, heads, layers (all
    stacks), output vocabulary."""
    dim = int(config.dim)
    ffn = int(getattr(config, "ffn_hidden", None) or 4 * dim)
    heads = int(config.num_heads)
    if hasattr(config, "num_encoder_layers"):  # encoder-decoder: the decoder has two attentions
        layers = int(config.num_encoder_layers) + 2 * int(config.num_decoder_layers)
        vocab = int(config.tgt_vocab_size)
    else:
        layers, vocab = int(config.num_layers), int(config.vocab_size)
    return dim, ffn, heads, layers, vocab


def estimate_training_bytes(model: nn.Module, *, batch_size: int, seq_len: int,
                            eval_examples: int = 0) -> MemoryEstimate:
    """A lower-bound estimate of the memory one training step of ``model`` needs (see the
    module docstring for the formula).

    Args:
        model: the model, best built on the ``meta`` device (only shapes are read); it must
            have a qkv ``config`` (dim, num_heads, layers, vocabulary).
        batch_size: B, sequences per step (on this process).
        seq_len: N, the longest sequence of a step in tokens.
        eval_examples: held-out examples per evaluation.
    """
    from ..modules.positions import Sinusoidal

    tables = sum(24 * m.max_len * m.dim for m in model.modules()
                 if isinstance(m, Sinusoidal) and m.max_len is not None)
    dim, ffn, heads, layers, vocab = _widths(model.config)
    b, n = int(batch_size), int(seq_len)
    return MemoryEstimate(
        parameters=_parameter_bytes(model),
        tables=tables,
        activations=FP32 * layers * b * n * (10 * dim + 2 * ffn),
        scores=FP32 * b * heads * n * n,
        logits=2 * FP32 * b * n * vocab,
        evaluation=int(eval_examples) * (200 + 2 * n))


def _parameter_bytes(model: nn.Module) -> int:
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return FP32 * params + 3 * FP32 * trainable + buffers


def scale_estimate(est: MemoryEstimate, model: nn.Module, *, shards: int = 1,
                   checkpointing: bool = False) -> MemoryEstimate:
    """``est`` (a kind's ``estimate_memory`` of ``model``) for a process of an FSDP run over
    ``shards`` processes (1: not sharded) and/or with activation checkpointing (the module
    docstring gives the formulas). ``model`` best on the meta device."""
    from .sharding import find_layers

    out = MemoryEstimate(est)
    layers = find_layers(model)
    if shards > 1:
        params = list(model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = sum(p.numel() for p in params if id(p) not in in_layers)
        biggest = max((sum(p.numel() for p in layer.parameters()) for layer in layers),
                      default=0)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        total = sum(p.numel() for p in params)
        out["parameters"] = ((FP32 * total + 3 * FP32 * trainable) // shards + buffers
                             + FP32 * (root + 2 * biggest))
    if checkpointing and layers:
        config = getattr(model, "config", None)
        dim = getattr(config, "dim", None)
        ratio = 4.0 if dim is None else (getattr(config, "ffn_hidden", None) or 4 * dim) / dim
        out["activations"] = int(out.get("activations", 0) * (1 / (10 + 2 * ratio)
                                                               + 1 / len(layers)))
    return out


def estimate_stacks_bytes(model: nn.Module, *, batch_size: int,
                          stacks: list[tuple[int, int, int, int, int]], output_numbers: int,
                          input_numbers: int = 0, eval_bytes: int = 0) -> MemoryEstimate:
    """The estimate of the module docstring for a model of several layer stacks (e.g.
    CLIP's image and text towers), each ``(C, F, H, L, N)``: width, feed-forward width,
    heads, layers and tokens per example. ``output_numbers``: the output (and its
    gradient) in numbers, for the whole batch; ``input_numbers``: the batch's input
    numbers (e.g. pixels) kept for the step; ``eval_bytes``: what an evaluation holds.
    The attention scores are those of the largest stack's layer (one alive at a time)."""
    b = int(batch_size)
    return MemoryEstimate(
        parameters=_parameter_bytes(model),
        tables=0,
        activations=sum(FP32 * layers * b * n * (10 * dim + 2 * ffn)
                        for dim, ffn, _, layers, n in stacks) + FP32 * int(input_numbers),
        scores=max(FP32 * b * heads * n * n for _, _, heads, _, n in stacks),
        logits=FP32 * int(output_numbers),
        evaluation=int(eval_bytes))


def available_bytes(device: torch.device | None = None) -> int | None:
    """Memory a new allocation can get: free memory of a CUDA ``device``; else
    ``MemAvailable`` (/proc/meminfo), else available pages from ``os.sysconf``; None when
    none can be read."""
    if device is not None and device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def check_training_fits(model: nn.Module, *, batch_size: int, seq_len: int,
                        eval_examples: int = 0, device: torch.device | None = None,
                        what: str = "this run") -> MemoryEstimate:
    """Raise ``ValueError`` (with the numbers) when ``estimate_training_bytes`` exceeds
    ``available_bytes(device)``; returns the estimate otherwise (also when the available
    memory is unknown)."""
    est = estimate_training_bytes(model, batch_size=batch_size, seq_len=seq_len,
                                  eval_examples=eval_examples)
    return check_estimate_fits(est, batch_size=batch_size, seq_len=seq_len, device=device,
                               what=what)


def _where(device: torch.device | None) -> str:
    """How a refusal names the memory it measured: the CUDA device's, or the machine's."""
    return (f"{device.type} device" if device is not None and device.type == "cuda"
            else "this machine")


def check_estimate_fits(est: MemoryEstimate, *, batch_size: int, seq_len: int,
                        device: torch.device | None = None,
                        what: str = "this run") -> MemoryEstimate:
    """Raise ``ValueError`` (with the numbers) when the estimate ``est`` of a step of
    ``batch_size`` examples of up to ``seq_len`` tokens exceeds ``available_bytes(device)``;
    returns ``est`` otherwise (also when the available memory is unknown)."""
    have = available_bytes(device)
    if have is None or est.total <= have:
        return est
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in est.items() if v)
    where = _where(device)
    raise ValueError(f"{what} needs at least {format_bytes(est.total)} of memory ({parts}; "
                     f"batch_size={batch_size} x {seq_len} tokens) but {where} has "
                     f"{format_bytes(have)} available; lower --max-len, --batch-size, "
                     f"--eval-examples or the model size")


def check_step_fits(kind: Any, model: nn.Module, config: Any, *, processes: int,
                    seq_len: int, max_len: int, device: torch.device | None = None,
                    doing: str = "training") -> MemoryEstimate:
    """Refuse an optimizer step of a run of ``config`` (a ``TrainConfig``) that cannot fit in
    memory: one micro-batch of this process's rows at a time (``batch_size / processes /
    grad_accum`` examples of up to ``seq_len`` tokens, estimated by ``kind.estimate_memory``
    on ``model``, best on the meta device); parameters, gradients and optimizer state split
    over the ``processes`` under ``fsdp``; activations of checkpointed layers
    (``scale_estimate``). ``ValueError`` as ``check_estimate_fits``, naming ``doing``, the
    model kind and ``max_len``; returns the estimate otherwise."""
    micro = config.batch_size // processes // config.grad_accum
    estimate = kind.estimate_memory(model, batch_size=micro, seq_len=seq_len,
                                    eval_examples=config.eval_examples)
    estimate = scale_estimate(estimate, model, shards=processes if config.fsdp else 1,
                              checkpointing=config.activation_checkpointing)
    return check_estimate_fits(estimate, batch_size=micro, seq_len=seq_len, device=device,
                               what=f"{doing} {config.model} (max_len={max_len})")


def adapter_bytes(parameters: int) -> int:
    """Bytes a new trainable adapter of ``parameters`` numbers needs at the least: its fp32
    weights, their gradients and AdamW's two moments, 16 bytes a parameter."""
    return 4 * FP32 * int(parameters)


def check_adapter_fits(parameters: int, *, what: str = "the adapter", lower: str = "its size",
                       device: torch.device | None = None) -> int:
    """Raise ``ValueError`` (one line, with the numbers) when an adapter of ``parameters``
    trainable numbers (``adapter_bytes``) cannot fit in ``available_bytes(device)`` — to be
    called before it is built. ``what`` names it, ``lower`` the setting to lower (e.g.
    "--lora r=..."). Returns the bytes (also when the available memory is unknown)."""
    need = adapter_bytes(parameters)
    have = available_bytes(device)
    if have is not None and need > have:
        where = _where(device)
        raise ValueError(f"{what} adds {int(parameters):,} parameters, which need at least "
                         f"{format_bytes(need)} (fp32 weights, gradients and AdamW moments, "
                         f"16 bytes each) but {where} has {format_bytes(have)} available; "
                         f"lower {lower}")
    return need
