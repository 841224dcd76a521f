"""Images are checked before work starts, and read by one loader everywhere.

- A CLIP folder with a zero-byte, corrupt or truncated image is refused when training is set
  up (it was found only when the image was first drawn: a run died at step 3, or a 2-step run
  "succeeded"), in one line naming the first bad file and its captions.tsv line and how many
  more are bad; nothing is written.
- ``check_image`` (the cheap check) refuses exactly the files that decoding in full
  (``load_image``) refuses, over zero-byte, garbage, truncated and damaged files of each
  format Pillow writes here, and good ones.
- ``qkv attention --image`` reads with training's loader: an image over Pillow's
  decompression-bomb limit (over twice it: a raw ``DecompressionBombError`` traceback; just
  over it: accepted) and a floating-point TIFF are refused in one line; alpha is composited
  onto white as in training.

Shapes: S image side (32 for clip-tiny), (3, S, S) images in [0, 1].
Oracles: the full decode for the cheap check; pixels typed here (red, and white where the
alpha is 0) for the composite; the files written here with Pillow.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from qkv.cli import main
from qkv.data import CharTokenizer, DataError, ImageFolderDataset, load_image
from qkv.data.images_folder import check_image
from qkv.models import CLIP, CLIPConfig


def _pixels(h: int = 24, w: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def _files(folder) -> dict[str, bytes]:
    """name -> bytes: good images of each format, and broken ones."""
    good = {}
    for ext in ("png", "jpg", "bmp", "gif", "webp", "tif"):
        path = folder / f"good.{ext}"
        Image.fromarray(_pixels()).save(path)
        good[path.name] = path.read_bytes()
    out = dict(good)
    for name, raw in good.items():
        out[f"half-{name}"] = raw[: len(raw) // 2]
    png = bytearray(good["good.png"])
    png[len(png) // 2] ^= 0xFF  # one damaged byte inside the image data
    out["damaged.png"] = bytes(png)
    out["zero.png"] = b""
    out["garbage.jpg"] = b"this is not an image at all"
    Image.fromarray(_pixels()[..., 0].astype(np.float32)).save(folder / "float.tif")  # "F"
    out["float.tif"] = (folder / "float.tif").read_bytes()
    return out


def _raises(fn, path) -> bool:
    try:
        fn(path)
    except DataError as err:
        assert "\n" not in str(err) and str(path) in str(err)
        return True
    return False


def test_the_quick_check_refuses_what_a_full_decode_refuses(tmp_path):
    files = _files(tmp_path)
    verdicts = {}
    for name, raw in files.items():
        path = tmp_path / name
        path.write_bytes(raw)
        verdicts[name] = (_raises(check_image, path), _raises(load_image, path))
    assert {n: c for n, (c, full) in verdicts.items() if c != full} == {}
    refused = {n for n, (c, _) in verdicts.items() if c}
    assert refused == {n for n in files if not n.startswith("good.")}
    assert check_image(tmp_path / "good.jpg") == (32, 24)  # (width, height)
    with pytest.raises(DataError, match=r"half-good\.jpg: truncated or corrupt"):
        check_image(tmp_path / "half-good.jpg")


def test_the_folder_is_checked_up_front_naming_the_first_bad_image(tmp_path):
    for i in range(3):
        Image.fromarray(_pixels(seed=i)).save(tmp_path / f"ok{i}.png")
    raw = (tmp_path / "ok0.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "junk.png").write_bytes(b"junk")
    (tmp_path / "captions.tsv").write_text(
        "ok0.png\ta\nok1.png\tb\ncut.png\tc\nempty.jpg\td\nok2.png\te\njunk.png\tf\n"
        "cut.png\tthe same file again\n")
    ImageFolderDataset(tmp_path)  # verify=False: only that the files exist
    with pytest.raises(DataError) as info:
        ImageFolderDataset(tmp_path, verify="quick")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'captions.tsv'}:3: cannot read image "
                              f"{tmp_path / 'cut.png'}: truncated or corrupt"), message
    assert message.endswith("(and 2 more bad image(s), at lines 4, 6)") and "\n" not in message
    with pytest.raises(ValueError, match="verify must be"):
        ImageFolderDataset(tmp_path, verify="thorough")


def test_qkv_train_refuses_a_folder_with_a_truncated_image_before_writing(tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    lines = []
    for i in range(6):
        Image.fromarray(_pixels(seed=i)).save(photos / f"{i}.jpg")
        lines.append(f"{i}.jpg\tpicture {i}")
    raw = (photos / "5.jpg").read_bytes()
    (photos / "5.jpg").write_bytes(raw[: len(raw) * 2 // 3])
    (photos / "captions.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    code = main(["train", "--model", "clip", "--data", str(photos), "--preset", "clip-tiny",
                 "--batch-size", "4", "--steps", "2", "--eval-every", "2", "--no-progress",
                 "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert f"captions.tsv:6: cannot read image {photos / '5.jpg'}: truncated" in err, err
    assert not out.exists()


# --- qkv attention --image ----------------------------------------------------------------
ALPHABET = "abcdefghijklmnopqrstuvwxyz "


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "run"
    path.mkdir()
    torch.manual_seed(0)
    tok = CharTokenizer(ALPHABET)
    config = CLIPConfig.from_name("clip-tiny", text={
        "vocab_size": tok.vocab_size, "max_len": 40, "eos_token_id": tok.eos_id})
    CLIP(config).eval().save_pretrained(path)
    tok.save(path / "tokenizer.json")
    (path / "run.json").write_text(json.dumps({"model": "clip", "data": "photos", "seed": 0}))
    return path


def _attention(run, image, tmp_path, capsys) -> tuple[int, str]:
    code = main(["attention", str(run), "--image", str(image), "--out", str(tmp_path / "v")])
    return code, capsys.readouterr().err.strip()


def test_attention_refuses_images_over_the_bomb_limit_in_one_line(clip_run, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for side in (40, 50):  # 1600 px: over the limit (a warning to Pillow); 2500: over twice
        path = tmp_path / f"big{side}.png"
        Image.fromarray(_pixels(side, side)).save(path)
        code, err = _attention(clip_run, path, tmp_path, capsys)
        assert code == 2 and "\n" not in err, err
        assert "decompression-bomb limit of 1000 pixels" in err and str(path) in err, err
        with pytest.raises(DataError, match="decompression-bomb limit"):
            check_image(path)
    assert not (tmp_path / "v").exists()


def test_attention_refuses_a_float_tiff_as_training_does(clip_run, tmp_path, capsys):
    path = tmp_path / "float.tif"
    Image.fromarray(np.full((32, 32), 0.5, dtype=np.float32)).save(path)
    assert Image.open(path).mode == "F"
    code, err = _attention(clip_run, path, tmp_path, capsys)
    assert code == 2 and "floating-point images (mode 'F') are not supported" in err, err
    with pytest.raises(DataError, match="floating-point"):  # training's loader refuses it
        load_image(path)


def test_attention_composites_alpha_onto_white_as_training_does(clip_run, tmp_path, capsys,
                                                                monkeypatch):
    import qkv.viz.patches as patches

    drawn = {}
    real = patches.draw_patch_attention

    def spy(image, grid, path, **kw):
        drawn["image"] = image
        return real(image, grid, path, **kw)

    monkeypatch.setattr(patches, "draw_patch_attention", spy)
    rgba = np.zeros((32, 32, 4), dtype=np.uint8)
    rgba[:, :16] = (255, 0, 0, 255)   # opaque red
    rgba[:, 16:] = (0, 0, 255, 0)     # fully transparent (blue underneath)
    path = tmp_path / "alpha.png"
    Image.fromarray(rgba, "RGBA").save(path)
    code, err = _attention(clip_run, path, tmp_path, capsys)
    assert code == 0, err
    expected = torch.ones(3, 32, 32)  # white where transparent
    expected[1:, :, :16] = 0.0        # red where opaque
    torch.testing.assert_close(drawn["image"], expected, atol=1e-6, rtol=0)
