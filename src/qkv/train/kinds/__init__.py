"""Model kinds of ``qkv train``: one object per kind, one file per kind, behind the
``ModelKind`` protocol (``base.py``) that the trainer calls.

Registered, in this order (``MODEL_KINDS``): "transformer" (``transformer.py``), "gpt"
(``gpt.py``), "bert-mlm" (``bert_mlm.py``) — the token kinds, sharing ``TokenKind``
(``text.py``) — and "clip" (``clip.py``: images and captions, a contrastive loss).

``get_kind(name)`` gives a kind; ``kind_of_model_type`` the kind owning a config.json
``model_type``; ``kind_of_model`` the kind of a model instance; ``model_classes()`` each
kind's own ``model_type`` -> class, as ``qkv.models.registry`` (the one table of model
types, which loading asks) has it. A kind owns its helpers: the token kinds' data,
loss and evaluation are ``TokenKind``'s methods, called on the kind object.
"""

from __future__ import annotations

from .base import (
    KINDS,
    ModelKind,
    get_kind,
    kind_of_model,
    kind_of_model_type,
    model_classes,
    register,
)
from .bert_mlm import BertMLMKind
from .clip import CLIPKind
from .gpt import GPTKind
from .text import TokenKind
from .transformer import TransformerKind

for _kind in (TransformerKind(), GPTKind(), BertMLMKind(), CLIPKind()):
    register(_kind)

#: the registered kinds' names, in registration order (``TrainConfig.model``)
MODEL_KINDS: tuple[str, ...] = tuple(KINDS)

__all__ = ["KINDS", "MODEL_KINDS", "BertMLMKind", "CLIPKind", "GPTKind", "ModelKind",
           "TokenKind", "TransformerKind", "get_kind", "kind_of_model", "kind_of_model_type",
           "model_classes", "register"]
