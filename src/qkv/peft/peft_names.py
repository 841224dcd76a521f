"""HF PEFT's LoRA tensor names -> qkv's LoRA sites, one ``PeftNames`` per architecture family:
GPT-2, BERT and the Llama-style decoders (on qkv's ``GPT`` / ``BERT``), T5 / Flan-T5 and
BART / Marian (on qkv's encoder-decoder ``Transformer``). ``families_for(model)`` gives the
candidates for a model; ``qkv.peft.files`` picks the one the file's keys fit.

Shapes: none (names only). A PEFT key, without its ``base_model.model.`` prefix, reads
``<module path>.lora_A.weight`` (A: (r, In)) or ``.lora_B.weight`` (B: (Out, r)); each maps to
``<qkv site path>.A_<role>`` / ``.B_<role>``.

The encoder-decoders (``qkv.models.hf_t5`` / ``hf_bart`` / ``hf_marian`` load them):

- T5 ``encoder.block.i.layer.0.SelfAttention.{q,k,v}`` -> ``encoder_layers.i.attn.in_proj``,
  roles ``"q"`` / ``"k"`` / ``"v"``; ``.o`` -> ``attn.out_proj`` (``"out"``);
  ``encoder.block.i.layer.1.DenseReluDense.wi`` -> ``ffn.fc_in`` (``"ffn_in"``), or on a gated
  FFN (T5 v1.1 / Flan-T5) ``wi_0`` / ``wi_1`` -> ``ffn.fc_in`` ``"gate"`` / ``"up"`` (rows
  [0, F) / [F, 2F)); ``wo`` -> ``ffn.fc_out`` (``"ffn_out"``). The decoder's blocks:
  ``layer.0.SelfAttention`` -> ``decoder_layers.i.self_attn``, ``layer.1.EncDecAttention`` ->
  ``decoder_layers.i.cross_attn`` (its fused ``in_proj``: q rows for the queries, k / v rows
  for the memory), ``layer.2.DenseReluDense`` -> ``decoder_layers.i.ffn``.
- BART / Marian ``model.encoder.layers.i.self_attn.{q,k,v}_proj`` ->
  ``encoder_layers.i.attn.in_proj`` (``"q"`` / ``"k"`` / ``"v"``), ``out_proj`` -> ``"out"``;
  ``fc1`` / ``fc2`` -> ``ffn.fc_in`` / ``ffn.fc_out``; the decoder's ``self_attn`` ->
  ``decoder_layers.i.self_attn``, ``encoder_attn`` -> ``decoder_layers.i.cross_attn``.
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from ..modules.feedforward import SwiGLU

__all__ = ["BART_MARIAN", "BERT_NAMES", "GPT2_NAMES", "LLAMA_NAMES", "PeftNames",
           "families_for", "t5_names"]


@dataclasses.dataclass(frozen=True)
class PeftNames:
    """How one family's PEFT LoRA keys name qkv's LoRA sites.

    Attributes:
        family: the family in words ("GPT-2", "T5"), for messages.
        pattern: matched in full against a key without ``base_model.model.``; named groups
            ``stack`` (optional: "encoder" / "decoder"), ``layer`` (the layer index),
            ``module`` (the module path after the layer index) and ``ab`` ("A" / "B").
        sites: ``(stack, module)`` -> ``(qkv site path after the layer index, role)``
            (stack "" where the pattern has none).
        stacks: ``stack`` -> qkv's layer list ("layers", "encoder_layers", ...).
    """

    family: str
    pattern: re.Pattern
    sites: dict[tuple[str, str], tuple[str, str]]
    stacks: dict[str, str]

    def match(self, short: str) -> tuple[str, str, str] | None:
        """``(qkv site path, role, "A" or "B")`` of a PEFT key (without
        ``base_model.model.``), or None when it names no site of this family."""
        m = self.pattern.fullmatch(short)
        if m is None:
            return None
        stack = m.groupdict().get("stack") or ""
        hit = self.sites.get((stack, m["module"]))
        if hit is None:
            return None
        site, role = hit
        return f"{self.stacks[stack]}.{int(m['layer'])}.{site}", role, m["ab"]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The module names (after the layer index) this family adapts, for checking what
        ``target_modules`` lists against the file."""
        return tuple(dict.fromkeys(module for _, module in self.sites))


def _flat(sites: dict[str, tuple[str, str]]) -> dict[tuple[str, str], tuple[str, str]]:
    return {("", module): hit for module, hit in sites.items()}


GPT2_NAMES = PeftNames(
    "GPT-2",
    re.compile(r"(?:transformer\.)?h\.(?P<layer>\d+)\.(?P<module>attn\.c_attn|attn\.c_proj|"
               r"mlp\.c_fc|mlp\.c_proj)\.lora_(?P<ab>[AB])\.weight"),
    _flat({"attn.c_attn": ("attn.in_proj", "qkv"), "attn.c_proj": ("attn.out_proj", "out"),
           "mlp.c_fc": ("ffn.fc_in", "ffn_in"), "mlp.c_proj": ("ffn.fc_out", "ffn_out")}),
    {"": "layers"})

