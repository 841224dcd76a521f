"""``Flamingo``: a frozen language model that reads images (Alayrac et al. 2022) — a frozen qkv
``GPT`` and a frozen vision tower (``ViT``, or a ``CLIP``'s image tower), joined by a trained
``PerceiverResampler`` and tanh-gated cross-attention blocks.

Shapes: B batch, N text length, V vocab, C the LM width, T image slots per row, Cin/Hi/Wi image
channels/height/width, P patch features per image, Cv the vision width, L latents per image.

::

    feats   = vision(images[real slots]).last_hidden_state[:, 1:]   # (M, P, Cv), no grad
    latents = resampler(feats per slot, media_mask)                 # (B, T, L, Cv)
    x = embed(input_ids) (+ positions)                              # (B, N, C), the GPT's own
    for i, layer in enumerate(lm.layers):
        if (i + 1) % cross_attn_every == 0:                         # OpenFlamingo's placement
            x = gated[i](x, latents, text_time, media_mask)         # identity at init
        x = layer(x)                                                # frozen
    logits = lm_head(norm(x))                                       # (B, N, V)

The vision features are the patch tokens of the final-normed last hidden state, without the
class token (``vision_features="patches"``, the default): the resampler reads a spatial grid
as the paper's (the flattened feature map of its NFNet) and OpenFlamingo's (open_clip's patch
tokens); the class token is a pooled summary trained for another objective (CLIP's contrastive
loss). ``vision_features="all"`` keeps it (P = 1 + Gh·Gw).

Images and ``<image>`` tokens: row b's t-th ``<image>`` token (``image_token_id``) stands for
``images[b, t]``; rows may hold different numbers of images (extra slots are padding, ignored
— never encoded, never attended); a row with more ``<image>`` tokens than slots is an error.
Each text position attends to the latents of its latest image (see
``qkv.modules.gated_cross_attention``).

The wrapper runs the GPT's own parts (embedding, positions, layers, final norm, head) with
the gated blocks in between (``hidden_states``); ``GPT`` itself is not edited and, called on
its own, is the plain LM.
The LM and the vision tower are frozen: ``requires_grad`` False (no ``.grad`` is ever
allocated for them; give the optimizer ``trainable_parameters()``) and kept in eval mode by
``train()``; the vision tower runs under ``torch.no_grad`` while frozen.

Decoding: ``bind_images(images)`` returns a ``FlamingoDecoder`` (``qkv.models.flamingo_decode``)
with the decoder-only
interface ``qkv.generate`` drives (``m(ids, attention_mask=, cache=)``, ``m.new_cache``): the
image latents and every block's cross-attention keys/values are computed once.

Files: ``save_pretrained(dir)`` writes ``flamingo_config.json`` (the config and the two bases,
each named by class, config, path and a sha256 of its weights) and
``flamingo_model.safetensors`` (the resampler and the gated blocks only); with
``include_bases=True`` the bases are written too, under ``dir/lm`` and ``dir/vision``.
``from_pretrained(dir, lm=, vision=)`` refuses a base whose weights changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..files import CheckpointError, atomic_write, read_json
from ..modules.gated_cross_attention import GatedCrossAttentionBlock, MediaKV, text_time_from_ids
from ..modules.positions import positions_from_mask
from ..modules.resampler import PerceiverResampler
from ..ops.lm_loss import linear_cross_entropy
from .clip import CLIP
from .config import ModelConfig
from .flamingo_decode import FlamingoCache, FlamingoDecoder, check_image_counts
from .gpt import GPT
from .inputs import check_token_ids
from .vit import ViT

__all__ = ["Flamingo", "FlamingoCache", "FlamingoConfig", "FlamingoDecoder", "weights_sha256"]

CONFIG_NAME = "flamingo_config.json"
WEIGHTS_NAME = "flamingo_model.safetensors"
_NEW_PARTS = ("resampler.", "gated.")


def _positive(name: str, val: Any) -> None:
    if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"FlamingoConfig: {name} must be a positive int, got {val!r}")


@dataclasses.dataclass(frozen=True)
class FlamingoConfig(ModelConfig):
    """The new parts of a ``Flamingo`` (frozen; the bases have their own configs).

    Args:
        image_token_id: the id of ``<image>`` in the LM's vocabulary.
        num_latents: L, latents per image. resampler_depth: Perceiver blocks.
        cross_attn_every: k; a gated block before LM layers k-1, 2k-1, ... (every layer
            when 1).
        resampler_heads: heads of the resampler (head dim Cv // heads).
        cross_attn_heads: heads of the gated cross-attention (head dim C // heads).
        ff_mult: feed-forward width multiplier of the resampler and the gated blocks.
        only_attend_immediate_media: a text position attends to its latest image only (True)
            or to every earlier image.
        vision_features: "patches" (patch tokens, no class token) or "all".
    """

    image_token_id: int
    num_latents: int = 64
    resampler_depth: int = 2
    cross_attn_every: int = 1
    resampler_heads: int = 1
    cross_attn_heads: int = 1
    ff_mult: int = 4
    only_attend_immediate_media: bool = True
    vision_features: str = "patches"

    MODEL_TYPE: ClassVar[str] = "qkv-flamingo"

    def __post_init__(self) -> None:
        if (not isinstance(self.image_token_id, int) or isinstance(self.image_token_id, bool)
                or self.image_token_id < 0):
            raise ValueError(f"FlamingoConfig: image_token_id must be an int >= 0, got "
                             f"{self.image_token_id!r}")
        for name in ("num_latents", "resampler_depth", "cross_attn_every", "resampler_heads",
                     "cross_attn_heads", "ff_mult"):
            _positive(name, getattr(self, name))
        if not isinstance(self.only_attend_immediate_media, bool):
            raise TypeError(f"FlamingoConfig: only_attend_immediate_media must be a bool, got "
                            f"{self.only_attend_immediate_media!r}")
        if self.vision_features not in ("patches", "all"):
            raise ValueError(f"FlamingoConfig: vision_features must be 'patches' or 'all', "
                             f"got {self.vision_features!r}")


def weights_sha256(module: nn.Module) -> str:
    """sha256 of a module's state dict: every tensor's name, dtype, shape and bytes, in key
    order — the same for a model loaded from any file that holds the same weights."""
    digest = hashlib.sha256()
    for key, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _default_heads(width: int) -> int:
    """Heads of head dim 64 when ``width`` is a multiple of 64, else one head."""
    return width // 64 if width % 64 == 0 else 1


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


class Flamingo(nn.Module):
    """A frozen ``GPT`` conditioned on images through a Perceiver resampler and tanh-gated
    cross-attention blocks; see the module docstring.

    Args:
        lm: a qkv ``GPT`` (frozen here).
        vision: a ``ViT``, or a ``CLIP`` (its image tower ``clip.vision`` is used), frozen.
        image_token_id: the ``<image>`` token id, in [0, V).
        num_latents: L. resampler_depth: Perceiver blocks. cross_attn_every: k.
        resampler_heads: default Cv // 64 when Cv is a multiple of 64, else 1.
        cross_attn_heads: default the LM's ``num_heads``.
        ff_mult, only_attend_immediate_media, vision_features: see ``FlamingoConfig``.

    The new parts are created on the LM's device and dtype.

    Attributes:
        lm, vision (frozen), resampler (``PerceiverResampler`` Cv -> Cv), gated
        (``nn.ModuleDict``: layer index -> ``GatedCrossAttentionBlock``, gates
        ``attn_gate`` / ``ff_gate``), config (``FlamingoConfig``).

    Example::

        model = Flamingo(gpt, clip.vision, image_token_id=tok.encode(IMAGE_CHAR)[0])
        logits = model(ids, images)                   # ids (B, N), images (B, T, 3, H, W)
        opt = torch.optim.AdamW(model.trainable_parameters())
        out = qkv.generate(model.bind_images(images), prompt, max_new_tokens=8)
    """

    def __init__(self, lm: GPT, vision: ViT | CLIP, *, image_token_id: int,
                 num_latents: int = 64, resampler_depth: int = 2, cross_attn_every: int = 1,
                 resampler_heads: int | None = None, cross_attn_heads: int | None = None,
                 ff_mult: int = 4, only_attend_immediate_media: bool = True,
                 vision_features: str = "patches") -> None:
        super().__init__()
        if not isinstance(lm, GPT):
            raise TypeError(f"Flamingo: lm must be a qkv.models.GPT, got {type(lm).__name__}")
        if isinstance(vision, CLIP):
            vision = vision.vision
        if not isinstance(vision, ViT):
            raise TypeError(f"Flamingo: vision must be a qkv.models.ViT or a CLIP (its image "
                            f"tower is used), got {type(vision).__name__}")
        vocab = lm.config.vocab_size
        if (not isinstance(image_token_id, int) or isinstance(image_token_id, bool)
                or not 0 <= image_token_id < vocab):
            raise ValueError(f"Flamingo: image_token_id must be a token id in [0, vocab_size="
                             f"{vocab}), got {image_token_id!r}")
        cv, c = vision.config.dim, lm.config.dim
        self.config = FlamingoConfig(
            image_token_id=image_token_id, num_latents=num_latents,
            resampler_depth=resampler_depth, cross_attn_every=cross_attn_every,
            resampler_heads=_default_heads(cv) if resampler_heads is None else resampler_heads,
            cross_attn_heads=(lm.config.num_heads if cross_attn_heads is None
                              else cross_attn_heads),
            ff_mult=ff_mult, only_attend_immediate_media=only_attend_immediate_media,
            vision_features=vision_features)
        cfg = self.config
        for name, heads, width in (("resampler_heads", cfg.resampler_heads, cv),
                                   ("cross_attn_heads", cfg.cross_attn_heads, c)):
            if width % heads:
                raise ValueError(f"Flamingo: {name}={heads} does not divide the width {width}")
        lm.requires_grad_(False).eval()
        vision.requires_grad_(False).eval()
        self.lm, self.vision = lm, vision
        w = lm.embed.weight
        factory = {"device": w.device, "dtype": w.dtype}
        self.resampler = PerceiverResampler(cv, num_latents=num_latents, depth=resampler_depth,
                                            num_heads=cfg.resampler_heads, ff_mult=ff_mult,
                                            **factory)
        self.gated = nn.ModuleDict({
            str(i): GatedCrossAttentionBlock(
                c, num_heads=cfg.cross_attn_heads, media_dim=cv, ff_mult=ff_mult,
                only_attend_immediate_media=only_attend_immediate_media, **factory)
            for i in range(len(lm.layers)) if (i + 1) % cross_attn_every == 0})
        if not self.gated:
            raise ValueError(f"Flamingo: cross_attn_every={cross_attn_every} places no gated "
                             f"block in an LM of {len(lm.layers)} layers")

    # --- parts --------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Flamingo:
        """Train/eval mode for the new parts; the frozen LM and vision tower stay in eval."""
        super().train(mode)
        self.lm.eval()
        self.vision.eval()
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters that train: the resampler's and the gated blocks'."""
        return [p for p in self.parameters() if p.requires_grad]

    def gates(self) -> dict[int, tuple[float, float]]:
        """``{layer index: (tanh(attn_gate), tanh(ff_gate))}`` — how open each block is."""
        return {int(k): (float(torch.tanh(b.attn_gate.detach())),
                         float(torch.tanh(b.ff_gate.detach())))
                for k, b in self.gated.items()}

    # --- inputs -------------------------------------------------------------------------------
    def _keep(self, attention_mask: Any, shape: tuple[int, int]) -> Tensor | None:
        if attention_mask is None:
            return None
        if (not isinstance(attention_mask, Tensor) or attention_mask.dtype.is_floating_point
                or tuple(attention_mask.shape) != shape):
            raise ValueError(f"Flamingo: attention_mask must be a bool/int tensor (B, N) = "
                             f"{shape} (1 = real token), got {_shape(attention_mask)}")
        return attention_mask.bool()

    def _check_images(self, images: Any, batch: int) -> Tensor:
        c = self.vision.config
        if images is None:
            w = self.lm.embed.weight
            return w.new_zeros(batch, 0, c.num_channels, c.image_size, c.image_size)
        if not isinstance(images, Tensor) or not images.dtype.is_floating_point:
            got = images.dtype if isinstance(images, Tensor) else type(images).__name__
            raise TypeError(f"Flamingo: images must be a floating-point tensor (B, T, "
                            f"{c.num_channels}, H, W) of normalised pixels, got {got}")
        if images.dim() != 5 or images.shape[0] != batch or images.shape[2] != c.num_channels:
            raise ValueError(f"Flamingo: images must have shape (B, T, Cin, H, W) = ({batch}, "
                             f"T, {c.num_channels}, H, W) (T image slots per row, the t-th for "
                             f"the t-th <image> token), got {_shape(images)}")
        return images

    def image_counts(self, input_ids: Tensor, keep: Tensor | None = None) -> Tensor:
        """(B,) int64: the ``<image>`` tokens of each row (real positions only)."""
        is_image = input_ids == self.config.image_token_id  # (B, N)
        if keep is not None:
            is_image = is_image & keep
        return is_image.sum(dim=1)

    def encode_images(self, images: Tensor, media_mask: Tensor) -> Tensor:
        """Image latents (B, T, L, Cv) of the real slots (``media_mask`` (B, T) True); padded
        slots are not encoded and hold zeros. ``images`` (B, T, Cin, Hi, Wi)."""
        b, t = images.shape[:2]
        real = images[media_mask]  # (M, Cin, Hi, Wi)
        cv = self.vision.config.dim
        if real.shape[0] == 0:
            w = self.lm.embed.weight
            return w.new_zeros(b, t, self.config.num_latents, cv)
        frozen = not any(p.requires_grad for p in self.vision.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            feats = self.vision(real).last_hidden_state  # (M, T_vis, Cv)
        if self.config.vision_features == "patches":
            feats = feats[:, 1:]  # (M, P, Cv), the class token dropped
        feats = feats.to(self.lm.embed.weight.dtype)
        full = feats.new_zeros(b, t, feats.shape[1], cv)  # (B, T, P, Cv)
        full[media_mask] = feats
        return self.resampler(full, media_mask=media_mask)  # (B, T, L, Cv)

    def media_kv(self, latents: Tensor) -> dict[str, MediaKV]:
        """Every gated block's cross-attention keys/values of ``latents`` (B, T, L, Cv)."""
        return {k: block.project_media(latents) for k, block in self.gated.items()}

    def hidden_states(self, input_ids: Tensor, *, media_kv: dict[str, MediaKV],
                      text_time: Tensor, media_mask: Tensor | None,
                      attention_mask: Tensor | None = None,
                      cache: list[Any] | None = None) -> Tensor:
        """The LM's final-normed hidden states (B, N, C) with the gated blocks before their
        layers: ``media_kv`` from ``media_kv()``, ``text_time`` (B, N) each position's latest
        image (0: none), ``media_mask`` (B, T). ``attention_mask`` (B, S) and ``cache`` (the
        LM's per-layer caches) as ``GPT.forward``.

        GPT's own parts run here, in GPT's order (embedding, positions from the mask, the
        layers with GPT's masks, the final norm), through the plain ``layer(x, ...)`` call:
        ``GPT`` is not edited and the blocks see the (B, N, C) states."""
        lm = self.lm
        check_token_ids("Flamingo", "input_ids", input_ids, lm.config.vocab_size,
                        "vocab_size")
        ids = input_ids.long()
        batch, n = ids.shape
        past = lm._check_cache(cache, batch)
        keep = lm._keep(attention_mask, batch, n, past)
        if keep is not None:
            pos = positions_from_mask(keep)[:, past:]  # (B, N)
        else:
            if lm.positions is not None and past + n > lm.config.max_len:
                raise ValueError(f"Flamingo: {past + n} positions (cached {past} + new {n}) "
                                 f"exceed the LM's max_len={lm.config.max_len}")
            pos = torch.arange(past, past + n, device=ids.device)  # (N,)
        x = lm.embed_tokens(ids)  # (B, N, C)
        if lm.positions is not None:
            x = lm.positions(x, pos)  # (B, N, C)
        if lm.drop.p and lm.training:
            x = lm.drop(x)
        masks = lm.layer_masks(keep, cache, n)
        rope_pos = pos if lm.rope is not None else None
        blocks = dict(self.gated.items())  # layer index (str) -> block
        for i, layer in enumerate(lm.layers):
            if str(i) in blocks:
                x = blocks[str(i)](x, media_kv=media_kv[str(i)], text_time=text_time,
                                   media_mask=media_mask)  # (B, N, C)
            mask, causal = masks[i]
            x = layer(x, mask=mask, causal=causal, cache=None if cache is None else cache[i],
                      positions=rope_pos)  # (B, N, C)
        return lm.norm(x)  # (B, N, C)

    def _prepare(self, input_ids: Tensor, images: Any, attention_mask: Any
                 ) -> tuple[dict[str, MediaKV], Tensor, Tensor]:
        check_token_ids("Flamingo", "input_ids", input_ids, self.lm.config.vocab_size,
                        "vocab_size")
        keep = self._keep(attention_mask, tuple(input_ids.shape))
        images = self._check_images(images, input_ids.shape[0])
        counts = self.image_counts(input_ids, keep)  # (B,)
        t = images.shape[1]
        check_image_counts(counts, t, "images holds")
        media_mask = torch.arange(t, device=input_ids.device) < counts[:, None]  # (B, T)
        latents = self.encode_images(images, media_mask)  # (B, T, L, Cv)
        text_time = text_time_from_ids(input_ids, self.config.image_token_id, keep=keep)
        return self.media_kv(latents), text_time, media_mask

    # --- forward ------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, images: Tensor | None,
                attention_mask: Tensor | None = None) -> Tensor:
        """Next-token logits of interleaved text and images.

        Args:
            input_ids: (B, N) token ids; ``image_token_id`` marks where each image goes.
            images: (B, T, Cin, Hi, Wi) floats (normalised pixels); ``images[b, t]`` is row
                b's t-th ``<image>``; slots past a row's ``<image>`` count are padding (not
                encoded). None: no images (then no ``<image>`` token may appear).
            attention_mask: (B, N) bool/int, 1 = real token (as ``GPT.forward``); padding
                positions are not counted as ``<image>`` tokens.

        Returns:
            logits (B, N, V); equal to ``lm(input_ids)`` while every gate is 0.

        Raises:
            TypeError / ValueError naming the argument and its shape: bad ids, images not
            (B, T, Cin, H, W) floats, a row with more ``<image>`` tokens than T, a size the
            vision tower refuses.
        """
        kvs, text_time, media_mask = self._prepare(input_ids, images, attention_mask)
        h = self.hidden_states(input_ids, media_kv=kvs, text_time=text_time,
                               media_mask=media_mask, attention_mask=attention_mask)
        return self.lm.soft_cap(self.lm.lm_head(h))  # (B, N, V)

    def loss(self, input_ids: Tensor, images: Tensor | None, targets: Tensor, *,
             attention_mask: Tensor | None = None, ignore_index: int = -100) -> Tensor:
        """Mean next-token cross-entropy, the (B·N, V) logits never materialised (GPT's
        fused LM-head + cross-entropy); targets (B, N), ``ignore_index`` entries left out
        (mask everything but the answers to train on answers only)."""
        if (not isinstance(targets, Tensor) or tuple(targets.shape) != tuple(input_ids.shape)
                or targets.dtype.is_floating_point):
            raise ValueError(f"Flamingo.loss: targets must be an integer tensor shaped like "
                             f"input_ids {_shape(input_ids)}, got {_shape(targets)}")
        t = targets.reshape(-1).long()
        ok = (t == ignore_index) | ((t >= 0) & (t < self.lm.config.vocab_size))
        if not bool(ok.all()):
            raise ValueError(f"Flamingo.loss: target {int(t[~ok][0])} is out of range for "
                             f"vocab_size={self.lm.config.vocab_size}")
        kvs, text_time, media_mask = self._prepare(input_ids, images, attention_mask)
        h = self.hidden_states(input_ids, media_kv=kvs, text_time=text_time,
                               media_mask=media_mask, attention_mask=attention_mask)
        if self.lm.config.logit_softcap is not None:  # Gemma 2's capped logits, then the loss
            logits = self.lm.soft_cap(self.lm.lm_head(h)).float()  # (B, N, V)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t,
                                                     ignore_index=ignore_index)
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm.lm_head.weight, t,
                                    ignore_index=ignore_index, chunk=512)

    # --- generation ---------------------------------------------------------------------------
    def bind_images(self, images: Tensor | None, *,
                    image_counts: Tensor | None = None) -> FlamingoDecoder:
        """A decoder-only view of this model with ``images`` (B, T, Cin, Hi, Wi) bound, for
        ``qkv.generate``: the latents and every block's keys/values are computed here, once
        (under ``torch.no_grad``). ``image_counts`` (B,) ints: the real slots of each row
        (default: all T); a row whose prompt and generated text hold more ``<image>`` tokens
        than its count raises ValueError when it happens."""
        b = images.shape[0] if isinstance(images, Tensor) and images.dim() >= 1 else None
        if b is None:
            raise ValueError(f"Flamingo.bind_images: images must be a tensor (B, T, Cin, H, W),"
                             f" got {_shape(images)}")
        images = self._check_images(images, b)
        t = images.shape[1]
        device = self.lm.embed.weight.device
        if image_counts is None:
            counts = torch.full((b,), t, dtype=torch.long, device=device)
        else:
            if (not isinstance(image_counts, Tensor) or image_counts.dtype.is_floating_point
                    or tuple(image_counts.shape) != (b,)):
                raise ValueError(f"Flamingo.bind_images: image_counts must be an integer "
                                 f"tensor (B,) = ({b},), got {_shape(image_counts)}")
            counts = image_counts.to(device=device, dtype=torch.long)
            if bool(((counts < 0) | (counts > t)).any()):
                raise ValueError(f"Flamingo.bind_images: image_counts must be in [0, T={t}], "
                                 f"got {counts.tolist()}")
        media_mask = torch.arange(t, device=device) < counts[:, None]  # (B, T)
        with torch.no_grad():
            kvs = self.media_kv(self.encode_images(images.to(device), media_mask))
        return FlamingoDecoder(self, kvs, media_mask, counts)

    # --- files --------------------------------------------------------------------------------
    def _base_info(self, name: str, base: nn.Module, path: Any) -> dict[str, Any]:
        return {"class": type(base).__name__, "config": base.config.to_dict(),
                "path": None if path is None else str(path), "sha256": weights_sha256(base)}

    def save_pretrained(self, directory: str | os.PathLike, *,
                        lm_path: str | os.PathLike | None = None,
                        vision_path: str | os.PathLike | None = None,
                        include_bases: bool = False) -> Path:
        """Write the new parts: ``flamingo_model.safetensors`` (resampler and gated blocks
        only) and ``flamingo_config.json`` (the config; each base's class, config, path and
        ``weights_sha256``). ``lm_path`` / ``vision_path``: where the bases' checkpoints live
        (recorded absolute, so ``from_pretrained`` can load them; a CLIP directory is fine for
        the vision tower). ``include_bases=True`` also saves the bases under ``dir/lm`` and
        ``dir/vision`` (recorded relative). Writes are atomic. Returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {"lm": lm_path, "vision": vision_path}
        if include_bases:
            for name in ("lm", "vision"):
                getattr(self, name).save_pretrained(directory / name)
                paths[name] = name
        else:
            paths = {k: None if p is None else Path(p).resolve() for k, p in paths.items()}
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()
                 if k.startswith(_NEW_PARTS)}
        atomic_write(directory / WEIGHTS_NAME,
                     lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        info = {"config": self.config.to_dict(),
                "bases": {name: self._base_info(name, getattr(self, name), paths[name])
                          for name in ("lm", "vision")}}
        text = json.dumps(info, indent=2, sort_keys=True)
        atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
        return directory

    @staticmethod
    def _load_base(directory: Path, name: str, info: dict[str, Any], given: Any) -> nn.Module:
        if given is None:
            path = info.get("path")
            if path is None:
                raise CheckpointError(f"{directory}: the {name} base was saved without a path; "
                                      f"pass {name}= (the {info.get('class')} it was trained "
                                      f"with)")
            path = Path(path) if Path(path).is_absolute() else directory / path
            model_type = read_json(path / "config.json").get("model_type")
            if name == "lm":
                given = GPT.from_pretrained(path)
            elif model_type == "qkv-clip":
                given = CLIP.from_pretrained(path).vision
            else:
                given = ViT.from_pretrained(path)
        module = given.vision if name == "vision" and isinstance(given, CLIP) else given
        now = weights_sha256(module)
        where = info.get("path") or f"the {name}= argument"
        if now != info.get("sha256"):
            raise CheckpointError(f"{directory}: the {name} base ({where}) is not the one this "
                                  f"Flamingo was trained with: weights sha256 "
                                  f"{str(info.get('sha256'))[:12]}... expected, got "
                                  f"{now[:12]}...; the gated blocks would read other features")
        # what defines the base is its config too (an activation changed in its config.json
        # keeps the weights): compared with the recorded one, field by field; the qkv
        # version that wrote it is not part of the model
        recorded = info.get("config")
        if isinstance(recorded, dict):
            current = json.loads(json.dumps(module.config.to_dict(), sort_keys=True))
            differ = sorted(k for k in set(recorded) | set(current) if k != "qkv_version"
                            and recorded.get(k) != current.get(k))
            if differ:
                shown = ", ".join(f"{k} {recorded.get(k)!r} -> {current.get(k)!r}"
                                  for k in differ[:4])
                raise CheckpointError(f"{directory}: the {name} base ({where}) is not the one "
                                      f"this Flamingo was trained with: its config differs "
                                      f"({shown}); the gated blocks would read other "
                                      f"features")
        return module

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, lm: GPT | None = None,
                        vision: ViT | CLIP | None = None) -> Flamingo:
        """Load a directory written by ``save_pretrained``. The bases are ``lm`` / ``vision``
        when given, else loaded from their recorded paths; either way their weights must hash
        to the recorded sha256 and their configs equal the recorded ones (all but
        ``qkv_version``). Returned in eval mode.

        Raises:
            CheckpointError: files missing or malformed, a base missing or changed, the
                tensors' keys/shapes not those of the config's new parts.
        """
        directory = Path(directory)
        data = read_json(directory / CONFIG_NAME)
        config_data, bases = data.get("config"), data.get("bases")
        if (not isinstance(config_data, dict) or not isinstance(bases, dict)
                or config_data.get("model_type") != FlamingoConfig.MODEL_TYPE
                or not all(isinstance(bases.get(k), dict) for k in ("lm", "vision"))):
            raise CheckpointError(f"{directory / CONFIG_NAME}: not a qkv Flamingo config "
                                  f"(expected {{'config': {{'model_type': 'qkv-flamingo', ...}}"
                                  f", 'bases': {{'lm', 'vision'}}}})")
        config = FlamingoConfig.from_dict(config_data)
        lm = cls._load_base(directory, "lm", bases["lm"], lm)
        vision = cls._load_base(directory, "vision", bases["vision"], vision)
        model = cls(lm, vision, **dataclasses.asdict(config))
        try:
            state = load_file(directory / WEIGHTS_NAME)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{directory / WEIGHTS_NAME}: cannot read ({err})") from err
        own = {k: v for k, v in model.state_dict().items() if k.startswith(_NEW_PARTS)}
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        shapes = [k for k in set(own) & set(state) if own[k].shape != state[k].shape]
        if missing or unexpected or shapes:
            raise CheckpointError(f"{directory / WEIGHTS_NAME} does not match the config: "
                                  f"missing {missing[:5]}, unexpected {unexpected[:5]}, "
                                  f"shape mismatches {sorted(shapes)[:5]}")
        model.load_state_dict(state, strict=False)
        return model.eval()
