"""CLIP image preprocessing with Pillow and torch (no torchvision).

Shapes: Cin channels (3, RGB), Hi/Wi input height/width, S the output side.

``preprocess_image(image, size=224)``: a ``PIL.Image`` (any mode; converted to RGB) or a
tensor (3, Hi, Wi) — uint8 in [0, 255] or floating in [0, 1] — is resized so that its
shorter side is S (bicubic; the longer side ``int(S · long / short)``, as transformers'
``CLIPImageProcessor``), centre-cropped to S × S (offset ``(side - S) // 2``), scaled to
[0, 1] and normalised with CLIP's mean and standard deviation -> (3, S, S) float32.
Pillow images are resized by Pillow in uint8 (as ``CLIPImageProcessor``); tensors by
``torch.nn.functional.interpolate(mode="bicubic", antialias=True)``, clamped to [0, 1].
``preprocess_images(images, size)`` stacks a list into (B, 3, S, S). ``processor_config(S)``
writes the same transform in HF ``CLIPImageProcessor``'s fields (a checkpoint's
``preprocessor_config.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CLIP_MEAN", "CLIP_STD", "normalize", "preprocess_image", "preprocess_images",
           "processor_config", "resize_shorter_side", "to_pixel_values"]

#: OpenAI CLIP's per-channel statistics (RGB), of pixels scaled to [0, 1]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _target(h: int, w: int, size: int) -> tuple[int, int]:
    """(height, width) with the shorter side ``size``: the longer ``int(size·long/short)``."""
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


def resize_shorter_side(image: Any, size: int) -> Any:
    """A ``PIL.Image`` or a (Cin, Hi, Wi) float tensor resized (bicubic) so that its shorter
    side is ``size``; the same type back."""
    if isinstance(image, Tensor):
        h, w = image.shape[-2:]
        th, tw = _target(h, w, size)
        if (th, tw) == (h, w):
            return image
        return F.interpolate(image[None], size=(th, tw), mode="bicubic", align_corners=False,
                             antialias=True)[0]
    from PIL import Image

    w, h = image.size
    th, tw = _target(h, w, size)
    if (th, tw) == (h, w):
        return image
    return image.resize((tw, th), Image.Resampling.BICUBIC)


def normalize(pixels: Tensor, mean: Sequence[float] = CLIP_MEAN,
              std: Sequence[float] = CLIP_STD) -> Tensor:
    """(pixels - mean) / std per channel: pixels (Cin, H, W) or (B, Cin, H, W) in [0, 1]."""
    m = torch.tensor(mean, dtype=pixels.dtype, device=pixels.device).view(-1, 1, 1)
    s = torch.tensor(std, dtype=pixels.dtype, device=pixels.device).view(-1, 1, 1)
    return (pixels - m) / s


def _check_size(size: Any) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"preprocess_image: size must be a positive int, got {size!r}")
    return size


def _tensor_pixels(image: Tensor) -> Tensor:
    """A (3, Hi, Wi) tensor -> float32 in [0, 1]; clear errors for anything else."""
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"preprocess_image: image tensor must have shape (3, H, W) (RGB, "
                         f"channels first), got {tuple(image.shape)}")
    if image.shape[1] == 0 or image.shape[2] == 0:
        raise ValueError(f"preprocess_image: image is empty, shape {tuple(image.shape)}")
    if image.dtype == torch.uint8:
        return image.float() / 255.0
    if not image.dtype.is_floating_point:
        raise TypeError(f"preprocess_image: image tensor must be uint8 in [0, 255] or "
                        f"floating in [0, 1], got dtype {image.dtype}")
    return image.float()


def preprocess_image(image: Any, size: int = 224, *, mean: Sequence[float] = CLIP_MEAN,
                     std: Sequence[float] = CLIP_STD) -> Tensor:
    """One image -> (3, S, S) float32, resized, centre-cropped and normalised (see the
    module docstring).

    Args:
        image: a ``PIL.Image.Image`` (any mode, converted to RGB) or a tensor (3, Hi, Wi),
            uint8 in [0, 255] or floating in [0, 1].
        size: S. mean, std: per-channel statistics (default CLIP's).

    Raises:
        TypeError naming ``image`` for another type or an integer tensor other than uint8;
        ValueError for a tensor not shaped (3, H, W), an empty image or a bad ``size``.
    """
    size = _check_size(size)
    if isinstance(image, Tensor):
        pixels = _tensor_pixels(image)  # (3, Hi, Wi) in [0, 1]
        pixels = resize_shorter_side(pixels, size).clamp_(0.0, 1.0)
    else:
        try:
            from PIL import Image
        except ImportError as err:  # pragma: no cover - Pillow is a dependency
            raise TypeError("preprocess_image: PIL images need Pillow") from err
        if not isinstance(image, Image.Image):
            raise TypeError(f"preprocess_image: image must be a PIL.Image.Image or a (3, H, W) "
                            f"tensor, got {type(image).__name__}")
        if image.width == 0 or image.height == 0:
            raise ValueError(f"preprocess_image: image is empty, size {image.size}")
        img = resize_shorter_side(image.convert("RGB"), size)
        data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        pixels = data.view(img.height, img.width, 3).permute(2, 0, 1).float() / 255.0
    h, w = pixels.shape[-2:]
    top, left = (h - size) // 2, (w - size) // 2
    pixels = pixels[:, top:top + size, left:left + size]  # (3, S, S)
    return normalize(pixels.contiguous(), mean, std)


def preprocess_images(images: Sequence[Any], size: int = 224, *,
                      mean: Sequence[float] = CLIP_MEAN,
                      std: Sequence[float] = CLIP_STD) -> Tensor:
    """A list of images (PIL or (3, H, W) tensors, sizes may differ) -> (B, 3, S, S)."""
    if isinstance(images, (Tensor, str)) or not isinstance(images, Sequence) or not images:
        raise TypeError(f"preprocess_images: images must be a non-empty list of PIL images "
                        f"or (3, H, W) tensors, got {type(images).__name__}")
    return torch.stack([preprocess_image(im, size, mean=mean, std=std) for im in images])


def to_pixel_values(images: Tensor) -> Tensor:
    """Images (B, 3, H, W) in [0, 1] (floating; uint8 is read as k/255) -> the model's
    ``pixel_values`` (B, 3, H, W) float32: CLIP's per-channel mean/std normalisation.

    Raises:
        TypeError / ValueError naming ``images``: not a tensor, another dtype, another shape.
    """
    if not isinstance(images, Tensor):
        raise TypeError(f"to_pixel_values: images must be a tensor (B, 3, H, W), got "
                        f"{type(images).__name__}")
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"to_pixel_values: images must have shape (B, 3, H, W), got "
                         f"{tuple(images.shape)}")
    if images.dtype == torch.uint8:
        images = images.float() / 255.0
    elif not images.dtype.is_floating_point:
        raise TypeError(f"to_pixel_values: images must be floating in [0, 1] or uint8, got "
                        f"{images.dtype}")
    return normalize(images.float(), CLIP_MEAN, CLIP_STD)  # (B, 3, H, W)


def processor_config(size: int) -> dict[str, Any]:
    """``preprocess_image(image, size)`` in the fields of HF ``CLIPImageProcessor`` (what a
    checkpoint's ``preprocessor_config.json`` holds): shorter side resized to S = ``size``
    (bicubic, resample 3), centre-cropped to S × S, scaled by 1/255, normalised with
    ``CLIP_MEAN`` / ``CLIP_STD``, converted to RGB.

    Raises:
        ValueError naming ``size`` when it is not a positive int.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"processor_config: size must be a positive int, got {size!r}")
    return {"image_processor_type": "CLIPImageProcessor", "do_resize": True,
            "size": {"shortest_edge": size}, "resample": 3, "do_center_crop": True,
            "crop_size": {"height": size, "width": size}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(CLIP_MEAN),
            "image_std": list(CLIP_STD), "do_convert_rgb": True}
