"""The "clip" model kind (``qkv.train.kinds.clip``) against oracles written here: batches
rebuilt from ``ShapesDataset`` and CLIP's normalisation constants, the symmetric InfoNCE
recomputed in fp64 from the model's own embeddings, zero-shot predictions recomputed by
hand (prompts spelled out here, one prompt at a time), a bit-identical resume, a folder of
PNGs, refusals, and two gloo processes against one.

Tolerances: the fp32 loss against fp64: rtol 1e-5 (seen ~1e-7); two processes against one:
rel 1e-5 on each step's loss (the same math summed in another order).
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_bounded
from qkv.cli import main
from qkv.data import ShapesDataset
from qkv.data.clip_text import encode_texts
from qkv.data.image_preprocess import to_pixel_values
from qkv.data.shapes import COLOURS, COMBINATIONS, SHAPES
from qkv.data.shapes_pairs import ShapesPairs
from qkv.models import CLIP
from qkv.train import TrainConfig, Trainer, load_run
from qkv.train.config import ConfigError
from qkv.train.kinds import get_kind
from qkv.train.kinds.clip import shapes_zero_shot_accuracy as zero_shot_accuracy

MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's statistics, typed in again
STD = (0.26862954, 0.26130258, 0.27577711)


def config(**kw) -> TrainConfig:
    base = dict(model="clip", task="shapes", preset="clip-tiny", steps=4, batch_size=8,
                lr=3e-3, warmup=1, schedule="constant", eval_every=2, eval_examples=8)
    return TrainConfig(**{**base, **kw})


def quiet() -> dict:
    return dict(progress=False, log=lambda line: None)


def step_losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(config(), tmp_path / "run", **quiet())
    yield t
    t.close()


# --- batches ----------------------------------------------------------------------------
def test_a_batch_is_the_steps_examples_of_the_train_split(trainer):
    """Step s holds examples s·B .. s·B + B - 1 of ShapesDataset("train", language="both"):
    images normalised with CLIP's mean/std, captions as bos + chars + eos, padded, masked."""
    kind, tok, b = trainer.kind, trainer.tokenizer, 8
    ds = ShapesDataset("train", size=10**6, seed=0, language="both")
    batch = trainer._batch(3)
    assert torch.equal(trainer._batch(3)["pixel_values"], batch["pixel_values"])
    assert not torch.equal(trainer._batch(4)["pixel_values"], batch["pixel_values"])
    want = ds.batch(range(3 * b, 4 * b))
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    torch.testing.assert_close(batch["pixel_values"], (want.images - mean) / std,
                               rtol=0, atol=1e-6)
    _, captions = trainer.data.train(3 * b, b)
    for caption, own, lab in zip(captions, want.captions, want.labels, strict=True):
        assert caption == own or caption in prompts_of(lab), (caption, own)
    rows = [[tok.bos_id, *tok.encode(c), tok.eos_id] for c in captions]
    width = max(map(len, rows))
    assert batch["input_ids"].tolist() == [r + [tok.pad_id] * (width - len(r)) for r in rows]
    assert batch["attention_mask"].tolist() == [[True] * len(r) + [False] * (width - len(r))
                                                for r in rows]
    assert {"zh", "en"} == {lab["language"] for lab in ds.batch(range(64)).labels}
    again = kind.make_batch(trainer.data.train(3 * b, b), tok, step=3, seed=0)
    assert all(torch.equal(again[k], batch[k]) for k in batch)


ZH_COLOUR = {"red": "红色", "green": "绿色", "blue": "蓝色", "yellow": "黄色", "purple": "紫色",
             "orange": "橙色"}
ZH_SHAPE = {"circle": "圆形", "square": "正方形", "triangle": "三角形", "star": "星形",
            "cross": "十字形"}


def prompts_of(labels: dict) -> set[str]:
    """The zero-shot prompts of an example's (colour, shape) in its language, typed here."""
    colour, shape = labels["colour"], labels["shape"]
    if labels["language"] == "zh":
        c, s = ZH_COLOUR[colour], ZH_SHAPE[shape]
        return {f"一张{c}{s}的照片", f"一个{c}{s}", f"{c}{s}"}
    a = "an" if colour[0] in "aeiou" else "a"
    return {f"a photo of {a} {colour} {shape}", f"{a} {colour} {shape}",
            f"a picture of {a} {colour} {shape}"}


