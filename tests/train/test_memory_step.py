"""``qkv.train.memory.check_step_fits``: the memory check a new run makes before anything is
built for real — one micro-batch of this process's rows, the parameters split over the
processes under fsdp — against figures worked out by hand here."""

from types import SimpleNamespace

import pytest
from torch import nn

from qkv.train import memory as memory_module
from qkv.train.memory import MemoryEstimate, check_step_fits


class _Kind:
    """A model kind whose estimate is fixed bytes; records the batch it was asked about."""

    def __init__(self, parts: dict[str, int]) -> None:
        self.parts, self.asked = parts, []

    def estimate_memory(self, model, *, batch_size, seq_len, eval_examples):
        self.asked.append((batch_size, seq_len, eval_examples))
        return MemoryEstimate(self.parts)


def _config(**changes):
    base = dict(batch_size=24, grad_accum=3, eval_examples=5, fsdp=False,
                activation_checkpointing=False, model="gpt")
    return SimpleNamespace(**{**base, **changes})


def test_one_micro_batch_of_this_processes_rows_is_estimated():
    kind = _Kind({"parameters": 100, "activations": 50})
    est = check_step_fits(kind, nn.Linear(2, 2), _config(), processes=4, seq_len=9, max_len=16,
                          device=None)
    assert kind.asked == [(2, 9, 5)]  # 24 rows / 4 processes / 3 micro-batches
    assert est.total == 150  # no fsdp, no checkpointing: the kind's figure as it is


def test_fsdp_splits_the_parameters_over_the_processes():
    model = nn.Linear(3, 4)  # 16 numbers, no Transformer layers: all in the root group
    est = check_step_fits(_Kind({"parameters": 10**6}), model, _config(fsdp=True),
                          processes=2, seq_len=9, max_len=16, device=None)
    # (4 bytes weights + 12 bytes gradient and AdamW moments) x 16 / 2, plus the root group
    # gathered whole: 4 x 16
    assert est["parameters"] == 16 * 16 // 2 + 4 * 16


def test_a_step_that_cannot_fit_is_refused_naming_what_was_checked(monkeypatch):
    monkeypatch.setattr(memory_module, "available_bytes", lambda device=None: 1000)
    kind = _Kind({"parameters": 600, "activations": 600})
    with pytest.raises(ValueError, match=r"^fine-tuning gpt \(max_len=16\) needs at least "
                                         r".*batch_size=8 x 9 tokens"):
        check_step_fits(kind, nn.Linear(2, 2), _config(grad_accum=1), processes=3, seq_len=9,
                        max_len=16, device=None, doing="fine-tuning")
    assert check_step_fits(_Kind({"parameters": 999}), nn.Linear(2, 2), _config(),
                           processes=1, seq_len=9, max_len=16, device=None).total == 999