BERT_NAMES = PeftNames(
    "BERT",
    re.compile(r"(?:bert\.)?encoder\.layer\.(?P<layer>\d+)\.(?P<module>attention\.self\.query|"
               r"attention\.self\.key|attention\.self\.value|attention\.output\.dense|"
               r"intermediate\.dense|output\.dense)\.lora_(?P<ab>[AB])\.weight"),
    _flat({"attention.self.query": ("attn.in_proj", "q"),
           "attention.self.key": ("attn.in_proj", "k"),
           "attention.self.value": ("attn.in_proj", "v"),
           "attention.output.dense": ("attn.out_proj", "out"),
           "intermediate.dense": ("ffn.fc_in", "ffn_in"),
           "output.dense": ("ffn.fc_out", "ffn_out")}),
    {"": "layers"})

LLAMA_NAMES = PeftNames(
    "Llama-style",
    re.compile(r"(?:model\.)?layers\.(?P<layer>\d+)\.(?P<module>self_attn\.(?:q|k|v|o|qkv)_proj|"
               r"mlp\.(?:gate|up|down|gate_up)_proj)\.lora_(?P<ab>[AB])\.weight"),
    _flat({"self_attn.q_proj": ("attn.in_proj", "q"),
           "self_attn.k_proj": ("attn.in_proj", "k"),
           "self_attn.v_proj": ("attn.in_proj", "v"),
           "self_attn.qkv_proj": ("attn.in_proj", "qkv"),  # Phi-3
           "self_attn.o_proj": ("attn.out_proj", "out"),
           "mlp.gate_proj": ("ffn.fc_in", "gate"),
           "mlp.up_proj": ("ffn.fc_in", "up"),
           "mlp.gate_up_proj": ("ffn.fc_in", "ffn_in"),  # Phi-3
           "mlp.down_proj": ("ffn.fc_out", "ffn_out")}),
    {"": "layers"})

_SEQ2SEQ_STACKS = {"encoder": "encoder_layers", "decoder": "decoder_layers"}


def _attention(hf: str, ours: str, names: dict[str, str]) -> dict[str, tuple[str, str]]:
    return {f"{hf}.{n}": (f"{ours}.{'out_proj' if role == 'out' else 'in_proj'}", role)
            for n, role in names.items()}


_BART_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "out"}
_FFN = {"fc1": ("ffn.fc_in", "ffn_in"), "fc2": ("ffn.fc_out", "ffn_out")}

BART_MARIAN = PeftNames(
    "BART / Marian",
    re.compile(r"(?:model\.)?(?P<stack>encoder|decoder)\.layers\.(?P<layer>\d+)\.(?P<module>"
               r"(?:self_attn|encoder_attn)\.(?:q|k|v|out)_proj|fc1|fc2)"
               r"\.lora_(?P<ab>[AB])\.weight"),
    {**{("encoder", m): hit for m, hit in {**_attention("self_attn", "attn", _BART_ROLES),
                                          **_FFN}.items()},
     **{("decoder", m): hit for m, hit in {**_attention("self_attn", "self_attn", _BART_ROLES),
                                          **_attention("encoder_attn", "cross_attn",
                                                       _BART_ROLES),
                                          **_FFN}.items()}},
    _SEQ2SEQ_STACKS)

_T5_ROLES = {"q": "q", "k": "k", "v": "v", "o": "out"}
_T5_KEY = re.compile(r"(?P<stack>encoder|decoder)\.block\.(?P<layer>\d+)\.(?P<module>layer\.\d+"
                     r"\.(?:SelfAttention|EncDecAttention|DenseReluDense)\.(?:q|k|v|o|wi|wi_0|"
                     r"wi_1|wo))\.lora_(?P<ab>[AB])\.weight")


def t5_names(gated: bool) -> PeftNames:
    """T5's names (the module docstring): ``gated`` (T5 v1.1 / Flan-T5) reads ``wi_0`` /
    ``wi_1`` as the fused FFN's gate / up rows, else ``wi`` as the whole ``fc_in``."""
    wi = ({"wi_0": ("ffn.fc_in", "gate"), "wi_1": ("ffn.fc_in", "up")} if gated
          else {"wi": ("ffn.fc_in", "ffn_in")})
    ffn = {**wi, "wo": ("ffn.fc_out", "ffn_out")}
    sites: dict[tuple[str, str], tuple[str, str]] = {}
    for stack, parts in (("encoder", (("0.SelfAttention", "attn"), ("1.DenseReluDense", None))),
                         ("decoder", (("0.SelfAttention", "self_attn"),
                                      ("1.EncDecAttention", "cross_attn"),
                                      ("2.DenseReluDense", None)))):
        for hf, ours in parts:
            table = (_attention("x", ours, _T5_ROLES) if ours is not None
                     else {f"x.{n}": hit for n, hit in ffn.items()})
            for key, hit in table.items():
                sites[(stack, f"layer.{hf}.{key.removeprefix('x.')}")] = hit
    return PeftNames("T5", _T5_KEY, sites, _SEQ2SEQ_STACKS)


def families_for(model: nn.Module) -> tuple[PeftNames, ...] | None:
    """The families whose PEFT files may load into ``model`` (a qkv ``GPT``: GPT-2 or
    Llama-style, as the file's keys say; ``BERT``; a ``Transformer`` with T5's relative
    positions: T5, its FFN gated or not as ``model``'s is; another ``Transformer``: BART /
    Marian), or None for another model."""
    from ..models import BERT, GPT, Transformer

    if isinstance(model, GPT):
        return (GPT2_NAMES, LLAMA_NAMES)
    if isinstance(model, BERT):
        return (BERT_NAMES,)
    if isinstance(model, Transformer):
        if model.config.positions != "t5":
            return (BART_MARIAN,)
        return (t5_names(any(isinstance(m, SwiGLU) for m in model.modules())),)
    return None
