"""Fine-tuning from a trained base: ``TrainConfig(init_from=BASE, peft={...})``.

``init_from`` is a qkv run or checkpoint directory, or a HuggingFace directory that
``qkv.models.from_pretrained`` loads into a model some trainer kind owns (GPT-2, BERT, the
Llama-style llama, mistral, qwen2, qwen3, gemma, gemma2, phi3 into ``GPT``, and the
encoder-decoders t5, bart, marian into ``Transformer``). The base
fixes the architecture, the tokenizer and the context length (``max_len``); the run's data
must be encodable by the base's tokenizer and fit that length — both checked before
anything is written.

``peft`` is one of ``{"kind": "lora", **LoraConfig fields}``, ``{"kind": "adapters",
**AdapterConfig fields}`` or ``{"kind": "prefix", **PrefixConfig fields}`` (``qkv.peft``):
only the new parameters train, and the run's checkpoints hold only them
(``adapter_config.json`` + ``adapter_model.safetensors``) with ``base.json``, which names the
base and what defines it: ``{"path": its checkpoint directory (absolute), "sha256": of its
model.safetensors, "config_sha256": of its config.json as canonical JSON}`` (keys sorted, no
spaces, UTF-8: ``config_sha256``; so re-indenting config.json changes nothing, while any
changed value — ``activation`` gelu_tanh -> relu — is a changed model).
Loading such a run (``load_run``, resume, ``qkv translate|generate|attention``) refuses a
base that is missing, whose weights changed or whose config changed since, naming the base's
path and which of the two changed. A run made before qkv recorded the config (base.json
without ``config_sha256``) still loads: what it recorded, the weights, is checked.
The adapter's memory is checked before it is built (``qkv.train.memory.check_adapter_fits``),
so ``r=10000000`` is one line with the estimate, not an allocator error. A base quantized to
int8 (``qkv.quantize``: quantization.json beside its config) is refused: int8 layers have no
gradient.
``init_from`` without ``peft`` is full fine-tuning: the checkpoints are whole models.
``peft`` without ``init_from`` is refused: adapters on a randomly initialised, frozen model
have nothing to adapt, and the run could not name a base to reload.

An HF directory's ``tokenizer.json`` is read by ``qkv.train.hf_tokenizer.base_tokenizer``:
one that ``qkv.data.read_tokenizer`` reads, a HF ``tokenizers`` file whose ids 0..3 are qkv's
``<pad> <bos> <eos> <unk>`` (a ``qkv.data.BPETokenizer``), or else the directory's own
tokenizer with its special ids and chat template (``HFTokenizer``: its eos named by
tokenizer_config.json, generation_config.json or config.json; refused without one). A run
from such a base saves that tokenizer in the HuggingFace layout (tokenizer.json,
tokenizer_config.json, generation_config.json) and reads it back with
``read_run_tokenizer``. An HF encoder-decoder's tokenizer (tokenizer.json, spiece.model, or
Marian's source.spm + target.spm + vocab.json) is its ``qkv.data.seq2seq_tokenizer.
Seq2SeqTokenizer``, kept in the run's checkpoints with its own files
(``qkv.train.hf_seq2seq``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..files import ADAPTER_MARK, QUANT_NAME, CheckpointError, read_json
from ..models import from_pretrained
from .data import file_fingerprint
from .hf_tokenizer import base_tokenizer, read_run_tokenizer
from .kinds import KINDS, kind_of_model, kind_of_model_type
from .memory import check_adapter_fits
from .rundir import find_checkpoint

__all__ = ["BASE_JSON", "PEFT_KINDS", "BaseModel", "attach_peft", "base_model_kind",
           "check_base", "config_sha256", "is_adapter_checkpoint", "load_adapter_run",
           "load_base", "peft_config", "read_adapter_run"]

BASE_JSON = "base.json"
ADAPTER_CONFIG = ADAPTER_MARK
#: ``peft["kind"]`` -> the ``qkv.peft`` config class name
PEFT_KINDS = ("lora", "adapters", "prefix")


def peft_config(spec: Any) -> tuple[str, Any]:
    """``(kind, config)`` of a ``TrainConfig.peft`` dict: a ``qkv.peft.LoraConfig``,
    ``AdapterConfig`` or ``PrefixConfig``.

    Raises:
        ValueError: not a dict, an unknown kind, unknown fields or bad values (one message
            naming them).
    """
    from ..peft import AdapterConfig, LoraConfig, PrefixConfig

    classes = {"lora": LoraConfig, "adapters": AdapterConfig, "prefix": PrefixConfig}
    if not isinstance(spec, dict) or spec.get("kind") not in classes:
        got = spec.get("kind") if isinstance(spec, dict) else spec
        raise ValueError(f'peft must be a dict with "kind" one of {PEFT_KINDS} and that '
                         f"kind's fields, got kind {got!r}")
    kind = spec["kind"]
    cls = classes[kind]
    fields = {k: v for k, v in spec.items() if k != "kind"}
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"peft kind {kind!r}: unknown fields {unknown}; known: {known}")
    if kind == "lora" and isinstance(fields.get("targets"), list):
        fields["targets"] = tuple(fields["targets"])
    try:
        return kind, cls(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"peft kind {kind!r}: {exc}") from None


def normalise_peft(spec: dict[str, Any]) -> dict[str, Any]:
    """The peft dict with every field of its config spelled out (JSON-ready)."""
    kind, config = peft_config(spec)
    return {"kind": kind, **config.to_dict()}


#: how a run's banner and errors name each ``peft`` kind, and the flag that sizes it
PEFT_LABELS = {"lora": ("LoRA adapter", "--lora r=..."),
               "adapters": ("bottleneck adapters", "--adapters reduction_factor=..."),
               "prefix": ("prefix", "--prefix N")}


def attach_peft(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """Add the adapter ``spec`` describes to ``model`` (named "default"); everything else
    is frozen. Returns ``model``.

    Raises:
        ValueError: as ``peft_config``; the adapter does not fit this model; or its
            parameters (counted from the config, before anything is built) cannot fit in
            the memory this machine has (``qkv.train.memory.check_adapter_fits``)."""
    from ..peft import adapter_shapes, add_adapters, add_lora, add_prefix

    kind, config = peft_config(spec)
    shapes = adapter_shapes(model, config)
    label, flag = PEFT_LABELS[kind]
    fields = ", ".join(f"{k}={v}" for k, v in config.to_dict().items()
                       if k in ("r", "targets", "reduction_factor", "placement", "num_tokens"))
    check_adapter_fits(sum(math.prod(s) for s in shapes.values()),
                       what=f"the {label} ({fields})", lower=flag)
    add = {"lora": add_lora, "adapters": add_adapters, "prefix": add_prefix}[kind]
    return add(model, config)


def model_kind(model: nn.Module) -> str:
    """The ``TrainConfig.model`` kind of a qkv model (``qkv.train.kinds.kind_of_model``)."""
    return kind_of_model(model).name


def is_adapter_checkpoint(ckpt: str | os.PathLike) -> bool:
    """Whether a checkpoint directory holds an adapter (and base.json), not a whole model."""
    ckpt = Path(ckpt)
    return (ckpt / ADAPTER_CONFIG).is_file() and not (ckpt / "config.json").is_file()


def _base_dir(init_from: str | os.PathLike) -> Path:
    """The directory holding the base's config.json + model.safetensors (absolute)."""
    path = Path(init_from)
    if not path.exists():
        raise CheckpointError(f"--init-from {path}: no such directory")
    if (path / "config.json").is_file():
        ckpt = path
    else:
        try:
            ckpt = find_checkpoint(path)
        except CheckpointError as exc:
            raise CheckpointError(f"--init-from {path}: not a qkv run or checkpoint, nor a "
                                  f"HuggingFace directory ({exc})") from None
    if (ckpt / QUANT_NAME).is_file():
        raise CheckpointError(f"--init-from {path}: the base is quantized to int8 "
                              f"({ckpt / QUANT_NAME}, made by qkv.quantize); int8 layers have "
                              f"no gradient, so it cannot be fine-tuned or given adapters: "
                              f"start from the float model it was quantized from")
    if is_adapter_checkpoint(ckpt):
        raise CheckpointError(f"--init-from {path} is itself an adapter run (its checkpoint "
                              f"holds only an adapter); merge it first with `qkv peft merge "
                              f"{path} --out DIR` and start from DIR")
    if (ckpt / "sharded.json").is_file():
        raise CheckpointError(f"--init-from {path} is a `qkv train --fsdp` run (a sharded "
                              f"checkpoint): `qkv export {path} --out DIR` gathers it into "
                              f"one model directory; start from DIR")
    if not (ckpt / "model.safetensors").is_file():
        raise CheckpointError(f"--init-from {path}: {ckpt} has no model.safetensors (a "
                              f"pytorch_model.bin alone is refused: convert it to "
                              f"safetensors)")
    return ckpt.resolve()


