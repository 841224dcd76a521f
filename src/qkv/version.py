"""The version of qkv (``qkv.__version__``), in a module that imports nothing, so that any
module may read it (``ModelConfig.to_dict`` writes it into config.json as ``qkv_version``)
without importing the package root."""

__version__ = "0.1.0"
