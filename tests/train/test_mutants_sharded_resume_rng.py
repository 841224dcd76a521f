"""A sharded (DCP) resume of a run with dropout, in a fresh process, continues exactly as the
run that never stopped: same losses, same weights, bit for bit.

Dropout draws from torch's global RNG, so the resumed run matches only if
``load_sharded_checkpoint`` puts back the RNG state of the save. Resuming in the process that
saved can hide a missing restore (the RNG may be where the save left it); a fresh process
starts from another state (seeded differently below, on purpose).

Oracle: the uninterrupted run, in this process (its RNG forked, so the test leaves the global
RNG as it found it). The fresh process runs on as many torch threads as this one, but may
still sum in another order (one CI run: 4.160905361 vs 4.160904884 at the last step): losses
within rel 1e-5, weights within rtol 1e-5 / atol 1e-6 but for Adam's rare sign flip
(``assert_weights_match``). A lost RNG state moves the losses by ~4e-3 (4.198 vs 4.183).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _spawn import assert_weights_match
from safetensors.torch import load_file
from torch import nn

from qkv.models import GPT, GPTConfig
from qkv.train.sharded_checkpoint import save_sharded_checkpoint

STEPS, STOP = 6, 3
LR = 1e-2  # the optimizer's, in COMMON below

COMMON = """
import torch
from torch import nn


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(100 + step)  # the batch of a step: its own generator
    ids = torch.randint(0, 64, (4, 12), generator=g)
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()
"""

RESUME = """
import json, sys
import torch
from safetensors.torch import save_file
from common import optimizer, train_step
from qkv.train.sharded_checkpoint import build_checkpoint_model, load_sharded_checkpoint

run, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(424242)  # anything but the state at the save
model = build_checkpoint_model(run + "/checkpoint")
opt = optimizer(model)
start = load_sharded_checkpoint(run, model=model, optimizer=opt)["step"]
model.train()
losses = [train_step(model, opt, s) for s in range(start, steps)]
save_file({k: v.clone() for k, v in model.state_dict().items()}, out + ".safetensors")
with open(out + ".json", "w") as f:
    json.dump(losses, f)
"""

ns: dict = {}
exec(COMMON, ns)  # the same step code here and in the fresh process
optimizer, train_step = ns["optimizer"], ns["train_step"]


def _model() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("gpt-tiny", vocab_size=64, max_len=16, dim=32, dropout=0.3,
                              attn_dropout=0.2)
    return GPT(cfg).train()


def _run(steps: int, save_to: Path | None = None) -> tuple[list[float], nn.Module]:
    with torch.random.fork_rng(devices=[]):
        model = _model()
        opt = optimizer(model)
        torch.manual_seed(1)
        losses = []
        for s in range(steps):
            losses.append(train_step(model, opt, s))
            if save_to is not None and s + 1 == STOP:
                save_sharded_checkpoint(save_to, model=model, optimizer=opt, step=STOP)
                return losses, model
    return losses, model


@pytest.mark.slow  # a fresh Python process importing torch: 5-15 s on 2 shared cores
def test_sharded_resume_with_dropout_in_a_fresh_process(tmp_path):
    full_losses, full_model = _run(STEPS)
    first_losses, _ = _run(STEPS, save_to=tmp_path / "run")
    assert first_losses == full_losses[:STOP]
    (tmp_path / "common.py").write_text(COMMON)
    (tmp_path / "resume.py").write_text(textwrap.dedent(RESUME))
    out = tmp_path / "resumed"
    proc = subprocess.run([sys.executable, str(tmp_path / "resume.py"), str(tmp_path / "run"),
                           str(out), str(STEPS)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env={**os.environ,
                                                   "OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert proc.returncode == 0, f"resume process failed:\n{proc.stderr[-4000:]}"
    resumed = json.loads(Path(str(out) + ".json").read_text())
    assert len(resumed) == STEPS - STOP
    assert first_losses + resumed == pytest.approx(full_losses, rel=1e-5), (
        f"resumed losses {resumed} != uninterrupted {full_losses[STOP:]}")
    weights = load_file(str(out) + ".safetensors")
    for name, t in full_model.state_dict().items():
        assert_weights_match(weights[name], t, rtol=1e-5, atol=1e-6, lr=LR, steps=STEPS,
                             what=name)
