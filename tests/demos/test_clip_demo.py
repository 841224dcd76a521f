"""``qkv demo clip``: the quick run end to end — files, printed lines, and the printed
zero-shot accuracy (English and Chinese prompts) and text→image recall@1 recomputed here from
the saved run; its step settings and refusals; (slow) the full default demo reaches
the issue's goal, >= 90 % zero-shot on the held-out combinations.

Shapes: B test images, K = 30 classes, M prompt templates, E embedding width.

Oracle (written here, apart from ``qkv.demos.clip`` and ``qkv.train.kinds.clip``): the run
loaded with ``load_run``; pixels normalised with the mean/std its checkpoint's
preprocessor_config.json records; texts framed bos + ids + eos and padded by hand; the
embeddings read from ``CLIP.forward``'s normalised ``image_embeds`` / ``text_embeds``; the
prompt ensembles, argmax and hit counts by hand. Near-ties are allowed to go either way: a
row whose best and second-best scores differ by less than ``TIE`` (fp32 rounding of
differently padded batches is ~1e-7) may count as a hit or not, and the printed figure must
lie within those bounds.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import matplotlib.image
import pytest
import torch

from qkv.cli import main
from qkv.data.shapes import COMBINATIONS, PROMPT_TEMPLATES, ShapesDataset
from qkv.demos.clip import (
    DEMO_TRAINING,
    QUICK_STEPS,
    QUICK_TEST_EXAMPLES,
    training_settings,
)
from qkv.train import load_run

TIE = 1e-5
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LINES = {
    "zero_shot": r"^zero-shot accuracy: (\d+\.\d)% \(English prompts .*chance 1/30 = 3\.3%\)$",
    "zh": r"^with Chinese prompts \(.*\): (\d+\.\d)%$",
    "recall": r"^text→image recall@1: (\d+\.\d)% \(each test caption's nearest of the (\d+) ",
    "heldout": r"^Held out of training \(the test split is only these\): (.*)$",
}


def parse(printed: str) -> dict[str, re.Match]:
    found = {k: re.search(v, printed, re.M) for k, v in LINES.items()}
    assert all(found.values()), (found, printed[-3000:])
    return found


def run_demo(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(["demo", "clip", *argv])
    return status, buf.getvalue()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick demo for the tests below: (output dir, what it printed)."""
    out = tmp_path_factory.mktemp("clip") / "demo"
    status, printed = run_demo("--quick", "--out", str(out))
    assert status == 0
    return out, printed


# --- the oracle ---------------------------------------------------------------------------
def prompts_by_hand(template: str, language: str) -> list[str]:
    """The 30 prompts of ``template`` in COMBINATIONS order, written here: English articles
    "a"/"an" by the colour's first letter, Chinese full names."""
    zh_colour = {"red": "红色", "green": "绿色", "blue": "蓝色", "yellow": "黄色",
                 "purple": "紫色", "orange": "橙色"}
    zh_shape = {"circle": "圆形", "square": "正方形", "triangle": "三角形", "star": "星形",
                "cross": "十字形"}
    out = []
    for colour, shape in COMBINATIONS:
        if language == "en":
            text = template.replace("a {colour}", ("an " if colour[0] in "aeiou" else "a ")
                                    + "{colour}")
            out.append(text.replace("{colour}", colour).replace("{shape}", shape))
        else:
            out.append(template.replace("{colour}", zh_colour[colour])
                       .replace("{shape}", zh_shape[shape]))
    return out


