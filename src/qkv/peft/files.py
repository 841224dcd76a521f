"""Adapter files, every kind through one entry point: ``save_adapter`` / ``load_adapter``
write and read LoRA adapters (qkv's own files and HF PEFT's LoRA files), bottleneck adapters
(``qkv.peft.adapters``) and prefixes (``qkv.peft.prefix``).

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with only the
adapter's tensors (kilobytes to a few megabytes, never the base weights). The JSON's
``"kind"`` says which: "lora", "bottleneck" or "prefix" (HF PEFT's files have
``"peft_type"`` instead); each is ``{"kind", "name", "config", "base": {"class", "config"}}``.

qkv's files: the JSON is ``{"kind": "lora", "name", "config": LoraConfig.to_dict(), "base":
{"class", "config"}}``; the tensors are keyed by the projection's module path and the
parameter, e.g. ``layers.0.attn.in_proj.A_q`` (r, In) and ``layers.0.attn.in_proj.B_q``
(Rows, r).

HF PEFT's LoRA files (``peft_type`` "LORA", saved by ``save_pretrained``) for the GPT-2,
BERT, Llama-style, T5 / Flan-T5, BART and Marian checkpoints ``qkv.models.from_pretrained``
loads map onto qkv's projections (the tables: ``qkv.peft.peft_names``):

- GPT-2 ``h.i.attn.c_attn`` (Conv1D) -> ``layers.i.attn.in_proj``, role ``"qkv"``;
- GPT-2 ``h.i.attn.c_proj`` -> ``layers.i.attn.out_proj``, ``"out"``;
- GPT-2 ``h.i.mlp.c_fc`` / ``h.i.mlp.c_proj`` -> ``layers.i.ffn.fc_in`` / ``fc_out``,
  ``"ffn_in"`` / ``"ffn_out"``;
- BERT ``encoder.layer.i.attention.self.query`` / ``key`` / ``value`` ->
  ``layers.i.attn.in_proj``, roles ``"q"`` / ``"k"`` / ``"v"`` (their rows of the fused
  projection);
- BERT ``attention.output.dense`` -> ``out_proj`` (``"out"``), ``intermediate.dense`` ->
  ``ffn.fc_in`` (``"ffn_in"``), ``output.dense`` -> ``ffn.fc_out`` (``"ffn_out"``);
- Llama, Mistral, Qwen2/3, Gemma 1/2 ``model.layers.i.self_attn.q_proj`` / ``k_proj`` /
  ``v_proj`` -> ``layers.i.attn.in_proj``, roles ``"q"`` / ``"k"`` / ``"v"``; ``o_proj`` ->
  ``out_proj`` (``"out"``); ``mlp.gate_proj`` / ``up_proj`` -> ``ffn.fc_in``, roles
  ``"gate"`` / ``"up"`` (rows [0, F) / [F, 2F) of the fused gated FFN); ``mlp.down_proj`` ->
  ``ffn.fc_out`` (``"ffn_out"``, alias ``"down"``);
- Phi-3 ``self_attn.qkv_proj`` -> ``in_proj``, ``"qkv"``; ``mlp.gate_up_proj`` -> ``fc_in``,
  ``"ffn_in"`` (one update over the fused rows, as PEFT computes it); ``o_proj`` and
  ``down_proj`` as above;
- T5 ``SelfAttention`` / ``EncDecAttention`` ``q`` / ``k`` / ``v`` / ``o`` -> the ``attn`` /
  ``self_attn`` / ``cross_attn`` ``in_proj`` rows and ``out_proj`` of ``encoder_layers.i`` /
  ``decoder_layers.i``; ``DenseReluDense.wi`` -> ``ffn.fc_in`` (``"ffn_in"``), ``wi_0`` /
  ``wi_1`` (gated, Flan-T5) -> its ``"gate"`` / ``"up"`` rows; ``wo`` -> ``ffn.fc_out``;
- BART / Marian ``self_attn`` / ``encoder_attn`` ``q_proj`` / ``k_proj`` / ``v_proj`` /
  ``out_proj`` -> the same sites, ``fc1`` / ``fc2`` -> ``ffn.fc_in`` / ``ffn.fc_out``.

PEFT's A (r, In) and B (Out, r) are the same for a Conv1D (``fan_in_fan_out`` only changes
how PEFT merges), so they are copied as they are; scale lora_alpha / r (/ √r with
``use_rslora``), dropout ``lora_dropout``. The file's modules must be the ones
``target_modules`` names (PEFT's matching: a string is a regular expression over the whole
module name, a list names module-name suffixes), and each listed module this architecture
has must be in the file. Refused with one ``CheckpointError`` before anything is attached:
other PEFT types, DoRA, LoRA biases, rank/alpha patterns, ``modules_to_save``, a subset of
the layers, the variants that compute something else (aLoRA, QALoRA, MonteCLoRA, BD-LoRA,
KaSA, Arrow routing, layer replication, trainable tokens), any other module (the pooler,
embeddings, the LM head), another architecture, other shapes. qkv writes its own format
only (``save_adapter``); it does not write PEFT's files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..files import CheckpointError, atomic_write, read_json
from . import adapters, lora, prefix
from .checks import check_finite, check_header, read_header
from .config import LoraConfig
from .kind_files import CONFIG_NAME, WEIGHTS_NAME
from .lora import attach, lora_sites, lora_states, plain_path, plan_updates
from .peft_names import families_for

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "adapter_file_kind", "adapter_shapes", "load_adapter",
           "save_adapter"]

KIND = "lora"

_PEFT_PREFIX = "base_model.model."
#: PEFT options that change what is computed (or the model's structure): refused when set
_PEFT_REFUSED = ("use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save",
                 "layers_to_transform", "target_parameters", "alora_invocation_tokens",
                 "use_qalora", "monteclora_config", "use_bdlora", "kasa_config",
                 "arrow_config", "layer_replication", "trainable_token_indices")
_LORA_SUFFIX = re.compile(r"\.lora_[AB]\.weight")


def save_adapter(model: nn.Module, path: str | os.PathLike, *, name: str | None = None
                 ) -> Path:
    """Write adapter ``name`` (default: the active one) of ``model`` into directory ``path``
    (created if needed): ``adapter_config.json`` + ``adapter_model.safetensors`` holding
    only the adapter's tensors — LoRA's A and B, a bottleneck adapter's down/up projections,
    or a prefix's keys/values. Writes are atomic. Returns the directory.

    Raises:
        ValueError: the model has no adapter, none named ``name``, or ``name`` is held by
            several kinds (a LoRA and a bottleneck adapter of the same name).
    """
    from .adapters import save_adapters
    from .prefix import save_prefix
    from .switch import active_adapter, adapter_kinds

    kinds = adapter_kinds(model)
    name = active_adapter(model) if name is None else name
    if name not in kinds:
        raise ValueError(f"save_adapter: no adapter named {name!r}; the model has "
                         f"{list(kinds)}")
    if len(kinds[name]) > 1:
        raise ValueError(f"save_adapter: {name!r} names adapters of several kinds "
                         f"{kinds[name]}; save them from models holding one each")
    kind = kinds[name][0]
    if kind == "bottleneck":
        return save_adapters(model, path, name=name)
    if kind == "prefix":
        return save_prefix(model, path, name=name)
    return _save_lora(model, path, name)


def _save_lora(model: nn.Module, path: str | os.PathLike, name: str) -> Path:
    tensors, config = {}, None
    for site, state in lora_states(model):
        if name in state:
            update = state[name]
            config = update.config
            for pname, p in update.named_parameters():
                tensors[f"{plain_path(site.path)}.{pname}"] = p.detach().cpu().contiguous()
    base_config = getattr(model, "config", None)
    base = {"class": type(model).__name__,
            "config": base_config.to_dict() if hasattr(base_config, "to_dict") else None}
    meta = {"kind": KIND, "name": name, "config": config.to_dict(), "base": base}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / WEIGHTS_NAME,
                 lambda tmp: save_file(tensors, tmp, metadata={"kind": KIND}))
    text = json.dumps(meta, indent=2, sort_keys=True, default=str)
    atomic_write(path / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    return path


def adapter_shapes(model: nn.Module, config: Any, *, name: str = "default"
                   ) -> dict[str, tuple[int, ...]]:
    """The tensors the adapter ``config`` (a ``LoraConfig``, ``AdapterConfig`` or
    ``PrefixConfig``) would add to ``model`` as ``name``: name (as ``save_adapter`` writes
    it) -> shape, with nothing allocated (``qkv.peft.lora.planned_shapes`` and its twins in
    ``adapters`` and ``prefix``). ``sum(math.prod(s) for s in shapes.values())`` is the
    number of parameters it adds.

    Raises:
        TypeError for another config type; otherwise as the kind's add function.
    """
    if isinstance(config, LoraConfig):
        return lora.planned_shapes(model, config, name=name)
    if isinstance(config, adapters.AdapterConfig):
        return adapters.planned_shapes(model, config, name=name)
    if isinstance(config, prefix.PrefixConfig):
        return prefix.planned_shapes(model, config, name=name)
    raise TypeError(f"adapter_shapes: config must be a LoraConfig, AdapterConfig or "
                    f"PrefixConfig, got {type(config).__name__}")


def adapter_file_kind(path: str | os.PathLike) -> str:
    """The kind of the adapter saved in directory ``path``: "lora" (qkv's or HF PEFT's),
    "bottleneck" or "prefix".

    Raises:
        CheckpointError: no readable adapter_config.json, or an unknown kind.
    """
    meta = read_json(Path(path) / CONFIG_NAME)
    if "peft_type" in meta:
        return "lora"
    kind = meta.get("kind")
    if kind not in ("lora", "bottleneck", "prefix"):
        raise CheckpointError(f"{Path(path) / CONFIG_NAME}: not a qkv adapter (kind {kind!r}; "
                              f"expected 'lora', 'bottleneck' or 'prefix', or HF PEFT's "
                              f"peft_type)")
    return kind


def load_adapter(model: nn.Module, path: str | os.PathLike, *, name: str | None = None
                 ) -> str:
    """Add the adapter saved in directory ``path`` to ``model`` and make it the active (and
    only trainable) one: a LoRA adapter (qkv's ``save_adapter`` files, or HF PEFT's LoRA
    files for a GPT-2 / BERT / Llama-style (Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3) /
    T5 / BART / Marian checkpoint loaded by ``qkv.models.from_pretrained``; see the module
    docstring), a bottleneck adapter or a prefix (``save_adapter``'s files). Adapters of the
    other kinds step aside (``qkv.peft.set_adapter``).

    Everything is checked before anything is attached: on any error the model is unchanged.
    The weights file's tensor names, shapes and dtypes are read from its safetensors header
    and checked against what ``adapter_config.json`` implies for ``model``
    (``adapter_shapes``) before anything is allocated; then its values must be finite.

    Args:
        model: the base model (a ``GPT`` / ``BERT`` / any qkv model for qkv's files).
        path: the adapter directory.
        name: the adapter's name in ``model`` (default: the saved name; "default" for PEFT).

    Returns:
        The adapter's name.

    Raises:
        CheckpointError (a ValueError) naming the file and the mismatch: missing files, an
        unknown format, another architecture, unknown or missing tensors, other shapes
        (naming the config's sizing fields and both shapes), non-float dtypes, NaN/inf
        values, a config a kind refuses (e.g. a LoRA scale beyond ``MAX_SCALE``).
    """
    from .adapters import load_adapters
    from .prefix import load_prefix
    from .switch import set_adapter

    kind = adapter_file_kind(path)
    if kind == "bottleneck":
        name = load_adapters(model, path, name=name)
    elif kind == "prefix":
        name = load_prefix(model, path, name=name)
    else:
        name = _load_lora(model, Path(path), name)
    set_adapter(model, name)
    return name


def _load_lora(model: nn.Module, path: Path, name: str | None) -> str:
    meta = read_json(path / CONFIG_NAME)
    weights = path / WEIGHTS_NAME
    header = read_header(weights)  # names, shapes, dtypes: nothing is allocated yet
    if "peft_type" in meta:
        config, roles_by_site, keys = _from_peft(model, meta, header, path)
        name = "default" if name is None else name
    elif meta.get("kind") == KIND:
        config, roles_by_site = _from_qkv(model, meta, path)
        keys = {k: k for k in header}
        name = meta.get("name", "default") if name is None else name
    else:
        raise CheckpointError(f"{path / CONFIG_NAME}: not a LoRA adapter (kind "
                              f"{meta.get('kind')!r}, peft_type {meta.get('peft_type')!r})")
    try:
        want = lora.planned_shapes(model, config, name=name, roles_by_site=roles_by_site)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    check_header(weights, {k: header[f] for k, f in keys.items()}, want, model=model,
                 fields=f"r={config.r}, targets {config.targets}")
    stored = _read_tensors(weights)
    tensors = {k: stored[f] for k, f in keys.items()}
    check_finite(weights, tensors)
    try:
        plan = plan_updates(model, config, name, roles_by_site)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    params = {f"{plain_path(site.path)}.{pname}": p
              for site, update in plan for pname, p in update.named_parameters()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[k])
    attach(model, plan, name)
    return name


def _few(items: list[str], n: int = 4) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return f"{items[:n]}{more}" if items else "none"


def _read_tensors(file: Path) -> dict[str, Tensor]:
    if not file.is_file():
        raise CheckpointError(f"{file}: no such adapter weights file")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: cannot read safetensors: {err}") from err


def _from_qkv(model: nn.Module, meta: dict, path: Path) -> tuple[LoraConfig, None]:
    base = meta.get("base") or {}
    if base.get("class") not in (None, type(model).__name__):
        raise CheckpointError(f"{path}: the adapter was made for a {base['class']}, this model "
                              f"is a {type(model).__name__}")
    try:
        return LoraConfig.from_dict(meta.get("config") or {}), None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path / CONFIG_NAME}: {err}") from err


def _from_peft(model: nn.Module, meta: dict, tensors: dict[str, Any], path: Path
               ) -> tuple[LoraConfig, dict[str, tuple[str, ...]], dict[str, str]]:
    """PEFT's config and tensor names (``tensors``: the file's header) -> (LoraConfig, roles
    per projection path, qkv tensor name -> the file's name)."""
    where = path / CONFIG_NAME
    if meta.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type {meta.get('peft_type')!r}; only LORA "
                              f"adapters load into qkv.peft")
    refused = {k: meta[k] for k in _PEFT_REFUSED if meta.get(k)}
    if meta.get("bias", "none") != "none":
        refused["bias"] = meta["bias"]
    if refused:
        raise CheckpointError(f"{where}: PEFT options qkv.peft does not load: {refused}")
    try:
        config_kw = {"r": meta["r"], "alpha": meta["lora_alpha"],
                     "dropout": meta.get("lora_dropout", 0.0) or 0.0,
                     "rslora": bool(meta.get("use_rslora", False))}
    except KeyError as err:
        raise CheckpointError(f"{where}: missing PEFT field {err}") from err
    shorts = {key: key.removeprefix(_PEFT_PREFIX) for key in tensors}
    families = families_for(model)
    if families is None:
        raise CheckpointError(f"{path}: HF PEFT adapters load into qkv GPT (GPT-2, "
                              f"Llama-style), BERT and Transformer (T5, BART, Marian) models, "
                              f"not {type(model).__name__}")
    # the file's keys decide between a model's families (GPT-2 or Llama-style names, ...)
    hits = [sum(f.match(k) is not None for k in shorts.values()) for f in families]
    names = families[hits.index(max(hits))]
    family = names.family if max(hits) else " or ".join(f.family for f in families)
    out: dict[str, str] = {}
    roles_by_site: dict[str, list[str]] = {}
    unknown = []
    for key, short in shorts.items():
        hit = names.match(short)
        if hit is None:
            unknown.append(key)
            continue
        site, role, ab = hit
        out[f"{site}.{ab}_{role}"] = key
        roles = roles_by_site.setdefault(site, [])
        if role not in roles:
            roles.append(role)
    if unknown:
        raise CheckpointError(f"{path / WEIGHTS_NAME}: tensors that do not map onto a "
                              f"{family} {type(model).__name__} in qkv (another base, or a "
                              f"module qkv.peft does not adapt): {_few(sorted(unknown))}")
    if not out:
        raise CheckpointError(f"{path / WEIGHTS_NAME}: no LoRA tensors")
    _check_target_modules(meta, {_LORA_SUFFIX.sub("", s) for s in shorts.values()},
                          names.kinds, path)
    targets = tuple(dict.fromkeys(r for roles in roles_by_site.values() for r in roles))
    try:
        config = LoraConfig(targets=targets, **config_kw)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from err
    for role in config.targets:  # every layer, as a qkv config targets them
        want = {plain_path(s.path) for s in lora_sites(model) if role in s.roles}
        have = {s for s, roles in roles_by_site.items() if role in roles}
        if want and have != want:  # a role no projection has: planned_shapes says why
            raise CheckpointError(f"{path / WEIGHTS_NAME}: LoRA on role {role!r} covers "
                                  f"{_few(sorted(have))}, this {type(model).__name__} has "
                                  f"{_few(sorted(want))}; qkv adapters cover every layer")
    return config, {s: tuple(r) for s, r in roles_by_site.items()}, out


def _peft_targets(target_modules: Any, module: str) -> bool:
    """Whether PEFT's ``target_modules`` names ``module`` (a module path of the HF model), as
    PEFT matches them: a string is a regular expression over the whole path ("all-linear":
    every linear but the head), a list names paths or their dotted suffixes."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in target_modules)


def _check_target_modules(meta: dict, modules: set[str], kinds: tuple[str, ...], path: Path
                          ) -> None:
    """The file's modules (``modules``: HF module paths) against ``target_modules``: each
    must be one PEFT would have adapted, and each module kind of the architecture
    (``kinds``: module names after the layer index) that a list names must have tensors in
    the file (unless ``exclude_modules`` may have removed it)."""
    where = path / CONFIG_NAME
    targets = meta.get("target_modules")
    if targets is None:
        return
    if not isinstance(targets, (str, list)) or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(f"{where}: target_modules must be a string or a list of module "
                              f"names, got {targets!r}")
    try:
        outside = sorted(m for m in modules if not _peft_targets(targets, m))
    except re.error as err:
        raise CheckpointError(f"{where}: target_modules {targets!r} is not a regular "
                              f"expression: {err}") from err
    if outside:
        raise CheckpointError(f"{path / WEIGHTS_NAME}: LoRA tensors of modules that "
                              f"target_modules {targets!r} does not name: {_few(outside)}; "
                              f"the weights and adapter_config.json do not belong together")
    if isinstance(targets, str) or meta.get("exclude_modules"):
        return
    absent = [t for t in targets
              if any(f".{kind}".endswith(f".{t}") for kind in kinds)
              and not any(m == t or m.endswith(f".{t}") for m in modules)]
    if absent:
        raise CheckpointError(f"{path / WEIGHTS_NAME}: target_modules names {absent} but the "
                              f"file holds no LoRA tensors for them; the weights and "
                              f"adapter_config.json do not belong together")

