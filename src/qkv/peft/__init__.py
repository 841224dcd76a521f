"""Parameter-efficient fine-tuning on qkv's models, added from the outside (the models do
not import this package): LoRA on the fused QKV projection and the other linears, named
adapters, mixed-adapter batches, merge/unmerge, adapter files (qkv's and HF PEFT's);
bottleneck adapters and prefix tuning. ``save_adapter`` / ``load_adapter`` /
``set_adapter`` / ``disable_adapters`` handle every kind (``qkv.peft.switch``).
``model.save_pretrained`` of a model holding adapters writes the plain model once every LoRA
adapter is merged and refuses otherwise, pointing to ``save_adapter`` (``qkv.peft.saving``).

Example::

    from qkv.peft import LoraConfig, add_lora, merge, save_adapter, trainable_summary

    add_lora(model, LoraConfig(r=8, alpha=16, targets=("q", "k", "v")))
    print(trainable_summary(model))   # trainable params: ... || all params: ... || trainable%
    ...                               # train: only the adapter's A and B have requires_grad
    save_adapter(model, "adapter/")   # adapter_config.json + adapter_model.safetensors
    merge(model)                      # inference at the base model's cost
"""

from .adapters import (
    AdaptedSublayer,
    AdapterConfig,
    add_adapters,
    load_adapters,
    remove_adapters,
    save_adapters,
)
from .config import TARGETS, LoraConfig
from .files import adapter_file_kind, adapter_shapes, load_adapter, save_adapter
from .lora import LoraLinear, adapter_rows, add_lora, merge, unload, unmerge
from .prefix import (
    PrefixAttention,
    PrefixConfig,
    PrefixKVCache,
    add_prefix,
    load_prefix,
    remove_prefix,
    save_prefix,
)
from .summary import count_parameters, trainable_summary
from .switch import active_adapter, adapter_kinds, adapter_names, disable_adapters, set_adapter

__all__ = ["TARGETS", "AdaptedSublayer", "AdapterConfig", "LoraConfig", "LoraLinear",
           "PrefixAttention", "PrefixConfig", "PrefixKVCache", "active_adapter",
           "adapter_file_kind", "adapter_kinds", "adapter_names", "adapter_rows",
           "adapter_shapes", "add_adapters", "add_lora", "add_prefix", "count_parameters",
           "disable_adapters", "load_adapter", "load_adapters", "load_prefix", "merge",
           "remove_adapters", "remove_prefix", "save_adapter", "save_adapters", "save_prefix",
           "set_adapter", "trainable_summary", "unload", "unmerge"]
