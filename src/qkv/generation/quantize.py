"""``qkv.quantize(model, "int8")``: int8 weights with per-output-channel scales for every
linear layer and the LM head of a qkv model (GPT, the encoder-decoder Transformer, BERT).

Shapes: M rows (every leading dim of an input flattened), K input features, N output
features (channels), V vocab size, C model width.

The int8 math (the reference the fast decode step in ``fast_int8`` reproduces):

- weight, once: per output channel n, ``s[n] = max_k |W[n, k]| / 127`` and
  ``Wq[n, k] = round(W[n, k] / s[n])`` in [-127, 127] (a zero row has s = 0, Wq = 0), so the
  dequantized weight ``Wq·s`` is within ``s/2`` of W entry by entry;
- activations, per call and per row (dynamic, symmetric): ``a[m] = max_k |x[m, k]|`` and
  ``xq[m, k] = round(127·x[m, k] / a[m])`` (round half to even) in [-127, 127];
- ``acc = xq @ Wqᵀ`` in int32 (exact: |acc| ≤ 127²·K < 2³¹ for K < 133 000), then
  ``y = acc · (a · s/127) + b`` in fp32.

Every row is quantized on its own, so a row of a batch gives what it gives alone, and the
last row of an uncached forward gives what a cached single-token step gives (up to the fp32
rounding of the non-linear parts, as for fp32 models).

The int8 matmul is ``torch._int_mm`` (a core aten op, the one torchao and inductor lower to;
on x86 CPUs a oneDNN/VNNI kernel): at batch 1 it reads the 4× smaller int8 weights at about
the bytes/s that fp32 GEMM reads fp32 ones (the 25 matrices of a 6-layer, 384-wide GPT: 1.1-1.4
ms vs 4.4-4.7 ms of CPU time here). Not used: ``torch.ao.quantization`` / the fbgemm
``quantized::linear_dynamic`` ops (their packed weights need quantized-dtype tensors, which
torch 2.13 warns "are deprecated and will be removed in a future PyTorch release", and they
quantize activations per tensor, so a row would depend on its batch),
torchao 0.18 (its eager CPU int8 paths ran at 0.4× / 1× fp32 here without
``torch.compile``), ``aten._weight_int8pack_mm`` (slower than fp32 here).

Error bound (what the tests check): for one layer and output n,
``|y[n] - (x·W[n] + b[n])| ≤ Σ_k |x[k]|·s[n]/2 + (a/254)·Σ_k |Wq[n, k]|·s[n]`` (+ fp32
rounding) — the weight rounding (≤ s/2 per entry) plus the activation rounding (≤ a/254 per
entry): a relative error of order 1/254 + 1/254 per layer.

Training: a quantized model has no gradients (rounding has none). ``quantize`` freezes every
parameter (``requires_grad=False``) and a ``QuantizedLinear`` refuses an input that requires
grad in grad mode (RuntimeError): fine-tune the fp32 model, then quantize. ``GPT.loss`` on a
quantized GPT uses the dequantized LM head with fp32 activations (it reads
``lm_head.weight``); the perplexity of the int8 math comes from ``model(ids)``'s logits.

Files: ``save_quantized(model, dir)`` writes the model's ``save_pretrained`` files (config.json
+ model.safetensors holding the int8 weights and their fp32 scales) and ``quantization.json``
(``{"quant_method": "qkv-int8", "mode": "int8", ...}``); ``load_quantized(dir)`` builds the
model from config.json, quantizes it (cheap: random init then int8) and loads the int8 state.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..models import BERT, GPT, Transformer
from ..models.bert import MLMHead
from ..models.hub import (
    CONFIG_NAME,
    CheckpointError,
    atomic_write,
    check_and_load,
    load_state_dict_file,
    read_json,
)
from ..modules.feedforward import ACTIVATIONS

__all__ = ["QUANT_NAME", "QuantizedLinear", "QuantizedMLMHead", "int8_linear", "is_quantized",
           "load_quantized", "quantize", "quantize_rows", "quantize_weight", "save_quantized",
           "scale127"]

QUANT_NAME = "quantization.json"
MODES = ("int8",)
_FORMAT = "qkv-int8"  # quant_method in quantization.json
_MODELS = (GPT, Transformer, BERT)
_TINY = torch.finfo(torch.float32).tiny
# 1.5·2²³: adding it to a float32 in [-2²², 2²²] rounds it to an integer (half to even) held
# in the low mantissa bits, so the low byte of the bits is the int8 value (little endian)
_MAGIC = 12582912.0
_LITTLE = sys.byteorder == "little"
_MAGIC_T = torch.full((1,), _MAGIC)  # (1,) fp32, broadcast to every row


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: weight (N, K) fp32 -> (Wq (N, K) int8, s (N,) fp32)
    with ``s = max|W[n]| / 127`` and ``Wq = round(W / s)`` in [-127, 127]; a zero row gets
    s = 0 and Wq = 0. ``Wq·s`` is within ``s/2`` of W entry by entry."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: weight must be (N, K), got {tuple(weight.shape)}")
    w = weight.detach().double()  # fp64 division: the rounding is of W/s itself
    s = w.abs().amax(dim=1) / 127.0  # (N,)
    q = torch.round(w / s.clamp_min(_TINY)[:, None]).clamp_(-127, 127)  # (N, K)
    return q.to(torch.int8), s.to(torch.float32)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8 of activations: x (M, K) fp32 -> (xq (M, K) int8 contiguous,
    a (M, 1) fp32) with ``a = max|x[m]|`` (at least the smallest normal float) and
    ``xq = round(127·x / a)`` (half to even) in [-127, 127]. A row holding NaN/inf has a
    non-finite ``a``, which the linear layer's output then carries."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise TypeError(f"quantize_rows: x must be a float32 (M, K) tensor, got {x.dtype} "
                        f"{tuple(x.shape)}")
    a = torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True).clamp_min_(_TINY)
    if _LITTLE:  # 3 kernels: fused scale-and-round, then the low bytes copied out
        m = _MAGIC_T if x.device.type == "cpu" else torch.full((1,), _MAGIC, device=x.device)
        q = torch.addcdiv(m, x, a, value=127.0).view(torch.int8)[..., ::4].contiguous()
    else:
        q = torch.addcdiv(torch.zeros((1,), dtype=x.dtype, device=x.device), x, a,
                          value=127.0).round_().to(torch.int8)
    return q, a  # (M, K), (M, 1)


def scale127(scale: Tensor) -> Tensor:
    """``s/127`` (N,) as the int8 layers use it: ``scale * (1/127)`` in fp32."""
    return scale * (1.0 / 127.0)


def int8_linear(x: Tensor, weight_t: Tensor, s127: Tensor, bias: Tensor | None) -> Tensor:
    """The int8 layer on rows: x (M, K) fp32, weight_t (K, N) int8 (``Wqᵀ``, any strides
    ``torch._int_mm`` takes), s127 (N,) = ``scale127(s)``, bias (N,) or None -> (M, N) fp32
    ``(xq @ Wqᵀ)·(a·s/127) + b``."""
    q, a = quantize_rows(x)  # (M, K) int8, (M, 1)
    acc = torch._int_mm(q, weight_t)  # (M, N) int32, exact
    a_s = a * s127  # (M, N)
    return torch.mul(acc, a_s) if bias is None else torch.addcmul(bias, acc, a_s)


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` with int8 weights and per-output-channel fp32 scales, inference only.

    Args:
        weight: (N, K) int8, ``Wq``.
        scale: (N,) fp32, ``s`` (W ≈ Wq·s).
        bias: (N,) fp32 or None.

    Forward: x (..., K) fp32 -> (..., N) fp32, ``y = (xq @ Wqᵀ)·(a·s/127) + b`` with the
    per-row activation quantization of ``quantize_rows`` (module docstring of
    ``qkv.generation.quantize``).

    Buffers (the state dict): ``weight_int8`` (N, K), ``weight_scale`` (N,), ``bias``.
    ``weight`` is the dequantized (N, K) fp32 weight, computed on each access (for code that
    reads a layer's weight for its dtype or to export it), not a parameter.
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(weight, Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
            got = (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor)
                   else type(weight).__name__)
            raise TypeError(f"QuantizedLinear: weight must be an int8 (N, K) tensor, got {got}")
        n, k = weight.shape
        if (not isinstance(scale, Tensor) or scale.dtype != torch.float32
                or tuple(scale.shape) != (n,)):
            raise TypeError(f"QuantizedLinear: scale must be fp32 (N,) = ({n},), got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)} "
                            f"{tuple(getattr(scale, 'shape', ()))}")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise TypeError(f"QuantizedLinear: bias must be fp32 (N,) = ({n},) or None, got "
                            f"{bias.dtype} {tuple(bias.shape)}")
        self.in_features, self.out_features = k, n
        self.register_buffer("weight_int8", weight.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> QuantizedLinear:
        """Quantize an fp32 ``nn.Linear`` (its weight (N, K) and bias)."""
        q, s = quantize_weight(linear.weight)
        return cls(q, s, None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> QuantizedLinear:
        """Quantize a plain fp32 (N, K) weight (a tied embedding table used as an LM head)."""
        q, s = quantize_weight(weight)
        return cls(q, s, None if bias is None else bias.detach())

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) fp32, ``Wq·s`` (a new tensor on each access)."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _check(self, x: Any) -> None:
        if not isinstance(x, Tensor) or x.dtype != torch.float32:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"QuantizedLinear: input must be a float32 tensor, got {got}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantizedLinear: input must have shape (..., K={self.in_features}),"
                             f" got {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("QuantizedLinear: an int8 layer has no gradient (rounding has "
                               "none), so a quantized model cannot be trained; train the fp32 "
                               "model and quantize it after, or run under torch.no_grad()")

    def _rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        lead = x.shape[:-1]
        whole = (start, stop) == (0, self.out_features)
        w = self.weight_int8 if whole else self.weight_int8[start:stop]  # (N', K) contiguous
        b = self.bias if self.bias is None or whole else self.bias[start:stop]
        s = self.weight_scale if whole else self.weight_scale[start:stop]
        y = int8_linear(x.reshape(-1, self.in_features), w.t(), scale127(s), b)  # (M, N')
        return y.reshape(*lead, stop - start)  # (..., N')

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) fp32 -> (..., N) fp32."""
        self._check(x)
        return self._rows(x, 0, self.out_features)

    def project_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output channels [start, stop) only: x (..., K) -> (..., stop - start) (the row
        blocks of a fused projection, ``qkv.modules.attention.project_rows``)."""
        self._check(x)
        if not 0 <= start < stop <= self.out_features:
            raise ValueError(f"QuantizedLinear.project_rows: need 0 <= start < stop <= "
                             f"{self.out_features}, got start={start}, stop={stop}")
        return self._rows(x, start, stop)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-channel")


class QuantizedMLMHead(nn.Module):
    """BERT's ``MLMHead`` with int8 dense and decoder layers: the decoder is the word
    embedding table (V, C) quantized on its own (the embeddings stay fp32) with the head's
    bias. (B, N, C) -> (B, N, V); ``word_weight`` is accepted and ignored."""

    def __init__(self, head: MLMHead, word_weight: Tensor) -> None:
        super().__init__()
        self.activation = head.activation
        self.dense = QuantizedLinear.from_linear(head.dense)
        self.norm = head.norm
        self.decoder = QuantizedLinear.from_weight(word_weight, head.bias.detach())

    def forward(self, hidden: Tensor, word_weight: Tensor | None = None) -> Tensor:
        """hidden (B, N, C) -> logits (B, N, V)."""
        h = self.norm(ACTIVATIONS[self.activation](self.dense(hidden)))  # (B, N, C)
        return self.decoder(h)  # (B, N, V)


def is_quantized(model: nn.Module) -> bool:
    """True when ``model`` holds int8 layers from ``quantize``."""
    return getattr(model, "quantization", None) is not None or any(
        isinstance(m, QuantizedLinear) for m in model.modules())


def _check_model(model: Any, mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"quantize: mode must be one of {list(MODES)}, got {mode!r}")
    if not isinstance(model, _MODELS):
        raise TypeError(f"quantize: model must be a qkv GPT, Transformer or BERT, got "
                        f"{type(model).__name__}")
    if is_quantized(model):
        raise ValueError(f"quantize: this {type(model).__name__} is already quantized "
                         f"({getattr(model, 'quantization', {}).get('mode', 'int8')}); "
                         f"quantize the fp32 model once")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and type(mod) is not nn.Linear:
            raise TypeError(f"quantize: {name} is a {type(mod).__name__}, not a plain "
                            f"nn.Linear; quantize handles nn.Linear layers only")
        if type(mod).__module__.startswith("qkv.peft"):
            raise ValueError(f"quantize: {name} is a qkv.peft {type(mod).__name__}; merge the "
                             f"adapters first (qkv.peft.merge(model)) and quantize the result")
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if p.is_floating_point() and p.dtype != torch.float32:
            raise TypeError(f"quantize: the int8 path takes an fp32 model; {name} is "
                            f"{p.dtype} (call model.float() first)")
        if p.device.type != "cpu":
            raise ValueError(f"quantize: the int8 path runs on the CPU; {name} is on "
                             f"{p.device} (call model.cpu() first)")


def _replace_linears(module: nn.Module, prefix: str, done: list[str]) -> None:
    for name, child in list(module.named_children()):
        path = f"{prefix}{name}"
        if type(child) is nn.Linear:
            setattr(module, name, QuantizedLinear.from_linear(child))
            done.append(path)
        elif isinstance(child, MLMHead):
            continue  # replaced by the caller (its decoder is the word-embedding table)
        else:
            _replace_linears(child, f"{path}.", done)


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Quantize every linear layer and the LM head of ``model`` to int8, in place.

    Args:
        model: a qkv ``GPT``, ``Transformer`` or ``BERT`` in fp32 on the CPU (LoRA adapters
            merged first). Every ``nn.Linear`` — fused QKV / cross-attention projections,
            feed-forward layers, output projections, the LM head, BERT's pooler and MLM
            dense — becomes a ``QuantizedLinear``; BERT's MLM decoder (the word-embedding
            table) gets an int8 copy (``QuantizedMLMHead``). Embeddings, norms and position
            tables stay fp32 (a tied LM head is quantized apart from the embedding it shares
            weights with, so the embeddings are untouched).
        mode: "int8" (per-output-channel weight scales, per-row dynamic activation scales;
            the math is in this module's docstring).

    Returns:
        ``model`` itself, in eval mode, every parameter frozen, with
        ``model.quantization`` = ``{"mode": "int8", "modules": [names...]}``.

    Raises:
        ValueError: unknown ``mode``, an already quantized model, unmerged adapters, a model
            off the CPU. TypeError: a model other than GPT / Transformer / BERT, or not fp32.
    """
    _check_model(model, mode)
    done: list[str] = []
    with torch.no_grad():
        _replace_linears(model, "", done)
        if isinstance(model, BERT) and model.mlm is not None:
            model.mlm = QuantizedMLMHead(model.mlm, model.word_embeddings.weight)
            done += ["mlm.dense", "mlm.decoder"]
    for p in model.parameters():
        p.requires_grad_(False)
    model.quantization = {"quant_method": _FORMAT, "mode": mode, "modules": done}
    return model.eval()


