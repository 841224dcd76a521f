"""Functional attention: no nn.Module here. See ``qkv.attention``. Also the module
``qkv.ops.fast_linear`` (``F.linear`` through oneDNN on CPU fp32 where that is faster) and
its switch ``onednn_linear(False)``, which turns it off for a block. (The function
``fast_linear`` is not re-exported here: it would shadow its module's name.)"""

from .attention import BACKENDS, NoBackendError, attention, explain
from .bias import BiasProducer
from .fast_linear import onednn_linear

__all__ = ["BACKENDS", "BiasProducer", "NoBackendError", "attention", "explain",
           "onednn_linear"]
