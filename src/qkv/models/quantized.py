"""``qkv.quantize(model, "int8")``: every linear layer and the LM head of a qkv GPT,
encoder-decoder Transformer or BERT becomes an int8 ``qkv.modules.quantized.QuantizedLinear``
(the int8 math and its error bound are in that module's docstring); and the files of a
quantized model: ``save_pretrained`` adds ``quantization.json`` beside config.json and
model.safetensors, ``from_pretrained`` of such a directory gives the quantized model back.

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

from ..modules.feedforward import ACTIVATIONS
from ..modules.quantized import QuantizedLinear
from .bert import BERT, MLMHead
from .gpt import GPT
from .hub import (
    QUANT_NAME,
    CheckpointError,
    CheckpointWeights,
    check_against_header,
    check_and_load,
    read_json,
)
from .transformer import Transformer

__all__ = ["QUANT_NAME", "QuantizedMLMHead", "is_quantized", "load_quantized_directory",
           "quantization_info", "quantize"]

MODES = ("int8",)
FORMAT = "qkv-int8"  # quant_method in quantization.json
MODELS = (GPT, Transformer, BERT)


class QuantizedMLMHead(nn.Module):
    """BERT's ``MLMHead`` with int8 dense and decoder layers: the decoder is the word
    embedding table (V, C) quantized on its own (the embeddings stay fp32) with the head's
    bias. (B, N, C) -> (B, N, V); ``word_weight`` is accepted and ignored.

    ``word_weight=None`` builds empty int8 layers shaped like ``head`` (to load a saved
    state into)."""

    def __init__(self, head: MLMHead, word_weight: Tensor | None) -> None:
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
    if not isinstance(model, MODELS):
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


def _replace_linears(module: nn.Module, prefix: str, done: list[str], exact: bool) -> None:
    for name, child in list(module.named_children()):
        path = f"{prefix}{name}"
        if type(child) is nn.Linear:
            setattr(module, name, QuantizedLinear.from_linear(child) if exact else
                    QuantizedLinear.empty(child.out_features, child.in_features,
                                          bias=child.bias is not None))
            done.append(path)
        elif isinstance(child, MLMHead):
            continue  # replaced by the caller (its decoder is the word-embedding table)
        else:
            _replace_linears(child, f"{path}.", done, exact)


def _convert(model: nn.Module, mode: str, *, exact: bool) -> nn.Module:
    """Swap the int8 layers in; ``exact=False``: empty ones (a saved state is loaded next)."""
    done: list[str] = []
    with torch.no_grad():
        _replace_linears(model, "", done, exact)
        if isinstance(model, BERT) and model.mlm is not None:
            model.mlm = QuantizedMLMHead(model.mlm,
                                         model.word_embeddings.weight if exact else None)
            done += ["mlm.dense", "mlm.decoder"]
    for p in model.parameters():
        p.requires_grad_(False)
    model.quantization = {"quant_method": FORMAT, "mode": mode, "modules": done}
    return model.eval()


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


def load_quantized_directory(model_class: type, directory: str | os.PathLike, config: Any,
                             info: dict, *, weights: CheckpointWeights | None = None,
                             **kwargs: Any) -> nn.Module:
    """Build ``model_class(config, **kwargs)``, swap in empty int8 layers as ``info``
    (quantization.json) says, and load ``directory``'s state (``weights``: its
    ``CheckpointWeights``, read here when not given); the model in eval mode. Everything is
    first checked on a meta-device probe against the files' headers
    (``hub.check_against_header``): nothing is allocated for a state that does not fit.

    Raises ``CheckpointError`` when the state does not match: names, shapes, an int8 weight
    stored in another dtype, or int8 layers at other places than the file lists."""
    directory = Path(directory)
    if model_class not in MODELS:
        raise CheckpointError(f"{directory}: {model_class.__name__} cannot be quantized "
                              f"(GPT, Transformer or BERT)")
    if weights is None:
        weights = CheckpointWeights(directory)

    def build(state: dict[str, Tensor], **kw: Any) -> nn.Module:
        model = model_class(config, **kw)
        _convert(model, info["mode"], exact=False)
        listed = info.get("modules")
        if listed is not None and sorted(listed) != sorted(model.quantization["modules"]):
            have = sorted(model.quantization["modules"])
            raise CheckpointError(f"{directory / QUANT_NAME}: int8 modules "
                                  f"{sorted(listed)[:10]} differ from the model's {have[:10]}")
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
        return model

    check_against_header(build, weights, config.to_dict(), **kwargs)
    return build(weights.load(), **kwargs).eval()
