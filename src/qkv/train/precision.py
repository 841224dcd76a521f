"""Whether ``--precision bf16`` may train on this device: on CUDA always; on a CPU where bf16 is
native (``qkv.ops.cpu.cpu_bf16``: bf16 matmul instructions reported and a probe that finds a
bf16 matmul at least as fast as fp32 in this process). Where it is not native (bf16 matmuls
were ~100x slower than fp32 on a CPU without them), it is refused with both measured figures
unless forced. Under torchrun every process decides for itself; the instruction sets are the
same on every rank of a node, and the probe only confirms them.

The CPU facts themselves live in ``qkv.ops.cpu`` (the decode engine reads them too); they are
re-exported here.
"""

from __future__ import annotations

import warnings

import torch

from ..ops.cpu import (
    BF16_ISA,
    CPUBF16,
    PROBE_ROUNDS,
    PROBE_SIZE,
    MatmulProbe,
    cpu_bf16,
    cpu_description,
    cpu_model_name,
    cpu_vector_extensions,
    probe_matmul,
)

__all__ = ["BF16_ISA", "CPUBF16", "PROBE_ROUNDS", "PROBE_SIZE", "MatmulProbe",
           "check_precision_device", "cpu_bf16", "cpu_description", "cpu_model_name",
           "cpu_vector_extensions", "probe_matmul"]


# --- the decision --------------------------------------------------------------------------------
def check_precision_device(precision: str, device: torch.device | str, *,
                           force: bool = False) -> None:
    """Refuse (or, with ``force``, warn about) computing in ``precision`` on ``device`` where
    it does not pay: bf16 on a CPU without native bf16 (``cpu_bf16().native``), with what was
    measured; fp16 on a CPU; bf16/fp16 on any device but CUDA and the CPU. fp32, CUDA and bf16
    on a native CPU pass silently.

    Raises:
        ValueError: one line naming the precision, the device and why, and how to force it.
    """
    device = torch.device(device)
    if precision == "fp32" or device.type == "cuda":
        return
    where = f"precision {precision!r} on device {str(device)!r}"
    if device.type == "cpu" and precision == "bf16":
        support = cpu_bf16()
        if support.native:
            return
        message = f"{where}: bf16 is not native on this CPU ({support})"
    elif device.type == "cpu":
        message = (f"{where}: {precision} matmuls on a CPU are slow and save no memory for "
                   f"the fp32 master weights and optimizer state")
    else:
        message = f"{where}: qkv trains in {precision} on CUDA (and bf16 on native CPUs) only"
    if not force:
        raise ValueError(message + "; use --precision fp32 here, or force it "
                                   "(--force-precision, Trainer(force_precision=True))")
    warnings.warn(message + " (forced)", UserWarning, stacklevel=3)
