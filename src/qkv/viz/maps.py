"""Attention weights of one example, collected from any qkv model into named stacks.

Shapes: L layers, H heads, N query length, S key length; for the encoder-decoder S source
tokens and T target tokens.

``attention_maps(model, ids)`` runs the model once with ``output_attentions=True`` and
returns ``{name: (L, H, N, S)}``:

- ``Transformer`` (encoder-decoder): "encoder" (L, H, S, S), "decoder" (L, H, T, T) (causal
  self-attention), "cross" (L, H, T, S) (target queries over source keys);
- ``GPT``: "decoder" (L, H, N, N) (causal);
- ``BERT``: "encoder" (L, H, N, N).

``token_labels`` pairs each map with its (query tokens, key tokens) for the plots and the
HTML page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["MAP_NAMES", "attention_maps", "token_labels"]

#: every map name ``attention_maps`` can return, in display order
MAP_NAMES = ("encoder", "decoder", "cross")


def _shape(x: object) -> object:
    return tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__


def _one_example(name: str, ids: Tensor | Sequence[int], device: torch.device) -> Tensor:
    """(N,) or (1, N) integer ids (a tensor or a list of ints) -> (1, N) on ``device``."""
    if not isinstance(ids, Tensor):
        if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
            raise TypeError(f"attention_maps: {name} must be a tensor or a list of ints, "
                            f"got {type(ids).__name__}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"attention_maps: {name} must hold ints, got {list(ids)[:8]!r}")
        ids = torch.tensor(list(ids), dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)  # (1, N)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"attention_maps: {name} must be ONE example, (N,) or (1, N); got "
                         f"shape {_shape(ids)} (run one example at a time)")
    if ids.shape[1] == 0:
        raise ValueError(f"attention_maps: {name} is empty, shape {_shape(ids)}")
    return ids.to(device)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def attention_maps(model: nn.Module, input_ids: Tensor | Sequence[int], *,
                   target_ids: Tensor | Sequence[int] | None = None) -> dict[str, Tensor]:
    """The attention weights of every layer and head for one example.

    Runs ``model`` once with ``output_attentions=True``, in eval mode (no dropout on the
    weights) under ``torch.no_grad()``; each submodule's training flag is restored after.

    Args:
        model: a ``qkv.models.Transformer``, ``GPT`` or ``BERT``.
        input_ids: (N,) or (1, N) token ids (a tensor or a list of ints): the source of an
            encoder-decoder, the sequence of a GPT/BERT. Batch size 1 only.
        target_ids: (T,) or (1, T): the decoder input of an encoder-decoder (typically bos +
            the target so far); required for a ``Transformer``, refused for the others.

    Returns:
        ``{name: (L, H, N, S)}`` on the CPU, detached, in the model's dtype: "encoder"
        (L, H, S, S), "decoder" (L, H, T, T) and "cross" (L, H, T, S) for a ``Transformer``;
        "decoder" (L, H, N, N) for a ``GPT``; "encoder" (L, H, N, N) for a ``BERT``. Rows sum
        to 1 over the keys a query may attend (causally masked and padding keys hold 0).

    Raises:
        TypeError: an unsupported model or non-integer ids.
        ValueError: more than one example, empty ids, ``target_ids`` missing or unexpected,
        or whatever the model refuses (ids out of range, too long).
    """
    from ..models import BERT, GPT, Transformer

    if not isinstance(model, (Transformer, GPT, BERT)):
        raise TypeError(f"attention_maps: model must be a qkv Transformer, GPT or BERT, got "
                        f"{type(model).__name__}")
    device = _device(model)
    src = _one_example("input_ids", input_ids, device)  # (1, N)
    if isinstance(model, Transformer):
        if target_ids is None:
            raise ValueError("attention_maps: target_ids is required for an encoder-decoder "
                             "Transformer (the decoder input, e.g. bos + target)")
        tgt = _one_example("target_ids", target_ids, device)  # (1, T)
    elif target_ids is not None:
        raise ValueError(f"attention_maps: target_ids is only for an encoder-decoder "
                         f"Transformer, not a {type(model).__name__}")
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(model, Transformer):
                out = model(src, tgt, output_attentions=True)
                stacks = {"encoder": out.encoder_attentions,
                          "decoder": out.decoder_self_attentions,
                          "cross": out.cross_attentions}
            elif isinstance(model, GPT):
                stacks = {"decoder": model(src, output_attentions=True).attentions}
            else:
                stacks = {"encoder": model(src, output_attentions=True).attentions}
    finally:
        for m, training in flags:
            m.training = training
    return {name: torch.stack([w[0] for w in ws]).detach().cpu()  # (L, H, N, S)
            for name, ws in stacks.items() if ws}


def token_labels(maps: Mapping[str, Tensor], *, input_tokens: Sequence[str],
                 target_tokens: Sequence[str] | None = None
                 ) -> dict[str, tuple[list[str], list[str]]]:
    """(query tokens, key tokens) of each map of ``attention_maps``.

    "encoder": (input, input); "decoder": (target, target) when ``target_tokens`` is given
    (an encoder-decoder), else (input, input) (a GPT); "cross": (target, input).

    Args:
        maps: ``{name: (L, H, N, S)}`` from ``attention_maps``.
        input_tokens: display strings of ``input_ids`` (length N or S).
        target_tokens: display strings of ``target_ids`` (length T), if any.

    Raises:
        ValueError: an unknown map name, "cross" without ``target_tokens``, or token lists
        whose lengths differ from the map's N / S.
    """
    src = [str(t) for t in input_tokens]
    tgt = None if target_tokens is None else [str(t) for t in target_tokens]
    out: dict[str, tuple[list[str], list[str]]] = {}
    for name, w in maps.items():
        if name == "encoder":
            q, k = src, src
        elif name == "decoder":
            q = k = src if tgt is None else tgt
        elif name == "cross":
            if tgt is None:
                raise ValueError("token_labels: the 'cross' map needs target_tokens")
            q, k = tgt, src
        else:
            raise ValueError(f"token_labels: unknown map {name!r}; known: {list(MAP_NAMES)}")
        if not isinstance(w, Tensor) or w.dim() != 4 or tuple(w.shape[2:]) != (len(q), len(k)):
            raise ValueError(f"token_labels: map {name!r} has shape {_shape(w)}, expected "
                             f"(L, H, {len(q)}, {len(k)}) for {len(q)} query and {len(k)} "
                             f"key tokens")
        out[name] = (list(q), list(k))
    return out
