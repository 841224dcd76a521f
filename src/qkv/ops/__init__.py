"""Functional attention: no nn.Module here. See ``qkv.attention``."""

from .attention import BACKENDS, NoBackendError, attention, explain
from .bias import BiasProducer

__all__ = ["BACKENDS", "BiasProducer", "NoBackendError", "attention", "explain"]