def config_sha256(ckpt: str | os.PathLike) -> str:
    """sha256 (hex) of ``ckpt/config.json`` as canonical JSON: keys sorted, separators
    ``,`` and ``:`` without spaces, UTF-8 — the same for any formatting of the same values.

    Raises:
        CheckpointError: no readable config.json."""
    data = read_json(Path(ckpt) / "config.json")
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclasses.dataclass
class BaseModel:
    """A loaded base: ``model`` (train mode off), ``tokenizer``, ``path`` (the absolute
    checkpoint directory), ``sha256`` of its model.safetensors and ``config_sha256`` of its
    config.json (``config_sha256``)."""

    model: nn.Module
    tokenizer: Any
    path: Path
    sha256: str
    config_sha256: str

    @property
    def max_len(self) -> int | None:
        """The model's context length (None when its config has none)."""
        value = getattr(self.model.config, "max_len", None)
        return None if value is None else int(value)

    def info(self) -> dict[str, str]:
        """base.json's content."""
        return {"path": str(self.path), "sha256": self.sha256,
                "config_sha256": self.config_sha256}


def base_model_kind(init_from: str | os.PathLike) -> str:
    """The ``TrainConfig.model`` kind of a base directory, read from its config.json
    (``CheckpointError`` when it is not a base ``load_base`` takes)."""
    data = read_json(_base_dir(init_from) / "config.json")
    kind = kind_of_model_type(data.get("model_type"))
    if kind is None:
        known = sorted(t for k in KINDS.values() for t in k.model_types)
        raise CheckpointError(f"--init-from {init_from}: model_type {data.get('model_type')!r} "
                              f"is not a model qkv trains (known: {', '.join(known)})")
    return kind.name


