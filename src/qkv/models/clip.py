"""``CLIP``: contrastive language-image pre-training (Radford et al. 2021) on qkv's layers —
a ``ViT`` image tower and a causal text tower, both projected into one embedding space;
loads HuggingFace ``CLIPModel`` checkpoints.

Shapes: B batch (B_img images, B_txt texts), N text length (≤ ``max_len``), V vocabulary,
Cv / Ct the towers' widths, E the shared embedding width (``embed_dim``), H heads,
T image tokens (see ``qkv.models.vit``).

Architecture::

    image_embeds = visual_projection(ViT(pixels).pooled)          # (B_img, E), no bias
    h = token_embed[ids] + position[:N]                            # (B_txt, N, Ct)
    h = EncoderLayer(h, causal, key padding) × L; h = norm(h)      # pre-norm, GPT-like
    text_embeds = text_projection(h[b, eos_b])                     # (B_txt, E), no bias
    logits_per_image = exp(logit_scale) · normalise(image) @ normalise(text)ᵀ   # (B_img, B_txt)

The text is pooled at its end-of-text token ("eos" pooling: the first ``eos_token_id`` of
each row) or, as OpenAI's original code and transformers for configs with
``eos_token_id == 2``, at the position of the highest token id ("argmax" pooling: OpenAI's
vocabulary puts the end-of-text token last).

The temperature is learned as ``logit_scale`` = log of the multiplier, a 1-element tensor
(FSDP2's ``fully_shard`` refuses 0-dim parameters), initialised to log(1/0.07); as
open_clip, training clamps it in place to at most log(100) after each optimizer step
(``clamp_logit_scale_``), and the forward uses ``exp(logit_scale)`` as it is (as open_clip
and transformers: OpenAI's checkpoints store 4.6052, a multiplier of 100.003).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules.layers import EncoderLayer, TokenRows
from ..modules.linear_call import apply_linear
from ..modules.norms import LayerNorm
from ..modules.positions import Learned
from .clip_loss import clip_loss
from .config import ModelConfig
from .hf_clip import CLIP_HF
from .hf_load import HFMapping, load_hf
from .hub import PretrainedMixin
from .inputs import check_token_ids
from .vit import ViT, ViTConfig, ViTOutput, check_layer_fields

__all__ = ["CLIP", "CLIPConfig", "CLIPOutput", "CLIPTextConfig", "CLIPTextOutput",
           "CLIPTextTower"]


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig(ModelConfig):
    """The text tower of a ``CLIPConfig`` (frozen).

    Args:
        vocab_size: V. max_len: the context length (N ≤ max_len; 77 for OpenAI CLIP).
        dim: Ct. num_layers, num_heads: as GPT. ffn_hidden: the MLP width, default 4·Ct.
        activation: a key of ``qkv.modules.feedforward.ACTIVATIONS`` ("quick_gelu": OpenAI).
        norm_eps: LayerNorm epsilon. dropout: residual dropout; attn_dropout: on weights.
        eos_token_id: the end-of-text token ("eos" pooling reads the first one of each row).
        pooling: "eos" (the first ``eos_token_id``) or "argmax" (the highest token id).
    """

    vocab_size: int = 49408
    max_len: int = 77
    dim: int = 512
    num_layers: int = 12
    num_heads: int = 8
    ffn_hidden: int | None = None
    activation: str = "quick_gelu"
    norm_eps: float = 1e-5
    dropout: float = 0.0
    attn_dropout: float = 0.0
    eos_token_id: int = 49407
    pooling: str = "eos"

    MODEL_TYPE: ClassVar[str] = "qkv-clip-text"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "dim", "num_layers", "num_heads"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"CLIPTextConfig: {name} must be a positive int, got {val!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"CLIPTextConfig: dim={self.dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int)
                                            or self.ffn_hidden <= 0):
            raise ValueError(f"CLIPTextConfig: ffn_hidden must be a positive int or None, "
                             f"got {self.ffn_hidden!r}")
        check_layer_fields("CLIPTextConfig", self)
        if (not isinstance(self.eos_token_id, int) or isinstance(self.eos_token_id, bool)
                or not 0 <= self.eos_token_id < self.vocab_size):
            raise ValueError(f"CLIPTextConfig: eos_token_id={self.eos_token_id!r} is outside "
                             f"[0, vocab_size={self.vocab_size})")
        if self.pooling not in ("eos", "argmax"):
            raise ValueError(f"CLIPTextConfig: pooling must be 'eos' or 'argmax', "
                             f"got {self.pooling!r}")


def _clip_vision(**kw: Any) -> dict[str, Any]:
    """A CLIP image tower: pre-LayerNorm, no patch bias, quick_gelu, eps 1e-5."""
    return {"pre_norm": True, "patch_bias": False, "activation": "quick_gelu",
            "norm_eps": 1e-5, **kw}


@dataclasses.dataclass(frozen=True)
class CLIPConfig(ModelConfig):
    """Configuration of a ``CLIP`` (frozen; ``CLIPConfig.from_name("clip-vit-b-32")``).

    Args:
        vision: the image tower's ``ViTConfig`` (or a dict of its fields); no pooler, no
            classification head.
        text: the text tower's ``CLIPTextConfig`` (or a dict).
        embed_dim: E, the shared embedding width (HF ``projection_dim``).
        logit_scale_init: the initial log multiplier (log(1/0.07) = 2.6593).
        logit_scale_max: the largest multiplier ``clamp_logit_scale_`` allows (100).

    Presets: "clip-tiny" (32 px, P=8, towers of width 64 with 2 layers: tests), "clip-s-64"
    (ViT-S-like towers at 64 px, P=8, width 384, 12 layers, 6 heads: the benchmark),
    "clip-vit-b-32" and "clip-vit-b-16" (OpenAI's shapes).
    """

    vision: ViTConfig = dataclasses.field(
        default_factory=lambda: ViTConfig.from_name("vit-b-32", **_clip_vision()))
    text: CLIPTextConfig = dataclasses.field(default_factory=CLIPTextConfig)
    embed_dim: int = 512
    logit_scale_init: float = math.log(1 / 0.07)
    logit_scale_max: float = 100.0

    MODEL_TYPE: ClassVar[str] = "qkv-clip"
    LAYER_KEYS: ClassVar[dict[str, str]] = {"vision.num_layers": r"vision\.layers\.(\d+)\.",
                                            "text.num_layers": r"text\.layers\.(\d+)\."}
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "clip-tiny": {"vision": _clip_vision(image_size=32, patch_size=8, dim=64,
                                             num_layers=2, num_heads=2),
                      "text": {"vocab_size": 512, "max_len": 32, "dim": 64, "num_layers": 2,
                               "num_heads": 2, "eos_token_id": 511},
                      "embed_dim": 64},
        # the shapes task (qkv train --model clip --task shapes): 32 px, P=8, width 64,
        # 3 image + 2 text layers, 4 heads; the text sizes are set from the data
        "clip-shapes": {"vision": _clip_vision(image_size=32, patch_size=8, dim=64,
                                               num_layers=3, num_heads=4),
                        "text": {"vocab_size": 512, "max_len": 32, "dim": 64, "num_layers": 2,
                                 "num_heads": 4, "eos_token_id": 2},
                        "embed_dim": 64},
        "clip-s-64": {"vision": _clip_vision(image_size=64, patch_size=8, dim=384,
                                             num_layers=12, num_heads=6),
                      "text": {"dim": 384, "num_layers": 12, "num_heads": 6},
                      "embed_dim": 384},
        "clip-vit-b-32": {"vision": _clip_vision(patch_size=32)},
        "clip-vit-b-16": {"vision": _clip_vision(patch_size=16)},
    }

    def __post_init__(self) -> None:
        # nested configs given as dicts (config.json, presets) become configs
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", ViTConfig.from_dict(self.vision))
        if isinstance(self.text, dict):
            object.__setattr__(self, "text", CLIPTextConfig.from_dict(self.text))
        if not isinstance(self.vision, ViTConfig):
            raise TypeError(f"CLIPConfig: vision must be a ViTConfig or a dict, "
                            f"got {type(self.vision).__name__}")
        if not isinstance(self.text, CLIPTextConfig):
            raise TypeError(f"CLIPConfig: text must be a CLIPTextConfig or a dict, "
                            f"got {type(self.text).__name__}")
        if self.vision.num_classes or self.vision.with_pooler:
            raise ValueError(f"CLIPConfig: the image tower has no classification head or "
                             f"pooler, got num_classes={self.vision.num_classes}, "
                             f"with_pooler={self.vision.with_pooler}")
        if (not isinstance(self.embed_dim, int) or isinstance(self.embed_dim, bool)
                or self.embed_dim <= 0):
            raise ValueError(f"CLIPConfig: embed_dim must be a positive int, "
                             f"got {self.embed_dim!r}")
        for name in ("logit_scale_init", "logit_scale_max"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not math.isfinite(val):
                raise ValueError(f"CLIPConfig: {name} must be a finite number, got {val!r}")
        if not self.logit_scale_max >= 1.0:
            raise ValueError(f"CLIPConfig: logit_scale_max must be >= 1, "
                             f"got {self.logit_scale_max!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (config.json), the towers as nested dicts."""
        out = super().to_dict()
        out["vision"] = dataclasses.asdict(self.vision)
        out["text"] = dataclasses.asdict(self.text)
        return out


@dataclasses.dataclass
class CLIPTextOutput:
    """What ``CLIPTextTower.forward`` returns.

    Attributes:
        last_hidden_state: (B, N, Ct), after the final norm.
        pooled: (B, Ct), the row at each text's end-of-text token.
        hidden_states: with ``output_hidden_states``, L + 1 tensors (B, N, Ct): the
            embeddings and each layer's output (before the final norm); else None.
        attentions: with ``output_attentions``, L tensors (B, H, N, N); else None.
    """

    last_hidden_state: Tensor
    pooled: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclasses.dataclass
class CLIPOutput:
    """What ``CLIP.forward`` returns.

    Attributes:
        logits_per_image: (B_img, B_txt), exp(logit_scale) · cosine similarities.
        logits_per_text: (B_txt, B_img), its transpose.
        image_embeds: (B_img, E), L2-normalised.
        text_embeds: (B_txt, E), L2-normalised.
        logit_scale: the multiplier exp(logit_scale), (1,).
        vision_output: the image tower's ``ViTOutput``.
        text_output: the text tower's ``CLIPTextOutput``.
    """

    logits_per_image: Tensor
    logits_per_text: Tensor
    image_embeds: Tensor
    text_embeds: Tensor
    logit_scale: Tensor
    vision_output: ViTOutput
    text_output: CLIPTextOutput


class CLIPTextTower(nn.Module):
    """CLIP's text encoder: token + learned position embeddings, pre-norm ``EncoderLayer``s
    run causally (with key padding), a final norm, pooling at the end-of-text token.

    Attributes: token_embed (V, Ct), position (``Learned`` (max_len, Ct)), layers, norm.
    """

    def __init__(self, config: CLIPTextConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        self.token_embed = nn.Embedding(c.vocab_size, c.dim, **factory)
        self.position = Learned(c.max_len, c.dim, init_std=0.01, **factory)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(
            EncoderLayer.build(c.dim, c.num_heads, ffn_hidden=c.ffn_hidden or 4 * c.dim,
                               activation=c.activation, norm_eps=c.norm_eps, norm_first=True,
                               dropout=c.dropout, attn_dropout=c.attn_dropout,
                               ffn_dropout=0.0, **factory)
            for _ in range(c.num_layers))
        self.norm = LayerNorm(c.dim, eps=c.norm_eps, **factory)

    def pool_positions(self, input_ids: Tensor) -> Tensor:
        """Each row's pooling position (B,) of ``input_ids`` (B, N): the first
        ``eos_token_id`` ("eos"), or the highest id's first position ("argmax").

        Raises ValueError naming ``input_ids`` when "eos" pooling finds a row without the
        end-of-text token (transformers would silently pool position 0)."""
        c = self.config
        if c.pooling == "argmax":
            return input_ids.argmax(dim=-1)  # (B,)
        is_eos = input_ids == c.eos_token_id  # (B, N)
        has = is_eos.any(dim=-1)  # (B,)
        if not bool(has.all()):
            rows = has.logical_not().nonzero().flatten().tolist()
            raise ValueError(f"CLIP: input_ids rows {rows[:10]} hold no end-of-text token "
                             f"eos_token_id={c.eos_token_id}, where the text is pooled "
                             f"(shape {tuple(input_ids.shape)})")
        return is_eos.int().argmax(dim=-1)  # (B,) the first eos

    def _inputs(self, input_ids: Tensor, attention_mask: Tensor | None
                ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Checked ``input_ids`` (B, N) as int32/int64, ``attention_mask`` as bool (B, N)
        (None when not given) and the pooling positions (B,); errors as ``forward``."""
        c = self.config
        ids = check_token_ids("CLIP", "input_ids", input_ids, c.vocab_size, "vocab_size")
        b, n = ids.shape
        if n > c.max_len:
            raise ValueError(f"CLIP: input_ids length N={n} exceeds the text tower's "
                             f"max_len={c.max_len} (shape {tuple(ids.shape)})")
        keep = None
        if attention_mask is not None:
            if (not isinstance(attention_mask, Tensor)
                    or tuple(attention_mask.shape) != (b, n)
                    or attention_mask.dtype.is_floating_point):
                got = (f"{tuple(attention_mask.shape)} {attention_mask.dtype}"
                       if isinstance(attention_mask, Tensor) else type(attention_mask).__name__)
                raise ValueError(f"CLIP: attention_mask must be a bool/integer tensor of "
                                 f"shape (B, N) = {(b, n)} (1 = real token), got {got}")
            keep = attention_mask.to(device=ids.device, dtype=torch.bool)  # (B, N)
        pool_at = self.pool_positions(ids)  # (B,)
        if ids.dtype not in (torch.int64, torch.int32):
            ids = ids.long()
        return ids, keep, pool_at

    def pooled_features(self, input_ids: Tensor, attention_mask: Tensor | None = None
                        ) -> Tensor:
        """``forward(input_ids, attention_mask).pooled`` (B, Ct) alone, computing only what
        it reads. Attention is causal, so the pooled token (position p_b) sees positions
        ≤ p_b only: the layers run on the token rows (``EncoderLayer.forward`` with
        ``rows=``) of the real tokens up to each row's pooled token (padding and everything
        after the end-of-text token skipped), the length cut to max(p_b) + 1, and the last
        layer (and the final norm) at the pooled tokens alone (``at=``; a layer whose
        attention is swapped or hooked computes its rows in full inside). Same arguments
        and errors as ``forward``."""
        ids, keep, pool_at = self._inputs(input_ids, attention_mask)
        b = ids.shape[0]
        n = int(pool_at.max()) + 1  # nothing after the last pooled token matters
        ids = ids[:, :n]
        pos = torch.arange(n, device=ids.device)  # (N,)
        keys = pos <= pool_at[:, None]  # (B, N) keys each pooled token may see
        if keep is not None:
            keys &= keep[:, :n]
        real = keys | (pos == pool_at[:, None])  # (B, N) the rows computed
        # real keys form a prefix of every row (right padding): causal alone masks the rest
        prefix = bool((keys.sum(dim=-1) == pool_at + 1).all())
        mask = None if prefix else keys[:, None, None, :]  # (B, 1, 1, N) True = may attend
        rows = TokenRows(None if bool(real.all()) else real, batch=b, length=n)
        flat_pos = pos.expand(b, n).reshape(-1)  # (B·N,)
        if rows.index is not None:
            flat_pos = flat_pos.index_select(0, rows.index)  # (T,)
        h = self.token_embed(rows.pack(ids)) + self.position.weight[flat_pos]  # (T, Ct)
        h = self.drop(h)
        bufs: dict[str, Tensor] | None = None if torch.is_grad_enabled() else {}
        *body, last = self.layers
        for layer in body:
            h = layer(h, rows=rows, mask=mask, causal=True, bufs=bufs)
        # the pooled tokens' rows in h
        flat_at = torch.arange(b, device=ids.device) * n + pool_at  # (B,) in B·N
        if rows.index is not None:
            flat_at = torch.searchsorted(rows.index, flat_at)  # (B,) in T
        h = last(h, rows=rows, at=flat_at, mask=mask, causal=True, bufs=bufs)  # (B, Ct)
        return self.norm(h)  # (B, Ct)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                output_hidden_states: bool = False,
                output_attentions: bool = False) -> CLIPTextOutput:
        """Encode texts: input_ids (B, N) in [0, V), N ≤ max_len; attention_mask (B, N)
        1/True at real tokens (default all real): padded keys are never attended.
        Returns a ``CLIPTextOutput`` (last_hidden_state (B, N, Ct), pooled (B, Ct)).

        Raises TypeError / ValueError naming ``input_ids`` / ``attention_mask``: not
        integer ids, ids out of range, N > max_len, a mask of another shape, a row without
        its end-of-text token.
        """
        ids, keep, pool_at = self._inputs(input_ids, attention_mask)
        b, n = ids.shape
        mask = None
        if keep is not None and not bool(keep.all()):  # no padding: causal alone
            mask = keep[:, None, None, :]  # (B, 1, 1, N) True = may attend
        x = self.token_embed(ids) + self.position.weight[:n]  # (B, N, Ct)
        x = self.drop(x)
        hidden = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        for layer in self.layers:
            out = layer(x, mask=mask, causal=True, need_weights=output_attentions)
            if output_attentions:
                x, wts = out
                attentions.append(wts)
            else:
                x = out
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)  # (B, N, Ct)
        pooled = x[torch.arange(b, device=x.device), pool_at]  # (B, Ct)
        return CLIPTextOutput(x, pooled, None if hidden is None else tuple(hidden),
                              None if attentions is None else tuple(attentions))


class CLIP(PretrainedMixin, nn.Module):
    """CLIP: a ``ViT`` image tower and a ``CLIPTextTower``, each projected (no bias) to E.

    Args:
        config: a ``CLIPConfig``.
        device, dtype: of the parameters.

    Attributes:
        vision (``ViT``), text (``CLIPTextTower``), visual_projection (Cv -> E),
        text_projection (Ct -> E), logit_scale (1,): the log multiplier.

    Example::

        model = CLIP(CLIPConfig.from_name("clip-tiny"))
        out = model(pixel_values, input_ids, attention_mask)   # (B_img, 3, 32, 32), (B_txt, N)
        out.logits_per_image                                   # (B_img, B_txt)
        loss = model.loss(pixel_values, input_ids, attention_mask)   # pairs i <-> i
        loss.backward(); opt.step(); model.clamp_logit_scale_()
        model = CLIP.from_pretrained("path/to/hf-clip")         # an HF CLIPModel directory
    """

    config_class: ClassVar[type[ModelConfig]] = CLIPConfig
    hf_mapping: ClassVar[HFMapping] = CLIP_HF

    def __init__(self, config: CLIPConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, CLIPConfig):
            raise TypeError(f"CLIP: config must be a CLIPConfig, got {type(config).__name__}")
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        self.vision = ViT(c.vision, **factory)
        self.text = CLIPTextTower(c.text, **factory)
        self.visual_projection = nn.Linear(c.vision.dim, c.embed_dim, bias=False, **factory)
        self.text_projection = nn.Linear(c.text.dim, c.embed_dim, bias=False, **factory)
        self.logit_scale = nn.Parameter(torch.empty(1, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """OpenAI CLIP's initialisation (as open_clip): token embedding N(0, 0.02²),
        positions N(0, 0.01²); per tower of width W and L layers, attention in-projections
        N(0, W^-1), out-projections and MLP outputs N(0, W^-1·(2L)^-1), MLP inputs
        N(0, (2W)^-1); projections N(0, W^-1); biases zero, norms identity; the image
        tower's class token and positions N(0, W^-1); logit_scale = logit_scale_init."""
        self.vision.reset_parameters()
        for tower, width, layers in ((self.vision, self.config.vision.dim, self.vision.layers),
                                     (self.text, self.config.text.dim, self.text.layers)):
            attn_std = width ** -0.5
            proj_std = attn_std * (2 * len(layers)) ** -0.5
            fc_std = (2 * width) ** -0.5
            for layer in layers:
                nn.init.normal_(layer.attn.in_proj.weight, std=attn_std)
                nn.init.normal_(layer.attn.out_proj.weight, std=proj_std)
                nn.init.normal_(layer.ffn.fc_in.weight, std=fc_std)
                nn.init.normal_(layer.ffn.fc_out.weight, std=proj_std)
                for lin in (layer.attn.in_proj, layer.attn.out_proj, layer.ffn.fc_in,
                            layer.ffn.fc_out):
                    nn.init.zeros_(lin.bias)
                for norm in (layer.norm1, layer.norm2):
                    nn.init.ones_(norm.weight)
                    nn.init.zeros_(norm.bias)
            if tower is self.vision:
                nn.init.normal_(self.vision.cls_token, std=attn_std)
                nn.init.normal_(self.vision.pos_embed, std=attn_std)
        nn.init.normal_(self.text.token_embed.weight, std=0.02)
        nn.init.normal_(self.text.position.weight, std=0.01)
        nn.init.ones_(self.text.norm.weight)
        nn.init.zeros_(self.text.norm.bias)
        nn.init.normal_(self.visual_projection.weight, std=self.config.vision.dim ** -0.5)
        nn.init.normal_(self.text_projection.weight, std=self.config.text.dim ** -0.5)
        with torch.no_grad():
            self.logit_scale.fill_(self.config.logit_scale_init)

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Clamp ``logit_scale`` in place to [0, log(logit_scale_max)] (open_clip, after
        every optimizer step): the multiplier stays in [1, 100]."""
        self.logit_scale.clamp_(0.0, math.log(self.config.logit_scale_max))

    def encode_image(self, pixel_values: Tensor) -> Tensor:
        """Image embeddings (B_img, E), not normalised: the projected pooled features of
        ``pixel_values`` (B_img, Cin, Hi, Wi) (see ``ViT.forward``)."""
        return apply_linear(self.visual_projection, self.vision.pooled_features(pixel_values))

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Text embeddings (B_txt, E), not normalised: the projected end-of-text states of
        ``input_ids`` (B_txt, N) with ``attention_mask`` (B_txt, N), 1 = real token."""
        pooled = self.text.pooled_features(input_ids, attention_mask)  # (B_txt, Ct)
        return apply_linear(self.text_projection, pooled)

    def forward(self, pixel_values: Tensor, input_ids: Tensor,
                attention_mask: Tensor | None = None, *, output_hidden_states: bool = False,
                output_attentions: bool = False) -> CLIPOutput:
        """Similarity logits of every image with every text.

        Args:
            pixel_values: (B_img, Cin, Hi, Wi) floats (``qkv.data.image_preprocess``).
            input_ids: (B_txt, N) token ids, each row holding its end-of-text token.
            attention_mask: (B_txt, N), 1 = real token, 0 = padding (default all real).
            output_hidden_states, output_attentions: passed to both towers.

        Returns:
            ``CLIPOutput``: logits_per_image (B_img, B_txt) = exp(logit_scale) · cosine
            similarities, logits_per_text (B_txt, B_img), the normalised embeddings, the
            towers' outputs.

        Raises:
            TypeError / ValueError naming the offending argument (see ``ViT.forward`` and
            ``CLIPTextTower.forward``).
        """
        vis = self.vision(pixel_values, output_hidden_states=output_hidden_states,
                          output_attentions=output_attentions)
        txt = self.text(input_ids, attention_mask, output_hidden_states=output_hidden_states,
                        output_attentions=output_attentions)
        image = F.normalize(apply_linear(self.visual_projection, vis.pooled), dim=-1)  # (B_img, E)
        text = F.normalize(apply_linear(self.text_projection, txt.pooled), dim=-1)  # (B_txt, E)
        scale = self.logit_scale.exp()  # (1,)
        logits_per_text = scale * (text @ image.t())  # (B_txt, B_img)
        return CLIPOutput(logits_per_text.t(), logits_per_text, image, text, scale, vis, txt)

    def loss(self, pixel_values: Tensor, input_ids: Tensor,
             attention_mask: Tensor | None = None) -> Tensor:
        """The symmetric contrastive loss of the pairs (image i, text i), a scalar:
        ``clip_loss(encode_image(...), encode_text(...), exp(logit_scale))`` — under
        torch.distributed, of the global batch (``qkv.models.clip_loss``)."""
        return clip_loss(self.encode_image(pixel_values),
                         self.encode_text(input_ids, attention_mask), self.logit_scale.exp())

    # --- HuggingFace --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, directory: str | os.PathLike, *, allow_pickle: bool = False,
                **kwargs: Any) -> CLIP:
        """A ``CLIP`` from a local HuggingFace ``CLIPModel`` directory (config.json with
        model_type "clip" and model.safetensors, or its shards with
        model.safetensors.index.json; a pytorch_model.bin only with
        ``allow_pickle=True``, read with ``torch.load(weights_only=True)``). quick_gelu,
        the image tower's pre-LayerNorm and both pooling rules (``eos_token_id == 2``:
        "argmax", else "eos") are read from the config. Returned in eval mode.

        Every config.json field (and those of text_config / vision_config) is classified
        in ``qkv.models.hf_config.CLIP_FIELDS`` (``CLIP_TEXT_FIELDS``,
        ``CLIP_VISION_FIELDS``); an option qkv does not compute raises ``CheckpointError``
        naming it, an unknown field warns. ``kwargs`` (device, dtype) go to the
        constructor (the steps are ``qkv.models.hf_load.load_hf``'s, as for every HF
        architecture). The tokenizer, if any: ``qkv.models.load_tokenizer(directory)``.
        """
        return load_hf(cls.hf_mapping, cls, directory, allow_pickle=allow_pickle, **kwargs)
