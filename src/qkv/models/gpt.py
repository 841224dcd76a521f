"""``GPT``: a decoder-only (causal) language model on qkv's layers; loads HF GPT-2 checkpoints.

Shapes: B batch, N length of the input ids, S key length (cached + new tokens), V vocab size,
C model width (``dim``), H heads, D head dim (C // H), L layers.

The model is a token embedding, learned absolute positions (``qkv.positions.Learned``, GPT-2)
or rotary positions (``qkv.positions.RoPE``, handed to every layer's attention), a stack of
pre-norm ``EncoderLayer``s run causally, a final norm and an LM head tied to the token
embedding (GPT-2). Left-padded batches take an ``attention_mask`` (1 = real token); positions
then count from each row's first real token, so a padded row equals the same row run alone.
Decoding token by token uses ``new_cache``: one ``KVCache`` per layer.

Attention variants (config fields): ``attention_window=W`` makes every layer attend with
``qkv.masks.SlidingWindow(W, causal=True)`` (the sparse band path; O(N·W)) and decode with
``WindowKVCache``s that keep only the last W - 1 positions; ``attention="linear"`` swaps each
layer's attention for ``LinearAttention`` (``feature_map`` "elu" or "favor", O(N) in N) and
decodes with constant-size ``LinearCache``s.

``GPT.from_hf(directory)`` / ``GPT.from_pretrained(directory)`` read a local HuggingFace
GPT-2 directory (config.json + model.safetensors); the conversion lives in
``qkv.models.hf_gpt2``. ``load_tokenizer(directory)`` reads its tokenizer.json.
"""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from ..modules.cache import KVCache, LinearCache, WindowKVCache
from ..modules.layers import EncoderLayer
from ..modules.linear_attention import LinearAttention
from ..modules.linear_call import apply_linear
from ..modules.norms import LayerNorm, RMSNorm, make_norm
from ..modules.positions import Learned, RoPE, positions_from_mask
from ..ops.lm_loss import linear_cross_entropy
from ..ops.masks import Mask, Padding
from ..ops.sparse_masks import SlidingWindow
from .config import ModelConfig
from .gpt_config import GPTConfig
from .hf_gemma import GEMMA, GEMMA2
from .hf_gpt2 import GPT2
from .hf_llama import LLAMA, MISTRAL, QWEN2, QWEN3
from .hf_load import HFMapping, load_hf, mapping_for
from .hf_phi3 import PHI3
from .hub import PretrainedMixin, load_tokenizer
from .inputs import check_token_ids

__all__ = ["GPT", "GPTConfig", "GPTOutput", "load_tokenizer"]


class GPTOutput(NamedTuple):
    """``GPT.forward(..., output_attentions=True)``: logits (B, N, V) and one attention-weight
    tensor (B, H, N, S) per layer (rows of padding queries are zeros)."""

    logits: Tensor
    attentions: tuple[Tensor, ...]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _describe(cache: Any) -> str:
    if isinstance(cache, (list, tuple)):
        return f"{type(cache).__name__} of {[repr(c) for c in cache][:2]}"[:300]
    return type(cache).__name__