def test_a_quarter_of_the_shapes_captions_are_prompts_of_their_combination():
    """Training captions: the dataset's own, or (about 1/4, by a coin of (seed, index)) one of
    the zero-shot prompts of the example's colour and shape in its caption's language — so
    that the prompts zero-shot reads are a form of text the tower was trained on. Never a
    held-out combination; the same captions every time (resume)."""
    n = 2000
    data = ShapesPairs(image_size=32, seed=1)
    ds = ShapesDataset("train", size=10**6, seed=1, language="both")
    want = ds.batch(range(500, 500 + n))
    _, captions = data.train(500, n)
    assert captions == data.train(500, n)[1]
    assert data.train(700, 5)[1] == captions[200:205]  # per index, not per batch
    replaced = [c != own for c, own in zip(captions, want.captions, strict=True)]
    for caption, own, lab, swap in zip(captions, want.captions, want.labels, replaced,
                                       strict=True):
        assert caption in (prompts_of(lab) if swap else {own}), (caption, own, lab)
    share = sum(replaced) / n  # binomial: sd = sqrt(.25 * .75 / 2000) = 0.0097
    assert 0.25 - 0.04 < share < 0.25 + 0.04, share
    langs = {want.labels[i]["language"] for i in range(n) if replaced[i]}
    assert langs == {"en", "zh"}
    assert len({c for c, swap in zip(captions, replaced, strict=True) if swap}) > 100
    plain = ShapesPairs(image_size=32, seed=1, prompt_share=0.0).train(500, 50)[1]
    assert plain == want.captions[:50]
    with pytest.raises(ValueError, match=r"prompt_share must be a number in \[0, 1\], got 1.5"):
        ShapesPairs(image_size=32, prompt_share=1.5)


