"""``ViT``: the Vision Transformer of Dosovitskiy et al. 2020 on qkv's encoder layers; loads
HuggingFace ``ViTModel`` / ``ViTForImageClassification`` checkpoints; CLIP's image tower.

Shapes: B batch, Cin image channels, Hi/Wi image height/width (pixels), P patch size,
Gh/Gw patch grid (Hi // P, Wi // P), G = image_size // P the config's grid, T = 1 + Gh·Gw
tokens (the class token first), C model width (``dim``), H heads, K classes, L layers.

Architecture (pre-norm)::

    x = [cls; Linear(patches)] + positions                 # (B, T, C); patches (B, Gh·Gw, Cin·P·P)
    x = norm_pre(x)                                        # CLIP only (``pre_norm=True``)
    x = EncoderLayer(x) × L                                # x = x + sublayer(norm(x))
    last_hidden_state = norm(x)                            # (B, T, C)
    pooled = last_hidden_state[:, 0]  (or the mean of the patch tokens: ``pooling="mean"``)
    pooler_output = tanh(Linear(pooled))                   # optional (HF ViTModel's pooler)
    logits = Linear(pooled)                                # optional head, (B, K)

The patch embedding is a convolution with kernel = stride = P, computed as one matrix
product over the flattened patches (the same numbers; the weight keeps the convolution's
(C, Cin, P, P) layout of HF checkpoints). Positions are learned for the config's G×G grid;
an image of another size (any multiple of P) gets them resampled to its Gh×Gw grid by
bicubic interpolation (``align_corners=False``: HF's ``interpolate_pos_encoding``, timm's
``resample_abs_pos_embed``), the class token's position unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules.feedforward import ACTIVATIONS
from ..modules.layers import EncoderLayer, TokenRows
from ..modules.linear_call import apply_linear
from ..modules.norms import LayerNorm
from ..ops.fast_linear import fast_linear
from .config import ModelConfig, check_norm_eps
from .hf_load import HFMapping, load_hf
from .hf_vit import VIT_HF
from .hub import PretrainedMixin

__all__ = ["PatchEmbed", "ViT", "ViTConfig", "ViTOutput", "check_pixel_values",
           "interpolate_positions"]


def _positive_int(owner: str, name: str, val: Any) -> None:
    if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {val!r}")


def check_layer_fields(owner: str, config: Any) -> None:
    """Validate the encoder-layer fields a ViT or CLIP tower config shares: ``activation``
    (one of ``ACTIVATIONS``), ``norm_eps`` in [1e-38, 1], ``dropout`` and ``attn_dropout``
    in [0, 1); ValueError naming ``owner`` and the field otherwise."""
    if config.activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {config.activation!r}")
    check_norm_eps(owner, config.norm_eps)
    for name in ("dropout", "attn_dropout"):
        val = getattr(config, name)
        if not isinstance(val, (int, float)) or not 0.0 <= val < 1.0:
            raise ValueError(f"{owner}: {name} must be in [0, 1), got {val!r}")


@dataclasses.dataclass(frozen=True)
class ViTConfig(ModelConfig):
    """Configuration of a ``ViT`` (frozen; ``ViTConfig.from_name("vit-b-16")`` for a preset).

    Args:
        image_size: the side of the square images the positions are learned for (pixels);
            other sizes (multiples of ``patch_size``) get interpolated positions.
        patch_size: P, the side of a square patch; ``image_size % patch_size == 0``.
        dim: C. num_layers: L. num_heads: H (``dim % num_heads == 0``).
        ffn_hidden: the MLP width, default 4·C.
        num_channels: Cin (3 for RGB).
        activation: the MLP activation, a key of ``qkv.modules.feedforward.ACTIVATIONS``
            ("gelu": ViT; "quick_gelu": OpenAI CLIP).
        norm_eps: LayerNorm epsilon (HF ViT checkpoints: 1e-12; CLIP 1e-5).
        dropout: dropout after the embeddings and on each residual branch;
            ``attn_dropout`` on the attention weights.
        pooling: "cls" (the class token's final state) or "mean" (the mean over the patch
            tokens' final states).
        pre_norm: a LayerNorm on the embeddings before the first layer (CLIP's vision tower).
        patch_bias: the patch embedding has a bias (ViT yes, CLIP no).
        with_pooler: build HF ``ViTModel``'s pooler, tanh(Linear(pooled)) (``pooler_output``).
        num_classes: K > 0 builds a classification head Linear(C -> K) on the pooled
            features (``ViTForImageClassification``); 0: none.

    Presets: "vit-tiny" (32 px, P=8, C=64, 2 layers, 2 heads: tests and demos), "vit-s-16"
    (C=384, 12 layers, 6 heads), "vit-b-16", "vit-b-32" (C=768, 12 layers, 12 heads), all at
    224 px but "vit-tiny".
    """

    image_size: int = 224
    patch_size: int = 16
    dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_hidden: int | None = None
    num_channels: int = 3
    activation: str = "gelu"
    norm_eps: float = 1e-6
    dropout: float = 0.0
    attn_dropout: float = 0.0
    pooling: str = "cls"
    pre_norm: bool = False
    patch_bias: bool = True
    with_pooler: bool = False
    num_classes: int = 0

    MODEL_TYPE: ClassVar[str] = "qkv-vit"
    LAYER_KEYS: ClassVar[dict[str, str]] = {"num_layers": r"layers\.(\d+)\."}
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "vit-tiny": {"image_size": 32, "patch_size": 8, "dim": 64, "num_layers": 2,
                     "num_heads": 2},
        "vit-s-16": {"dim": 384, "num_layers": 12, "num_heads": 6},
        "vit-b-16": {},
        "vit-b-32": {"patch_size": 32},
    }

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "dim", "num_layers", "num_heads",
                     "num_channels"):
            _positive_int("ViTConfig", name, getattr(self, name))
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig: image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        if self.dim % self.num_heads:
            raise ValueError(f"ViTConfig: dim={self.dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.ffn_hidden is not None:
            _positive_int("ViTConfig", "ffn_hidden", self.ffn_hidden)
        check_layer_fields("ViTConfig", self)
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"ViTConfig: pooling must be 'cls' or 'mean', "
                             f"got {self.pooling!r}")
        if (not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool)
                or self.num_classes < 0):
            raise ValueError(f"ViTConfig: num_classes must be an int >= 0, "
                             f"got {self.num_classes!r}")

    @property
    def grid(self) -> int:
        """G = image_size // patch_size, the side of the position grid."""
        return self.image_size // self.patch_size


@dataclasses.dataclass
class ViTOutput:
    """What ``ViT.forward`` returns.

    Attributes:
        last_hidden_state: (B, T, C), the final norm of the last layer's output.
        pooled: (B, C), the class token's row of ``last_hidden_state`` (or the mean of the
            patch tokens' rows with ``pooling="mean"``): what a head or a projection reads.
        pooler_output: (B, C), tanh(Linear(pooled)) — None without ``with_pooler``.
        logits: (B, K) from the classification head — None without one.
        hidden_states: with ``output_hidden_states``, L + 1 tensors (B, T, C): the encoder's
            input (embeddings, after ``norm_pre``) and each layer's output (before the
            final norm), as HF; else None.
        attentions: with ``output_attentions``, L tensors (B, H, T, T); else None.
    """

    last_hidden_state: Tensor
    pooled: Tensor
    pooler_output: Tensor | None = None
    logits: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


def check_pixel_values(owner: str, pixel_values: Any, *, num_channels: int,
                       patch_size: int) -> tuple[int, int]:
    """Check an image batch (B, Cin, Hi, Wi) of floats; returns the grid (Gh, Gw).

    Raises TypeError (not a tensor; an integer/bool dtype: convert images with
    ``qkv.data.image_preprocess``) or ValueError (not 4-D, Cin != ``num_channels``, a side
    that is not a positive multiple of ``patch_size``), naming ``pixel_values`` and its
    shape/dtype.
    """
    if not isinstance(pixel_values, Tensor):
        raise TypeError(f"{owner}: pixel_values must be a torch.Tensor (B, {num_channels}, "
                        f"H, W) of floats, got {type(pixel_values).__name__}")
    if not pixel_values.dtype.is_floating_point:
        raise TypeError(f"{owner}: pixel_values must be a floating-point tensor (normalised "
                        f"pixels, e.g. from qkv.data.image_preprocess.preprocess_images), got "
                        f"dtype {pixel_values.dtype}")
    if pixel_values.dim() != 4:
        raise ValueError(f"{owner}: pixel_values must have shape (B, Cin, H, W) (4-D, "
                         f"channels first), got {tuple(pixel_values.shape)}")
    _, cin, h, w = pixel_values.shape
    if cin != num_channels:
        raise ValueError(f"{owner}: pixel_values has {cin} channels (shape "
                         f"{tuple(pixel_values.shape)}), the model expects num_channels="
                         f"{num_channels} (channels first: (B, Cin, H, W))")
    if h < patch_size or w < patch_size or h % patch_size or w % patch_size:
        raise ValueError(f"{owner}: pixel_values height and width must be positive multiples "
                         f"of patch_size={patch_size}, got shape {tuple(pixel_values.shape)}")
    return h // patch_size, w // patch_size


def interpolate_positions(pos: Tensor, grid: int, gh: int, gw: int) -> Tensor:
    """Positions for a Gh×Gw patch grid from ones learned for a G×G grid.

    ``pos`` (1 + G·G, C), the class token's first -> (1 + Gh·Gw, C): the patch positions
    as a (C, G, G) image resized bicubically (``align_corners=False``) to (C, Gh, Gw), as HF's
    ``interpolate_pos_encoding``; returned unchanged when (Gh, Gw) == (G, G).
    """
    if (gh, gw) == (grid, grid):
        return pos
    c = pos.shape[-1]
    cls_pos, patch = pos[:1], pos[1:]  # (1, C), (G·G, C)
    img = patch.reshape(1, grid, grid, c).permute(0, 3, 1, 2)  # (1, C, G, G)
    img = F.interpolate(img, size=(gh, gw), mode="bicubic", align_corners=False)
    patch = img.permute(0, 2, 3, 1).reshape(gh * gw, c)  # (Gh·Gw, C)
    return torch.cat([cls_pos, patch], dim=0)  # (1 + Gh·Gw, C)


class PatchEmbed(nn.Module):
    """Non-overlapping P×P patches -> C: the convolution Conv2d(Cin, C, P, stride=P) computed
    as one matrix product over the flattened patches.

    ``weight`` (C, Cin, P, P) (a convolution's layout, as HF checkpoints), ``bias`` (C,) or
    None. forward: pixels (B, Cin, Hi, Wi), Hi and Wi multiples of P -> (B, Gh·Gw, C), the
    patches in row-major order (as ``conv(x).flatten(2).transpose(1, 2)``).
    """

    def __init__(self, num_channels: int, dim: int, patch_size: int, *, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.patch_size = patch_size
        self.weight = nn.Parameter(torch.empty(dim, num_channels, patch_size, patch_size,
                                               **factory))
        self.bias = nn.Parameter(torch.empty(dim, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Conv2d's default initialisation (Kaiming-uniform weight, uniform bias)."""
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        if self.bias is not None:
            fan_in = self.weight[0].numel()
            nn.init.uniform_(self.bias, -fan_in ** -0.5, fan_in ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, Cin, Hi, Wi) -> (B, Gh·Gw, C)."""
        b, cin, h, w = x.shape
        p = self.patch_size
        gh, gw = h // p, w // p
        patches = x.reshape(b, cin, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)  # (B,Gh,Gw,Cin,P,P)
        patches = patches.reshape(b, gh * gw, cin * p * p)  # (B, Gh·Gw, Cin·P·P)
        w = self.weight.reshape(self.weight.shape[0], -1)  # (C, Cin·P·P)
        return fast_linear(patches, w, self.bias)  # (B, Gh·Gw, C)

    def extra_repr(self) -> str:
        c, cin, p, _ = self.weight.shape
        return f"{cin}, {c}, patch_size={p}, bias={self.bias is not None}"


class ViT(PretrainedMixin, nn.Module):
    """Vision Transformer: patch embedding, class token, learned positions (interpolated for
    other image sizes), pre-norm ``EncoderLayer`` stack, final norm, optional pooler / head.

    Args:
        config: a ``ViTConfig``.
        device, dtype: of the parameters.

    Attributes:
        patch_embed (``PatchEmbed``), cls_token (C,), pos_embed (1 + G·G, C),
        norm_pre (LayerNorm or None), layers (L ``EncoderLayer``s, pre-norm),
        norm (final LayerNorm), pooler (Linear C -> C or None), head (Linear C -> K or None).

    Example::

        model = ViT(ViTConfig.from_name("vit-tiny"))
        out = model(pixel_values)              # pixel_values (B, 3, 32, 32) floats
        out.pooled                             # (B, 64)
        model(torch.randn(2, 3, 48, 48))       # another size: positions interpolated
        vit = ViT.from_pretrained("path/to/hf-vit")   # HF ViTModel / ViTForImageClassification
    """

    config_class: ClassVar[type[ModelConfig]] = ViTConfig
    hf_mapping: ClassVar[HFMapping] = VIT_HF

    def __init__(self, config: ViTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"ViT: config must be a ViTConfig, got {type(config).__name__}")
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        self.patch_embed = PatchEmbed(c.num_channels, c.dim, c.patch_size, bias=c.patch_bias,
                                      **factory)
        self.cls_token = nn.Parameter(torch.empty(c.dim, **factory))
        self.pos_embed = nn.Parameter(torch.empty(1 + c.grid ** 2, c.dim, **factory))
        self.drop = nn.Dropout(c.dropout)
        self.norm_pre = LayerNorm(c.dim, eps=c.norm_eps, **factory) if c.pre_norm else None
        self.layers = nn.ModuleList(
            EncoderLayer.build(c.dim, c.num_heads, ffn_hidden=c.ffn_hidden or 4 * c.dim,
                               activation=c.activation, norm_eps=c.norm_eps, norm_first=True,
                               dropout=c.dropout, attn_dropout=c.attn_dropout,
                               ffn_dropout=0.0, **factory)
            for _ in range(c.num_layers))
        self.norm = LayerNorm(c.dim, eps=c.norm_eps, **factory)
        self.pooler = nn.Linear(c.dim, c.dim, **factory) if c.with_pooler else None
        self.head = nn.Linear(c.dim, c.num_classes, **factory) if c.num_classes else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """ViT's initialisation (timm, HF): linear weights and the class token / positions
        N(0, std²) truncated at ±2 std, biases zero, norms identity; the patch embedding
        keeps the convolution's default."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.patch_embed.reset_parameters()
        nn.init.trunc_normal_(self.cls_token, std=std, a=-2 * std, b=2 * std)
        nn.init.trunc_normal_(self.pos_embed, std=std, a=-2 * std, b=2 * std)

    def embed(self, pixel_values: Tensor) -> Tensor:
        """Token embeddings (B, T, C): [cls; patches] + (interpolated) positions, dropout and
        ``norm_pre``. ``pixel_values`` (B, Cin, Hi, Wi) is checked (see ``forward``)."""
        c = self.config
        gh, gw = check_pixel_values("ViT", pixel_values, num_channels=c.num_channels,
                                    patch_size=c.patch_size)
        w = self.patch_embed.weight
        x = self.patch_embed(pixel_values.to(w.dtype))  # (B, Gh·Gw, C)
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, C)
        pos = interpolate_positions(self.pos_embed, c.grid, gh, gw)  # (T, C)
        x = torch.cat([cls, x], dim=1) + pos  # (B, T, C)
        x = self.drop(x)
        return x if self.norm_pre is None else self.norm_pre(x)

    def pool(self, hidden: Tensor) -> Tensor:
        """The pooled features (B, C) of final-normed states (B, T, C): the class token's
        row, or the mean of the patch rows (``pooling="mean"``)."""
        if self.config.pooling == "mean":
            return hidden[:, 1:].mean(dim=1)
        return hidden[:, 0]

    def forward(self, pixel_values: Tensor, *, output_hidden_states: bool = False,
                output_attentions: bool = False) -> ViTOutput:
        """Encode images.

        Args:
            pixel_values: (B, Cin, Hi, Wi) floating point, normalised pixels
                (``qkv.data.image_preprocess``); Hi and Wi positive multiples of P (other
                than ``image_size``: positions interpolated bicubically). Cast to the
                parameters' dtype.
            output_hidden_states: also return the encoder input and each layer's output.
            output_attentions: also return each layer's attention weights (B, H, T, T)
                (computed by the reference math, slower).

        Returns:
            ``ViTOutput``: last_hidden_state (B, T, C), pooled (B, C), pooler_output /
            logits when built, hidden_states / attentions on request.

        Raises:
            TypeError / ValueError naming ``pixel_values`` and its shape or dtype: not a
            tensor, an integer dtype, not 4-D, the wrong number of channels, a side that
            is not a positive multiple of the patch size.
        """
        x = self.embed(pixel_values)  # (B, T, C)
        hidden = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        # The layers run on the (B·T, C) rows (EncoderLayer.forward with rows=; nothing is
        # padded: the same math as on (B, T, C)): without gradients the MLP activation runs
        # in place (quick_gelu folded into the projections, see FeedForward).
        rows = TokenRows(None, batch=x.shape[0], length=x.shape[1])
        h = rows.pack(x)  # (B·T, C)
        bufs: dict[str, Tensor] | None = None if torch.is_grad_enabled() else {}
        for layer in self.layers:
            h = layer(h, rows=rows, need_weights=output_attentions, bufs=bufs)
            if output_attentions:
                h, wts = h
                attentions.append(wts)
            if hidden is not None:
                hidden.append(rows.unpack(h))
        x = self.norm(rows.unpack(h))  # (B, T, C)
        pooled = self.pool(x)  # (B, C)
        pooler_output = None if self.pooler is None else torch.tanh(
            apply_linear(self.pooler, pooled))  # (B, C)
        return ViTOutput(
            last_hidden_state=x, pooled=pooled,
            pooler_output=pooler_output,
            logits=None if self.head is None else apply_linear(self.head, pooled),
            hidden_states=None if hidden is None else tuple(hidden),
            attentions=None if attentions is None else tuple(attentions))

    def pooled_features(self, pixel_values: Tensor) -> Tensor:
        """``forward(pixel_values).pooled`` (B, C) alone, computing only what it reads: with
        ``pooling="cls"`` the last layer's query projection, attention, output projection,
        FFN and the final norm run for the class tokens only (``EncoderLayer.forward`` with
        ``at=``; every token is still a key/value), i.e. ~3/4 of the last layer is skipped
        (a layer whose attention is swapped or hooked computes its rows in full inside;
        FSDP, activation checkpointing and hooks on the layer wrap that call). Mean pooling
        runs the last layer in full. Same arguments and errors as ``forward``."""
        x = self.embed(pixel_values)  # (B, T, C)
        b, t, _ = x.shape
        rows = TokenRows(None, batch=b, length=t)
        h = rows.pack(x)  # (B·T, C)
        bufs: dict[str, Tensor] | None = None if torch.is_grad_enabled() else {}
        layers = list(self.layers)
        last = layers[-1] if layers and self.config.pooling == "cls" else None
        for layer in layers if last is None else layers[:-1]:
            h = layer(h, rows=rows, bufs=bufs)
        if last is None:
            return self.pool(self.norm(rows.unpack(h)))  # (B, C)
        at = torch.arange(b, device=h.device) * t  # (B,) the class tokens' rows
        return self.norm(last(h, rows=rows, at=at, bufs=bufs))  # (B, C)

    # --- HuggingFace --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, directory: str | os.PathLike, *, allow_pickle: bool = False,
                **kwargs: Any) -> ViT:
        """A ``ViT`` from a local HuggingFace ``ViTModel`` / ``ViTForImageClassification``
        directory (config.json with model_type "vit" and model.safetensors, or its shards
        with model.safetensors.index.json; a pytorch_model.bin only with
        ``allow_pickle=True``, read with
        ``torch.load(weights_only=True)``). The pooler and the classification head are
        built when the checkpoint holds them. Returned in eval mode.

        Every config.json field is classified in ``qkv.models.hf_config.VIT_FIELDS``; an
        option qkv does not compute raises ``CheckpointError`` naming it, an unknown field
        warns. ``qkv_bias: false`` loads zero query/key/value biases (the same outputs; they
        are trainable parameters here). ``kwargs`` (device, dtype) go to the constructor (the
        steps are ``qkv.models.hf_load.load_hf``'s, as for every HF architecture).
        """
        return load_hf(cls.hf_mapping, cls, directory, allow_pickle=allow_pickle, **kwargs)
