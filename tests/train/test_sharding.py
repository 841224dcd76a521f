"""FSDP2 sharding, gradient accumulation, activation checkpointing and the precision policy
(``qkv.train.sharding``).

Oracle: one process, the plain (unsharded, unwrapped) model on the whole global batch, its
mean token loss ``loss_sum / count`` backpropagated directly, ``clip_grad_norm_``, AdamW —
written here apart from ``accumulate_gradients``. Two gloo processes (``_spawn``) sharding
the same initial weights must give the same losses and final weights: rel 1e-5 (fp32, the
same math reduced in another order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _spawn import assert_weights_match, spawn
from safetensors.torch import load_file, save_file
from torch import nn

from qkv.models import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
from qkv.models.clip import CLIP, CLIPConfig
from qkv.train.sharding import (
    accumulate_gradients,
    apply_activation_checkpointing,
    autocast,
    find_layers,
    grad_norm_,
    no_gradient_sync,
    precision_policy,
    saved_activation_bytes,
    shard_model,
    split_batch,
)

B = 8  # the global batch (4 rows per rank with 2 processes)
STEPS = {"gpt": 3, "bert": 1, "transformer": 1}
CLIP_NORM = 0.5  # small enough to clip (checked in the oracle: the norms exceed it)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=64, max_len=16, dim=32))
    if kind == "bert":
        return BERT(BERTConfig.from_name("bert-tiny", vocab_size=64, max_len=16, dim=32,
                                         ffn_hidden=64, dropout=0.0, attn_dropout=0.0,
                                         with_pooler=False))
    return Transformer(TransformerConfig.from_name("transformer-tiny", share_embeddings=True))


def batch(kind: str, step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: random ids, some targets ignored (-100), rows of unequal
    token counts (so the global normalisation matters)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, 60 if kind != "transformer" else 30, (B, 12), generator=g)
    drop = torch.rand(B, 12, generator=g) < torch.linspace(0.0, 0.8, B)[:, None]
    if kind == "gpt":
        return {"ids": ids, "targets": ids.roll(-1, 1).masked_fill(drop, -100)}
    if kind == "bert":  # the last rows padded: BERT runs its layers on packed token rows
        keep = torch.ones_like(ids).index_fill_(0, torch.tensor([B - 2, B - 1]), 0)
        keep[:, :9] = 1
        labels = ids.masked_fill(drop | (torch.rand(B, 12, generator=g) < 0.5), -100)
        return {"ids": ids, "attention_mask": keep, "labels": labels.masked_fill(keep == 0, -100)}
    return {"src": ids, "tgt_in": ids.flip(1), "tgt_out": ids.roll(-1, 1).masked_fill(drop, -100)}


def objective(kind: str, model: nn.Module, b: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's objective, written here: the summed token cross-entropy (in the model's
    dtype) and the number of predicted tokens."""
    if kind == "gpt":
        logits, target = model(b["ids"]), b["targets"]
    elif kind == "bert":
        logits, target = model.masked_lm(b["ids"], b["attention_mask"]), b["labels"]
    else:
        logits, target = model(b["src"], b["tgt_in"]), b["tgt_out"]
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                           reduction="sum")
    return loss, (target != -100).sum()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with eps 1e-6: a gradient that is zero in exact math (the attention's key bias)
    is rounding noise of ~1e-10 that summation order changes; eps 1e-8 would turn it into
    steps of ±lr in either direction."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def oracle(kind: str, steps: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, the mean loss backpropagated as is."""
    model = build(kind)
    opt = optimizer(model)
    losses, norms = [], []
    for step in range(steps):
        loss_sum, count = objective(kind, model, batch(kind, step))
        loss = loss_sum / count
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_rows(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = B // world
    return {k: t[rank * per:(rank + 1) * per] for k, t in b.items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state of a possibly sharded model, on every rank."""
    out = {}
    for k, v in model.state_dict().items():
        full = getattr(v, "full_tensor", None)
        out[k] = (full() if full is not None else v).detach().clone()
    return out


def _train_worker(rank: int, world: int, out: str, runs: list[tuple[str, str, int]]) -> None:
    """Each run (kind, "fsdp" | "ddp", K): train STEPS[kind] steps on this rank's rows; rank 0
    writes the losses, grad norms and final full weights."""
    import torch.distributed as dist

    for kind, how, k in runs:
        model = build(kind)
        if how != "ddp":  # "fsdp"; "offload": CPU offload, kept gathered after forward;
            # "bf16": computed in bf16 (forced on a CPU), reduced in fp32
            policy = precision_policy("bf16", "cpu", force=True) if how == "bf16" else None
            shard_model(model, offload=how == "offload", mp_policy=policy,
                        reshard_after_forward=how != "offload")
            assert model.get_parameter(_tied(kind)[0]) is model.get_parameter(_tied(kind)[1])
            wrapped: nn.Module = model
            step_fn = lambda b, m=model, kd=kind: objective(kd, m, b)
        else:
            wrapped = _DDPObjective(kind, model)
            wrapped = nn.parallel.DistributedDataParallel(wrapped)
            step_fn = wrapped
        opt = optimizer(model)
        losses, norms = [], []
        for step in range(STEPS[kind]):
            micro = split_batch(local_rows(batch(kind, step), rank, world), k)
            loss_sum, total = accumulate_gradients(step_fn, micro, model=wrapped,
                                                   world_size=world)
            dist.all_reduce(loss_sum)
            norms.append(grad_norm_(model.parameters(), CLIP_NORM))
            opt.step()
            opt.zero_grad()
            losses.append((loss_sum / total).item())
        state = full_state(model)
        if rank == 0:
            name = f"{kind}-{how}-{k}"
            Path(out, f"{name}.json").write_text(json.dumps({"losses": losses, "norms": norms}))
            save_file({n: t.contiguous() for n, t in state.items() if n not in _tied(kind)[1:]},
                      str(Path(out, f"{name}.safetensors")))


class _DDPObjective(nn.Module):
    def __init__(self, kind: str, model: nn.Module) -> None:
        super().__init__()
        self.kind, self.model = kind, model

    def forward(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return objective(self.kind, self.model, b)


def _tied(kind: str) -> tuple[str, ...]:
    return {"gpt": ("embed.weight", "lm_head.weight"),
            "bert": ("word_embeddings.weight", "word_embeddings.weight"),
            "transformer": ("src_embed.weight", "tgt_embed.weight", "lm_head.weight")}[kind]


RUNS = [("gpt", "fsdp", 1), ("gpt", "fsdp", 2), ("gpt", "ddp", 2), ("gpt", "offload", 1),
        ("gpt", "bf16", 1), ("bert", "fsdp", 1), ("transformer", "fsdp", 2)]


@pytest.mark.slow  # 2 spawned processes: 20-40 s on 2 shared cores
def test_two_fsdp_ranks_match_one_process(tmp_path):
    errors = spawn(_train_worker, 2, tmp_path, str(tmp_path), RUNS)
    assert errors == ["", ""], "\n".join(errors)
    for kind in STEPS:
        want_losses, want_norms, want_state = oracle(kind, STEPS[kind])
        assert max(want_norms) > CLIP_NORM  # the clipping is exercised
        for name in (f"{kind}-{how}-{k}" for kd, how, k in RUNS if kd == kind):
            got = json.loads((tmp_path / f"{name}.json").read_text())
            if "bf16" in name:  # bf16 matmuls (8-bit mantissa): the fp32 losses within 2 %
                assert got["losses"] == pytest.approx(want_losses, rel=2e-2), name
                assert got["losses"] != pytest.approx(want_losses, rel=1e-6), name
                continue
            assert got["losses"] == pytest.approx(want_losses, rel=1e-5), name
            assert got["norms"] == pytest.approx(want_norms, rel=1e-5), name
            state = load_file(str(tmp_path / f"{name}.safetensors"))
            assert set(state) | set(_tied(kind)[1:]) == set(want_state)
            for key, t in state.items():
                assert_weights_match(t, want_state[key], rtol=1e-5, atol=1e-6, lr=1e-2,
                                     steps=STEPS[kind], what=f"{name} {key}")


def _clip_worker(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)
    model = CLIP(CLIPConfig.from_name("clip-tiny"))
    torch.manual_seed(1)
    pixels, ids = torch.randn(3, 3, 32, 32), torch.randint(0, 500, (3, 8))
    ids[:, -1] = model.config.text.eos_token_id
    shard_model(model)
    assert len(find_layers(model)) == 4  # both towers
    logits = model(pixels, ids).logits_per_image.detach()
    emb = model.encode_text(ids).detach()  # a registered forward method
    clip_loss = model.loss(pixels, ids)  # another, with a backward through both towers
    clip_loss.backward()
    gpt = shard_model(build("gpt"))
    b = batch("gpt", 0)
    gpt_loss = gpt.loss(b["ids"], b["targets"])  # GPT.loss (calls hidden_states: nested)
    gpt_loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in gpt.named_parameters()}
    if rank == 0:
        save_file({"logits": logits.contiguous(), "text": emb.contiguous().clone(),
                   "clip_loss": clip_loss.detach().reshape(1),
                   "gpt_loss": gpt_loss.detach().reshape(1),
                   **{f"grad.{n}": g.contiguous() for n, g in grads.items()}},
                  str(Path(out, "clip.safetensors")))


@pytest.mark.slow  # 2 spawned processes: 20-40 s on 2 shared cores
def test_clip_and_other_entry_points_shard(tmp_path):
    """CLIP's two towers, its encode_text / loss, GPT.loss: the methods training calls
    besides forward get FSDP's gather too (same outputs and gradients as unsharded)."""
    errors = spawn(_clip_worker, 2, tmp_path, str(tmp_path))
    assert errors == ["", ""], "\n".join(errors)
    torch.manual_seed(0)
    model = CLIP(CLIPConfig.from_name("clip-tiny"))
    torch.manual_seed(1)
    pixels, ids = torch.randn(3, 3, 32, 32), torch.randint(0, 500, (3, 8))
    ids[:, -1] = model.config.text.eos_token_id
    got = load_file(str(tmp_path / "clip.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(pixels, ids).logits_per_image,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["text"], model.encode_text(ids), rtol=1e-5, atol=1e-5)
        # under a process group CLIP's loss gathers both ranks' pairs (the same 3 here):
        # the one-process loss of the 6 pairs
        torch.testing.assert_close(got["clip_loss"][0],
                                   model.loss(torch.cat([pixels, pixels]), torch.cat([ids, ids])),
                                   rtol=1e-5, atol=1e-6)
    gpt = build("gpt")
    b = batch("gpt", 0)
    loss = gpt.loss(b["ids"], b["targets"])
    loss.backward()
    torch.testing.assert_close(got["gpt_loss"][0], loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in gpt.named_parameters():  # both ranks ran the same rows: the mean is the same
        torch.testing.assert_close(got[f"grad.{n}"], p.grad, rtol=1e-5, atol=1e-7, msg=n)


# --- one process ---------------------------------------------------------------------------------
def test_zero_dim_parameter_refused():
    model = build("gpt")
    model.scale = nn.Parameter(torch.tensor(1.0))  # 0-dim: fully_shard cannot split it
    with pytest.raises(ValueError, match=r"0-dim parameters.*'scale'"):
        shard_model(model)


def test_layers_found_in_every_model():
    assert len(find_layers(build("gpt"))) == 2
    assert len(find_layers(build("bert"))) == 2
    tr = build("transformer")
    assert find_layers(tr) == [*tr.encoder_layers, *tr.decoder_layers]
    with pytest.raises(ValueError, match="no EncoderLayer/DecoderLayer"):
        shard_model(nn.Linear(2, 2))


@pytest.mark.parametrize("kind", sorted(STEPS))
def test_grad_accumulation_equals_full_batch(kind):
    """K micro-batches (global-count normalisation) == the whole batch's mean loss: gradients
    in fp64, for K = 2 and 4 (unequal token counts per micro-batch)."""
    want = build(kind).double()
    loss_sum, count = objective(kind, want, batch(kind, 0))
    (loss_sum / count).backward()
    for k in (2, 4):
        model = build(kind).double()
        step_fn = lambda b, m=model: objective(kind, m, b)
        got_sum, total = accumulate_gradients(step_fn, split_batch(batch(kind, 0), k))
        assert int(total) == int(count)
        torch.testing.assert_close(got_sum / total, (loss_sum / count).detach(),
                                   rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(model.named_parameters(), want.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_split_batch_refuses_a_non_divisor():
    with pytest.raises(ValueError, match="grad_accum 3 does not divide"):
        split_batch(batch("gpt", 0), 3)
    with pytest.raises(ValueError, match="grad_accum must be a positive integer, got 0"):
        split_batch(batch("gpt", 0), 0)


def test_no_gradient_sync_is_a_no_op_for_a_plain_module():
    m = nn.Linear(2, 2)
    with no_gradient_sync(m):
        m(torch.ones(1, 2)).sum().backward()
    assert m.weight.grad is not None


@pytest.mark.parametrize("kind", sorted(STEPS))
def test_activation_checkpointing_gradients_equal_plain(kind):
    """fp64, dropout on (the recomputation must replay the same dropout masks)."""
    def run(checkpointed: bool) -> tuple[dict[str, torch.Tensor], int]:
        model = build(kind).double().train()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.2
        if checkpointed:
            assert apply_activation_checkpointing(model) == len(find_layers(model))
            assert apply_activation_checkpointing(model) == 0  # idempotent
        torch.manual_seed(5)
        with saved_activation_bytes() as saved:
            loss_sum, count = objective(kind, model, batch(kind, 0))
        (loss_sum / count).backward()
        return {n: p.grad for n, p in model.named_parameters()}, saved[0]

    plain, plain_bytes = run(False)
    ckpt, ckpt_bytes = run(True)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-12, atol=1e-14, msg=name)
    assert ckpt_bytes < plain_bytes  # only the layers' inputs kept


def test_checkpointed_model_keeps_its_state_dict_keys_and_inference():
    model = build("gpt").eval()
    keys = list(model.state_dict())
    ids = batch("gpt", 0)["ids"]
    with torch.no_grad():
        want = model(ids)
    apply_activation_checkpointing(model)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, rtol=0, atol=0)


def test_precision_policy(monkeypatch):
    from qkv.train.precision import CPUBF16, MatmulProbe

    # a CPU without native bf16 (native ones train bf16: tests/train/test_bf16_cpu.py)
    monkeypatch.setattr("qkv.train.precision.cpu_bf16", lambda: CPUBF16(
        "no bf16", (), MatmulProbe(512, bf16_gflops=1.0, fp32_gflops=100.0)))
    assert precision_policy("fp32", "cpu") is None
    for p in ("bf16", "fp16"):
        with pytest.raises(ValueError, match=f"precision '{p}' on device 'cpu'"):
            precision_policy(p, "cpu")
        with pytest.warns(UserWarning, match="forced"):
            policy = precision_policy(p, "cpu", force=True)
        assert policy.param_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[p]
        assert policy.reduce_dtype == torch.float32
    cuda = precision_policy("bf16", "cuda")  # only builds the policy: no device needed
    assert (cuda.param_dtype, cuda.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        precision_policy("fp8", "cpu")
    with autocast("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
