"""``qkv.models.clip_loss`` against the formula written here (fp64), and under
torch.distributed: 2 gloo processes (torch.multiprocessing, as tests/train/test_distributed.py
does for DDP) give the loss and the gradients of 1 process on the global batch
(open_clip's test_training_clip: gather with grad + local loss).

Shapes: B local batch, W processes, E embedding width.
Tolerances: fp64 atol 1e-12; across processes (another reduction order) atol 1e-10 fp64.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qkv.models import clip_loss
from qkv.train.distributed import settle_gloo_workers


def formula(img: torch.Tensor, txt: torch.Tensor, scale) -> torch.Tensor:
    """(1/2B) Σ_i [-log softmax_j(s cos(I_i, T_j))_i - log softmax_j(s cos(T_i, I_j))_i]."""
    i = img / img.norm(dim=1, keepdim=True)
    t = txt / txt.norm(dim=1, keepdim=True)
    sim = scale * (i @ t.T)  # (B, B): rows images, columns texts
    diag = sim.diagonal()
    per_image = torch.logsumexp(sim, dim=1) - diag
    per_text = torch.logsumexp(sim, dim=0) - diag
    return (per_image.mean() + per_text.mean()) / 2


@pytest.mark.parametrize("b, e", [(1, 4), (2, 3), (7, 16)])
def test_equals_formula_loss_and_grads(b, e):
    torch.manual_seed(b)
    img = torch.randn(b, e, dtype=torch.float64, requires_grad=True)
    txt = torch.randn(b, e, dtype=torch.float64, requires_grad=True)
    log_s = torch.tensor([math.log(1 / 0.07)], dtype=torch.float64, requires_grad=True)
    loss = clip_loss(img, txt, log_s.exp())
    assert loss.dim() == 0
    want = formula(img, txt, log_s.exp())
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-12)
    g = torch.autograd.grad(loss, (img, txt, log_s))
    gw = torch.autograd.grad(want, (img, txt, log_s))
    for a, w in zip(g, gw, strict=True):
        torch.testing.assert_close(a, w, atol=1e-12, rtol=1e-10)


def test_scale_float_and_fp32_inputs_and_unnormalised():
    torch.manual_seed(0)
    img, txt = torch.randn(5, 8), torch.randn(5, 8)
    want = formula(img.double(), txt.double(), 10.0)
    torch.testing.assert_close(clip_loss(img, txt, 10.0).double(), want, atol=5e-6, rtol=5e-6)
    # normalising the inputs first changes nothing: the loss normalises them itself
    torch.testing.assert_close(clip_loss(3 * img, txt / 7, torch.tensor(10.0)),
                               clip_loss(img, txt, 10.0))
    bf = clip_loss(img.bfloat16(), txt.bfloat16(), 10.0)
    assert bf.dtype == torch.float32 and torch.isfinite(bf)


def test_gradcheck_fp64():
    torch.manual_seed(1)
    img = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    txt = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    s = torch.tensor([5.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(clip_loss, (img, txt, s))


@pytest.mark.parametrize("args, err, msg", [
    ((torch.randn(3, 4), torch.randn(2, 4), 1.0), ValueError, "same shape"),
    ((torch.randn(3), torch.randn(3), 1.0), ValueError, r"image_embeds must have shape \(B, E\)"),
    ((torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.long), 1.0), TypeError, "text_embeds"),
    ((torch.randn(3, 4), torch.randn(3, 4), torch.ones(2)), ValueError, "logit_scale.*1-element"),
    ((torch.randn(3, 4), torch.randn(3, 4), "10"), TypeError, "logit_scale"),
])
def test_bad_arguments(args, err, msg):
    with pytest.raises(err, match=msg):
        clip_loss(*args)


# --- two processes ------------------------------------------------------------------------
W, B, E = 2, 3, 5


def _global_batch():
    g = torch.Generator().manual_seed(123)
    feats = torch.randn(W * B, 6, generator=g, dtype=torch.float64)  # tower outputs
    text = torch.randn(W * B, 6, generator=g, dtype=torch.float64)
    proj = torch.randn(E, 6, generator=g, dtype=torch.float64)  # a shared parameter
    return feats, text, proj


def _one_process():
    feats, text, proj = _global_batch()
    proj = proj.clone().requires_grad_(True)
    log_s = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    img = feats @ proj.T
    loss = clip_loss(img, text @ proj.T, log_s.exp())
    loss.backward()
    return loss.detach(), proj.grad, log_s.grad


def _worker(rank: int, init_file: str, out_dir: str, unequal: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=W)
    try:
        feats, text, proj = _global_batch()
        rows = slice(rank * B, (rank + 1) * B)
        if unequal and rank == 1:
            rows = slice(rank * B, (rank + 1) * B - 1)
        proj = proj.clone().requires_grad_(True)
        log_s = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
        try:
            loss = clip_loss(feats[rows] @ proj.T, text[rows] @ proj.T, log_s.exp())
        except ValueError as err:
            torch.save({"error": str(err)}, os.path.join(out_dir, f"{rank}.pt"))
            return
        loss.backward()
        # what DDP does with parameter gradients: the mean over processes
        for g in (proj.grad, log_s.grad):
            dist.all_reduce(g)
            g /= W
        losses = [torch.zeros(()) for _ in range(W)]
        dist.all_gather(losses, loss.detach().float())
        torch.save({"loss": loss.detach(), "proj": proj.grad, "scale": log_s.grad},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        settle_gloo_workers(timeout_s=10)  # no worker may still need the GIL (the gloo deadlock)
        dist.destroy_process_group()


def _spawn(unequal: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(init, tmp, unequal), nprocs=W, join=True)
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=True) for r in range(W)]


def test_two_gloo_processes_equal_one_process():
    loss, g_proj, g_scale = _one_process()
    res = _spawn()
    # mean of the local losses == the loss of the global batch
    mean_loss = sum(r["loss"] for r in res) / W
    torch.testing.assert_close(mean_loss, loss, atol=1e-10, rtol=1e-10)
    for r in res:  # the averaged gradients are one process's, on every rank
        torch.testing.assert_close(r["proj"], g_proj, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(r["scale"], g_scale, atol=1e-10, rtol=1e-10)


def test_two_processes_with_different_batches_raise():
    res = _spawn(unequal=True)
    for r in res:
        assert "same local batch" in r["error"] and "[3, 2]" in r["error"]
