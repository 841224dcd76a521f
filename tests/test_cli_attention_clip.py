"""``qkv attention RUN`` on a CLIP run: the image tower's attention over the patches of a
shapes test image (``--index``) or of a file (``--image``), the rollout drawn on it, the
text tower's attention with ``--input``; the refusals; the text path keeps its rules.

Shapes: L layers, H heads, T = 1 + gh·gw image tokens, N text tokens, K = 30 classes.

The run directory is built here (a randomly initialised "clip-tiny" CLIP saved with a char
tokenizer and a run.json, as ``qkv train --model clip --task shapes`` writes). Oracles
written here: the image drawn by ``ShapesDataset`` normalised with CLIP's published
mean/std (numbers typed here), the attention weights read from ``CLIP.vision(...,
output_attentions=True)`` on it, the rollout recomputed by hand (Abnar & Zuidema: mean of
heads + I, rows renormalised, product over layers), the zero-shot answer as an argmax of
cosine similarities of hand-framed prompts.
"""

from __future__ import annotations

import json
import re

import matplotlib.image
import numpy as np
import pytest
import torch
from PIL import Image

from qkv.cli import main
from qkv.data import CharTokenizer, ShapesDataset
from qkv.data.shapes import COMBINATIONS
from qkv.models import CLIP, CLIPConfig

MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
ALPHABET = "abcdefghijklmnopqrstuvwxyz 一张的照片个红绿蓝黄紫橙色圆正方形三角星十字"
SEED = 3  # the run's seed: its test split is the held-out combinations of seed 3


def save_run(path, *, task="shapes", seed=SEED) -> tuple[CLIP, CharTokenizer]:
    torch.manual_seed(0)
    tok = CharTokenizer(ALPHABET)
    config = CLIPConfig.from_name("clip-tiny", text={
        "vocab_size": tok.vocab_size, "max_len": 40, "dim": 64, "num_layers": 2,
        "num_heads": 2, "eos_token_id": tok.eos_id})
    model = CLIP(config).eval()
    with torch.no_grad():  # sharper attention than the init's near-uniform weights
        for layer in model.vision.layers:
            layer.attn.in_proj.weight.mul_(6.0)
    model.save_pretrained(path)
    tok.save(path / "tokenizer.json")
    (path / "run.json").write_text(json.dumps({"model": "clip", "task": task, "seed": seed}))
    return model, tok


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "run"
    path.mkdir()
    model, tok = save_run(path)
    return path, model, tok


def page_data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    payload = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text,
                        re.S).group(1)
    return json.loads(payload)


def vision_attentions(model: CLIP, image: torch.Tensor) -> torch.Tensor:
    """(L, H, T, T) of one image (3, S, S) in [0, 1], normalised here."""
    with torch.no_grad():
        out = model.vision((image[None] - MEAN) / STD, output_attentions=True)
    return torch.stack(out.attentions)[:, 0]


def rollout_by_hand(att: torch.Tensor) -> np.ndarray:
    """Abnar & Zuidema in float64 numpy: (L, H, T, T) -> the class token's row over the
    patches, (gh, gw)."""
    a = att.double().numpy()
    t = a.shape[-1]
    r = np.eye(t)
    for layer in a:
        m = layer.mean(axis=0) + np.eye(t)
        m = m / m.sum(axis=1, keepdims=True)
        r = m @ r
    side = round((t - 1) ** 0.5)
    return r[0, 1:].reshape(side, side)


def map_weights(data: dict, name: str) -> np.ndarray:
    entry = next(m for m in data["maps"] if m["name"] == name)
    return np.array(entry["w"], dtype=np.float64)


def test_index_draws_the_rollout_of_that_test_image(clip_run, tmp_path, capsys):
    run, model, tok = clip_run
    out = tmp_path / "viz"
    assert main(["attention", str(run), "--index", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    names = ["attention_rollout.png", "attention_patches.png", "attention_vision.png",
             "attention.html"]
    assert printed[-4:] == [str(out / n) for n in names]
    for n in names[:-1]:
        assert matplotlib.image.imread(out / n).shape[2] == 4
    image, caption, _ = ShapesDataset("test", size=5, seed=SEED, language="en")[4]
    assert printed[0] == f"image: shapes test image 4 (seed {SEED}): {caption!r}"
    att = vision_attentions(model, image)  # (L, H, T, T)
    page = map_weights(page_data(out / "attention.html"), "vision")
    assert page.shape == tuple(att.shape)
    np.testing.assert_allclose(page, att.numpy(), atol=1e-4)  # the page keeps 4 decimals
    # the zero-shot line: argmax over the 30 English prompt ensembles, by hand
    templates = ["a photo of {art} {c} {s}", "{art} {c} {s}", "a picture of {art} {c} {s}"]
    texts = [t.format(art="an" if c[0] in "aeiou" else "a", c=c, s=s) for t in templates
             for c, s in COMBINATIONS]
    rows = [[tok.bos_id, *tok.encode(t), tok.eos_id] for t in texts]
    n = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (n - len(r)) for r in rows])
    mask = ids != tok.pad_id
    with torch.no_grad():
        emb = model((image[None] - MEAN) / STD, ids, mask)
    weights = emb.text_embeds.view(3, 30, -1).mean(0)
    weights = weights / weights.norm(dim=-1, keepdim=True)
    scores = (emb.image_embeds @ weights.t())[0]
    best = int(scores.argmax())
    colour, shape = COMBINATIONS[best]
    article = "an" if colour[0] in "aeiou" else "a"
    assert printed[1].startswith(f"zero-shot: a photo of {article} {colour} {shape} (cosine ")
    assert float(printed[1].split("cosine ")[1].rstrip(")")) == pytest.approx(
        float(scores[best]), abs=5e-4)