def save_quantized(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write a quantized model: its ``save_pretrained`` files (config.json, model.safetensors
    with the int8 weights ``*.weight_int8``, fp32 ``*.weight_scale`` and the fp32 rest) and
    ``quantization.json`` marking the directory quantized. Returns the directory."""
    info = getattr(model, "quantization", None)
    if info is None:
        raise ValueError(f"save_quantized: this {type(model).__name__} is not quantized; "
                         f"call qkv.quantize(model, 'int8') first (or save_pretrained)")
    directory = Path(model.save_pretrained(directory))
    text = json.dumps(info, indent=2, sort_keys=True)
    atomic_write(directory / QUANT_NAME, lambda tmp: Path(tmp).write_text(text))
    return directory


def load_quantized(directory: str | os.PathLike, model_class: type | None = None) -> nn.Module:
    """The quantized model saved by ``save_quantized`` in ``directory`` (eval mode).

    ``model_class`` (GPT, Transformer, BERT) defaults to the one config.json's model_type
    names. Raises ``CheckpointError`` when ``quantization.json`` is missing or names another
    format, or when the weights do not match (names, shapes, or an int8 weight stored in
    another dtype)."""
    directory = Path(directory)
    if not (directory / QUANT_NAME).exists():
        raise CheckpointError(f"{directory}: no {QUANT_NAME}; not a quantized model directory "
                              f"(load it with from_pretrained)")
    info = read_json(directory / QUANT_NAME)
    if info.get("quant_method") != _FORMAT or info.get("mode") not in MODES:
        raise CheckpointError(f"{directory / QUANT_NAME}: unknown quantization "
                              f"{info.get('quant_method')!r} mode {info.get('mode')!r}")
    data = read_json(directory / CONFIG_NAME)
    if model_class is None:
        kinds = {m.config_class.MODEL_TYPE: m for m in _MODELS}
        model_class = kinds.get(data.get("model_type"))
        if model_class is None:
            raise CheckpointError(f"{directory}: config model_type {data.get('model_type')!r} "
                                  f"is not one of {sorted(kinds)}")
    if data.get("model_type") != model_class.config_class.MODEL_TYPE:
        raise CheckpointError(f"{directory}: config model_type {data.get('model_type')!r}, "
                              f"expected {model_class.config_class.MODEL_TYPE!r}")
    model = model_class(model_class.config_class.from_dict(data))
    quantize(model, info["mode"])
    state = load_state_dict_file(directory)
    own = model.state_dict()
    for key in model.tied_keys:  # a tied embedding the file leaves out
        if key in own:
            state.setdefault(key, own[key])
    bad = [f"{k}: {state[k].dtype} vs {own[k].dtype}" for k in sorted(set(state) & set(own))
           if state[k].dtype != own[k].dtype]
    if bad:
        raise CheckpointError(f"{directory} does not match the quantized model: dtypes "
                              + "; ".join(bad[:10]))
    check_and_load(model, state, str(directory))
    return model.eval()

