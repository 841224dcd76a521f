"""``GatedCrossAttentionBlock``: Flamingo's tanh-gated cross-attention from text to image
latents, inserted before a frozen language model's layers (Alayrac et al. 2022, §2.2).

Shapes: B batch, N text length, C text width (``dim``), T images per row, L latents per image,
Cm latent width (``media_dim``), S = T·L keys, H heads, Hkv kv heads, D head dim (C // H).

::

    x = x + tanh(attn_gate) · attn(norm_attn(x), media latents, media mask)   # (B, N, C)
    x = x + tanh(ff_gate)   · ffn(norm_ffn(x))                                 # (B, N, C)

``attn_gate`` and ``ff_gate`` are 1-element parameters (not 0-dim: FSDP2's ``fully_shard``
refuses 0-dim parameters) initialised to 0, so at initialisation the block returns its input
exactly and the model it is inserted into is the frozen language model, bit for bit. The
projections have no biases (as the reference code), so a query that attends nothing gets an
exactly zero attention branch.

Media mask (True = may attend). ``text_time`` (B, N) says, for each text position, how many
``<image>`` tokens of its row are at or before it: k >= 1 means its latest image is the k-th
(1-based), 0 means no image yet. Key j belongs to image ``j // L + 1``.

- ``only_attend_immediate_media=True`` (OpenFlamingo's default): a position attends only to
  the latents of its latest image (``text_time == image``) — the ``<image>`` token itself and
  the text after it up to the next ``<image>``;
- ``False``: to the latents of every image at or before it (``1 <= image <= text_time``).

Positions before the first image (``text_time == 0``) attend nothing: the core's
fully-masked-row guarantee makes their attention output exactly zero with finite gradients
(never NaN). Padded image slots (``media_mask`` False) are never attended. The gated
feed-forward applies to every position, those before the first image included (as the paper's
and OpenFlamingo's blocks): once ``ff_gate`` opens, text-only positions change too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .feedforward import FeedForward
from .norms import LayerNorm
from .resampler import check_media_mask

__all__ = ["GatedCrossAttentionBlock", "MediaKV", "cross_attention_mask", "text_time_from_ids"]


class MediaKV(NamedTuple):
    """Cross-attention keys/values of a row's image latents, computed once by
    ``GatedCrossAttentionBlock.project_media``: ``k``, ``v`` (B, Hkv, T·L, D), with the
    number of images ``num_media`` (T) and latents per image ``num_latents`` (L)."""

    k: Tensor
    v: Tensor
    num_media: int
    num_latents: int

    def repeat_rows(self, times: int) -> MediaKV:
        """Each row repeated ``times`` times, consecutively (beam search's row order)."""
        if times == 1:
            return self
        return MediaKV(self.k.repeat_interleave(times, dim=0),
                       self.v.repeat_interleave(times, dim=0), self.num_media,
                       self.num_latents)


def text_time_from_ids(input_ids: Tensor, image_token_id: int, *,
                       keep: Tensor | None = None, start: Tensor | None = None) -> Tensor:
    """``text_time`` (B, N) int64 of token ids (B, N): the number of ``image_token_id``
    tokens at or before each position (counting only positions where ``keep`` (B, N) bool is
    True), plus ``start`` (B,) (the images already seen, e.g. in a decoding cache)."""
    is_image = input_ids == image_token_id  # (B, N)
    if keep is not None:
        is_image = is_image & keep
    time = is_image.long().cumsum(dim=1)  # (B, N)
    return time if start is None else time + start[:, None]


def cross_attention_mask(text_time: Tensor, num_media: int, num_latents: int, *,
                         media_mask: Tensor | None = None,
                         only_attend_immediate_media: bool = True) -> Tensor:
    """The (B, 1, N, T·L) boolean mask (True = may attend) of text positions over image
    latents; see the module docstring.

    Args:
        text_time: (B, N) integers in [0, T]: the 1-based index of each position's latest
            image, 0 before the first.
        num_media: T. num_latents: L.
        media_mask: (B, T) bool, False = a padded slot (never attended); default all real.
        only_attend_immediate_media: the latest image only (True) or every earlier one.
    """
    image = torch.arange(1, num_media + 1, device=text_time.device)  # (T,)
    image = image.repeat_interleave(num_latents)  # (S,) the image of each key
    t = text_time[:, :, None]  # (B, N, 1)
    # the latest image only, or every image at or before the position: (B, N, S)
    allowed = (t == image) if only_attend_immediate_media else (image <= t)
    if media_mask is not None:
        real = media_mask.repeat_interleave(num_latents, dim=1)  # (B, S)
        allowed = allowed & real[:, None, :]  # (B, N, S)
    return allowed[:, None]  # (B, 1, N, S)


class GatedCrossAttentionBlock(nn.Module):
    """Tanh-gated cross-attention plus a tanh-gated feed-forward, both residual; the identity
    at initialisation.

    Args:
        dim: C, the text width; ``dim % num_heads == 0``.
        num_heads: H of the cross-attention.
        media_dim: Cm, the width of the image latents (default C).
        ff_mult: the feed-forward's hidden width is ``ff_mult · C`` (GELU, no biases).
        only_attend_immediate_media: see the module docstring (default True, OpenFlamingo's).
        norm_eps: LayerNorm epsilon.
        device, dtype: of the parameters.

    Attributes:
        norm_attn, attn (``MultiHeadAttention`` with ``kv_dim=media_dim``, no biases),
        attn_gate (1,), norm_ffn, ffn (``FeedForward``), ff_gate (1,).

    Example::

        block = GatedCrossAttentionBlock(128, num_heads=4, media_dim=64)
        y = block(x, latents, text_time=tt)         # x (B, N, 128), latents (B, T, L, 64)
        kv = block.project_media(latents)           # once, then for every decoding step:
        y = block(x_t, media_kv=kv, text_time=tt_t)
    """

    def __init__(self, dim: int, *, num_heads: int, media_dim: int | None = None,
                 ff_mult: int = 4, only_attend_immediate_media: bool = True,
                 norm_eps: float = 1e-5, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        media_dim = dim if media_dim is None else media_dim
        if not isinstance(ff_mult, int) or isinstance(ff_mult, bool) or ff_mult <= 0:
            raise ValueError(f"GatedCrossAttentionBlock: ff_mult must be a positive int, "
                             f"got {ff_mult!r}")
        if not isinstance(only_attend_immediate_media, bool):
            raise TypeError(f"GatedCrossAttentionBlock: only_attend_immediate_media must be a "
                            f"bool, got {only_attend_immediate_media!r}")
        factory = {"device": device, "dtype": dtype}
        self.dim, self.media_dim = dim, media_dim
        self.only_attend_immediate_media = only_attend_immediate_media
        self.norm_attn = LayerNorm(dim, eps=norm_eps, **factory)
        self.attn = MultiHeadAttention(dim, num_heads, kv_dim=media_dim, bias=False, **factory)
        self.attn_gate = nn.Parameter(torch.zeros(1, **factory))
        self.norm_ffn = LayerNorm(dim, eps=norm_eps, **factory)
        self.ffn = FeedForward(dim, ff_mult * dim, activation="gelu", bias=False, **factory)
        self.ff_gate = nn.Parameter(torch.zeros(1, **factory))

    def reset_gates(self) -> None:
        """Both gates back to 0 (the block becomes the identity)."""
        with torch.no_grad():
            self.attn_gate.zero_()
            self.ff_gate.zero_()

    def _check_media(self, media: Any) -> None:
        if not isinstance(media, Tensor) or not media.dtype.is_floating_point:
            got = media.dtype if isinstance(media, Tensor) else type(media).__name__
            raise TypeError(f"GatedCrossAttentionBlock: media must be a floating-point tensor "
                            f"(B, T, L, Cm), got {got}")
        if media.dim() != 4 or media.shape[-1] != self.media_dim or 0 in media.shape[2:]:
            raise ValueError(f"GatedCrossAttentionBlock: media must have shape (B, T, L, Cm="
                             f"{self.media_dim}) with L >= 1, got {tuple(media.shape)}")

    def project_media(self, media: Tensor) -> MediaKV:
        """Keys/values of image latents ``media`` (B, T, L, Cm), to compute once and reuse
        for every decoding step (``forward(..., media_kv=kv)``). T may be 0 (no images)."""
        self._check_media(media)
        b, t, lat, cm = media.shape
        if t == 0:
            h, d = self.attn.num_kv_heads, self.attn.head_dim
            empty = media.new_zeros(b, h, 0, d)  # (B, Hkv, 0, D)
            return MediaKV(empty, empty, 0, lat)
        k, v = self.attn.project_kv(media.reshape(b, t * lat, cm))  # (B, Hkv, T·L, D) each
        return MediaKV(k, v, t, lat)

    def _check_time(self, text_time: Any, batch: int, n: int, num_media: int) -> Tensor:
        if (not isinstance(text_time, Tensor) or text_time.dtype.is_floating_point
                or text_time.dtype == torch.bool or tuple(text_time.shape) != (batch, n)):
            got = (f"{tuple(text_time.shape)} {text_time.dtype}"
                   if isinstance(text_time, Tensor) else type(text_time).__name__)
            raise ValueError(f"GatedCrossAttentionBlock: text_time must be an integer tensor "
                             f"(B, N) = ({batch}, {n}), got {got}")
        if text_time.numel() and (int(text_time.min()) < 0 or int(text_time.max()) > num_media):
            raise ValueError(f"GatedCrossAttentionBlock: text_time must be in [0, T={num_media}]"
                             f" (the 1-based index of each position's latest image), got "
                             f"values in [{int(text_time.min())}, {int(text_time.max())}]")
        return text_time

    def cross_attend(self, x: Tensor, media: Tensor | None = None, *, text_time: Tensor,
                     media_mask: Tensor | None = None,
                     media_kv: MediaKV | None = None) -> Tensor:
        """The ungated attention branch ``attn(norm_attn(x))`` (B, N, C) (arguments as
        ``forward``): exactly zero at positions that may attend no latent."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"GatedCrossAttentionBlock: x must have shape (B, N, C={self.dim})"
                             f", got {got}")
        if (media is None) == (media_kv is None):
            raise ValueError("GatedCrossAttentionBlock: give exactly one of media (B, T, L, Cm)"
                             " or media_kv (from project_media)")
        kv = self.project_media(media) if media is not None else media_kv
        if not isinstance(kv, MediaKV):
            raise TypeError(f"GatedCrossAttentionBlock: media_kv must be the MediaKV from "
                            f"project_media(), got {type(kv).__name__}")
        b, n, _ = x.shape
        if kv.k.shape[0] != b:
            raise ValueError(f"GatedCrossAttentionBlock: the media has batch {kv.k.shape[0]}, "
                             f"x has batch {b}")
        text_time = self._check_time(text_time, b, n, kv.num_media)
        mask_media = check_media_mask("GatedCrossAttentionBlock", media_mask, b, kv.num_media,
                                      x.device)
        if kv.num_media == 0 or n == 0:
            return x.new_zeros(x.shape)  # nothing to attend to: the zero branch
        mask = cross_attention_mask(text_time.to(x.device), kv.num_media, kv.num_latents,
                                    media_mask=mask_media,
                                    only_attend_immediate_media=self.only_attend_immediate_media)
        return self.attn(self.norm_attn(x), kv=(kv.k, kv.v), mask=mask)  # (B, N, C)

    def forward(self, x: Tensor, media: Tensor | None = None, *, text_time: Tensor,
                media_mask: Tensor | None = None, media_kv: MediaKV | None = None) -> Tensor:
        """Gated cross-attention then gated feed-forward.

        Args:
            x: text hidden states (B, N, C).
            media: image latents (B, T, L, Cm) — or ``media_kv`` from ``project_media``.
            text_time: (B, N) integers in [0, T]: each position's latest image (1-based),
                0 before the first (``text_time_from_ids``).
            media_mask: (B, T) bool, False = a padded image slot (never attended).
            media_kv: precomputed ``MediaKV`` instead of ``media``.

        Returns:
            (B, N, C); exactly ``x`` while both gates are 0.

        Raises:
            TypeError / ValueError naming the argument and its shape or values.
        """
        a = self.cross_attend(x, media, text_time=text_time, media_mask=media_mask,
                              media_kv=media_kv)  # (B, N, C)
        x = x + torch.tanh(self.attn_gate) * a  # (B, N, C)
        return x + torch.tanh(self.ff_gate) * self.ffn(self.norm_ffn(x))  # (B, N, C)

    def extra_repr(self) -> str:
        extra = "" if self.only_attend_immediate_media else ", only_attend_immediate_media=False"
        return f"dim={self.dim}, media_dim={self.media_dim}{extra}"