def test_public_helpers_refuse_what_they_cannot_read(trainer):
    with pytest.raises(ValueError, match=r"images must have shape \(B, 3, H, W\)"):
        to_pixel_values(torch.zeros(3, 8, 8))
    with pytest.raises(TypeError, match="floating in"):
        to_pixel_values(torch.zeros(1, 3, 8, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="texts must be a non-empty list"):
        encode_texts(trainer.tokenizer, "a red circle")


# --- the loss ---------------------------------------------------------------------------
def _info_nce_fp64(image: torch.Tensor, text: torch.Tensor, log_scale: torch.Tensor) -> float:
    """(CE(s·ÎT̂ᵀ, i) + CE(s·T̂Îᵀ, i)) / 2, written out in fp64 with logsumexp."""
    img = image.double() / image.double().norm(dim=1, keepdim=True)
    txt = text.double() / text.double().norm(dim=1, keepdim=True)
    logits = math.exp(float(log_scale.detach())) * img @ txt.t()  # (B, B)
    diag = logits.diagonal()
    per_image = (torch.logsumexp(logits, dim=1) - diag).mean()
    per_text = (torch.logsumexp(logits, dim=0) - diag).mean()
    return float((per_image + per_text) / 2)


def test_the_loss_is_the_symmetric_info_nce_of_the_models_embeddings(trainer):
    model, batch = trainer.model, trainer._batch(0)
    with torch.no_grad():
        model.logit_scale.fill_(3.0)  # far from log(1/0.07): the scale must reach the loss
        loss_sum, count = trainer.kind.loss(model, batch)
        ref = copy.deepcopy(model).double()
        image = ref.encode_image(batch["pixel_values"].double())
        text = ref.encode_text(batch["input_ids"], batch["attention_mask"])
    assert int(count) == 8 and count.dtype == torch.int64
    want = _info_nce_fp64(image, text, ref.logit_scale)
    assert float(loss_sum) / int(count) == pytest.approx(want, rel=1e-5)
    assert abs(want - _info_nce_fp64(image, text, torch.tensor(2.0))) > 1e-3


def test_training_lowers_the_loss_of_a_fixed_batch(tmp_path, monkeypatch):
    """The same 16 pairs every step: the contrastive loss starts near log(16) (chance) and
    must fall to nearly 0 (seen: 3.06 -> 0.01 in 40 steps)."""
    t = Trainer(config(steps=40, batch_size=16, eval_every=40, lr=1e-3), tmp_path / "run",
                **quiet())
    fixed = t.data.train(0, 16)
    monkeypatch.setattr(t.data, "train", lambda start, count: fixed)
    t.run()
    losses = step_losses(tmp_path / "run")
    assert losses[0] > 0.8 * math.log(16) and losses[-1] < 0.1, losses


def test_every_optimizer_step_clamps_the_logit_scale(trainer):
    with torch.no_grad():
        trainer.model.logit_scale.fill_(7.0)  # a multiplier of 1097 > 100
    trainer.train_step()
    assert float(trainer.model.logit_scale.detach()) == pytest.approx(math.log(100), abs=1e-6)


# --- runs: resume, load_run, evaluation -------------------------------------------------
def test_resume_after_an_interruption_is_bit_identical(tmp_path, monkeypatch):
    Trainer(config(), tmp_path / "whole", **quiet()).run()
    real_step = Trainer.train_step

    def crash_at_3(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config(), tmp_path / "cut", **quiet()).run()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    Trainer.resume(tmp_path / "cut", **quiet()).run()
    assert step_losses(tmp_path / "cut") == step_losses(tmp_path / "whole")
    a, b = load_run(tmp_path / "whole")[0].state_dict(), load_run(tmp_path / "cut")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_run_gives_a_clip_that_encodes_every_zero_shot_prompt(tmp_path):
    result = Trainer(config(steps=2), tmp_path / "run", **quiet()).run()
    assert set(result) == {"step", "eval_loss", "recall_at_1", "zero_shot_accuracy"}
    model, tok = load_run(tmp_path / "run")
    assert isinstance(model, CLIP) and not model.training
    from qkv.data.shapes import PROMPT_TEMPLATES, class_prompts

    prompts = [p for lang in ("en", "zh") for t in PROMPT_TEMPLATES[lang]
               for p in class_prompts(t, language=lang)]
    assert len(prompts) == 180
    ids, mask = encode_texts(tok, prompts)
    assert not (ids == tok.unk_id).any()  # every character of every prompt is known
    with torch.no_grad():
        emb = model.encode_text(ids, mask)
    assert emb.shape == (180, model.config.embed_dim) and torch.isfinite(emb).all()
    pre = json.loads((tmp_path / "run/checkpoint/preprocessor_config.json").read_text())
    assert pre["image_mean"] == list(MEAN) and pre["crop_size"]["height"] == 32


def _prompt(template: str, colour: str, shape: str) -> str:
    article = "an" if colour[0] in "aeiou" else "a"
    return template.format(a=article, colour=colour, shape=shape)


def test_zero_shot_accuracy_is_the_argmax_over_all_thirty_ensembled_classes(trainer):
    """Predictions recomputed by hand: the three English templates spelled out here, each
    prompt encoded alone (no padding), normalised, averaged per class, renormalised; images
    normalised here; argmax of the cosine similarity over the 30 combinations."""
    model, tok = trainer.model.eval(), trainer.tokenizer
    templates = ("a photo of {a} {colour} {shape}", "{a} {colour} {shape}",
                 "a picture of {a} {colour} {shape}")
    combinations = [(c, s) for c in COLOURS for s in SHAPES]  # the label order
    assert tuple(combinations) == COMBINATIONS
    images, labels = ShapesPairs(image_size=32, seed=0).test(12)
    with torch.no_grad():
        classes = []
        for colour, shape in combinations:
            rows = []
            for t in templates:
                ids = torch.tensor([[tok.bos_id, *tok.encode(_prompt(t, colour, shape)),
                                     tok.eos_id]])
                e = model.encode_text(ids).double()[0]
                rows.append(e / e.norm())
            mean = torch.stack(rows).mean(0)
            classes.append(mean / mean.norm())
        weights = torch.stack(classes)  # (30, E)
        mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
        img = model.encode_image((images - mean) / std).double()
        img = img / img.norm(dim=1, keepdim=True)
        predicted = (img @ weights.t()).argmax(dim=1)  # (12,)
        assert zero_shot_accuracy(model, tok, images, predicted) == 1.0
        assert zero_shot_accuracy(model, tok, images, (predicted + 1) % 30) == 0.0
        right = float((predicted == labels).float().mean())
        assert zero_shot_accuracy(model, tok, images, labels) == pytest.approx(right)
    result = trainer.kind.evaluate(model, tok, trainer.data, 12)
    assert result["zero_shot_accuracy"] == pytest.approx(right)
    assert 0.0 <= result["recall_at_1"] <= 1.0 and result["eval_loss"] > 0


# --- a folder of images -----------------------------------------------------------------
def test_a_folder_of_pngs_trains_and_resumes(tmp_path):
    from PIL import Image

    folder = tmp_path / "photos"
    folder.mkdir()
    lines = ["file\tcaption"]
    for i, (colour, rgb) in enumerate([("red", (220, 30, 30)), ("blue", (30, 70, 220))] * 4):
        size = (40 + 4 * i, 36)  # not square, not the model's size: resized and cropped
        Image.new("RGB", size, rgb).save(folder / f"img{i}.png")
        lines.append(f"img{i}.png\ta {colour} picture number {i}")
    (folder / "captions.tsv").write_text("\n".join(lines) + "\n")
    cfg = config(task=None, data=str(folder), steps=2, batch_size=4, eval_examples=4)
    result = Trainer(cfg, tmp_path / "run", **quiet()).run()
    assert set(result) == {"step", "eval_loss", "recall_at_1"} and result["step"] == 2
    info = json.loads((tmp_path / "run/run.json").read_text())
    assert info["data"] == str(folder.resolve()) and info["data_fingerprint"]["size"] > 0
    model, _ = load_run(tmp_path / "run")
    assert isinstance(model, CLIP)
    Trainer.resume(tmp_path / "run", steps=3, **quiet()).run()
    (folder / "captions.tsv").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(Exception, match="changed since the run"):
        Trainer.resume(tmp_path / "run", steps=4, **quiet())


def test_a_folder_holds_out_whole_images(tmp_path):
    """An image with several captions is either trained on or held out, never both; the
    training order is a seeded per-epoch permutation of the training lines."""
    from PIL import Image

    from qkv.data.folder_pairs import FolderPairs

    lines = []
    for i in range(20):
        Image.new("RGB", (8, 8), (10 * i, 0, 0)).save(tmp_path / f"{i}.png")
        lines += [f"{i}.png\tcaption {i}", f"{i}.png\tanother caption {i}"]
    (tmp_path / "captions.tsv").write_text("\n".join(lines))
    data = FolderPairs(str(tmp_path), image_size=16, seed=3)
    files = data.dataset.files
    held = {files[i] for i in data.held_rows}
    assert len(held) == 1 and len(data.held_rows) == 2  # 5 % of 20 images, both captions
    assert not held & {files[i] for i in data.train_rows}
    _, first_epoch = data.train(0, 38)
    assert sorted(first_epoch) == sorted(data.dataset.captions[i] for i in data.train_rows)
    images, again = data.train(0, 38)
    assert again == first_epoch and images.shape == (38, 3, 16, 16)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


# --- refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "field", "needle"), [
    (dict(model="clip", task="dates"), "task", "--model clip trains on --task shapes"),
    (dict(model="transformer", task="shapes"), "task", "trained by --model clip"),
    (dict(model="gpt", task="shapes"), "task", "trained by --model clip"),
    (dict(model="clip", task="shapes", init_from="somewhere"), "init_from",
     "not supported with --model clip"),
])
def test_wrong_task_and_model_combinations_are_refused(kw, field, needle):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**kw)
    assert exc.value.field == field and needle in str(exc.value)
    assert len(str(exc.value).splitlines()) == 1


