"""``qkv demo flamingo``: the quick run end to end (image tower, LM and Flamingo trained, files
written, the lines printed), its accuracies recomputed from the saved files, reuse of a CLIP
run with ``vision=``, refusals; the full demo reaches the issue's bar (slow).

Oracles written here: the accuracies are recomputed from the saved Flamingo
(``Flamingo.from_pretrained`` + the saved tokenizer) one row at a time (no batching, no
padding, no ``collate``), the pixels normalised by CLIP's mean/std written out here, an answer
counted right when the argmax before each of its characters is that character; the answer
spans are found in the row's text by string search, not taken from ``answer_spans``."""

from __future__ import annotations

import json
import re

import pytest
import torch
from PIL import Image

from qkv.data.shapes import COLOURS, SHAPES
from qkv.data.shapes_qa import IMAGE_CHAR, ShapesQADataset
from qkv.data.tokenizer import read_tokenizer
from qkv.demos.flamingo import QUICK, answer_targets, run_flamingo_demo
from qkv.models import Flamingo

ACC = re.compile(r"^answer accuracy: (\d+\.\d)%$", re.M)
TEXT_ACC = re.compile(r"^text-only accuracy: (\d+\.\d)%$", re.M)
#: CLIP's normalisation (OpenAI's constants), written out independently of qkv
MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)


