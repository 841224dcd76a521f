"""``processor_config(S)`` (a checkpoint's ``preprocessor_config.json``) read by HF's own
``CLIPImageProcessor`` reproduces ``preprocess_image(image, S)``: the oracle is
transformers' processor built from those fields alone (test-only dependency).

Tolerance: one uint8 step after normalisation (Pillow's and HF's rounding), as
tests/models/test_clip.py's comparison of the transform itself.
"""

from __future__ import annotations

import pytest
import torch

from qkv.data.image_preprocess import CLIP_STD, preprocess_images, processor_config


@pytest.mark.parametrize("size", [16, 32])
def test_hf_processor_from_the_config_reproduces_the_transform(size):
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    fields = processor_config(size)
    proc = transformers.CLIPImageProcessorPil(**{k: v for k, v in fields.items()
                                                 if k != "image_processor_type"})
    g = torch.Generator().manual_seed(size)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g,
                                            dtype=torch.uint8).numpy())
              for h, w in ((45, 70), (64, 33), (size, size))]
    images.append(images[0].convert("L"))
    want = proc(images, return_tensors="pt")["pixel_values"]
    got = preprocess_images(images, size)
    assert want.shape == got.shape == (4, 3, size, size)
    torch.testing.assert_close(got, want, atol=1.01 / 255 / min(CLIP_STD), rtol=0)


def test_config_fields_and_refusal():
    fields = processor_config(24)
    assert fields["size"] == {"shortest_edge": 24}
    assert fields["crop_size"] == {"height": 24, "width": 24}
    assert fields["image_processor_type"] == "CLIPImageProcessor"
    with pytest.raises(ValueError, match="processor_config: size"):
        processor_config(0)
