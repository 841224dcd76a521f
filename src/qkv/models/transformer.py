"""``Transformer``: the encoder-decoder of "Attention Is All You Need" (Vaswani et al. 2017).

Shapes: B batch, S source length, N target length, C model width, H heads, V vocabulary
(``src_vocab_size`` / ``tgt_vocab_size``), L tokens already in a decoder cache.

Source ids (B, S) -> token embedding · sqrt(C) + positions -> encoder stack -> memory
(B, S, C). Target ids (B, N) -> embedding + positions -> decoder stack (causal self-
attention, cross-attention over the memory) -> logits (B, N, V) by the output projection,
tied to the target embedding table by default.

Masks follow the house convention, True = a real token (may be attended):

- Source padding: ``src_lengths`` (B,) or ``src_mask`` (B, S) bool; when neither is given it
  is derived from ``pad_id`` (``src != pad_id``). It masks the encoder's self-attention keys
  and the decoder's cross-attention keys.
- Target padding: ``tgt_lengths`` / ``tgt_mask`` (B, N); *not* derived from ``pad_id``:
  the causal mask already keeps right padding out of every real position, and a decoder
  that starts from ``pad_id`` (as T5/BART do) must not lose its first token. Pass it for
  left-padded targets.
- With absolute positions and padding, each real token's position counts from its row's
  first real token (``positions_from_mask``), so a left-padded row matches the unpadded one.

Generation: ``memory, memory_mask = model.encode(src)``, ``kv = model.precompute_memory_kv(
memory)`` (cross-attention keys/values, once per source), ``cache = model.new_cache(B, cap)``
(one self-attention ``KVCache`` per decoder layer), then ``model.decode(step_ids, memory_kv=kv,
memory_mask=memory_mask, cache=cache)`` per step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules.attention import MultiHeadAttention
from ..modules.cache import KVCache
from ..modules.feedforward import GATED_ACTIVATIONS, FeedForward, SwiGLU
from ..modules.layers import DecoderLayer, EncoderLayer, TokenRows
from ..modules.linear_call import apply_linear
from ..modules.norms import LayerNorm, RMSNorm
from ..modules.positions import positions_from_mask
from ..ops.masks import Padding
from .hf_bart import BART
from .hf_load import HFMapping, load_hf, mapping_for
from .hf_marian import MARIAN
from .hf_t5 import T5
from .hub import PretrainedMixin
from .inputs import check_token_ids
from .transformer_config import TransformerConfig, build_positions, embedding_scale

__all__ = ["Transformer", "TransformerConfig", "TransformerOutput"]

MemoryKV = list[tuple[Tensor, Tensor]]


@dataclass
class TransformerOutput:
    """What ``forward``/``decode`` return with ``output_attentions=True``.

    Attributes:
        logits: (B, N, V).
        encoder_attentions: one (B, H, S, S) per encoder layer (empty from ``decode``).
        decoder_self_attentions: one (B, H, N, L + N) per decoder layer (L = 0 without
            a cache).
        cross_attentions: one (B, H, N, S) per decoder layer.
    Rows sum to 1 over allowed keys (0 where a row may attend nothing).
    """

    logits: Tensor
    encoder_attentions: tuple[Tensor, ...] = ()
    decoder_self_attentions: tuple[Tensor, ...] = ()
    cross_attentions: tuple[Tensor, ...] = ()


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def _norm(config: TransformerConfig, factory: dict) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.dim, eps=config.norm_eps, **factory)
    return LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias, **factory)


def _ffn(config: TransformerConfig, factory: dict) -> nn.Module:
    c = config
    inner = c.dropout if c.ffn_dropout is None else c.ffn_dropout
    if c.activation in GATED_ACTIVATIONS:
        return SwiGLU(c.dim, c.ffn_hidden, bias=c.bias, dropout=inner,
                      activation=GATED_ACTIVATIONS[c.activation], **factory)
    return FeedForward(c.dim, c.ffn_hidden, activation=c.activation, bias=c.bias,
                       dropout=inner, **factory)


def _mha(config: TransformerConfig, factory: dict) -> MultiHeadAttention:
    c = config
    return MultiHeadAttention(c.dim, c.num_heads, bias=c.bias, dropout=c.attn_dropout,
                              head_dim=c.attention_head_dim, scale=c.attention_scale,
                              **factory)


class Transformer(PretrainedMixin, nn.Module):
    """The encoder-decoder Transformer of Vaswani et al. 2017 on qkv's shared layers.

    Args:
        config: a ``TransformerConfig`` (``TransformerConfig.from_name("vaswani-base")``).
        device, dtype: of the parameters.

    Attributes:
        src_embed, tgt_embed: (V, C) token tables (the same module with
            ``share_embeddings``); rows of ``pad_id`` start at zero and get no gradient
            (unless ``freeze_pad_row=False``, as T5).
        src_positions, tgt_positions: absolute position modules, or None (relative schemes).
        encoder_bias, decoder_bias: relative bias producers (shared, or a ModuleList with
            one per layer), or None.
        encoder_layers, decoder_layers: ``EncoderLayer`` / ``DecoderLayer`` stacks.
        src_embed_norm, tgt_embed_norm: the norms on each stack's embeddings
            (``config.embed_norm``, BART's ``layernorm_embedding``), or None.
        encoder_norm, decoder_norm: the final norms (``config.final_norm``), or None.
        lm_head: C -> V output projection, a bias only with ``config.head_bias``; its weight
            *is* ``tgt_embed.weight`` with ``tie_output``. The decoder output is multiplied by
            ``config.head_scale`` before it (T5's C^-0.5 with tied embeddings).

    ``tied_keys`` (state-dict keys not written by ``save_pretrained``, re-tied on load):
    ``lm_head.weight`` with ``tie_output``, ``tgt_embed.weight`` with ``share_embeddings``.
    """

    config_class = TransformerConfig
    #: the HuggingFace encoder-decoders it reads (``from_hf``): T5 / Flan-T5, BART, Marian
    hf_mapping: ClassVar[HFMapping] = T5
    hf_mappings: ClassVar[tuple[HFMapping, ...]] = (T5, BART, MARIAN)
    #: keys that may be tied (``from_pretrained`` fills those the file lacks from the tie);
    #: each instance narrows this to the keys tied under its config.
    tied_keys = ("tgt_embed.weight", "lm_head.weight")
    #: ``qkv.quantize`` turns its linear layers to int8
    quantizable = True

    def __init__(self, config: TransformerConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"Transformer: config must be a TransformerConfig, "
                            f"got {type(config).__name__}")
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        pad_row = c.pad_id if c.freeze_pad_row else None
        self.src_embed = nn.Embedding(c.src_vocab_size, c.dim, padding_idx=pad_row, **factory)
        self.tgt_embed = (self.src_embed if c.share_embeddings else
                          nn.Embedding(c.tgt_vocab_size, c.dim, padding_idx=pad_row,
                                       **factory))
        for emb in {id(self.src_embed): self.src_embed,
                    id(self.tgt_embed): self.tgt_embed}.values():
            nn.init.normal_(emb.weight, std=c.dim ** -0.5)  # ~unit entries after · sqrt(C)
            if c.freeze_pad_row:
                with torch.no_grad():
                    emb.weight[c.pad_id].zero_()
        parts = build_positions(c, **factory)
        self.src_positions, self.tgt_positions = parts.src, parts.tgt
        self.encoder_bias, self.decoder_bias = parts.encoder_bias, parts.decoder_bias
        self.src_embed_norm = _norm(c, factory) if c.embed_norm else None
        self.tgt_embed_norm = _norm(c, factory) if c.embed_norm else None
        self.dropout = nn.Dropout(c.dropout)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(_mha(c, factory), _ffn(c, factory), _norm(c, factory),
                         _norm(c, factory), norm_first=c.norm_first, dropout=c.dropout)
            for _ in range(c.num_encoder_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(_mha(c, factory), _mha(c, factory), _ffn(c, factory),
                         _norm(c, factory), _norm(c, factory), _norm(c, factory),
                         norm_first=c.norm_first, dropout=c.dropout)
            for _ in range(c.num_decoder_layers))
        self.encoder_norm = _norm(c, factory) if c.final_norm else None
        self.decoder_norm = _norm(c, factory) if c.final_norm else None
        self.lm_head = nn.Linear(c.dim, c.tgt_vocab_size, bias=c.head_bias, **factory)
        if c.head_bias:
            nn.init.zeros_(self.lm_head.bias)
        if c.tie_output:
            self.lm_head.weight = self.tgt_embed.weight
        self.tied_keys = tuple(k for k, on in (("tgt_embed.weight", c.share_embeddings),
                                               ("lm_head.weight", c.tie_output)) if on)
        self._scale = embedding_scale(c)

    # --- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _layer_bias(bias: nn.Module | None, i: int) -> nn.Module | None:
        return bias[i] if isinstance(bias, nn.ModuleList) else bias

    def _keep(self, name: str, batch: int, length: int, lengths: Tensor | None,
              mask: Tensor | None, device: torch.device) -> Tensor | None:
        """(B, length) bool keep-mask from lengths or a mask (None: nothing masked)."""
        if lengths is not None and mask is not None:
            raise ValueError(f"Transformer: give {name}_lengths or {name}_mask, not both")
        if lengths is not None:
            if (not isinstance(lengths, Tensor) or lengths.dim() != 1
                    or lengths.dtype.is_floating_point or lengths.dtype == torch.bool
                    or lengths.shape[0] != batch):
                raise ValueError(f"Transformer: {name}_lengths must be an integer tensor "
                                 f"(B,) = ({batch},), got {_shape(lengths)}"
                                 + (f" {lengths.dtype}" if isinstance(lengths, Tensor) else ""))
            if int(lengths.min()) < 0 or int(lengths.max()) > length:
                raise ValueError(f"Transformer: {name}_lengths must lie in [0, {length}], "
                                 f"got {lengths.tolist()}")
            mask = torch.arange(length, device=device)[None, :] < lengths.to(device)[:, None]
        if mask is None:
            return None
        if (not isinstance(mask, Tensor) or mask.dtype != torch.bool
                or tuple(mask.shape) != (batch, length)):
            got = f"{_shape(mask)} {mask.dtype}" if isinstance(mask, Tensor) else _shape(mask)
            raise ValueError(f"Transformer: {name}_mask must be a bool tensor (B, L) = "
                             f"({batch}, {length}), True = real token, got {got}")
        return None if bool(mask.all()) else mask.to(device)

    def _embed(self, ids: Tensor, table: nn.Embedding, pos_module: nn.Module | None,
               positions: Tensor, name: str, norm: nn.Module | None) -> Tensor:
        """ids (B, L) -> (B, L, C): embedding · scale + positions, the embedding norm if any,
        then dropout."""
        x = table(ids)
        if self._scale != 1.0:
            x = x * self._scale
        if pos_module is not None:
            top = int(positions.max())
            if top >= self.config.max_len:
                raise ValueError(f"Transformer: {name} reaches position {top}, beyond "
                                 f"max_len={self.config.max_len} of the "
                                 f"{self.config.positions!r} positions")
            x = pos_module(x, positions + self.config.position_offset)
        if norm is not None:
            x = norm(x)
        return self.dropout(x)

    def head(self, x: Tensor) -> Tensor:
        """Decoder output (B, N, C) -> logits (B, N, V): ``x · head_scale`` through
        ``lm_head``."""
        if self.config.head_scale != 1.0:
            x = x * self.config.head_scale
        return apply_linear(self.lm_head, x)

    # --- stacks -----------------------------------------------------------------------------
    def _encoder(self, x: Tensor, keep: Tensor | None, need_weights: bool
                 ) -> tuple[Tensor, list[Tensor]]:
        mask = None if keep is None else Padding(keep=keep)
        weights = []
        # eval, padded: the layers run on the real tokens' rows (EncoderLayer, rows=;
        # the padded positions of the output are zeros, masked wherever they are read)
        rows = TokenRows(keep) if keep is not None and not self.training else None
        if rows is not None:
            x = rows.pack(x)  # (T, C)
        for i, layer in enumerate(self.encoder_layers):
            kw = dict(mask=mask, bias=self._layer_bias(self.encoder_bias, i),
                      need_weights=need_weights)
            x = layer(x, rows=rows, **kw)
            if need_weights:
                x, w = x
                weights.append(w)
        if rows is not None:
            x = rows.unpack(x)  # (B, S, C)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, weights

    def _decoder(self, x: Tensor, *, memory: Tensor | None, memory_kv: MemoryKV | None,
                 memory_keep: Tensor | None, self_keep: Tensor | None,
                 cache: Sequence[KVCache] | None, causal: bool, need_weights: bool
                 ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        memory_mask = None if memory_keep is None else Padding(keep=memory_keep)
        self_mask = None if self_keep is None else Padding(keep=self_keep)
        w_self, w_cross = [], []
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, memory_kv=None if memory_kv is None else memory_kv[i],
                      self_mask=self_mask, causal=causal,
                      self_bias=self._layer_bias(self.decoder_bias, i),
                      memory_mask=memory_mask, need_weights=need_weights,
                      cache=None if cache is None else cache[i])
            if need_weights:
                x, (ws, wc) = x
                w_self.append(ws)
                w_cross.append(wc)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return x, w_self, w_cross

    def forward_embeddings(self, src_emb: Tensor, tgt_emb: Tensor, *,
                           src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                           causal: bool = True) -> Tensor:
        """Run the encoder and decoder stacks on given embeddings: torch.nn.Transformer's
        ``forward`` (batch-first), without token tables, scaling, absolute positions or
        embedding dropout. Relative position producers ("alibi", "t5", "shaw") belong to the
        stacks' self-attentions and do apply.

        Args:
            src_emb: (B, S, C) encoder input.
            tgt_emb: (B, N, C) decoder input.
            src_mask: (B, S) bool, True = real token; masks encoder self-attention and
                cross-attention keys (torch's ``src_key_padding_mask`` and
                ``memory_key_padding_mask`` are ``~src_mask``).
            tgt_mask: (B, N) bool, True = real token (torch's ``~tgt_key_padding_mask``).
            causal: the decoder's self-attention is causal (torch's square subsequent mask).

        Returns:
            (B, N, C): the decoder stack's output (after ``decoder_norm`` if any).
        """
        for name, t in (("src_emb", src_emb), ("tgt_emb", tgt_emb)):
            if (not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != self.config.dim
                    or not t.dtype.is_floating_point):
                raise ValueError(f"Transformer.forward_embeddings: {name} must be a float "
                                 f"(B, L, C={self.config.dim}) tensor, got {_shape(t)}")
        if src_emb.shape[0] != tgt_emb.shape[0]:
            raise ValueError(f"Transformer.forward_embeddings: batch sizes differ: src_emb "
                             f"{_shape(src_emb)}, tgt_emb {_shape(tgt_emb)}")
        b, s, n = src_emb.shape[0], src_emb.shape[1], tgt_emb.shape[1]
        src_keep = self._keep("src", b, s, None, src_mask, src_emb.device)
        tgt_keep = self._keep("tgt", b, n, None, tgt_mask, tgt_emb.device)
        memory, _ = self._encoder(src_emb, src_keep, False)
        out, _, _ = self._decoder(tgt_emb, memory=memory, memory_kv=None, memory_keep=src_keep,
                                  self_keep=tgt_keep, cache=None, causal=causal,
                                  need_weights=False)
        return out

    # --- public API -------------------------------------------------------------------------
    def _encode(self, src: Tensor, src_lengths: Tensor | None, src_mask: Tensor | None,
                need_weights: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
        c = self.config
        src = check_token_ids("Transformer", "src", src, c.src_vocab_size, "src_vocab_size")
        b, s = src.shape
        if src_lengths is None and src_mask is None:
            src_mask = src != c.pad_id
        keep = self._keep("src", b, s, src_lengths, src_mask, src.device)
        pos = (torch.arange(s, device=src.device) if keep is None
               else positions_from_mask(keep))  # (S,) or (B, S)
        x = self._embed(src, self.src_embed, self.src_positions, pos, "src",
                        self.src_embed_norm)
        memory, weights = self._encoder(x, keep, need_weights)
        full = torch.ones(b, s, dtype=torch.bool, device=src.device) if keep is None else keep
        return memory, full, weights

    def encode(self, src: Tensor, *, src_lengths: Tensor | None = None,
               src_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Encode source ids.

        Args:
            src: (B, S) token ids in [0, src_vocab_size).
            src_lengths: (B,) real lengths (right padding), or
            src_mask: (B, S) bool, True = real token. Neither: ``src != pad_id``.

        Returns:
            ``(memory (B, S, C), memory_mask (B, S) bool)``: the encoder output (after the
            final norm if any) and its keep-mask, to pass to ``decode``. In eval a padded
            source runs as token rows (``EncoderLayer.forward``, rows=): the padded positions
            of memory hold zeros (the final norm of zeros with one), masked wherever memory
            is read.
        """
        memory, keep, _ = self._encode(src, src_lengths, src_mask, False)
        return memory, keep

    def precompute_memory_kv(self, memory: Tensor) -> MemoryKV:
        """Cross-attention keys/values of ``memory`` (B, S, C) for every decoder layer,
        computed once per source: a list of ``(k, v)``, each (B, H, S, D)."""
        if (not isinstance(memory, Tensor) or memory.dim() != 3
                or memory.shape[-1] != self.config.dim):
            raise ValueError(f"Transformer.precompute_memory_kv: memory must be (B, S, "
                             f"C={self.config.dim}), got {_shape(memory)}")
        return [layer.cross_attn.project_kv(memory) for layer in self.decoder_layers]

    def new_cache(self, batch: int, capacity: int | None = None, *,
                  dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> list[KVCache]:
        """One empty self-attention ``KVCache`` per decoder layer, buffers (B, H, capacity, D);
        ``capacity`` defaults to ``max_len``. Decode under ``torch.no_grad()``."""
        capacity = self.config.max_len if capacity is None else capacity
        return [layer.self_attn.new_cache(batch, capacity, dtype=dtype, device=device)
                for layer in self.decoder_layers]

    def decode(self, tgt: Tensor, memory: Tensor | None = None, *,
               memory_mask: Tensor | None = None, memory_kv: MemoryKV | None = None,
               tgt_lengths: Tensor | None = None, tgt_mask: Tensor | None = None,
               cache: Sequence[KVCache] | None = None, output_attentions: bool = False
               ) -> Tensor | TransformerOutput:
        """Run the decoder on target ids: logits of the next token at each position.

        Args:
            tgt: (B, N) token ids in [0, tgt_vocab_size); with a cache, the N new tokens
                after the L cached ones (positions L .. L+N-1).
            memory: (B, S, C) from ``encode``; or instead
            memory_kv: ``precompute_memory_kv(memory)`` (computed once per source).
            memory_mask: (B, S) bool, True = real source token (``encode``'s second output);
                None: every memory position is attended.
            tgt_lengths: (B,) real lengths of ``tgt`` (no cache only), or
            tgt_mask: (B, N) bool, True = real token; with a cache (B, L + N), covering every
                position so far. None: no target padding (the causal mask still applies).
            cache: ``new_cache(B, capacity)``: the N new keys/values are appended per layer.
            output_attentions: return a ``TransformerOutput`` with the decoder's weights.

        Returns:
            logits (B, N, V), or a ``TransformerOutput``.
        """
        x, w_self, w_cross = self._decode_hidden(
            tgt, memory, memory_mask=memory_mask, memory_kv=memory_kv, tgt_lengths=tgt_lengths,
            tgt_mask=tgt_mask, cache=cache, need_weights=output_attentions)
        logits = self.head(x)  # (B, N, V)
        if output_attentions:
            return TransformerOutput(logits, (), tuple(w_self), tuple(w_cross))
        return logits

    def _decode_hidden(self, tgt, memory, *, memory_mask, memory_kv, tgt_lengths, tgt_mask,
                       cache, need_weights):
        c = self.config
        tgt = check_token_ids("Transformer", "tgt", tgt, c.tgt_vocab_size, "tgt_vocab_size")
        b, n = tgt.shape
        if (memory is None) == (memory_kv is None):
            raise ValueError("Transformer.decode: give exactly one of memory (B, S, C) or "
                             "memory_kv (from precompute_memory_kv)")
        if memory is not None:
            if (not isinstance(memory, Tensor) or memory.dim() != 3
                    or memory.shape[0] != b or memory.shape[-1] != c.dim):
                raise ValueError(f"Transformer.decode: memory must be (B, S, C) = ({b}, S, "
                                 f"{c.dim}) for tgt {_shape(tgt)}, got {_shape(memory)}")
            s = memory.shape[1]
        else:
            if (not isinstance(memory_kv, Sequence)
                    or len(memory_kv) != len(self.decoder_layers)):
                raise ValueError(f"Transformer.decode: memory_kv must be a list of "
                                 f"{len(self.decoder_layers)} (k, v) pairs from "
                                 f"precompute_memory_kv, got {_shape(memory_kv)}")
            k0 = memory_kv[0][0]
            if not isinstance(k0, Tensor) or k0.dim() != 4 or k0.shape[0] != b:
                raise ValueError(f"Transformer.decode: memory_kv keys must be (B, H, S, D) "
                                 f"with B={b} (tgt {_shape(tgt)}), got {_shape(k0)}")
            s = k0.shape[2]
            memory_kv = list(memory_kv)
        past = 0
        if cache is not None:
            if (not isinstance(cache, Sequence) or len(cache) != len(self.decoder_layers)
                    or not all(isinstance(kc, KVCache) for kc in cache)):
                raise ValueError(f"Transformer.decode: cache must be a list of "
                                 f"{len(self.decoder_layers)} KVCache (new_cache), "
                                 f"got {_shape(cache)}")
            if cache[0].batch != b:
                raise ValueError(f"Transformer.decode: cache has batch {cache[0].batch}, "
                                 f"tgt has batch {b} ({_shape(tgt)})")
            if tgt_lengths is not None:
                raise ValueError("Transformer.decode: tgt_lengths is for a full decode; with a "
                                 "cache pass tgt_mask (B, L + N) over every position so far")
            past = cache[0].length
        memory_keep = self._keep("memory", b, s, None, memory_mask, tgt.device)
        self_keep = self._keep("tgt", b, past + n, tgt_lengths, tgt_mask, tgt.device)
        pos = (torch.arange(past, past + n, device=tgt.device) if self_keep is None
               else positions_from_mask(self_keep)[:, past:])  # (N,) or (B, N)
        x = self._embed(tgt, self.tgt_embed, self.tgt_positions, pos, "tgt",
                        self.tgt_embed_norm)
        return self._decoder(x, memory=memory, memory_kv=memory_kv, memory_keep=memory_keep,
                             self_keep=self_keep, cache=cache, causal=True,
                             need_weights=need_weights)

    def forward(self, src: Tensor, tgt: Tensor, *, src_lengths: Tensor | None = None,
                src_mask: Tensor | None = None, tgt_lengths: Tensor | None = None,
                tgt_mask: Tensor | None = None, output_attentions: bool = False
                ) -> Tensor | TransformerOutput:
        """Teacher-forced logits: encode ``src``, decode ``tgt``.

        Args:
            src: (B, S) source ids in [0, src_vocab_size).
            tgt: (B, N) target ids in [0, tgt_vocab_size) (typically bos + shifted target).
            src_lengths / src_mask: source padding, (B,) lengths or (B, S) bool True = real
                token; neither: derived as ``src != pad_id``.
            tgt_lengths / tgt_mask: target padding, (B,) or (B, N); neither: none (causal
                masking already hides right padding from real positions).
            output_attentions: return a ``TransformerOutput`` with per-layer weights.

        Returns:
            logits (B, N, V), or a ``TransformerOutput``.

        Raises:
            ValueError: ids out of range, lengths beyond ``max_len`` (absolute positions),
            batch sizes that differ, masks of the wrong shape/dtype.
        """
        if (isinstance(src, Tensor) and isinstance(tgt, Tensor) and src.dim() >= 1
                and tgt.dim() >= 1 and src.shape[0] != tgt.shape[0]):
            raise ValueError(f"Transformer: src and tgt batch sizes differ: src "
                             f"{_shape(src)}, tgt {_shape(tgt)}")
        memory, keep, w_enc = self._encode(src, src_lengths, src_mask, output_attentions)
        x, w_self, w_cross = self._decode_hidden(
            tgt, memory, memory_mask=keep, memory_kv=None, tgt_lengths=tgt_lengths,
            tgt_mask=tgt_mask, cache=None, need_weights=output_attentions)
        logits = self.head(x)  # (B, N, V)
        if output_attentions:
            return TransformerOutput(logits, tuple(w_enc), tuple(w_self), tuple(w_cross))
        return logits

    # --- HuggingFace -------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, directory: str | os.PathLike, *, allow_pickle: bool = False,
                **kwargs: Any) -> Transformer:
        """A ``Transformer`` from a local HuggingFace T5 / Flan-T5, BART or Marian (opus-mt)
        directory (config.json + model.safetensors, or its shards; pytorch_model.bin only
        with ``allow_pickle=True``, read with ``torch.load(weights_only=True)``), by the
        mapping of its ``model_type`` (``qkv.models.hf_t5``, ``hf_bart``, ``hf_marian``).
        Returned in eval mode. A config option qkv does not compute, or a key or shape that
        does not fit, raises ``CheckpointError`` and loads nothing; ``kwargs`` (device,
        dtype) go to the constructor."""
        return load_hf(mapping_for(cls, directory), cls, directory, allow_pickle=allow_pickle,
                       **kwargs)

    # --- torch.nn.Transformer interop -------------------------------------------------------
    @classmethod
    def from_torch(cls, m: nn.Transformer, *, src_vocab_size: int | None = None,
                   tgt_vocab_size: int | None = None, **overrides) -> Transformer:
        """A ``Transformer`` whose stacks hold the weights of a ``torch.nn.Transformer``.

        torch's module has no token tables or positions: ``model.forward_embeddings(src_emb,
        tgt_emb, src_mask=~src_key_padding_mask, tgt_mask=~tgt_key_padding_mask)`` equals
        ``m(src_emb, tgt_emb, tgt_mask=causal, src_key_padding_mask=...,
        memory_key_padding_mask=..., tgt_key_padding_mask=...)`` (batch-first; transpose
        (L, B, C) inputs if ``m.batch_first`` is False). The token tables are freshly
        initialised (size 3 — pad, bos, eos — unless the vocab sizes are given); ``overrides``
        set other config fields (``max_len``, ``positions``, ...).

        Supported: post-norm and ``norm_first``, ReLU and GELU, with or without biases;
        torch's final ``encoder.norm``/``decoder.norm`` become ``encoder_norm``/
        ``decoder_norm`` (``final_norm=True``). Other layer types raise TypeError.
        """
        if not isinstance(m, nn.Transformer):
            raise TypeError(f"Transformer.from_torch: expected torch.nn.Transformer, "
                            f"got {type(m).__name__}")
        enc, dec = m.encoder, m.decoder
        if not (isinstance(enc, nn.TransformerEncoder) and isinstance(dec, nn.TransformerDecoder)
                and all(isinstance(x, nn.TransformerEncoderLayer) for x in enc.layers)
                and all(isinstance(x, nn.TransformerDecoderLayer) for x in dec.layers)):
            raise TypeError("Transformer.from_torch: the encoder/decoder must be torch's "
                            "TransformerEncoder/Decoder of TransformerEncoder/DecoderLayer")
        layers = list(enc.layers) + list(dec.layers)
        first = enc.layers[0]

        def activation(layer: nn.Module) -> str:
            kind = getattr(layer, "activation_relu_or_gelu", 0)
            if kind == 1 or layer.activation is F.relu:
                return "relu"
            if kind == 2 or layer.activation is F.gelu:
                return "gelu"
            raise ValueError(f"Transformer.from_torch: activation {layer.activation!r} is "
                             f"not supported (relu or gelu)")

        act, norm_first = activation(first), first.norm_first
        bias = first.linear1.bias is not None
        for layer in layers:
            if (activation(layer) != act or layer.norm_first != norm_first
                    or (layer.linear1.bias is not None) != bias):
                raise ValueError("Transformer.from_torch: all layers must share activation, "
                                 "norm_first and bias")
        if (enc.norm is None) != (dec.norm is None):
            raise ValueError("Transformer.from_torch: encoder.norm and decoder.norm must both "
                             "be present or both absent")
        vocab = {"src_vocab_size": src_vocab_size or 3, "tgt_vocab_size": tgt_vocab_size or 3}
        config = TransformerConfig(**{
            **vocab, "dim": first.self_attn.embed_dim,
            "num_encoder_layers": len(enc.layers), "num_decoder_layers": len(dec.layers),
            "num_heads": first.self_attn.num_heads, "ffn_hidden": first.linear1.out_features,
            "activation": act, "norm_first": norm_first, "norm_eps": first.norm1.eps,
            "dropout": first.dropout.p, "attn_dropout": first.self_attn.dropout,
            "final_norm": enc.norm is not None, "bias": bias, **overrides})
        w = first.linear1.weight
        model = cls(config, device=w.device, dtype=w.dtype)

        def copy(ours: nn.Module, theirs: nn.Module) -> None:
            ours.load_state_dict(theirs.state_dict())

        with torch.no_grad():
            for ours, theirs in zip(model.encoder_layers, enc.layers, strict=True):
                copy(ours.attn, MultiHeadAttention.from_torch(theirs.self_attn))
                copy(ours.ffn.fc_in, theirs.linear1)
                copy(ours.ffn.fc_out, theirs.linear2)
                copy(ours.norm1, theirs.norm1)
                copy(ours.norm2, theirs.norm2)
            for ours, theirs in zip(model.decoder_layers, dec.layers, strict=True):
                copy(ours.self_attn, MultiHeadAttention.from_torch(theirs.self_attn))
                copy(ours.cross_attn, MultiHeadAttention.from_torch(theirs.multihead_attn))
                copy(ours.ffn.fc_in, theirs.linear1)
                copy(ours.ffn.fc_out, theirs.linear2)
                for k in (1, 2, 3):
                    copy(getattr(ours, f"norm{k}"), getattr(theirs, f"norm{k}"))
            if enc.norm is not None:
                copy(model.encoder_norm, enc.norm)
                copy(model.decoder_norm, dec.norm)
        return model.train(m.training)
