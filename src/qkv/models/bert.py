"""``BERT``: the encoder-only Transformer of Devlin et al. 2018, and loading HuggingFace
BERT-family checkpoints (BERT, MiniLM-style sentence encoders).

Shapes: B batch, N sequence length (≤ ``max_len``), C model width (``dim``), H heads,
V vocabulary size, F feed-forward hidden width. Inputs are batch-first (B, N) token ids;
hidden states are (B, N, C); attention weights (B, H, N, N).

Architecture (post-norm, as the paper and every BERT checkpoint)::

    x = LayerNorm(word[ids] + token_type[tt] + position[pos])      # eps 1e-12, then dropout
    x = EncoderLayer(x) × num_layers                                # x = norm(x + sublayer(x))
    pooler_output = tanh(Linear(x[:, 0]))                           # optional, (B, C)
    mlm_logits = LayerNorm(gelu(Linear(x))) @ wordᵀ + bias          # optional, tied, (B, N, V)

Key padding follows the qkv convention (True = may attend): ``attention_mask`` (B, N) with
1 at real tokens becomes the bool mask ``attention_mask.bool()[:, None, None, :]``
(B, 1, 1, N) — what ``qkv.masks.Padding(keep=...)`` allows, without its zeroing of padded
keys/values (see ``key_padding_mask``); a mask without any padding is dropped, so the
attention kernel runs unmasked. A padded batch runs every token-wise op (projections, FFN,
LayerNorms: ~90% of the time) on its T real tokens only, packed (T, C); only attention
itself sees the padded (B, H, N, D) layout (``EncoderLayer.forward(h, rows=...)``, shared
with the encoder-decoder's encoder).

Loading HuggingFace checkpoints: ``BERT.from_hf(dir)`` (or ``BERT.from_pretrained(dir)``)
reads config.json (model_type "bert") and model.safetensors, fuses each layer's
query/key/value projections into one ``in_proj`` (rows q, k, v) and maps every other
weight by name. A pickle (pytorch_model.bin) is refused unless ``allow_pickle=True``, and
then read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules.attention import MultiHeadAttention
from ..modules.feedforward import ACTIVATIONS, FeedForward
from ..modules.layers import EncoderLayer, TokenRows
from ..modules.linear_call import apply_linear
from ..modules.norms import LayerNorm
from ..modules.positions import Learned
from ..ops.fast_linear import fast_linear
from .config import ModelConfig, check_norm_eps
from .hf_bert import BERT_HF
from .hf_load import HFMapping, load_hf
from .hub import PretrainedMixin, load_tokenizer
from .inputs import check_token_ids

__all__ = ["BERT", "BERTConfig", "BERTOutput", "key_padding_mask", "load_tokenizer",
           "mean_pool"]


@dataclasses.dataclass(frozen=True)
class BERTConfig(ModelConfig):
    """BERT hyper-parameters (defaults: BERT-base). Presets: ``BERTConfig.from_name(name)``
    with name "bert-base" (C=768, 12 layers, 12 heads), "bert-large", "minilm-l6" (the shape
    of sentence-transformers' all-MiniLM-L6-v2: C=384, 6 layers, 12 heads, F=1536) and
    "bert-tiny" (C=128, 2 layers, 2 heads; for tests).

    Fields:
        vocab_size: V. max_len: positions with an embedding (N ≤ max_len).
        type_vocab_size: number of token types (segments). dim: C. num_layers, num_heads: H.
        ffn_hidden: F. activation: FFN activation, a key of ``qkv.modules.feedforward
        .ACTIVATIONS`` ("gelu" is the exact erf GELU of BERT). norm_eps: LayerNorm eps, in
        [1e-38, 1].
        dropout: embedding/residual dropout. attn_dropout: dropout on attention weights.
        pad_token_id: the padding token (its embedding gets no gradient).
        with_pooler: build the pooler (dense + tanh on [CLS]).
        with_mlm_head: build the masked-LM head (tied to the word embeddings).
    """

    vocab_size: int = 30522
    max_len: int = 512
    type_vocab_size: int = 2
    dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_hidden: int = 3072
    activation: str = "gelu"
    norm_eps: float = 1e-12
    dropout: float = 0.1
    attn_dropout: float = 0.1
    pad_token_id: int = 0
    with_pooler: bool = True
    with_mlm_head: bool = True

    MODEL_TYPE: ClassVar[str] = "qkv-bert"
    LAYER_KEYS: ClassVar[dict[str, str]] = {"num_layers": r"layers\.(\d+)\."}
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "bert-base": {},
        "bert-large": {"dim": 1024, "num_layers": 24, "num_heads": 16, "ffn_hidden": 4096},
        "minilm-l6": {"dim": 384, "num_layers": 6, "num_heads": 12, "ffn_hidden": 1536},
        "bert-tiny": {"dim": 128, "num_layers": 2, "num_heads": 2, "ffn_hidden": 512},
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "type_vocab_size", "dim", "num_layers",
                     "num_heads", "ffn_hidden"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"BERTConfig: {name} must be a positive int, got {val!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"BERTConfig: dim={self.dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"BERTConfig: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        for name in ("dropout", "attn_dropout"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not 0.0 <= val < 1.0:
                raise ValueError(f"BERTConfig: {name} must be in [0, 1), got {val!r}")
        check_norm_eps("BERTConfig", self.norm_eps)
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"BERTConfig: pad_token_id={self.pad_token_id} is outside "
                             f"[0, vocab_size={self.vocab_size})")


@dataclasses.dataclass
class BERTOutput:
    """What ``BERT.forward`` returns.

    Attributes:
        last_hidden_state: (B, N, C), the last layer's output.
        pooler_output: (B, C), tanh(Linear(hidden[:, 0])) — None without a pooler.
        attentions: with ``output_attentions=True``, one (B, H, N, N) tensor of attention
            weights per layer (rows sum to 1 over the real keys); else None.
    """

    last_hidden_state: Tensor
    pooler_output: Tensor | None = None
    attentions: tuple[Tensor, ...] | None = None


class MLMHead(nn.Module):
    """BERT's masked-LM transform: Linear(C -> C), activation, LayerNorm; then the decoder,
    tied to the word embeddings, plus a bias (V,). (B, N, C) -> (B, N, V). ``device``,
    ``dtype``: of the parameters."""

    def __init__(self, dim: int, vocab_size: int, *, activation: str, eps: float,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.activation = activation
        self.dense = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.norm = LayerNorm(dim, eps=eps, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.zeros(vocab_size, device=device, dtype=dtype))

    def forward(self, hidden: Tensor, word_weight: Tensor) -> Tensor:
        """hidden (B, N, C), word_weight (V, C) -> logits (B, N, V)."""
        h = self.norm(ACTIVATIONS[self.activation](apply_linear(self.dense, hidden)))  # (B, N, C)
        return fast_linear(h, word_weight, self.bias)  # (B, N, V)


class BERT(PretrainedMixin, nn.Module):
    """BERT encoder (post-norm ``EncoderLayer`` stack) with optional pooler and MLM head.

    Args:
        config: a ``BERTConfig``.
        device, dtype: of the parameters.

    Example::

        model = BERT(BERTConfig.from_name("bert-tiny")).eval()
        out = model(ids, attention_mask)                 # ids, mask (B, N)
        out.last_hidden_state                            # (B, N, C)
        emb = mean_pool(out.last_hidden_state, attention_mask)   # (B, C) sentence embedding
        logits = model.mlm_logits(out.last_hidden_state) # (B, N, V)

        model = BERT.from_pretrained("path/to/hf-bert")  # a local HF checkpoint directory

    Attributes:
        word_embeddings (V, C), position (``qkv.positions.Learned``, (max_len, C)),
        token_type_embeddings (type_vocab_size, C), embed_norm, layers (``EncoderLayer``s),
        pooler (Linear C -> C or None), mlm (``MLMHead`` or None).
    """

    config_class: ClassVar[type[ModelConfig]] = BERTConfig
    hf_mapping: ClassVar[HFMapping] = BERT_HF
    #: ``qkv.quantize`` turns its linear layers to int8; the MLM head's decoder is the word
    #: embedding table, quantized as one head (``qkv.models.quantized.QuantizedMLMHead``)
    quantizable: ClassVar[bool] = True
    tied_heads: ClassVar[dict[str, str]] = {"mlm": "word_embeddings"}

    def __init__(self, config: BERTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, BERTConfig):
            raise TypeError(f"BERT: config must be a BERTConfig, got {type(config).__name__}")
        self.config = config
        c = config
        f = {"device": device, "dtype": dtype}
        self.word_embeddings = nn.Embedding(c.vocab_size, c.dim, padding_idx=c.pad_token_id,
                                            **f)
        self.position = Learned(c.max_len, c.dim, **f)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.dim, **f)
        self.embed_norm = LayerNorm(c.dim, eps=c.norm_eps, **f)
        self.embed_dropout = nn.Dropout(c.dropout)
        # EncoderLayer.build's FeedForward would add dropout after the activation, which
        # BERT does not have: the parts are built here (dropout only on the residuals).
        self.layers = nn.ModuleList(
            EncoderLayer(
                MultiHeadAttention(c.dim, c.num_heads, dropout=c.attn_dropout, **f),
                FeedForward(c.dim, c.ffn_hidden, activation=c.activation, **f),
                LayerNorm(c.dim, eps=c.norm_eps, **f), LayerNorm(c.dim, eps=c.norm_eps, **f),
                norm_first=False, dropout=c.dropout)
            for _ in range(c.num_layers))
        self.pooler = nn.Linear(c.dim, c.dim, **f) if c.with_pooler else None
        self.mlm = (MLMHead(c.dim, c.vocab_size, activation=c.activation, eps=c.norm_eps, **f)
                    if c.with_mlm_head else None)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """BERT's initialisation: Linear and embedding weights N(0, std²) (the padding row
        zero), biases zero, LayerNorm weight 1 and bias 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.Embedding, Learned)):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.word_embeddings.weight[self.config.pad_token_id].zero_()
        if self.mlm is not None:
            nn.init.zeros_(self.mlm.bias)

    # --- input checks -------------------------------------------------------------------
    # --- forward ------------------------------------------------------------------------
    def embed(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
              position_ids: Tensor | None = None) -> Tensor:
        """Embeddings (B, N, C): LayerNorm(word + token type + position), then dropout.
        Inputs are assumed valid (``forward`` checks them)."""
        x = self.word_embeddings(input_ids)  # (B, N, C)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.position(x, position_ids)  # (B, N, C)
        return self.embed_dropout(self.embed_norm(x))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, *, position_ids: Tensor | None = None,
                output_attentions: bool = False) -> BERTOutput:
        """Encode token ids.

        Args:
            input_ids: (B, N) integers in [0, V); N ≤ max_len.
            attention_mask: (B, N), 1/True at real tokens, 0/False at padding (default all
                real). Padded keys are never attended. With padding, the token-wise work
                (projections, FFN, norms) runs on the real tokens only and the padded
                positions of ``last_hidden_state`` are zeros (HF computes values there
                that nothing should read); any padding pattern (right, left) works.
            token_type_ids: (B, N) integers in [0, type_vocab_size) (default all 0).
            position_ids: (N,) or (B, N) integers in [0, max_len) (default arange(N)).
            output_attentions: also return each layer's weights (B, H, N, N) (computed by
                the reference math, slower).

        Returns:
            ``BERTOutput`` with ``last_hidden_state`` (B, N, C), ``pooler_output`` (B, C)
            when the model has a pooler, ``attentions`` (per layer (B, H, N, N)) on request.

        Raises:
            TypeError / ValueError naming the offending input: ids out of range, a sequence
            longer than ``max_len``, mismatched shapes.
        """
        c = self.config
        ids = check_token_ids("BERT", "input_ids", input_ids, c.vocab_size, "vocab_size")
        b, n = ids.shape
        if n > c.max_len:
            raise ValueError(f"BERT: sequence length N={n} exceeds max_len={c.max_len} "
                             f"(input_ids shape {tuple(ids.shape)})")
        if n == 0:
            raise ValueError(f"BERT: input_ids is empty, shape {tuple(ids.shape)}")
        if token_type_ids is not None:
            check_token_ids("BERT", "token_type_ids", token_type_ids, c.type_vocab_size,
                            "type_vocab_size", shape=(b, n))
        mask = None
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (b, n):
                got = (tuple(attention_mask.shape) if isinstance(attention_mask, Tensor)
                       else type(attention_mask).__name__)
                raise ValueError(f"BERT: attention_mask must have shape (B, N) = {(b, n)} "
                                 f"(1 = real token), got {got}")
            keep = attention_mask.to(device=ids.device, dtype=torch.bool)  # (B, N)
            if not bool(keep.all()):  # no padding: run the kernel unmasked
                mask = key_padding_mask(keep)  # (B, 1, 1, N)
        x = self.embed(ids, token_type_ids, position_ids)  # (B, N, C)
        # The layers run on 2-D (T, C) token rows (EncoderLayer.forward, rows=): every
        # token-wise op (projections, FFN, norms) sees only the T real tokens of a padded
        # batch (T = B·N without padding); attention alone runs in the padded layout.
        rows = TokenRows(None if mask is None else keep, batch=b, length=n)
        h = rows.pack(x)  # (T, C)
        attentions = []
        bufs: dict[str, Tensor] | None = None if torch.is_grad_enabled() else {}
        for layer in self.layers:
            h = layer(h, rows=rows, mask=mask, need_weights=output_attentions, bufs=bufs)
            if output_attentions:
                h, w = h
                attentions.append(w)
        x = rows.unpack(h)  # (B, N, C), zeros at padded positions
        pooled = None  # (B, C) with a pooler
        if self.pooler is not None:
            pooled = torch.tanh(apply_linear(self.pooler, x[:, 0]))
        return BERTOutput(x, pooled, tuple(attentions) if output_attentions else None)

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """Masked-LM logits (B, N, V) of hidden states (B, N, C) (``last_hidden_state``)."""
        if self.mlm is None:
            raise ValueError("BERT: this model has no masked-LM head (config.with_mlm_head "
                             "is False, or the checkpoint held none)")
        return self.mlm(hidden, self.word_embeddings.weight)

    def masked_lm(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                  token_type_ids: Tensor | None = None, *,
                  labels: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``forward`` then ``mlm_logits``: logits (B, N, V). With ``labels`` (B, N) (-100 =
        not predicted) returns ``(loss, logits)``, loss the mean cross-entropy."""
        logits = self.mlm_logits(self(input_ids, attention_mask, token_type_ids)
                                 .last_hidden_state)  # (B, N, V)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               labels.reshape(-1), ignore_index=-100)
        return loss, logits

    # --- HuggingFace checkpoints --------------------------------------------------------
    @classmethod
    def from_hf(cls, directory: str | os.PathLike, *, allow_pickle: bool = False,
                **kwargs: Any) -> BERT:
        """A ``BERT`` with the weights of a local HuggingFace BERT checkpoint directory.

        Reads config.json (model_type "bert": hidden_size, num_hidden_layers,
        num_attention_heads, intermediate_size, hidden_act, max_position_embeddings,
        type_vocab_size, layer_norm_eps, vocab_size, pad_token_id, dropouts) and
        model.safetensors, or its shards with model.safetensors.index.json (``BertModel`` or
        ``BertForMaskedLM``/``BertForPreTraining`` keys, with or without the "bert." prefix),
        checked against config.json from the files' headers before anything is built. The
        pooler and MLM head are built only when the checkpoint holds them; the model is
        returned in eval mode. The tokenizer, if any: ``load_tokenizer(directory)``
        (re-exported from ``hub``). Dropped silently:
        ``embeddings.position_ids``, the next-sentence head ``cls.seq_relationship.*`` (not
        modelled) and a decoder weight/bias equal to the tied word embeddings /
        ``cls.predictions.bias``. Old ``LayerNorm.gamma/beta`` names are read as weight/bias.

        Every config.json field is classified in ``qkv.models.hf_config.BERT_FIELDS``
        (used, ignored as unable to change the outputs, or checked); a field it does not
        know loads with a warning.

        ``kwargs`` (device, dtype) go to the constructor; the steps are
        ``qkv.models.hf_load.load_hf``'s, as for every HF architecture (the mapping:
        ``qkv.models.hf_bert.BERT_HF``).

        Raises:
            CheckpointError naming missing, unknown or mis-shaped HuggingFace keys, each
            config option qkv does not compute with its value (is_decoder, cross-attention,
            relative position embeddings, an unknown activation, an untied MLM decoder...),
            or a pickle-only directory without ``allow_pickle=True``.
        """
        return load_hf(cls.hf_mapping, cls, directory, allow_pickle=allow_pickle, **kwargs)


def key_padding_mask(keep: Tensor) -> Tensor:
    """The attention mask of a padded batch: ``keep`` (B, N) bool, True at real tokens ->
    (B, 1, 1, N) bool, True = may attend (every query sees the real keys of its row).

    Equivalent to ``qkv.masks.Padding(keep=keep)`` except that ``qkv.attention`` skips
    ``Padding``'s guard against NaN/inf stored past a sequence's end (a read-only finiteness
    sum of k and v per layer; a copy only when they hold NaN/inf). BERT's token rows leave
    exact zeros at the padded keys/values (``EncoderLayer.forward``, rows=), so the guard
    would buy nothing here.
    """
    return keep[:, None, None, :]  # (B, 1, 1, N)


# --- sentence embeddings ---------------------------------------------------------------
def mean_pool(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Sentence embeddings (B, C): the mean of ``hidden`` (B, N, C) over real tokens
    (``attention_mask`` (B, N), 1 = real; default all real) — sentence-transformers'
    mean pooling (all-MiniLM-L6-v2 then L2-normalises: ``F.normalize(emb, dim=-1)``).
    A row without real tokens gives zeros."""
    if hidden.dim() != 3:
        raise ValueError(f"mean_pool: hidden must be (B, N, C), got {tuple(hidden.shape)}")
    if attention_mask is None:
        return hidden.mean(dim=1)
    if tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"mean_pool: attention_mask must be (B, N) = "
                         f"{tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}")
    w = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, N, 1)
    return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp_min(1e-9)  # (B, C)
