"""qkv state dicts -> HuggingFace state dicts by a loader's key map: the inverse of
``hf_state.map_hf_state``, shared by every exporter (``hf_export`` for GPT / BERT,
``hf_export_seq2seq`` for the encoder-decoders).

Shapes: C model width, H / Hkv heads, D head dim; a fused qkv tensor such as ``in_proj``
((H + 2·Hkv)·D, C) splits along dim 0 into the HF tensors its key-map value names (q (H·D, C),
k and v (Hkv·D, C)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .hf_state import KeyMap, fused_parts

__all__ = ["unmap_state"]


def _same(name: str) -> str:
    return name


def unmap_state(own: dict[str, Tensor], key_map: KeyMap, *, family: str,
                rename: Callable[[str], str] = _same) -> dict[str, Tensor]:
    """The HF tensors of a qkv state dict ``own`` (CPU, contiguous, owning their memory):
    each qkv key's tensor is split along dim 0 into the HF keys its ``key_map`` value names
    (a tuple: equal row blocks; a ``Fused``: its rows), each HF key passed through
    ``rename`` (a class prefix such as "model."). Several qkv keys on one HF key (tied tables,
    a tied head) must hold equal values and give it once, as transformers saves it.

    Args:
        own: ``model.state_dict()``.
        key_map: the loader's map (qkv key -> HF key(s)).
        family: the HF family in messages ("Marian").
        rename: HF key as the key map names it -> as the model class saves it.

    Raises:
        ValueError (one line): a qkv key the layout has no place for (adapters, added
            modules) or one it expects that ``own`` lacks; a non-float tensor; a tensor
            whose rows do not split as the key map says; tied copies that differ.
    """
    extra = sorted(set(own) - set(key_map))
    absent = sorted(set(key_map) - set(own))
    if extra or absent:
        raise ValueError(f"to_hf: the model's state dict does not fit HF {family}'s layout: "
                         f"keys with no HF place {extra[:8]}{' ...' if len(extra) > 8 else ''}"
                         f", expected keys missing {absent[:8]}"
                         f"{' ...' if len(absent) > 8 else ''} (merge or remove adapters and "
                         f"added modules first)")
    out: dict[str, Tensor] = {}
    for key, value in key_map.items():
        t = own[key].detach()
        if not t.is_floating_point():
            raise ValueError(f"to_hf: {key} is {t.dtype}; HF's {family} holds floats")
        parts = fused_parts(value, tuple(t.shape))
        rows = [shape[0] for _, shape in parts]
        if sum(rows) != t.shape[0]:
            raise ValueError(f"to_hf: {key} has {t.shape[0]} rows; the key map splits it "
                             f"into {rows}")
        for (name, _), piece in zip(parts, t.split(rows), strict=True):
            hf_name = rename(name)
            if hf_name in out:
                if not torch.equal(out[hf_name], piece.cpu()):
                    raise ValueError(f"to_hf: {key} and another tensor both map to HF "
                                     f"{hf_name} but differ")
                continue  # a tied table or head: written once, as transformers saves it
            out[hf_name] = piece.cpu().clone(memory_format=torch.contiguous_format)
    return out