def test_the_cli_refuses_a_text_task_for_clip_in_one_line(tmp_path, capsys):
    assert main(["train", "--model", "clip", "--task", "copy", "--out",
                 str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv train: error: --task:") and len(err.splitlines()) == 1, err
    assert "--model clip trains on --task shapes" in err and not (tmp_path / "run").exists()


def test_the_cli_trains_clip_on_shapes_by_default(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--model", "clip", "--preset", "clip-tiny", "--steps", "1",
            "--batch-size", "4", "--eval-examples", "4", "--no-progress", "--device", "cpu",
            "--out", str(run)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "qkv train: done (step 1, eval_loss" in out and "zero_shot_accuracy" in out
    assert json.loads((run / "run.json").read_text())["task"] == "shapes"


def test_a_huge_clip_run_is_refused_by_the_memory_check(tmp_path):
    with pytest.raises(ValueError, match=r"needs at least .* available"):
        Trainer(config(batch_size=10**7), tmp_path / "run", **quiet())
    assert not (tmp_path / "run").exists()
    kind = get_kind("clip")
    with torch.device("meta"):
        model = kind.build_model(config(preset="clip-shapes"), _Vocab(), 40)
    est = kind.estimate_memory(model, batch_size=256, seq_len=40, eval_examples=200)
    assert 0 < est.total < 2**30  # the recipe fits in 1 GiB by the estimate


class _Vocab:
    vocab_size, pad_id, bos_id, eos_id = 60, 0, 1, 2


# --- two processes ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _column(run: Path, name: str) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[name] for r in rows if name in r and "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocesses' own limits, with room
def test_two_gloo_processes_match_one(tmp_path):
    """Each rank holds half the pairs and gathers the other half's features with gradients:
    the logged losses (the count arithmetic), the gradient norms (DDP's average of the
    gathered gradients) and the later steps' losses (after lr 1e-2 updates) equal one
    process's on the whole batch. (Weights are not compared: the attention key biases get
    exactly-zero gradients whose rounding noise Adam turns into +-lr steps.)"""
    args = ["train", "--model", "clip", "--task", "shapes", "--preset", "clip-tiny",
            "--steps", "3", "--batch-size", "8", "--lr", "1e-2", "--warmup", "1",
            "--eval-every", "3", "--eval-examples", "4", "--no-progress", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run_bounded([sys.executable, "-m", "qkv.cli", *args, "--out", str(tmp_path / "one")],
                      env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(_free_port()), "-m", "qkv.cli", *args, "--out",
                       str(tmp_path / "two")], env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(a) == len(b) == 3
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    norms = [_column(tmp_path / run, "grad_norm") for run in ("one", "two")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)  # the gradients, before clipping