class GPT(PretrainedMixin, nn.Module):
    """Decoder-only Transformer language model (Radford et al. 2019, GPT-2).

    Args:
        config: a ``GPTConfig``.
        device, dtype: of the parameters.

    Attributes:
        embed: token embedding (V, C).
        positions: ``Learned`` (max_len, C) or None (RoPE: ``rope`` is shared by the layers).
        layers: L pre-norm ``EncoderLayer``s, run with ``causal=True``.
        norm: the final norm.
        lm_head: C -> V, no bias; its weight *is* ``embed.weight`` when ``tie_embeddings``.

    Example::

        model = GPT(GPTConfig.from_name("gpt-tiny"))
        logits = model(ids)                                   # ids (B, N) -> (B, N, V)
        loss = model.loss(ids, targets)                       # scalar, targets (B, N)
        cache = model.new_cache(B, 64)
        logits = model(prompt, cache=cache)                   # prefill
        logits = model(next_ids, cache=cache)                 # one step, (B, 1, V)
    """

    config_class: ClassVar[type[ModelConfig]] = GPTConfig
    tied_keys: ClassVar[tuple[str, ...]] = ("lm_head.weight",)
    hf_mapping: ClassVar[HFMapping] = GPT2
    hf_mappings: ClassVar[tuple[HFMapping, ...]] = (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA,
                                                    GEMMA2, PHI3)
    quantizable: ClassVar[bool] = True

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        factory = {"device": device, "dtype": dtype}
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim, **factory)
        self.positions = Learned(c.max_len, c.dim, **factory) if c.positions == "learned" \
            else None
        rope_kw = {} if c.rope_scaling is None else {"scaling": c.rope_scaling}
        self.rope = RoPE(c.head_dim, base=c.rope_base, **rope_kw) \
            if c.positions == "rope" else None
        self.drop = nn.Dropout(c.dropout)
        qkv_bias, out_bias, ffn_bias = c.biases()
        attn_options = {"out_bias": out_bias, "qk_norm": c.qk_norm, "qk_norm_eps": c.norm_eps,
                        "scale": c.attention_scale, "softcap": c.attn_softcap}
        if c.attention_head_dim is not None:
            attn_options["head_dim"] = c.attention_head_dim
        self.layers = nn.ModuleList(
            EncoderLayer.build(c.dim, c.num_heads, ffn_hidden=c.ffn_hidden or 4 * c.dim,
                               activation=c.activation, norm=c.norm, norm_eps=c.norm_eps,
                               norm_first=True, dropout=c.dropout, attn_dropout=c.attn_dropout,
                               ffn_dropout=0.0,  # GPT-2's MLP has no inner dropout
                               bias=qkv_bias, ffn_bias=ffn_bias, num_kv_heads=c.num_kv_heads,
                               rope=self.rope, post_norms=c.post_norms,
                               attn_options=attn_options, **factory)
            for _ in range(c.num_layers))
        if c.attention == "linear":  # the same layer with a linear attention part
            for layer in self.layers:
                layer.attn = LinearAttention(
                    c.dim, c.num_heads, num_kv_heads=c.num_kv_heads, bias=c.bias,
                    feature_map=c.feature_map, num_features=c.num_features, rope=self.rope,
                    **factory)
        self.norm = make_norm(c.norm, c.dim, eps=c.norm_eps, **factory)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False, **factory)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        else:
            self.tied_keys = ()  # instance attribute: save the head's own weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) for linear and embedding weights, zero biases,
        residual output projections scaled by 1/sqrt(2L); norms to identity."""
        std = 0.02
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, (nn.Embedding, Learned)):
                nn.init.normal_(mod.weight, std=std)
            elif isinstance(mod, RMSNorm):
                mod.reset_parameters()  # ones, or zeros for Gemma's (1 + w)
            elif isinstance(mod, LayerNorm):
                nn.init.ones_(mod.weight)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
        resid_std = std / math.sqrt(2 * self.config.num_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attn.out_proj.weight, std=resid_std)
            nn.init.normal_(layer.ffn.fc_out.weight, std=resid_std)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    # --- caches -------------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None
                  ) -> list[KVCache] | list[LinearCache]:
        """Empty decoding caches, one per layer; pass the list as ``cache=`` to every
        decoding call. ``capacity`` counts prompt + generated tokens.

        - softmax attention: ``KVCache``s (B, Hkv, capacity, D);
        - ``attention_window=W``: ``WindowKVCache``s, ring buffers of W - 1 positions —
          ``capacity`` may exceed W (it only bounds the positions accepted; memory stays
          O(W) per layer); with ``windowed_layers``, only those layers' (the others'
          ``KVCache``s);
        - ``attention="linear"``: ``LinearCache``s, the constant-size fp32 state (B, H, D',
          D) (``capacity`` again only a bound; ``dtype``/``device`` follow the inputs).
        """
        c = self.config
        if c.attention == "linear":
            return [layer.attn.new_cache(batch, capacity) for layer in self.layers]
        w = self.embed.weight
        return [WindowKVCache(batch, layer.attn.num_kv_heads, c.attention_window,
                              layer.attn.head_dim, capacity=capacity,
                              dtype=w.dtype if dtype is None else dtype,
                              device=w.device if device is None else device)
                if c.is_windowed(i) else
                layer.attn.new_cache(batch, capacity, dtype=dtype, device=device)
                for i, layer in enumerate(self.layers)]

    # --- validation ---------------------------------------------------------------------------
    def _check_cache(self, cache: Any, batch: int) -> int:
        if cache is None:
            return 0
        c = self.config
        window = c.attention_window
        kinds = [LinearCache if c.attention == "linear"
                 else WindowKVCache if c.is_windowed(i) else KVCache
                 for i in range(len(self.layers))]
        # a windowed layer also takes a plain KVCache (it keeps every key; the window is then
        # the mask's, layer_mask): the decode plan's caches when they fit in the window
        if (not isinstance(cache, (list, tuple)) or len(cache) != len(self.layers)
                or not all(isinstance(x, kind) or (kind is WindowKVCache
                                                   and type(x) is KVCache)
                           for x, kind in zip(cache, kinds, strict=True))
                or any(kind is KVCache and isinstance(x, WindowKVCache)
                       for x, kind in zip(cache, kinds, strict=True))
                or any(kind is WindowKVCache and isinstance(x, WindowKVCache)
                       and x.window != window
                       for x, kind in zip(cache, kinds, strict=True))):
            names = sorted({k.__name__ for k in kinds})
            raise TypeError(f"GPT: cache must be the list of {len(self.layers)} "
                            f"{'/'.join(names)}s from new_cache(), got {_describe(cache)}")
        past = cache[0].length
        if any(c.length != past for c in cache) or cache[0].batch != batch:
            raise ValueError(f"GPT: cache does not fit this call: batch {cache[0].batch} vs "
                             f"input batch {batch}, lengths {[c.length for c in cache]}")
        return past

    def _keep(self, attention_mask: Any, batch: int, n: int, past: int) -> Tensor | None:
        if attention_mask is None:
            return None
        total = past + n
        if (not isinstance(attention_mask, Tensor) or attention_mask.dtype.is_floating_point
                or attention_mask.dtype.is_complex):
            got = attention_mask.dtype if isinstance(attention_mask, Tensor) \
                else type(attention_mask).__name__
            raise TypeError(f"GPT: attention_mask must be a bool or integer tensor (1 = real "
                            f"token), got {got}")
        if _shape(attention_mask) != (batch, total):
            extra = f" (cached {past} + new {n})" if past else ""
            raise ValueError(f"GPT: attention_mask must have shape (B, S) = ({batch}, {total})"
                             f"{extra}, covering every cached and new token; got "
                             f"{_shape(attention_mask)}")
        return attention_mask.bool()

    def layer_mask(self, keep: Tensor | None, cache: Any, n: int, layer: int = 0
                   ) -> tuple[Mask | None, bool]:
        """The ``(mask, causal)`` that ``hidden_states`` hands layer ``layer``, for N = ``n``
        new tokens: key padding over the S keys the attention sees (the last S of ``keep``;
        S = ``cache[layer].key_length(n)`` with a cache, else N) and, when the layer attends
        in a window, ``SlidingWindow(W)`` (needed only when some key is outside some query's
        window). ``layer_masks`` gives every layer's.

        Args:
            keep: (B, past + N) bool, True = real token (``attention_mask``), or None.
            cache: the per-layer caches (``new_cache``) or None.
            n: N, the number of new tokens.
            layer: the layer's index.

        Returns:
            ``(mask, causal)``: a ``qkv.masks.Padding``, a ``SlidingWindow`` (``& Padding``)
            or None, and whether the layers add ``Causal()``.
        """
        s = n if cache is None else cache[layer].key_length(n)
        if keep is not None:
            keep = keep[:, keep.shape[1] - s:]  # (B, S)
        pad = None if keep is None or bool(keep.all()) else Padding(keep=keep)
        window = self.config.attention_window if self.config.is_windowed(layer) else None
        if window is None or s <= window:  # every key within every query's window
            return pad, True
        band = SlidingWindow(window, causal=True)  # causal itself: the sparse band path
        return (band if pad is None else band & pad), False

    def layer_masks(self, keep: Tensor | None, cache: Any, n: int
                    ) -> list[tuple[Mask | None, bool]]:
        """``layer_mask`` of every layer (one computed per distinct (windowed, S))."""
        made: dict[tuple[bool, int], tuple[Mask | None, bool]] = {}
        out = []
        for i in range(len(self.layers)):
            key = (self.config.is_windowed(i), n if cache is None else cache[i].key_length(n))
            if key not in made:
                made[key] = self.layer_mask(keep, cache, n, layer=i)
            out.append(made[key])
        return out

    # --- forward ------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The token embeddings (B, N) -> (B, N, C) (any leading dims): ``embed``, times √C
        rounded to the weight dtype with ``embed_scale`` (Gemma)."""
        x = self.embed(input_ids)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.dim ** 0.5, dtype=x.dtype)
        return x

    def soft_cap(self, logits: Tensor) -> Tensor:
        """The LM head's logits (..., V) soft-capped by ``logit_softcap`` (cap·tanh(x/cap),
        Gemma 2), or as they are."""
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hidden_states(self, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                      position_ids: Tensor | None = None, cache: list[Any] | None = None,
                      output_attentions: bool = False) -> tuple[Tensor, list[Tensor]]:
        """The final-normed hidden states (B, N, C) and, with ``output_attentions``, the list
        of per-layer weights (B, H, N, S) (else an empty list). Arguments as ``forward``."""
        check_token_ids("GPT", "input_ids", input_ids, self.config.vocab_size, "vocab_size")
        if input_ids.dtype not in (torch.int64, torch.int32):  # what nn.Embedding takes
            input_ids = input_ids.long()
        batch, n = input_ids.shape
        past = self._check_cache(cache, batch)
        keep = self._keep(attention_mask, batch, n, past)
        if position_ids is not None:
            if (not isinstance(position_ids, Tensor) or position_ids.dtype.is_floating_point
                    or position_ids.dtype == torch.bool
                    or _shape(position_ids) not in ((n,), (batch, n))):
                got = (f"shape {_shape(position_ids)} dtype {position_ids.dtype}"
                       if isinstance(position_ids, Tensor) else type(position_ids).__name__)
                raise ValueError(f"GPT: position_ids must be an integer tensor of shape (N,) = "
                                 f"({n},) or (B, N) = ({batch}, {n}), got {got}")
            pos = position_ids.to(device=input_ids.device, dtype=torch.long)
        elif keep is not None:
            pos = positions_from_mask(keep)[:, past:]  # (B, N)
        else:
            if self.positions is not None and past + n > self.config.max_len:
                raise ValueError(f"GPT: {past + n} positions (cached {past} + new {n}) exceed "
                                 f"max_len={self.config.max_len} of the learned positions")
            pos = torch.arange(past, past + n, device=input_ids.device)  # (N,)
        x = self.embed_tokens(input_ids)  # (B, N, C)
        if self.positions is not None:
            x = self.positions(x, pos)  # (B, N, C); a position >= max_len raises ValueError
        if self.drop.p and self.training:
            x = self.drop(x)
        masks = self.layer_masks(keep, cache, n)
        rope_pos = pos if self.rope is not None else None
        attentions: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            mask, causal = masks[i]
            out = layer(x, mask=mask, causal=causal, need_weights=output_attentions,
                        cache=None if cache is None else cache[i], positions=rope_pos)
            if output_attentions:
                x, w = out
                attentions.append(w)
            else:
                x = out
        return self.norm(x), attentions

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: list[Any] | None = None,
                output_attentions: bool = False) -> Tensor | GPTOutput:
        """Next-token logits.

        Args:
            input_ids: (B, N) integer token ids in [0, V).
            attention_mask: (B, S) bool/int, 1 = real token, 0 = padding (left padding for
                generation); S = N, or cached + N with a cache (it covers every cached token).
                Without ``position_ids`` the positions are derived from it
                (``qkv.positions.positions_from_mask``), so a padded row equals the unpadded
                row run alone.
            position_ids: (N,) or (B, N) integer positions; default ``arange(N)`` offset by the
                cache length.
            cache: the list from ``new_cache``; the new tokens' keys/values are appended
                (a window cache keeps the last W - 1, a linear cache sums them into its
                state). Decode under ``torch.no_grad()`` / ``torch.inference_mode()``.
            output_attentions: also return each layer's attention weights.

        Returns:
            logits (B, N, V), or ``GPTOutput(logits, attentions)`` with attentions a tuple of
            L tensors (B, H, N, S).

        Raises:
            TypeError for a wrong type/dtype; ValueError for a wrong shape, a token id outside
            [0, V) (naming it), or more than ``max_len`` positions with learned positions.
        """
        h, attentions = self.hidden_states(input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, cache=cache,
                                           output_attentions=output_attentions)
        logits = self.soft_cap(apply_linear(self.lm_head, h))  # (B, N, V); oneDNN where it pays
        return GPTOutput(logits, tuple(attentions)) if output_attentions else logits

    def loss(self, input_ids: Tensor, targets: Tensor, *, attention_mask: Tensor | None = None,
             position_ids: Tensor | None = None, ignore_index: int = -100,
             label_smoothing: float = 0.0, chunk: int = 512) -> Tensor:
        """Mean next-token cross-entropy, without materialising the (B·N, V) logits
        (``qkv.ops.lm_loss.linear_cross_entropy``: the LM head fused with the loss over
        chunks of rows, fp32 inside each chunk).

        Args:
            input_ids: (B, N) token ids.
            targets: (B, N) the token each position should predict (usually ``input_ids``
                shifted left by one); ``ignore_index`` entries are left out of the mean.
            attention_mask, position_ids: as for ``forward``.
            label_smoothing: in [0, 1], as ``F.cross_entropy``'s.
            chunk: rows of logits computed at a time by the fused LM-head + cross-entropy.

        Returns:
            an fp32 scalar tensor; equals ``F.cross_entropy(forward(ids).flatten(0,
            1).float(), targets.flatten(), label_smoothing=label_smoothing)`` up to rounding.
        """
        if not isinstance(targets, Tensor) or _shape(targets) != _shape(input_ids) \
                or targets.dtype.is_floating_point:
            got = f"{_shape(targets)} {targets.dtype}" if isinstance(targets, Tensor) \
                else type(targets).__name__
            raise ValueError(f"GPT.loss: targets must be an integer tensor shaped like "
                             f"input_ids {_shape(input_ids)}, got {got}")
        h, _ = self.hidden_states(input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids)
        t = targets.reshape(-1).long()
        ok = (t == ignore_index) | ((t >= 0) & (t < self.config.vocab_size))
        if not bool(ok.all()):
            raise ValueError(f"GPT.loss: target {int(t[~ok][0])} is out of range for "
                             f"vocab_size={self.config.vocab_size}")
        if self.config.logit_softcap is not None:  # the capped logits, then the loss
            logits = self.soft_cap(apply_linear(self.lm_head, h)).float()
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), t, ignore_index=ignore_index,
                label_smoothing=label_smoothing)
        weight = self.lm_head.weight
        # under autocast the hidden states may be bf16/fp16 while the head is fp32: the head
        # runs in its own dtype, its softmax in fp32 (as autocast runs cross-entropy)
        with torch.autocast(h.device.type, enabled=False):
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]).to(weight.dtype), weight,
                                        t, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, chunk=chunk)

    # --- HuggingFace --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, directory: str | os.PathLike, *, allow_pickle: bool = False,
                **kwargs: Any) -> GPT:
        """A ``GPT`` from a local HuggingFace GPT-2 directory (config.json with model_type
        "gpt2" and model.safetensors, or its shards with model.safetensors.index.json; a
        pytorch_model.bin only with ``allow_pickle=True``,
        read with ``torch.load(weights_only=True)``). Returned in eval mode, like
        transformers. Mismatched keys or shapes raise ``CheckpointError`` and load nothing.
        Every config.json field is classified in ``qkv.models.hf_config.GPT2_FIELDS``: an
        option qkv does not compute (cross-attention, unscaled or per-layer-scaled
        attention, an unknown activation...) raises ``CheckpointError`` naming it; a field
        it does not know loads with a warning. ``kwargs`` (device, dtype) go to the
        constructor (the steps are ``qkv.models.hf_load.load_hf``'s, as for every HF
        architecture)."""
        return load_hf(mapping_for(cls, directory), cls, directory, allow_pickle=allow_pickle,
                       **kwargs)