def test_rollout_drawn_is_the_rollout_of_the_image(clip_run, tmp_path, monkeypatch):
    """What the CLI hands to ``draw_patch_attention``: the test image itself (in [0, 1])
    and the rollout of its attention, recomputed by hand in float64."""
    import qkv.viz.patches as patches

    drawn = {}
    real = patches.draw_patch_attention

    def spy(image, grid, path, **kw):
        drawn["image"], drawn["grid"] = image, grid
        return real(image, grid, path, **kw)

    monkeypatch.setattr(patches, "draw_patch_attention", spy)
    run, model, _ = clip_run
    assert main(["attention", str(run), "--index", "1", "--out", str(tmp_path / "v")]) == 0
    image, _, _ = ShapesDataset("test", size=2, seed=SEED, language="en")[1]
    assert torch.equal(drawn["image"], image)
    np.testing.assert_allclose(np.asarray(drawn["grid"], dtype=np.float64),
                               rollout_by_hand(vision_attentions(model, image)), atol=1e-6)


def test_image_file_and_text_input(clip_run, tmp_path, capsys):
    run, model, tok = clip_run
    image, _, _ = ShapesDataset("test", size=1, seed=SEED, language="en")[0]
    png = tmp_path / "shape.png"
    pixels = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(png)
    out = tmp_path / "viz"
    assert main(["attention", str(run), "--image", str(png), "--input", "a red circle",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"image: {png}"
    assert str(out / "attention_text.png") in printed
    data = page_data(out / "attention.html")
    # a 32x32 file at the model's size goes through unchanged: the same weights
    np.testing.assert_allclose(map_weights(data, "vision"),
                               vision_attentions(model, image).numpy(), atol=1e-4)
    ids = torch.tensor([[tok.bos_id, *tok.encode("a red circle"), tok.eos_id]])
    with torch.no_grad():
        txt = model.text(ids, output_attentions=True)
        cos = torch.nn.functional.cosine_similarity(
            model.encode_image((image[None] - MEAN) / STD), model.encode_text(ids))
    np.testing.assert_allclose(map_weights(data, "text"),
                               torch.stack(txt.attentions)[:, 0].numpy(), atol=1e-4)
    line = next(p for p in printed if p.startswith("cosine similarity"))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(float(cos), abs=5e-4)
    # a rerun without --input leaves no stale text map behind
    assert main(["attention", str(run), "--image", str(png), "--out", str(out)]) == 0
    assert not (out / "attention_text.png").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--index", "1", "--image", "{png}"], "give one of them"),
    (["--image", "{missing}"], "no such file"),
    (["--image", "{notimage}"], "not an image Pillow can read"),
    (["--target", "x"], "a CLIP run has no target"),
    (["--layer", "2"], "--layer 2 is out of range"),
    (["--head", "-3"], "--head -3 is out of range"),
    (["--index", "-1"], "argument --index: must be an integer >= 0"),
    (["--input", " "], "--input is empty"),
])
def test_bad_arguments_are_one_line_errors(clip_run, tmp_path, capsys, args, message):
    run, _, _ = clip_run
    png = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(png)
    (tmp_path / "notimage.png").write_text("hello")
    argv = [a.format(png=png, missing=tmp_path / "nope.png",
                     notimage=tmp_path / "notimage.png") for a in args]
    code = None
    try:
        code = main(["attention", str(run), *argv, "--out", str(tmp_path / "o")])
    except SystemExit as exc:  # argparse refuses the flag's value itself
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_index_needs_a_shapes_run(tmp_path, capsys):
    run = tmp_path / "folder-run"
    run.mkdir()
    save_run(run, task=None)
    assert main(["attention", str(run), "--out", str(tmp_path / "o")]) == 2
    assert "give an image with --image PATH" in capsys.readouterr().err


def test_text_runs_still_need_input_and_refuse_images(tmp_path, capsys):
    from qkv.models import GPT, GPTConfig

    tok = CharTokenizer(ALPHABET)
    run = tmp_path / "gpt"
    GPT(GPTConfig.from_name("gpt-tiny", vocab_size=tok.vocab_size, max_len=32,
                            dim=32)).save_pretrained(run)
    tok.save(run / "tokenizer.json")
    (run / "run.json").write_text(json.dumps({"model": "gpt", "task": None}))
    assert main(["attention", str(run), "--out", str(tmp_path / "o")]) == 2
    assert "--input is required" in capsys.readouterr().err
    assert main(["attention", str(run), "--input", "ab", "--index", "0",
                 "--out", str(tmp_path / "o")]) == 2
    assert "for CLIP runs" in capsys.readouterr().err