def frame(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """bos + ids + eos, right-padded with pad, mask True at real tokens."""
    rows = [[tok.bos_id, *tok.encode(t), tok.eos_id] for t in texts]
    n = max(len(r) for r in rows)
    ids = torch.tensor([r + [tok.pad_id] * (n - len(r)) for r in rows])  # (B, N)
    mask = torch.tensor([[True] * len(r) + [False] * (n - len(r)) for r in rows])
    return ids, mask


def embeddings(run, images: torch.Tensor, texts: list[str]):
    """Normalised image (B, E) and text (Bt, E) embeddings of the saved run, from forward."""
    model, tok = load_run(run)
    model.eval()
    pre = json.loads((run / "checkpoint" / "preprocessor_config.json").read_text())
    mean = torch.tensor(pre["image_mean"]).view(1, 3, 1, 1)
    std = torch.tensor(pre["image_std"]).view(1, 3, 1, 1)
    ids, mask = frame(tok, texts)
    with torch.no_grad():
        out = model((images - mean) / std, ids, mask)
    return out.image_embeds, out.text_embeds


def hit_bounds(scores: torch.Tensor, right: torch.Tensor) -> tuple[int, int]:
    """(sure hits, sure hits + near-ties) of argmax over ``scores`` (B, K); ``right`` (B, K)
    bool marks the answers that count as hits."""
    top2 = scores.topk(2, dim=-1)
    best = top2.indices[:, 0]
    sure = right[torch.arange(len(best)), best]
    tie = (top2.values[:, 0] - top2.values[:, 1]) < TIE
    return int((sure & ~tie).sum()), int((sure | tie).sum())


def check_percent(printed: float, bounds: tuple[int, int], count: int) -> None:
    low, high = bounds
    assert 100 * low / count - 0.05 <= printed <= 100 * high / count + 0.05, (printed, bounds)


# --- tests --------------------------------------------------------------------------------
def test_quick_demo_writes_its_files(quick_run):
    out, printed = quick_run
    for name in ("similarity.png", "predictions.png", "attention.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
        assert matplotlib.image.imread(out / name).shape[2] == 4
    assert (out / "checkpoint" / "model.safetensors").is_file()
    summary = json.loads((out / "demo.json").read_text(encoding="utf-8"))
    assert summary["test_examples"] == QUICK_TEST_EXAMPLES
    assert summary["steps"] == QUICK_STEPS
    assert summary["chance"] == pytest.approx(1 / 30)
    found = parse(printed)
    assert float(found["zero_shot"].group(1)) == pytest.approx(
        100 * summary["zero_shot_accuracy"], abs=0.05)
    # the held-out combinations printed are the test split's, none of them trained on
    test = ShapesDataset("test", size=1, seed=0)
    assert found["heldout"].group(1) == ", ".join(f"{c} {s}" for c, s in test.heldout)
    train = ShapesDataset("train", size=300, seed=0)
    trained = {(lab["colour"], lab["shape"]) for lab in (train.describe(i)[1]
                                                        for i in range(300))}
    assert not trained & set(test.heldout)
    # the run trained the demo's recipe
    info = json.loads((out / "run.json").read_text())
    assert (info["model"], info["task"], info["preset"]) == ("clip", "shapes", "clip-shapes")
    assert info["steps"] == QUICK_STEPS and info["lr"] == DEMO_TRAINING["lr"]


def test_printed_figures_match_a_recomputation_from_the_saved_run(quick_run):
    out, printed = quick_run
    found = parse(printed)
    count = QUICK_TEST_EXAMPLES
    batch = ShapesDataset("test", size=count, seed=0, language="both").batch(range(count))
    labels = torch.tensor([COMBINATIONS.index((lab["colour"], lab["shape"]))
                           for lab in batch.labels])
    right = torch.nn.functional.one_hot(labels, len(COMBINATIONS)).bool()  # (B, K)
    for lang, key in (("en", "zero_shot"), ("zh", "zh")):
        templates = PROMPT_TEMPLATES[lang]
        texts = [p for t in templates for p in prompts_by_hand(t, lang)]  # M·K, template-major
        image, text = embeddings(out, batch.images, texts)
        weights = text.view(len(templates), len(COMBINATIONS), -1).mean(dim=0)  # (K, E)
        weights = weights / weights.norm(dim=-1, keepdim=True)
        scores = image @ weights.t()  # (B, K)
        check_percent(float(found[key].group(1)), hit_bounds(scores, right), count)
    # recall@1: a caption's nearest image is right when the caption describes it
    image, text = embeddings(out, batch.images, batch.captions)
    facts = [(lab["colour"], lab["shape"], lab["count"], lab["size"], lab["position"])
             for lab in batch.labels]
    describes = torch.tensor([[facts[i] == facts[j] for j in range(count)]
                              for i in range(count)])  # (Bt, B)
    assert int(found["recall"].group(2)) == count
    check_percent(float(found["recall"].group(1)), hit_bounds(text @ image.t(), describes),
                  count)


def test_training_settings():
    assert training_settings() == DEMO_TRAINING
    assert DEMO_TRAINING["steps"] == 800 and DEMO_TRAINING["batch_size"] == 256
    s = training_settings(900)
    assert (s["steps"], s["warmup"], s["eval_every"]) == (900, 90, 225)
    s = training_settings(quick=True)
    assert (s["steps"], s["batch_size"], s["eval_every"]) == (QUICK_STEPS, 64, QUICK_STEPS)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            training_settings(bad)


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "clip", "--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["demo", "clip", "--steps", "x"], "argument --steps: must be an integer"),
    (["demo", "--steps", "5"], "only `qkv demo clip` and `qkv demo flamingo` take --steps"),
    (["demo", "lora", "--steps", "5"], "only `qkv demo clip` and `qkv demo flamingo` take --steps"),
    (["demo", "clip", "--base", "runs/x"], "only `qkv demo lora` takes --base"),
    (["demo", "clip", "--length", "64"], "only `qkv demo tour` takes --length"),
    (["demo", "clip", "--seed", "-1"], "argument --seed"),
])
def test_wrong_arguments_are_one_line_errors(argv, message, capsys):
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "error" in err


def test_out_must_be_new_or_empty(tmp_path, capsys):
    out = tmp_path / "used"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["demo", "clip", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_help_lists_clip(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "qkv demo clip" in text and "--steps" in text


def test_draw_similarity_writes_a_png_and_checks_its_inputs(tmp_path):
    """``qkv.viz.patches.draw_similarity`` (added for this demo's similarity.png)."""
    from qkv.viz.patches import draw_similarity

    images = torch.rand(3, 3, 32, 32)
    path = draw_similarity(images, ["a", "b", "c", "d"], torch.rand(3, 4), tmp_path / "s.png",
                           title="t")
    assert path.read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match=r"similarity must be \(B, K\) = \(3, 4\)"):
        draw_similarity(images, ["a", "b", "c", "d"], torch.rand(4, 3), tmp_path / "x.png")
    with pytest.raises(ValueError, match="similarity holds NaN"):
        draw_similarity(images, ["a"] * 4, torch.full((3, 4), float("nan")), tmp_path / "x.png")
    with pytest.raises(TypeError, match="captions must be a list of strings"):
        draw_similarity(images, "abcd", torch.rand(3, 4), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a full demo: minutes on 2 idle cores, several times that loaded
def test_the_full_demo_reaches_the_goal(tmp_path):
    """The default demo (DEMO_TRAINING, seed 0): >= 90 % zero-shot on the held-out
    combinations with the English prompts (the issue's goal; chance 1/30). Prints what the
    demo printed (run with -s to see it)."""
    status, printed = run_demo("--out", str(tmp_path / "demo"))
    print(printed)
    assert status == 0
    found = parse(printed)
    assert float(found["zero_shot"].group(1)) >= 90.0, printed[-2000:]
