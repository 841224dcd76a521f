"""``qkv.quantize(model, "int8")``: every linear layer and the LM head of a quantizable qkv
model (``quantizable = True`` on its class: GPT, the encoder-decoder Transformer, BERT)
becomes an int8 ``qkv.modules.quantized.QuantizedLinear`` (the int8 math and its error bound
are in that module's docstring); and the files of a quantized model: ``save_pretrained`` adds
``quantization.json`` beside config.json and model.safetensors; loading such a directory
(``qkv.models.loading.load_qkv_directory``, which every ``from_pretrained`` runs) swaps in
empty int8 layers as the file says (``prepare_quantized``) before the state is loaded.

This module knows no model class: a model says it can be quantized with the class attribute
``quantizable``, and names a head whose decoder is another module's weight (BERT's masked-LM
head, tied to the word embeddings) in ``tied_heads`` (docs/ARCHITECTURE.md: The model
registry).

Shapes: B batch, N length, C model width, V vocab size.

Training: a quantized model has no gradients (rounding has none). ``quantize`` freezes every
parameter (``requires_grad=False``) and a ``QuantizedLinear`` refuses an input that requires
grad in grad mode (RuntimeError): fine-tune the fp32 model, then quantize. ``GPT.loss`` on a
quantized GPT uses the dequantized LM head with fp32 activations (it reads
``lm_head.weight``); the perplexity of the int8 math comes from ``model(ids)``'s logits.

Files: model.safetensors holds the int8 weights ``*.weight_int8``, their fp32 scales
``*.weight_scale`` and the fp32 rest; ``quantization.json`` is
``{"quant_method": "qkv-int8", "mode": "int8", "modules": [...]}``. Loading builds the model
from config.json, swaps in empty int8 layers where the file says, and loads the state
(an int8 weight stored in another dtype is refused, not converted).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..files import QUANT_NAME, CheckpointError, read_json
from ..modules.feedforward import ACTIVATIONS
from ..modules.quantized import QuantizedLinear

__all__ = ["QUANT_NAME", "QuantizedMLMHead", "check_quantized_state", "is_quantizable",
           "is_quantized", "prepare_quantized", "quantization_info", "quantize"]

MODES = ("int8",)
FORMAT = "qkv-int8"  # quant_method in quantization.json
#: what the refusals name: the qkv models whose class sets ``quantizable = True``
QUANTIZABLE = "GPT, Transformer or BERT"


def is_quantizable(model_class: Any) -> bool:
    """Whether ``qkv.quantize`` handles models of ``model_class`` (its ``quantizable``
    class attribute is True)."""
    return getattr(model_class, "quantizable", False) is True


class QuantizedMLMHead(nn.Module):
    """BERT's ``MLMHead`` with int8 dense and decoder layers: the decoder is the word
    embedding table (V, C) quantized on its own (the embeddings stay fp32) with the head's
    bias. (B, N, C) -> (B, N, V); ``word_weight`` is accepted and ignored.

    ``head``: any module with BERT's MLM head's parts: ``dense`` (an ``nn.Linear`` C -> C),
    ``activation`` (a key of ``ACTIVATIONS``), ``norm`` and ``bias`` (V,).

    ``word_weight=None`` builds empty int8 layers shaped like ``head`` (to load a saved
    state into)."""

    def __init__(self, head: nn.Module, word_weight: Tensor | None) -> None:
        super().__init__()
        self.activation = head.activation
        self.norm = head.norm
        if word_weight is None:
            c, v = head.dense.in_features, head.bias.shape[0]
            self.dense = QuantizedLinear.empty(head.dense.out_features, c,
                                               bias=head.dense.bias is not None)
            self.decoder = QuantizedLinear.empty(v, head.dense.out_features, bias=True)
        else:
            self.dense = QuantizedLinear.from_linear(head.dense)
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
    if not is_quantizable(type(model)):
        raise TypeError(f"quantize: model must be a qkv {QUANTIZABLE}, got "
                        f"{type(model).__name__}")
    if is_quantized(model):
        raise ValueError(f"quantize: this {type(model).__name__} is already quantized "
                         f"({getattr(model, 'quantization', {}).get('mode', 'int8')}); "
                         f"quantize the fp32 model once")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and type(mod) is not nn.Linear:
            raise TypeError(f"quantize: {name} is a {type(mod).__name__}, not a plain "
                            f"nn.Linear; quantize handles nn.Linear layers only")
        for attr in _PROJECTIONS:  # a stand-in for a projection computes more than its weight
            lin = mod._modules.get(attr)
            w = getattr(lin, "weight", None)
            if (lin is not None and not isinstance(lin, nn.Linear)
                    and isinstance(w, Tensor) and w.dim() == 2):
                raise ValueError(f"quantize: {name}.{attr} is a {type(lin).__name__} standing "
                                 f"in for an nn.Linear (an unmerged adapter); merge the "
                                 f"adapters into the weights first and quantize the "
                                 f"result")
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if p.is_floating_point() and p.dtype != torch.float32:
            raise TypeError(f"quantize: the int8 path takes an fp32 model; {name} is "
                            f"{p.dtype} (call model.float() first)")
        if p.device.type != "cpu":
            raise ValueError(f"quantize: the int8 path runs on the CPU; {name} is on "
                             f"{p.device} (call model.cpu() first)")


#: the attributes that hold a projection in qkv's modules and models (attention, feed-forward,
#: LM head); a wrapper put there from outside (an adapter) is refused, not skipped
_PROJECTIONS = ("in_proj", "q_proj", "kv_proj", "out_proj", "fc_in", "fc_out", "lm_head")


def _replace_linears(module: nn.Module, prefix: str, done: list[str], exact: bool,
                     skip: frozenset[str]) -> None:
    for name, child in list(module.named_children()):
        path = f"{prefix}{name}"
        if path in skip:
            continue  # a tied head: replaced by the caller (its decoder is another weight)
        if type(child) is nn.Linear:
            setattr(module, name, QuantizedLinear.from_linear(child) if exact else
                    QuantizedLinear.empty(child.out_features, child.in_features,
                                          bias=child.bias is not None))
            done.append(path)
        else:
            _replace_linears(child, f"{path}.", done, exact, skip)


def _tied_heads(model: nn.Module) -> dict[str, str]:
    """The model's ``tied_heads`` it holds: head attribute -> the module whose (V, C) weight
    is the head's decoder (BERT: {"mlm": "word_embeddings"}); heads set to None are left
    out."""
    heads = getattr(model, "tied_heads", {}) or {}
    return {h: w for h, w in heads.items() if getattr(model, h, None) is not None}


def _convert(model: nn.Module, mode: str, *, exact: bool) -> nn.Module:
    """Swap the int8 layers in; ``exact=False``: empty ones (a saved state is loaded next)."""
    done: list[str] = []
    heads = _tied_heads(model)
    with torch.no_grad():
        _replace_linears(model, "", done, exact, frozenset(heads))
        for head, source in heads.items():
            word = getattr(model, source).weight if exact else None
            setattr(model, head, QuantizedMLMHead(getattr(model, head), word))
            done += [f"{head}.dense", f"{head}.decoder"]
    for p in model.parameters():
        p.requires_grad_(False)
    model.quantization = {"quant_method": FORMAT, "mode": mode, "modules": done}
    return model.eval()


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Quantize every linear layer and the LM head of ``model`` to int8, in place.

    Args:
        model: a qkv ``GPT``, ``Transformer`` or ``BERT`` (a class with ``quantizable =
            True``) in fp32 on the CPU (LoRA adapters merged first). Every ``nn.Linear`` —
            fused QKV / cross-attention projections, feed-forward layers, output
            projections, the LM head, BERT's pooler and MLM dense — becomes a
            ``QuantizedLinear``; BERT's MLM decoder (the word-embedding table) gets an int8
            copy (``QuantizedMLMHead``). Embeddings, norms and position tables stay fp32 (a
            tied LM head is quantized apart from the embedding it shares weights with, so
            the embeddings are untouched).
        mode: "int8" (per-output-channel weight scales, per-row dynamic activation scales;
            the math is in ``qkv.modules.quantized``).

    Returns:
        ``model`` itself, in eval mode, every parameter frozen, with
        ``model.quantization`` = ``{"quant_method": "qkv-int8", "mode": "int8",
        "modules": [names...]}`` (``save_pretrained`` writes it as quantization.json).

    Raises:
        ValueError: unknown ``mode``, an already quantized model, unmerged adapters, a model
            off the CPU. TypeError: a model other than GPT / Transformer / BERT, or not fp32.
    """
    _check_model(model, mode)
    return _convert(model, mode, exact=True)


