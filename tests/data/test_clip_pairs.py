"""The image-caption pairs of CLIP training, what the kind's tests do not cover:
``ShapesPairs.texts`` holds every caption and prompt a run reads (checked against captions
drawn from the dataset and prompts spelled out here), ``FolderPairs.texts`` the TSV's
captions, and ``folder_fingerprint`` notices what it should (captions, a file's size, a new
file) and nothing else (a file's time), against SHA-256 recomputed here."""

from __future__ import annotations

import hashlib
import os

import pytest
from PIL import Image

from qkv.data.folder_pairs import FolderPairs, folder_fingerprint
from qkv.data.shapes import COMBINATIONS
from qkv.data.shapes_pairs import PROMPT_CAPTION_SHARE, ShapesPairs, zero_shot_prompts


def test_shapes_texts_hold_every_caption_and_prompt_a_run_reads():
    data = ShapesPairs(image_size=16, seed=4)
    texts = set(data.texts)
    _, captions = data.train(0, 300)
    _, held = data.heldout(50)
    assert set(captions) <= texts and set(held) <= texts
    prompts = 0
    for start in range(0, 300, 100):
        batch = data.splits["train"].batch(range(start, start + 100))
        prompts += sum(c != d for c, d in zip(data.train(start, 100)[1], batch.captions,
                                              strict=True))
    assert 0.15 < prompts / 300 < 0.35  # about PROMPT_CAPTION_SHARE of them are prompts
    assert PROMPT_CAPTION_SHARE == 0.25
    colours_en = {"red": "红色", "blue": "蓝色"}
    for (c, s), zh_shape in (("red", "circle"), "圆形"), (("blue", "star"), "星形"):
        assert f"a photo of a {c} {s}" in texts
        assert f"一张{colours_en[c]}{zh_shape}的照片" in texts
    table = zero_shot_prompts("en")
    assert len(table[0]) == len(COMBINATIONS) == 30
    assert table[0][COMBINATIONS.index(("orange", "square"))] == "a photo of an orange square"


def _folder(tmp_path):
    for i in range(3):
        Image.new("RGB", (6, 4), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "captions.tsv").write_text("0.png\tone\n1.png\ttwo\n1.png\tzwei\n2.png\tthree\n")
    return tmp_path


def test_folder_texts_are_the_tsv_captions(tmp_path):
    data = FolderPairs(str(_folder(tmp_path)), image_size=8)
    assert data.texts == ["one", "two", "zwei", "three"]
    images, captions = data.train(0, 3)
    assert images.shape == (3, 3, 8, 8) and set(captions) <= set(data.texts)
    with pytest.raises(ValueError, match="at least 2 different images"):
        (tmp_path / "captions.tsv").write_text("0.png\tone\n0.png\tagain\n")
        FolderPairs(str(tmp_path), image_size=8)


def test_folder_fingerprint(tmp_path):
    folder = _folder(tmp_path)

    def oracle():
        tsv = folder / "captions.tsv"
        h = hashlib.sha256(tsv.read_bytes())
        total = tsv.stat().st_size
        for name in sorted(p.name for p in folder.iterdir() if p.name != "captions.tsv"):
            size = (folder / name).stat().st_size
            h.update(f"\0{name}\0{size}".encode())
            total += size
        return {"size": total, "sha256": h.hexdigest()}

    first = folder_fingerprint(folder)
    assert first == oracle()
    os.utime(folder / "1.png", (1, 1))
    assert folder_fingerprint(str(folder)) == first  # a time is not a change
    (folder / "captions.tsv").write_text("0.png\tone\n1.png\ttwo\n")
    second = folder_fingerprint(folder)
    assert second != first and second == oracle()
    with open(folder / "2.png", "ab") as f:
        f.write(b"\0")
    third = folder_fingerprint(folder)
    assert third["size"] == second["size"] + 1 and third == oracle()
    Image.new("RGB", (2, 2)).save(folder / "new.png")
    assert folder_fingerprint(folder) == oracle() != third