def load_base(init_from: str | os.PathLike, want: str) -> BaseModel:
    """Load the base of a fine-tuning run and check that it is a ``want`` model
    ("transformer", "gpt", "bert-mlm"), and one that kind can train (``check_base``); its
    tokenizer by ``qkv.train.hf_tokenizer.base_tokenizer``, checked against the model by the
    kind (``check_base_tokenizer``: an HF encoder-decoder's embeddings, pad and eos ids).

    Raises:
        CheckpointError / ValueError: no base there, an adapter run, no model.safetensors or
            tokenizer, another model kind (naming ``--model`` and the base's kind), a BERT
            without its masked-LM head.
    """
    ckpt = _base_dir(init_from)
    config_sha = config_sha256(ckpt)
    sha = file_fingerprint(ckpt / "model.safetensors")["sha256"]
    model = from_pretrained(ckpt)  # a qkv checkpoint, or a HF GPT-2 / BERT directory
    kind = kind_of_model(model)
    if kind.name != want:
        raise ValueError(f"--model {want} does not match the base {init_from}, a "
                         f"{type(model).__name__} (--model {kind.name})")
    kind.check_base(model, init_from)
    tokenizer = base_tokenizer(ckpt)
    kind.check_base_tokenizer(model, tokenizer, init_from)
    return BaseModel(model, tokenizer, ckpt, sha, config_sha)


def check_base(ckpt: str | os.PathLike) -> dict[str, str]:
    """base.json of an adapter checkpoint, after checking that the base is still there and
    unchanged: the sha256 of its model.safetensors and, where base.json records it
    (``config_sha256``; runs made before it was recorded have only the weights' sha256,
    which is then what is checked), of its config.json. Returns base.json's content.

    Raises:
        CheckpointError: naming the base's path — base.json unreadable, the base missing,
            or its weights or its config changed since the run began.
    """
    ckpt = Path(ckpt)
    info = read_json(ckpt / BASE_JSON)
    path, sha = info.get("path"), info.get("sha256")
    config_sha = info.get("config_sha256")
    if (not isinstance(path, str) or not isinstance(sha, str)
            or not isinstance(config_sha, (str, type(None)))):
        raise CheckpointError(f"{ckpt / BASE_JSON}: expected {{\"path\", \"sha256\", "
                              f"\"config_sha256\"}} strings, got {info}")
    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{ckpt}: the adapter's base {path} is missing (no "
                              f"model.safetensors there); put the base back at that path")
    now = file_fingerprint(weights)["sha256"]
    if now != sha:
        raise CheckpointError(f"{ckpt}: the adapter's base {path} changed since the run began "
                              f"(sha256 {sha[:12]}... -> {now[:12]}...): the adapter was "
                              f"trained on other weights; restore the base or start a new run")
    if config_sha is not None:
        if not (Path(path) / "config.json").is_file():
            raise CheckpointError(f"{ckpt}: the adapter's base {path} is missing its "
                                  f"config.json; put the base back at that path")
        now = config_sha256(path)
        if now != config_sha:
            raise CheckpointError(f"{ckpt}: the adapter's base {path} changed since the run "
                                  f"began: its config.json holds other values (sha256 of its "
                                  f"canonical JSON {config_sha[:12]}... -> {now[:12]}...), so "
                                  f"it is another model than the adapter was trained on; "
                                  f"restore the base's config.json or start a new run")
    return info


def read_adapter_run(ckpt: str | os.PathLike, *, device: Any = None,
                     dtype: Any = None) -> nn.Module:
    """The model of an adapter checkpoint: the base (checked by ``check_base``) with the
    adapter attached and active, in eval mode (the adapter's parameters keep requires_grad,
    the base's are frozen). ``qkv.models.from_pretrained``'s reader of a directory holding
    adapter_config.json (registered by ``qkv.train``; it places the model on ``device`` /
    ``dtype`` afterwards, so they are not used here)."""
    from ..peft import load_adapter

    ckpt = Path(ckpt)
    info = check_base(ckpt)
    model = from_pretrained(Path(info["path"]))
    load_adapter(model, ckpt)
    return model.eval()


def load_adapter_run(ckpt: str | os.PathLike) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of an adapter checkpoint: ``read_adapter_run``'s model and the
    run's tokenizer (``read_run_tokenizer``)."""
    ckpt = Path(ckpt)
    model = read_adapter_run(ckpt)
    return model, read_run_tokenizer(ckpt)