def run(out, **kwargs) -> tuple[str, dict]:
    lines: list[str] = []
    assert run_flamingo_demo(str(out), log=lines.append, **kwargs) == 0
    return "\n".join(lines), json.loads((out / "demo.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick demo for the tests below: (output dir, what it printed, demo.json)."""
    out = tmp_path_factory.mktemp("flamingo") / "out"
    printed, summary = run(out, quick=True, seed=0)
    return out, printed, summary


def answers_of(text: str) -> list[tuple[int, int]]:
    """[start, end) of each answer: the characters after "A: " up to the next "."."""
    return [(m.start(1), m.end(1)) for m in re.finditer(r"A: ([^.]+)\.", text)]


def recompute(out, count: int, seed: int = 0) -> tuple[float, float]:
    """(answer accuracy, text-only accuracy) of the saved Flamingo on the first ``count``
    test rows, row by row."""
    model = Flamingo.from_pretrained(out / "flamingo")
    tok = read_tokenizer(out / "flamingo" / "tokenizer.json")
    test = ShapesQADataset("test", size=count, seed=seed)
    hits = text_hits = total = 0

    def right(logits, ids, spans):
        pred = logits[0].argmax(-1)  # (N,)
        return [all(int(pred[j - 1]) == ids[j] for j in range(s, e)) for s, e in spans]

    with torch.no_grad():
        for i in range(count):
            row = test[i]
            ids = tok.encode(row.text)
            assert len(ids) == len(row.text)
            images = torch.stack([(test.images[k][0] - MEAN) / STD
                                  for k in row.image_indices])  # (T, 3, H, W)
            logits = model(torch.tensor([ids]), images[None])
            got = right(logits, ids, answers_of(row.text))
            plain = row.text.replace(IMAGE_CHAR + " ", "")
            assert IMAGE_CHAR not in plain
            plain_ids = tok.encode(plain)
            text_got = right(model.lm(torch.tensor([plain_ids])), plain_ids, answers_of(plain))
            assert len(got) == len(text_got) == len(row.pairs)
            hits, text_hits, total = hits + sum(got), text_hits + sum(text_got), total + len(got)
    return hits / total, text_hits / total


def test_quick_run_files_and_lines(quick_run):
    out, printed, summary = quick_run
    for name in ("gates.png", "demo.json", "qa_text.txt", "flamingo/flamingo_config.json",
                 "flamingo/flamingo_model.safetensors", "flamingo/tokenizer.json",
                 "lm/checkpoint/config.json", "vision/checkpoint/config.json"):
        assert (out / name).is_file(), name
    with Image.open(out / "gates.png") as im:
        assert im.size[0] > 100 and im.size[1] > 100
    assert len(ACC.findall(printed)) == 1 and len(TEXT_ACC.findall(printed)) == 1, printed
    assert "A held-out row" in printed and printed.count("  Q: ") == 3  # the 3-image example
    assert len(summary["example"]["answers"]) == 3
    assert summary["steps"] == QUICK["steps"] and summary["vision_steps"] == QUICK["vision_steps"]
    # the gates: step 0 (all zero: the frozen LM) and the end, every block both gates
    first, last = summary["gates"][0], summary["gates"][-1]
    assert first["step"] == 0 and last["step"] == QUICK["steps"]
    blocks = [k for k in first if k != "step"]
    assert blocks and all(first[k] == [0.0, 0.0] for k in blocks)
    assert any(last[k] != [0.0, 0.0] for k in blocks)
    # the LM's text file: rows with and without images, and nothing else
    text = (out / "qa_text.txt").read_text(encoding="utf-8")
    assert text.startswith(IMAGE_CHAR) and " Q: " in text and "\n" not in text


def test_quick_run_accuracy_matches_recomputation(quick_run):
    out, printed, summary = quick_run
    acc, text_acc = recompute(out, QUICK["eval_rows"])
    assert ACC.search(printed).group(1) == f"{100 * acc:.1f}"
    assert TEXT_ACC.search(printed).group(1) == f"{100 * text_acc:.1f}"
    assert summary["answer_accuracy"] == pytest.approx(acc, abs=1e-12)
    assert summary["text_only_accuracy"] == pytest.approx(text_acc, abs=1e-12)
    # not a degenerate run: the quick LM already answers some questions from the prior
    assert 0 < text_acc < 1


def test_answer_targets_match_a_hand_made_row():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    answer = torch.tensor([[False, False, True, True, False, False, True, False]])
    # position j predicts token j + 1: the answers 7 8 and 11, and the token closing each (9, 12)
    want = torch.tensor([[-100, 7, 8, 9, -100, 11, 12, -100]])
    assert torch.equal(answer_targets(ids, answer), want)


def test_vision_run_is_reused(quick_run, tmp_path, monkeypatch):
    out, _, _ = quick_run
    monkeypatch.setitem(QUICK, "lm_training", {**QUICK["lm_training"], "steps": 2,
                                               "warmup": 0, "eval_every": 2})
    printed, summary = run(tmp_path / "again", quick=True, seed=0, steps=2,
                           vision=str(out / "vision"))
    assert "(reused)" in printed and summary["vision_steps"] == 0 and summary["steps"] == 2
    assert not (tmp_path / "again" / "vision").exists()
    config = json.loads((tmp_path / "again" / "flamingo" / "flamingo_config.json").read_text())
    assert config["bases"]["vision"]["path"] == str((out / "vision" / "checkpoint").resolve())


def test_refusals_before_writing(quick_run, tmp_path):
    out, _, _ = quick_run
    with pytest.raises(ValueError, match=r"--vision .* is a 'qkv-gpt' run, not a CLIP"):
        run_flamingo_demo(str(tmp_path / "a"), vision=str(out / "lm"), quick=True)
    with pytest.raises(ValueError, match=r"--vision .*no such run directory"):
        run_flamingo_demo(str(tmp_path / "b"), vision=str(tmp_path / "nothing"), quick=True)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            run_flamingo_demo(str(tmp_path / "c"), steps=bad, quick=True)
    assert not any((tmp_path / n).exists() for n in "abc")
    with pytest.raises(ValueError, match="--out"):  # a non-empty directory
        run_flamingo_demo(str(out), quick=True)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a full demo: minutes on 2 idle cores, several times that loaded
def test_full_demo_reaches_the_goal(tmp_path):
    printed, summary = run(tmp_path / "full", seed=0)
    acc = float(ACC.search(printed).group(1))
    text_acc = float(TEXT_ACC.search(printed).group(1))
    assert acc >= 90.0, printed
    assert acc - text_acc >= 30.0, printed
    assert summary["answer_accuracy"] == pytest.approx(acc / 100, abs=5e-4)
    # the generated answers stop at their "." (the blocks learn where an answer ends)
    words = {*COLOURS, *SHAPES, "1", "2", "3"}
    assert all(got in words for _, got, _ in summary["example"]["answers"]), printed
