"""``qkv.data.images_folder``: a folder of images + a ``file<TAB>caption`` TSV.

Shapes: B batch, H image height, W image width.

Images are written with Pillow in every mode a user's folder may hold; the expected pixels
are computed here by hand (the alpha blend onto white, 16-bit / 257, the EXIF rotation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qkv.data import DataError, ImageFolderDataset, load_image


def rgb_array(h: int = 5, w: int = 7, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def write_tsv(folder, lines: list[str], name: str = "captions.tsv"):
    path = folder / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "sub").mkdir()
    Image.fromarray(rgb_array(seed=1)).save(tmp_path / "a.png")
    Image.fromarray(rgb_array(6, 4, seed=2)).save(tmp_path / "sub" / "b.png")
    write_tsv(tmp_path, ["file\tcaption", "a.png\ta red thing", "", "sub/b.png\t一只猫",
                         "a.png\tthe same image, another caption"])
    return tmp_path


def test_reads_pairs_pixels_and_line_numbers(folder):
    data = ImageFolderDataset(folder)
    assert len(data) == 3 and data.lines == [2, 4, 5]
    image, caption = data[0]
    assert caption == "a red thing" and image.dtype == torch.uint8 and image.shape == (3, 5, 7)
    assert torch.equal(image, torch.from_numpy(rgb_array(seed=1)).permute(2, 0, 1))
    image, caption = data[1]
    assert caption == "一只猫" and image.shape == (3, 6, 4)
    assert torch.equal(image, torch.from_numpy(rgb_array(6, 4, seed=2)).permute(2, 0, 1))
    assert torch.equal(data[-1][0], data[0][0])
    with pytest.raises(IndexError):
        data[3]
    with pytest.raises(ValueError, match="different shapes"):
        data.batch([0, 1])
    images, captions = data.batch([0, 2])
    assert images.shape == (2, 3, 5, 7) and captions[1].startswith("the same")


def test_transform_and_another_tsv(folder):
    write_tsv(folder, ["sub/b.png\tb", "a.png\ta"], name="other.tsv")
    data = ImageFolderDataset(folder, captions=folder / "other.tsv",
                              transform=lambda im: im[:, :4, :4].float() / 255)
    images, captions = data.batch(range(2))
    assert images.shape == (2, 3, 4, 4) and images.dtype == torch.float32
    assert captions == ["b", "a"]
    with pytest.raises(TypeError, match="transform"):
        ImageFolderDataset(folder, transform="resize")


def test_image_size_applies_clip_preprocessing(folder):
    from qkv.data.image_preprocess import preprocess_image

    data = ImageFolderDataset(folder, image_size=4)
    images, _ = data.batch(range(3))  # sizes differ on disk, one size after preprocessing
    assert images.shape == (3, 3, 4, 4) and images.dtype == torch.float32
    torch.testing.assert_close(images[1], preprocess_image(load_image(folder / "sub/b.png"), 4),
                               atol=0, rtol=0)
    with pytest.raises(ValueError, match="image_size"):
        ImageFolderDataset(folder, image_size=0)
    with pytest.raises(ValueError, match="not both"):
        ImageFolderDataset(folder, image_size=4, transform=lambda im: im)


def test_missing_file_is_named_with_its_line(folder):
    write_tsv(folder, ["a.png\tok", "", "nope.jpg\tmissing"])
    with pytest.raises(DataError, match=r"captions\.tsv:3: image 'nope\.jpg' not found"):
        ImageFolderDataset(folder)


@pytest.mark.parametrize("name", ["../a.png", "sub/../../a.png", "/etc/passwd", "..\\a.png"])
def test_paths_escaping_the_folder_are_refused(folder, name):
    inner = folder / "inner"
    inner.mkdir()
    Image.fromarray(rgb_array()).save(inner / "x.png")
    write_tsv(inner, ["x.png\tfine", f"{name}\tescape"])
    with pytest.raises(DataError, match=r"captions\.tsv:2: image path .* leaves the folder"):
        ImageFolderDataset(inner)


def test_a_link_out_of_the_folder_is_refused(folder):
    inner = folder / "inner"
    inner.mkdir()
    (inner / "link.png").symlink_to(folder / "a.png")
    write_tsv(inner, ["link.png\tescape"])
    with pytest.raises(DataError, match=r"captions\.tsv:1: .* resolves outside the folder"):
        ImageFolderDataset(inner)


@pytest.mark.parametrize("content", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\nbroken"])
def test_corrupt_images_are_named_with_their_line(folder, content):
    (folder / "bad.png").write_bytes(content)
    write_tsv(folder, ["a.png\tfine", "bad.png\tbroken"])
    data = ImageFolderDataset(folder)  # found when loaded...
    with pytest.raises(DataError, match=r"captions\.tsv:2: cannot read image .*bad\.png"):
        data[1]
    with pytest.raises(DataError, match=r"captions\.tsv:2: cannot read image"):
        ImageFolderDataset(folder, verify=True)  # ...or up front
    with pytest.raises(DataError, match="cannot read image"):
        load_image(folder / "bad.png")


def test_truncated_image_is_an_error(folder):
    raw = (folder / "a.png").read_bytes()
    (folder / "cut.png").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="cannot read image"):
        load_image(folder / "cut.png")
    with pytest.raises(DataError, match="not found"):
        load_image(folder / "absent.png")


@pytest.mark.parametrize(("lines", "pattern"), [
    ([], "no file<TAB>caption lines"),
    (["", "  "], "no file<TAB>caption lines"),
    (["file\tcaption"], "no file<TAB>caption lines"),
    (["a.png"], r":1: expected file<TAB>caption, found no tab"),
    (["a.png\tx\ty"], r":1: expected file<TAB>caption, found 2 tabs"),
    (["a.png\t "], r":1: empty caption"),
    (["\tcaption"], r":1: empty file name"),
])
def test_malformed_tsv(folder, lines, pattern):
    write_tsv(folder, lines)
    with pytest.raises(DataError, match=pattern):
        ImageFolderDataset(folder)


def test_missing_tsv_or_folder(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        ImageFolderDataset(tmp_path)
    with pytest.raises(DataError, match="not a directory"):
        ImageFolderDataset(tmp_path / "absent")


def test_non_rgb_images_are_converted(tmp_path):
    rgb = rgb_array(4, 6, seed=3)
    gray = rgb[..., 0]
    alpha = np.random.default_rng(4).integers(0, 256, size=(4, 6), dtype=np.uint8)

    def on_white(colour, a):  # the expected blend, by hand
        return np.round(colour * (a / 255.0) + 255 * (1 - a / 255.0))
    rgba = np.dstack([rgb, alpha])
    cases = {
        "gray.png": (Image.fromarray(gray, "L"), np.dstack([gray] * 3)),
        "rgba.png": (Image.fromarray(rgba, "RGBA"), on_white(rgb, alpha[..., None])),
        "la.png": (Image.fromarray(np.dstack([gray, alpha]), "LA"),
                   np.dstack([on_white(gray, alpha)] * 3)),
        "gray16.png": (Image.fromarray(gray.astype(np.uint16) * 257),
                       np.dstack([gray] * 3)),
        "bw.png": (Image.fromarray(gray > 127).convert("1"),
                   np.dstack([np.where(gray > 127, 255, 0)] * 3)),
        "cmyk.jpg": (Image.fromarray(rgb).convert("CMYK"), None),
    }
    palette = Image.fromarray(rgb).quantize(8)  # "P"
    cases["palette.png"] = (palette, np.asarray(palette.convert("RGB")))
    transparent = palette.copy()
    transparent.info["transparency"] = 0  # palette entry 0 is see-through
    index = np.asarray(palette)
    cases["ptrans.png"] = (transparent, np.where(index[..., None] == 0, 255,
                                                 np.asarray(palette.convert("RGB"))))
    for name, (image, _) in cases.items():
        image.save(tmp_path / name)
    assert Image.open(tmp_path / "gray16.png").mode.startswith("I")
    assert Image.open(tmp_path / "ptrans.png").mode == "P"
    for name, (_, expected) in cases.items():
        out = load_image(tmp_path / name)
        assert out.dtype == torch.uint8 and out.shape == (3, 4, 6), name
        if expected is not None:
            got = out.permute(1, 2, 0).to(torch.int64).numpy()
            assert np.abs(got - expected).max() <= 1, name  # rounding of the blend
    with pytest.raises(DataError, match="floating-point"):
        Image.fromarray(np.zeros((3, 3), np.float32)).save(tmp_path / "f.tiff")
        load_image(tmp_path / "f.tiff")


def test_exif_orientation_is_applied(tmp_path):
    rgb = rgb_array(4, 6, seed=5)
    image = Image.fromarray(rgb)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    image.save(tmp_path / "turned.png", exif=exif)
    out = load_image(tmp_path / "turned.png")
    expected = np.rot90(rgb, k=-1)  # 90 degrees clockwise
    assert out.shape == (3, 6, 4)
    assert np.array_equal(out.permute(1, 2, 0).numpy(), expected)