def quantization_info(directory: str | os.PathLike) -> dict | None:
    """The checked contents of ``directory/quantization.json``, or None when there is none.
    Raises ``CheckpointError`` for a format or mode this version does not read."""
    path = Path(directory) / QUANT_NAME
    if not path.exists():
        return None
    info = read_json(path)
    if info.get("quant_method") != FORMAT or info.get("mode") not in MODES:
        raise CheckpointError(f"{path}: unknown quantization {info.get('quant_method')!r} "
                              f"mode {info.get('mode')!r}")
    return info


def prepare_quantized(model: nn.Module, info: dict, directory: str | os.PathLike) -> nn.Module:
    """The loader's quantization step: swap empty int8 layers into a freshly built ``model``
    as ``info`` (``quantization_info(directory)``) says, so that the saved int8 state loads
    into it. Raises ``CheckpointError`` when the model's class is not quantizable or the int8
    layers would sit at other places than the file lists."""
    directory = Path(directory)
    if not is_quantizable(type(model)):
        raise CheckpointError(f"{directory}: {type(model).__name__} cannot be quantized "
                              f"({QUANTIZABLE})")
    _convert(model, info["mode"], exact=False)
    listed = info.get("modules")
    have = sorted(model.quantization["modules"])
    if listed is not None and sorted(listed) != have:
        raise CheckpointError(f"{directory / QUANT_NAME}: int8 modules "
                              f"{sorted(listed)[:10]} differ from the model's {have[:10]}")
    return model


def check_quantized_state(model: nn.Module, state: dict[str, Tensor],
                          directory: str | os.PathLike) -> None:
    """Refuse (``CheckpointError``) a state whose tensors have other dtypes than the quantized
    ``model``'s (an int8 weight stored as a float would be cast, not loaded as it was
    saved)."""
    own = model.state_dict()
    bad = [f"{k}: {state[k].dtype} vs {own[k].dtype}" for k in sorted(set(state) & set(own))
           if state[k].dtype != own[k].dtype]
    if bad:
        raise CheckpointError(f"{directory} does not match the quantized model: dtypes "
                              + "; ".join(bad[:10]))
