"""``KVCache`` buffers are uninitialised (``torch.empty``): every decode path must write a
position before reading it. Here the buffers are filled with NaN right after the stepper
makes them, and the logits must equal those of an untouched stepper exactly — the decode
engine's stepper (``decoder_stepper``; one row: the fp32 C layer or, kernels off, the torch
backend; six padded rows: oneDNN packed or, where this torch cannot pack, the torch backend,
with the C attention kernel or torch's) and the generic stepper over the model's modules.

Shapes: R rows, N prompt length, V vocab size.
"""

from __future__ import annotations

import pytest
import torch
from _fast_gpt_models import left_padded, tiny_gpt

from qkv.generation.engine import decoder_stepper
from qkv.generation.steppers import GPTStepper

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _poison(cache) -> None:
    for kc in cache:
        kc.keys.fill_(float("nan"))
        kc.values.fill_(float("nan"))


def _logits(make, poison: bool, new: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        stepper = make()
        if poison:
            _poison(stepper.cache)
        out = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(new.shape[1])]
    return torch.stack(out, dim=1)  # (R, T + 1, V)


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("kw", [dict(), dict(positions="rope", num_kv_heads=2)],
                         ids=["gpt2", "rope-gqa"])
def test_unwritten_cache_positions_are_never_read(rows, kernels, kw, monkeypatch):
    if kernels == "off":
        for name in ("QKV_ATTN_KERNEL", "QKV_ROW_KERNEL", "QKV_GEMV_KERNEL"):
            monkeypatch.setenv(name, "0")
    monkeypatch.setattr("qkv.generation.linears.PACKED_MIN_WEIGHTS", 1)  # six rows: packed
    model = tiny_gpt(**kw)
    ids, keep = left_padded(rows=rows, n=7, shift=2)
    keep = keep if rows > 1 else None
    torch.manual_seed(3)
    new = torch.randint(3, 48, (rows, 6))
    for make in (lambda: decoder_stepper(model, ids, keep, ids.shape[1] + new.shape[1]),
                 lambda: GPTStepper(model, ids, keep, new.shape[1] + 1, use_cache=True)):
        clean = _logits(make, False, new)
        assert torch.isfinite(clean).all()
        assert torch.equal(_logits(make, True, new), clean)
