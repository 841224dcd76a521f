"""``PerceiverResampler``: a fixed number of learned latents read a variable number of image
patch features (Alayrac et al. 2022, Flamingo §2.1 / appendix A.1.1).

Shapes: B batch, T images (media) per row, P patch features per image, Cm media width
(``media_dim``), C latent width (``dim``), L latents (``num_latents``), H heads.

Per image, independently (the images of a row never mix)::

    x = media_proj(media)                                  # (B·T, P, C) (identity if Cm == C)
    lat = latents                                          # (B·T, L, C), learned, shared
    repeat depth times:
        kv  = concat(norm_media(x), norm_latents(lat))     # (B·T, P + L, C)
        lat = lat + attn(q = norm_latents(lat), kv)        # L queries, P + L keys
        lat = lat + ffn(norm_ffn(lat))
    out = norm_out(lat)                                    # (B, T, L, C)

As the paper and its reference code (lucidrains' flamingo-pytorch, OpenFlamingo): the keys
and values are the concatenation of the image's features and the latents themselves, the
projections have no biases, every sub-block is pre-norm and residual, and a final LayerNorm
normalises the output. The output shape (B, T, L, C) does not depend on P. The attention is
``qkv.modules.MultiHeadAttention`` used as cross-attention (its ``in_proj`` row blocks: queries
from the latents, keys/values from the concatenation).

Padded image slots (``media_mask`` False) are not computed at all: their output rows are
exactly zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .feedforward import FeedForward
from .norms import LayerNorm

__all__ = ["PerceiverResampler", "check_media_mask"]


def _positive(owner: str, name: str, val: Any) -> None:
    if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {val!r}")


def check_media_mask(owner: str, media_mask: Any, batch: int, num_media: int,
                     device: torch.device) -> Tensor | None:
    """Validate a (B, T) bool media mask (True = a real image, False = a padded slot);
    returns it on ``device`` (None stays None). TypeError / ValueError name ``media_mask``."""
    if media_mask is None:
        return None
    if not isinstance(media_mask, Tensor) or media_mask.dtype != torch.bool:
        got = media_mask.dtype if isinstance(media_mask, Tensor) else type(media_mask).__name__
        raise TypeError(f"{owner}: media_mask must be a bool tensor (B, T) (True = a real "
                        f"image), got {got}")
    if tuple(media_mask.shape) != (batch, num_media):
        raise ValueError(f"{owner}: media_mask must have shape (B, T) = ({batch}, {num_media}),"
                         f" got {tuple(media_mask.shape)}")
    return media_mask.to(device)


class _ResamplerLayer(nn.Module):
    """One Perceiver block: latents attend to [media; latents], then a feed-forward."""

    def __init__(self, dim: int, num_heads: int, ff_mult: int, eps: float, factory) -> None:
        super().__init__()
        self.norm_media = LayerNorm(dim, eps=eps, **factory)
        self.norm_latents = LayerNorm(dim, eps=eps, **factory)
        self.attn = MultiHeadAttention(dim, num_heads, bias=False, **factory)
        self.norm_ffn = LayerNorm(dim, eps=eps, **factory)
        self.ffn = FeedForward(dim, ff_mult * dim, activation="gelu", bias=False, **factory)

    def forward(self, x: Tensor, latents: Tensor) -> Tensor:
        """x (M, P, C) media, latents (M, L, C) -> latents (M, L, C)."""
        lat = self.norm_latents(latents)  # (M, L, C)
        kv = torch.cat([self.norm_media(x), lat], dim=1)  # (M, P + L, C)
        latents = latents + self.attn(lat, kv)  # (M, L, C)
        return latents + self.ffn(self.norm_ffn(latents))  # (M, L, C)


class PerceiverResampler(nn.Module):
    """Learned latents that summarise each image's patch features into L vectors.

    Args:
        dim: C, the latents' (and the output's) width; ``dim % num_heads == 0``.
        num_latents: L, output vectors per image (64 in the paper).
        depth: Perceiver blocks (6 in the paper; 2 is OpenFlamingo's small setting).
        num_heads: H of every block's attention (head dim C // H).
        media_dim: Cm, the width of the input features (default C). When it differs a
            bias-free ``media_proj`` Linear(Cm -> C) maps the features to C first.
        ff_mult: the feed-forward's hidden width is ``ff_mult · C`` (GELU, no biases).
        norm_eps: LayerNorm epsilon.
        device, dtype: of the parameters.

    Attributes:
        latents (L, C) learned, N(0, 1) as the reference code; media_proj (Linear or
        Identity); layers (``depth`` blocks with ``norm_media``, ``norm_latents``, ``attn``,
        ``norm_ffn``, ``ffn``); norm (the output LayerNorm).

    Example::

        rs = PerceiverResampler(256, num_latents=8, num_heads=4, media_dim=64)
        out = rs(feats)                       # feats (B, T, P, 64) -> (B, T, 8, 256)
        out = rs(feats, media_mask=valid)     # valid (B, T) bool; padded slots -> zeros
    """

    def __init__(self, dim: int, *, num_latents: int = 64, depth: int = 2, num_heads: int,
                 media_dim: int | None = None, ff_mult: int = 4, norm_eps: float = 1e-5,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        media_dim = dim if media_dim is None else media_dim
        for name, val in (("dim", dim), ("num_latents", num_latents), ("depth", depth),
                          ("num_heads", num_heads), ("media_dim", media_dim),
                          ("ff_mult", ff_mult)):
            _positive("PerceiverResampler", name, val)
        if dim % num_heads:
            raise ValueError(f"PerceiverResampler: dim={dim} is not divisible by "
                             f"num_heads={num_heads}")
        factory = {"device": device, "dtype": dtype}
        self.dim, self.media_dim, self.num_latents = dim, media_dim, num_latents
        self.latents = nn.Parameter(torch.empty(num_latents, dim, **factory))
        self.media_proj = (nn.Identity() if media_dim == dim
                           else nn.Linear(media_dim, dim, bias=False, **factory))
        self.layers = nn.ModuleList(_ResamplerLayer(dim, num_heads, ff_mult, norm_eps, factory)
                                    for _ in range(depth))
        self.norm = LayerNorm(dim, eps=norm_eps, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Latents N(0, 1) (the reference code's ``torch.randn``); the projections keep
        their modules' initialisation."""
        nn.init.normal_(self.latents)

    def forward(self, media: Tensor, *, media_mask: Tensor | None = None) -> Tensor:
        """Resample every image of every row.

        Args:
            media: (B, T, P, Cm) patch features, T images per row, P features per image
                (any P >= 1; 4-D (B, P, Cm) is refused: add the T axis).
            media_mask: (B, T) bool, True = a real image; False slots are skipped and get
                zero output. Default: every slot is real.

        Returns:
            (B, T, L, C) latents per image.

        Raises:
            TypeError / ValueError naming ``media`` or ``media_mask`` and the shape.
        """
        if not isinstance(media, Tensor) or not media.dtype.is_floating_point:
            got = media.dtype if isinstance(media, Tensor) else type(media).__name__
            raise TypeError(f"PerceiverResampler: media must be a floating-point tensor "
                            f"(B, T, P, Cm), got {got}")
        if media.dim() != 4 or media.shape[-1] != self.media_dim or media.shape[2] == 0:
            raise ValueError(f"PerceiverResampler: media must have shape (B, T, P, Cm="
                             f"{self.media_dim}) with P >= 1, got {tuple(media.shape)}")
        b, t, p, _ = media.shape
        mask = check_media_mask("PerceiverResampler", media_mask, b, t, media.device)
        flat = media.reshape(b * t, p, self.media_dim)  # (B·T, P, Cm)
        rows = None if mask is None else mask.reshape(b * t).nonzero().squeeze(1)  # (M,)
        if rows is not None:
            flat = flat.index_select(0, rows)  # (M, P, Cm), only the real images
        x = self.media_proj(flat)  # (M, P, C)
        lat = self.latents.to(x.dtype).expand(x.shape[0], -1, -1)  # (M, L, C)
        for layer in self.layers:
            lat = layer(x, lat)  # (M, L, C)
        lat = self.norm(lat)  # (M, L, C)
        if rows is not None:
            out = lat.new_zeros(b * t, self.num_latents, self.dim)  # (B·T, L, C)
            lat = out.index_copy(0, rows, lat)  # padded slots stay zero
        return lat.reshape(b, t, self.num_latents, self.dim)  # (B, T, L, C)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_latents={self.num_latents}, depth={len(self.layers)}, "
                f"media_dim={self.media_dim}")
