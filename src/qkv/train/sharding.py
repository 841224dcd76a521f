"""Scale-out building blocks on PyTorch's own pieces: FSDP2 sharding (``fully_shard``) of every
qkv model, per-layer activation checkpointing (non-reentrant ``torch.utils.checkpoint``), the
precision policy, gradient accumulation with one gradient sync per optimizer step, and the
gradient norm of sharded (DTensor) gradients.

Shapes: B the examples of one optimizer step on this rank, K micro-batches, B/K rows each.

Where the layers are (each one ``fully_shard``-ed as its own group; the rest — embeddings,
final norms, heads, shared relative biases — belongs to the root group)::

    GPT            layers                          (EncoderLayer, causal)
    BERT           layers                          (EncoderLayer)
    Transformer    encoder_layers, decoder_layers  (EncoderLayer, DecoderLayer)
    CLIP           vision.layers, text.layers      (EncoderLayer, both towers)
    ViT            layers                          (EncoderLayer)

Found by type (``EncoderLayer`` / ``DecoderLayer`` anywhere under the module), so a model
wrapped by an objective or a LoRA adapter shards the same way. Tied weights (GPT's LM head and
token embedding; the encoder-decoder's shared source/target embeddings and tied output) are
one ``nn.Parameter`` reached under two names: it lives in the root group, is sharded once, and
the tie survives sharding (``lm_head.weight is embed.weight`` on every rank afterwards).

Typical use (under torchrun, after ``dist.init_process_group``)::

    apply_activation_checkpointing(model)              # optional, before or after sharding
    shard_model(model, mp_policy=precision_policy("bf16", device))
    optimizer = AdamW(model.parameters())              # after sharding: DTensor parameters
    loss_sum, total = accumulate_gradients(objective, split_batch(batch, k), model=model,
                                           world_size=world)
    norm = grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..modules.layers import DecoderLayer, EncoderLayer
from .data import IGNORE
from .precision import check_precision_device

__all__ = ["LAYER_TYPES", "PRECISIONS", "accumulate_gradients", "apply_activation_checkpointing",
           "autocast", "find_layers", "grad_norm_", "is_sharded", "no_gradient_sync",
           "precision_policy", "saved_activation_bytes", "shard_model", "split_batch",
           "unsharded"]

#: the module types sharded (and checkpointed) one by one
LAYER_TYPES: tuple[type[nn.Module], ...] = (EncoderLayer, DecoderLayer)
#: ``--precision`` choices -> the dtype parameters are computed in
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                      "fp16": torch.float16}
#: the model methods training calls instead of ``forward``: they run FSDP's root hooks too
_ENTRY_METHODS = ("masked_lm", "loss", "encode", "decode", "encode_image", "encode_text",
                  "hidden_states")
#: the layer methods activation checkpointing wraps: ``forward`` alone, since every entry
#: (token rows, ``at=`` rows included: ``EncoderLayer.forward(x, rows=..., at=...)``) is a call
#: of the layer, which also runs its FSDP hooks (gather before, free after)
_LAYER_METHODS = ("forward",)


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The Transformer layers of ``model`` (``LAYER_TYPES`` instances, outermost only), in
    module order: what ``shard_model`` and ``apply_activation_checkpointing`` work on."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, LAYER_TYPES) and not any(name.startswith(p) for p in inside):
            found.append(mod)
            inside.add(name + ".")  # type: ignore[arg-type]
    return found


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) went through ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _check_shardable(model: nn.Module) -> None:
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"model: FSDP2 (fully_shard) cannot shard 0-dim parameters, and this model has "
            f"{len(scalars)}: {scalars[:5]}; make them 1-element tensors of shape (1,) "
            f"(as CLIP's logit_scale)")
    if not find_layers(model):
        raise ValueError(f"model: no {'/'.join(t.__name__ for t in LAYER_TYPES)} found in "
                         f"{type(model).__name__}: nothing to shard layer by layer")


def shard_model(model: nn.Module, *, mesh: Any = None, mp_policy: Any = None,
                reshard_after_forward: bool = True, offload: bool = False) -> nn.Module:
    """Shard ``model`` in place with FSDP2: every layer (``find_layers``) its own group, then
    the root (everything else). Returns ``model`` (now an ``FSDPModule``).

    Each rank keeps 1/world of every parameter (dim 0), of its gradient and of the optimizer
    moments built on it afterwards (build the optimizer *after* sharding). A layer's
    parameters are all-gathered just before its forward and backward, its gradients
    reduce-scattered (averaged over ranks, like DDP) right after its backward.

    Args:
        model: a qkv model (GPT, BERT, Transformer, CLIP, ViT) or a module holding one; on its
            training device already (CUDA: ``cuda:LOCAL_RANK``).
        mesh: a 1-D ``DeviceMesh``; default: all ranks of the default process group, on the
            device type of the model's parameters (cpu -> gloo, cuda -> nccl).
        mp_policy: a ``MixedPrecisionPolicy`` (``precision_policy``); default fp32.
        reshard_after_forward: free each layer's gathered parameters after its forward (and
            gather again in backward): less memory, more communication. The root keeps
            FSDP's own default (not resharded: its parameters are needed first in backward).
        offload: keep the sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``; pinned only when CUDA is available).

    Raises:
        ValueError: a 0-dim parameter (fully_shard refuses them), no layers found, or no
            process group joined.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    _check_shardable(model)
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("shard_model: no process group: run under torchrun (or "
                             "dist.init_process_group) first, or pass mesh=")
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload \
        else OffloadPolicy()
    kwargs: dict[str, Any] = {"mesh": mesh, "offload_policy": policy,
                              "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in find_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    for name in _ENTRY_METHODS:  # e.g. BERT.masked_lm uses the tied table after forward
        if callable(getattr(type(model), name, None)):
            register_fsdp_forward_method(model, name)
    return model


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every FSDP group of ``model`` holds its whole parameters (one
    all-gather per group on entry; plain tensors, not DTensors) and keeps them across
    forwards: code that reads weights directly (qkv's decoding steppers) and any number of
    forwards then run with no collective, so ranks may evaluate independently. On exit every
    group is resharded and its ``reshard_after_forward`` setting restored. A collective on
    entry and exit (every rank enters); a no-op for a model that is not sharded. Memory: the
    whole model's parameters on every rank while inside."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = []
    for m in groups:
        state = m._get_fsdp_state()
        saved.append((state._auto_reshard_after_forward,
                       [g.post_forward_mesh_info for g in state._fsdp_param_groups]))
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m, (auto, infos) in zip(groups, saved, strict=True):
            m.reshard()
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for g, info in zip(state._fsdp_param_groups, infos, strict=True):
                g.post_forward_mesh_info = info


# --- activation checkpointing --------------------------------------------------------------------
def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each layer's activations in backward instead of keeping them (non-reentrant
    ``torch.utils.checkpoint``, RNG state preserved so dropout draws the same): per layer only
    its input (B, N, C) stays saved. Gradients equal the plain run's. Only while gradients are
    enabled; inference and cached decoding run the layer as before. Module names and state-dict
    keys are unchanged. Idempotent; returns the number of layers wrapped.

    Works before or after ``shard_model`` (FSDP's hooks stay outside the recomputed region).
    """
    count = 0
    for layer in find_layers(model):
        if getattr(layer, "_qkv_checkpointed", False):
            continue
        for name in _LAYER_METHODS:
            plain = getattr(layer, name, None)
            if callable(plain):
                setattr(layer, name, _checkpointed(plain))
        layer._qkv_checkpointed = True  # type: ignore[assignment]
        count += 1
    return count


def _checkpointed(plain: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(plain)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return plain(*args, **kwargs)
        return checkpoint(plain, *args, use_reentrant=False, **kwargs)

    return run


@contextlib.contextmanager
def saved_activation_bytes() -> Iterator[list[int]]:
    """Count the bytes autograd saves for backward inside the block (``saved_tensors_hooks``):
    ``with saved_activation_bytes() as n: loss = f(x)`` then ``n[0]``. Parameters saved by
    reference are counted too (every run alike); storages are counted once."""
    seen: set[int] = set()
    box = [0]

    def pack(t: Tensor) -> Tensor:
        try:
            key = t.untyped_storage().data_ptr()
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # e.g. a DTensor or a fake tensor
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            box[0] += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box


# --- precision -----------------------------------------------------------------------------------
def precision_policy(precision: str, device: torch.device | str, *,
                     force: bool = False) -> Any:
    """The ``MixedPrecisionPolicy`` of ``--precision``: "fp32" -> None (plain fp32); "bf16" /
    "fp16" -> parameters all-gathered and computed in that dtype, gradients reduced in fp32,
    fp32 master weights and optimizer state (the sharded parameters stay fp32).

    On a CPU, bf16 is allowed where it is native (``qkv.train.precision``: torch reports bf16
    matmul instructions and a short probe finds bf16 matmuls at least as fast as fp32);
    elsewhere bf16 — and fp16 on any CPU — is refused, with the probe's figures, unless
    ``force=True`` (then a ``UserWarning`` says so). fp16 also needs loss scaling
    (``torch.amp.GradScaler``) against gradient underflow; the policy alone does not provide it.

    Raises:
        ValueError: an unknown ``precision``, or bf16 on a CPU where it is not native (fp16 on
            any CPU) without ``force``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    check_precision_device(precision, device, force=force)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32)


def autocast(precision: str, device: torch.device | str, *,
             force: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The forward context of ``--precision`` for an unsharded (single process / DDP) run:
    ``torch.autocast`` to bf16/fp16 with fp32 weights, or a no-op for "fp32". Refuses
    bf16 on a CPU where it is not native, and fp16 on a CPU, unless ``force`` (see
    ``precision_policy``). Under ``shard_model`` with a ``precision_policy`` no autocast is
    needed."""
    if precision_policy(precision, device, force=force) is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=PRECISIONS[precision])


# --- gradient accumulation -----------------------------------------------------------------------
def split_batch(batch: dict[str, Tensor], k: int) -> list[dict[str, Tensor]]:
    """``batch`` (every tensor (B, ...)) as ``k`` micro-batches of B/k consecutive rows.

    Raises:
        ValueError: ``k`` < 1, or B not divisible by ``k``.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"grad_accum must be a positive integer, got {k!r}")
    rows = {t.shape[0] for t in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"batch: tensors disagree on the batch size: {sorted(rows)}")
    (b,) = rows
    if b % k:
        raise ValueError(f"grad_accum {k} does not divide this rank's batch of {b} examples "
                         f"(--batch-size / processes)")
    return [{name: t[i * (b // k):(i + 1) * (b // k)] for name, t in batch.items()}
            for i in range(k)]


@contextlib.contextmanager
def no_gradient_sync(module: nn.Module, *, enabled: bool = True) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter of backward passes inside the block
    (gradients accumulate locally): ``DistributedDataParallel.no_sync()``, or FSDP2's
    ``set_requires_gradient_sync(False)`` (restored afterwards). A no-op for an unwrapped
    module or with ``enabled=False``."""
    from torch.distributed.fsdp import FSDPModule

    if not enabled:
        yield
    elif isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def _default_count(batch: dict[str, Tensor]) -> Tensor:
    for key in ("targets", "tgt_out", "labels"):  # GPT, the encoder-decoder, BERT
        if key in batch:
            return (batch[key] != IGNORE).sum()
    raise ValueError(f"batch has none of the target keys targets/tgt_out/labels "
                     f"(keys {sorted(batch)}): pass count=")


def accumulate_gradients(objective: Callable[[dict[str, Tensor]], tuple[Tensor, Tensor]],
                         micro_batches: Sequence[dict[str, Tensor]], *,
                         model: nn.Module | None = None, world_size: int = 1,
                         count: Callable[[dict[str, Tensor]], Tensor] = _default_count,
                         ) -> tuple[Tensor, Tensor]:
    """Forward + backward of one optimizer step's micro-batches, one after another, with the
    gradient sync (DDP all-reduce / FSDP reduce-scatter) only in the last backward. The
    gradients equal those of the whole batch in one go (up to summation order): every
    micro-batch's summed loss is divided by the *global* number of predicted tokens (all
    micro-batches, all ranks), times ``world_size`` because the sync averages over ranks —
    the trainer's normalisation.

    Args:
        objective: ``objective(batch) -> (loss_sum, count)``, the summed token loss (a scalar)
            and the number of predicted tokens (the trainer's ``_Objective``, DDP-wrapped or
            not).
        micro_batches: ``split_batch(batch, k)`` for this rank.
        model: the module whose sync is skipped: the DDP wrapper or the FSDP root; default
            ``objective`` itself when it is a module.
        world_size: the number of ranks.
        count: the number of predicted tokens of a micro-batch, known before its forward
            (default: the non-ignored entries of targets / tgt_out / labels).

    Returns:
        ``(loss_sum, total)``: this rank's summed loss over all micro-batches (detached) and
        the global token count (all ranks, clamped to ≥ 1); the step's mean loss is
        ``all_reduce_sum(loss_sum) / total``.
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one micro-batch, got none")
    sync = model if model is not None else objective
    total = torch.stack([count(mb) for mb in micro_batches]).sum().detach()
    if world_size > 1:
        total = total.clone()
        dist.all_reduce(total)
    total = total.clamp(min=1)
    loss_sum = torch.zeros(())
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with no_gradient_sync(sync, enabled=not last):  # type: ignore[arg-type]
            part, _ = objective(mb)
            # the scale in the loss's dtype: an int64 count would divide in fp32
            (part * (world_size / total.to(part.device, part.dtype))).backward()
        loss_sum = loss_sum.to(part.device) + part.detach()
    return loss_sum, total


def grad_norm_(parameters: Any, max_norm: float = 0.0) -> float:
    """The global 2-norm of the gradients of ``parameters`` (plain or FSDP-sharded DTensors:
    the norm over all ranks' shards, the same on every rank); with ``max_norm`` > 0 the
    gradients are also clipped to it (``clip_grad_norm_``). Parameters without a gradient are
    skipped; 0.0 when none has one."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
    return float((full() if full is not None else norm).item())
