"""Every field of transformers' GPT2Config / BertConfig is classified by qkv's HF loaders
(``qkv.models.hf_config``) as used, ignored or checked — and each class is tested against
transformers itself, built from a config with random weights (code nobody here wrote).

- every field of the installed transformers' configs (``to_dict()``, what config.json holds)
  is in the tables: a new transformers field fails ``test_every_*_field_is_classified``;
- "used": a non-default value gives transformers' outputs (dropouts: the value reaches
  qkv's config, since eval outputs cannot show a dropout);
- "ignored": the field set to a non-default value in config.json changes neither
  transformers' outputs (the model transformers loads from that directory) nor qkv's;
- checks: each refused value raises a CheckpointError naming the field and its value;
- a field nobody knows loads with a warning naming it.

Shapes: B batch, N length. Tolerances: fp32 against transformers fp32 (same math, other
kernels): atol 1e-5, rtol 1e-5 on logits, hidden states, pooler outputs, MLM logits.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import qkv.models
from qkv.models import BERT, GPT
from qkv.models.hf_bert import config_from_hf as bert_config_from_hf
from qkv.models.hf_config import BERT_FIELDS, GPT2_FIELDS, HF_ACTIVATIONS, Check
from qkv.models.hf_gpt2 import config_from_hf as gpt2_config_from_hf
from qkv.models.hub import CheckpointError

transformers = pytest.importorskip("transformers")

ATOL = RTOL = 1e-5
V = 53
GPT2_BASE = dict(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=V,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                 eos_token_id=0)
BERT_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=48, vocab_size=V, max_position_embeddings=16,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# --- what the tests set each field to ---------------------------------------------------
#: "used" fields -> a non-default value (relative to the tiny base configs above)
GPT2_USED = {"vocab_size": 61, "n_positions": 24, "n_embd": 48, "n_layer": 3, "n_head": 4,
             "n_inner": 40, "layer_norm_epsilon": 1e-2, "tie_word_embeddings": False,
             "activation_function": "relu", "resid_pdrop": 0.2, "attn_pdrop": 0.3}
GPT2_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
BERT_USED = {"vocab_size": 61, "hidden_size": 48, "num_hidden_layers": 3,
             "num_attention_heads": 4, "intermediate_size": 40, "max_position_embeddings": 24,
             "type_vocab_size": 3, "layer_norm_eps": 1e-2, "hidden_act": "gelu_new",
             "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.3,
             "pad_token_id": 5, "tie_word_embeddings": False}
#: fields whose effect is training-only: HF field -> the qkv config attribute it sets
GPT2_TRAINING_ONLY = {"resid_pdrop": "dropout", "attn_pdrop": "attn_dropout"}
BERT_TRAINING_ONLY = {"hidden_dropout_prob": "dropout", "attention_probs_dropout_prob":
                      "attn_dropout", "pad_token_id": "pad_token_id"}

#: checked fields -> values qkv refuses
GPT2_REFUSED = {"model_type": ["bert"], "scale_attn_weights": [False],
                "scale_attn_by_inverse_layer_idx": [True], "add_cross_attention": [True],
                "activation_function": ["quick_gelu", "gelu_accurate", "mish", "linear"],
                "pruned_heads": [{"0": [1]}],
                "layer_norm_epsilon": [-1.0, 0.0, float("nan"), float("inf"), "x", True, 2.0]}
BERT_REFUSED = {"model_type": ["gpt2"], "is_decoder": [True], "add_cross_attention": [True],
                "position_embedding_type": ["relative_key", "relative_key_query"],
                "hidden_act": ["quick_gelu", "gelu_10", "tanh"], "pruned_heads": [{"1": [0]}],
                "layer_norm_eps": [-1.0, 0.0, float("nan"), float("inf"), "x", 1e-300]}
#: warn-only checks -> a value that warns
GPT2_WARNED = {"embd_pdrop": 0.25}

#: "ignored" fields -> a non-default value written into config.json
COMMON_IGNORED = {
    "transformers_version": "4.0.0", "_name_or_path": "somewhere/else", "_commit_hash": "abc",
    "architectures": ["SomethingForSequenceClassification"], "output_hidden_states": True,
    "output_attentions": True, "return_dict": False, "output_scores": True,
    "return_dict_in_generate": True, "torchscript": True, "dtype": "bfloat16",
    "torch_dtype": "float16", "use_bfloat16": True, "tf_legacy_loss": True,
    "_attn_implementation": "eager", "attn_implementation": "eager",
    "_attn_implementation_internal": "eager", "_attn_implementation_autoset": True,
    "_experts_implementation": "eager", "gradient_checkpointing": True,
    "chunk_size_feed_forward": 3, "is_encoder_decoder": True, "tie_encoder_decoder": True,
    "cross_attention_hidden_size": 7, "id2label": {"0": "A", "1": "B", "2": "C"},
    "label2id": {"A": 0, "B": 1, "C": 2}, "num_labels": 3, "problem_type": "regression",
    "finetuning_task": "mnli", "classifier_dropout": 0.3, "tokenizer_class": "BertTokenizer",
    "prefix": "hello ", "bos_token_id": 3, "eos_token_id": 4, "sep_token_id": 5,
    "decoder_start_token_id": 6, "task_specific_params": {"text-generation": {"max_length": 5}},
    "max_length": 5, "min_length": 2, "do_sample": True, "early_stopping": True,
    "num_beams": 3, "num_beam_groups": 3, "diversity_penalty": 0.5, "temperature": 0.7,
    "top_k": 5, "top_p": 0.9, "typical_p": 0.9, "repetition_penalty": 1.3,
    "length_penalty": 0.5, "no_repeat_ngram_size": 2, "encoder_no_repeat_ngram_size": 2,
    "bad_words_ids": [[1]], "num_return_sequences": 2, "forced_bos_token_id": 1,
    "forced_eos_token_id": 2, "remove_invalid_values": True,
    "exponential_decay_length_penalty": [5, 1.1], "suppress_tokens": [7],
    "begin_suppress_tokens": [8],
    "pruned_heads": {},  # a checked field, at its one accepted non-null value
}
GPT2_IGNORED = {**COMMON_IGNORED, "reorder_and_upcast_attn": True, "n_ctx": 7,
                "initializer_range": 0.5, "use_cache": False, "pad_token_id": 3,
                "is_decoder": True, "summary_type": "last", "summary_use_proj": False,
                "summary_activation": "tanh", "summary_proj_to_labels": False,
                "summary_first_dropout": 0.5, "summary_last_dropout": 0.5}
BERT_IGNORED = {**COMMON_IGNORED, "use_cache": False, "initializer_range": 0.5}


def _kind(rule) -> str:
    if isinstance(rule, Check):
        return "check"
    assert rule == "used" or rule.startswith("ignored: "), rule
    return rule.split(":")[0]


# ----------------------------------------------------------------- the tables are complete

@pytest.mark.parametrize("hf_cls, table", [("GPT2Config", GPT2_FIELDS),
                                           ("BertConfig", BERT_FIELDS)])
def test_every_transformers_config_field_is_classified(hf_cls, table):
    """Fails when the installed transformers writes a field the table does not know."""
    cfg = getattr(transformers, hf_cls)()
    fields = set(cfg.to_dict()) | set(json.loads(cfg.to_json_string()))
    fields |= set(type(cfg).attribute_map)
    assert sorted(fields - set(table)) == []
    for rule in table.values():
        _kind(rule)  # each entry is "used", "ignored: why" or a Check


@pytest.mark.parametrize("table, used, refused, ignored, warned", [
    (GPT2_FIELDS, {**GPT2_USED, **GPT2_ALIASES}, GPT2_REFUSED, GPT2_IGNORED, GPT2_WARNED),
    (BERT_FIELDS, BERT_USED, BERT_REFUSED, BERT_IGNORED, {}),
])
def test_every_classified_field_is_tested_here(table, used, refused, ignored, warned):
    """Each table entry has a value in this file's tests (a new entry needs a test)."""
    for field, rule in table.items():
        kind = _kind(rule)
        if kind == "used" or (kind == "check" and rule.used):
            assert field in used, f"no non-default value tested for used field {field}"
        if kind == "ignored":
            assert field in ignored, f"no non-default value tested for ignored field {field}"
        if kind == "check" and not rule.warn:
            assert field in refused, f"no refused value tested for checked field {field}"
        if kind == "check" and rule.warn:
            assert field in warned, f"no warned value tested for field {field}"


# ------------------------------------------------------------------------------ helpers

def _perturb_(model: torch.nn.Module) -> None:
    """Non-trivial biases and norms (HF init zeroes them, hiding a mapping error)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def _save_hf(model, directory: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory, safe_serialization=True)
    return directory


def _hf_gpt2_dir(directory: Path, **overrides) -> Path:
    torch.manual_seed(1234)
    cfg = transformers.GPT2Config(**{**GPT2_BASE, **overrides})
    model = transformers.GPT2LMHeadModel(cfg)
    _perturb_(model)
    return _save_hf(model, directory)


def _hf_bert_dir(directory: Path, cls: str = "BertForPreTraining", **overrides) -> Path:
    torch.manual_seed(1234)
    cfg = transformers.BertConfig(**{**BERT_BASE, **overrides})
    model = getattr(transformers, cls)(cfg)
    _perturb_(model)
    return _save_hf(model, directory)


def _edit_config(src: Path, dst: Path, **fields) -> Path:
    """A copy of checkpoint ``src`` whose config.json has ``fields`` set (None: removed)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _hf_load(directory: Path, cls: str):
    """transformers' own reading of ``directory`` (fp32, eager attention)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, cls).from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _qkv_load(directory: Path):
    """qkv.models.from_hf, failing on any warning (every field here is classified)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return qkv.models.from_hf(directory)


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _compare_gpt2(directory: Path, model: GPT | None = None) -> GPT:
    hf = _hf_load(directory, "GPT2LMHeadModel")
    model = _qkv_load(directory) if model is None else model
    assert isinstance(model, GPT)
    vocab, n = hf.config.vocab_size, min(11, hf.config.n_positions)
    ids = torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # GPT2LMHeadModel itself breaks under config return_dict=False: its body and head
        ref = hf.transformer(ids, return_dict=True, use_cache=False).last_hidden_state
        _close(model(ids), hf.lm_head(ref), "logits")
    return model


def _compare_bert(directory: Path, cls: str = "BertForPreTraining",
                  model: BERT | None = None) -> BERT:
    hf = _hf_load(directory, cls)
    model = _qkv_load(directory) if model is None else model
    assert isinstance(model, BERT)
    c = hf.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (3, 9), generator=g)  # (B, N)
    tt = torch.randint(0, c.type_vocab_size, (3, 9), generator=g)  # (B, N)
    am = torch.ones(3, 9, dtype=torch.long)  # (B, N), right padding in rows 1, 2
    am[1, 6:] = 0
    am[2, 3:] = 0
    keep = am.bool()
    body = hf if cls == "BertModel" else hf.bert
    with torch.no_grad():
        ref = body(ids, attention_mask=am, token_type_ids=tt, return_dict=True)
        out = model(ids, am, tt)
        _close(out.last_hidden_state[keep], ref.last_hidden_state[keep], "hidden")
        _close(out.pooler_output, ref.pooler_output, "pooler")
        if cls == "BertForPreTraining":
            logits = hf(ids, attention_mask=am, token_type_ids=tt,
                        return_dict=True).prediction_logits
            _close(model.mlm_logits(out.last_hidden_state)[keep], logits[keep], "MLM logits")
    return model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return _hf_gpt2_dir(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return _hf_bert_dir(tmp_path_factory.mktemp("bert"))


# ------------------------------------------------------------------------ used fields

def test_base_checkpoints_match_and_load_without_warnings(gpt2_dir, bert_dir):
    _compare_gpt2(gpt2_dir)
    _compare_bert(bert_dir)


@pytest.mark.parametrize("field", sorted(GPT2_USED))
def test_gpt2_used_field_non_default_matches_transformers(field, tmp_path):
    overrides = {field: GPT2_USED[field]}
    if field == "resid_pdrop":  # embd_pdrop unlike resid_pdrop warns (tested below)
        overrides["embd_pdrop"] = GPT2_USED[field]
    model = _compare_gpt2(_hf_gpt2_dir(tmp_path, **overrides))
    if field in GPT2_TRAINING_ONLY:
        assert getattr(model.config, GPT2_TRAINING_ONLY[field]) == GPT2_USED[field]


@pytest.mark.parametrize("field", sorted(BERT_USED))
def test_bert_used_field_non_default_matches_transformers(field, tmp_path):
    value = BERT_USED[field]
    if field == "tie_word_embeddings":  # untied: only without an MLM head (see below)
        model = _compare_bert(_hf_bert_dir(tmp_path, "BertModel", **{field: value}),
                              "BertModel")
    else:
        model = _compare_bert(_hf_bert_dir(tmp_path, **{field: value}))
    if field in BERT_TRAINING_ONLY:
        assert getattr(model.config, BERT_TRAINING_ONLY[field]) == value
    if field == "pad_token_id":
        assert model.word_embeddings.padding_idx == value


@pytest.mark.parametrize("name", sorted(HF_ACTIVATIONS))
def test_every_accepted_activation_matches_transformers(name, tmp_path):
    if name not in transformers.activations.ACT2CLS:
        pytest.skip(f"transformers {transformers.__version__} has no {name!r}")
    _compare_gpt2(_hf_gpt2_dir(tmp_path / "gpt2", activation_function=name))
    _compare_bert(_hf_bert_dir(tmp_path / "bert", hidden_act=name))


def test_gpt2_alias_fields_are_read(gpt2_dir, tmp_path):
    """transformers' attribute_map: hidden_size etc. in config.json set n_embd etc."""
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    renamed = {alias: cfg[name] for alias, name in GPT2_ALIASES.items()}
    d = _edit_config(gpt2_dir, tmp_path / "aliases",
                     **{name: None for name in GPT2_ALIASES.values()}, **renamed)
    assert all(name not in json.loads((d / "config.json").read_text())
               for name in GPT2_ALIASES.values())
    _compare_gpt2(d)
    bad = _edit_config(gpt2_dir, tmp_path / "disagree", hidden_size=cfg["n_embd"] * 2)
    with pytest.raises(CheckpointError, match=r"hidden_size=64 and n_embd=32"):
        qkv.models.from_hf(bad)


def test_missing_fields_take_transformers_defaults():
    """A config.json that leaves a field out means transformers' default for it."""
    gpt = gpt2_config_from_hf({"model_type": "gpt2"})
    hf = transformers.GPT2Config()
    assert (gpt.vocab_size, gpt.max_len, gpt.dim, gpt.num_layers, gpt.num_heads,
            gpt.norm_eps, gpt.tie_embeddings) == (
        hf.vocab_size, hf.n_positions, hf.n_embd, hf.n_layer, hf.n_head,
        hf.layer_norm_epsilon, hf.tie_word_embeddings)
    assert gpt.activation == HF_ACTIVATIONS[hf.activation_function]
    assert (gpt.dropout, gpt.attn_dropout) == (hf.resid_pdrop, hf.attn_pdrop)
    bert = bert_config_from_hf({"model_type": "bert"}, "x")
    hf = transformers.BertConfig()
    assert bert == {"vocab_size": hf.vocab_size, "max_len": hf.max_position_embeddings,
                    "type_vocab_size": hf.type_vocab_size, "dim": hf.hidden_size,
                    "num_layers": hf.num_hidden_layers, "num_heads": hf.num_attention_heads,
                    "ffn_hidden": hf.intermediate_size,
                    "activation": HF_ACTIVATIONS[hf.hidden_act], "norm_eps": hf.layer_norm_eps,
                    "dropout": hf.hidden_dropout_prob,
                    "attn_dropout": hf.attention_probs_dropout_prob,
                    "pad_token_id": hf.pad_token_id}


# --------------------------------------------------------------------- ignored fields

def _current(table: dict, cls: str) -> list[str]:
    """Ignored fields the installed transformers itself defines (it could read them)."""
    cfg = getattr(transformers, cls)()
    return sorted(f for f, r in table.items() if _kind(r) == "ignored" and f in cfg.to_dict())


def _ignored(model_ignored: dict, table: dict) -> dict:
    return {f: v for f, v in model_ignored.items() if _kind(table[f]) == "ignored"
            or f == "pruned_heads"}


@pytest.mark.parametrize("field", _current(GPT2_FIELDS, "GPT2Config"))
def test_gpt2_ignored_field_changes_no_output(field, gpt2_dir, tmp_path):
    _compare_gpt2(_edit_config(gpt2_dir, tmp_path, **{field: GPT2_IGNORED[field]}))


@pytest.mark.parametrize("field", _current(BERT_FIELDS, "BertConfig"))
def test_bert_ignored_field_changes_no_output(field, bert_dir, tmp_path):
    _compare_bert(_edit_config(bert_dir, tmp_path, **{field: BERT_IGNORED[field]}))


def test_gpt2_all_ignored_fields_at_once_change_no_output(gpt2_dir, tmp_path):
    """Including the 4.x-era fields this transformers no longer defines (n_ctx, generation
    defaults, torch_dtype...): neither transformers nor qkv reads them."""
    _compare_gpt2(_edit_config(gpt2_dir, tmp_path, **_ignored(GPT2_IGNORED, GPT2_FIELDS)))


def test_bert_all_ignored_fields_at_once_change_no_output(bert_dir, tmp_path):
    _compare_bert(_edit_config(bert_dir, tmp_path, **_ignored(BERT_IGNORED, BERT_FIELDS)))


def test_bert_chunked_feed_forward_matches(tmp_path):
    """chunk_size_feed_forward set when the weights are written (transformers builds the
    model with it), not only edited into config.json afterwards."""
    _compare_bert(_hf_bert_dir(tmp_path, chunk_size_feed_forward=3))  # N = 9: 3 chunks


# ------------------------------------------------------------------------ refused values

def _names(field: str, value: object) -> str:
    """A pattern for an error naming ``field`` with ``value`` ("field=value" or, for
    model_type, "model_type 'value'")."""
    return rf"{field}[= ]{re.escape(repr(value))}"


def _refused_cases(refused: dict) -> list[tuple[str, object]]:
    return [(f, v) for f, values in sorted(refused.items()) for v in values]


@pytest.mark.parametrize("field, value", _refused_cases(GPT2_REFUSED))
def test_gpt2_refused_value_names_field(field, value, gpt2_dir, tmp_path):
    d = _edit_config(gpt2_dir, tmp_path, **{field: value})
    with pytest.raises(CheckpointError, match=_names(field, value)):
        GPT.from_hf(d)


@pytest.mark.parametrize("field, value", _refused_cases(BERT_REFUSED))
def test_bert_refused_value_names_field(field, value, bert_dir, tmp_path):
    d = _edit_config(bert_dir, tmp_path, **{field: value})
    with pytest.raises(CheckpointError, match=_names(field, value)):
        BERT.from_hf(d)


def test_bert_is_decoder_refused_and_transformers_really_differs(tmp_path):
    """Defect 8: is_decoder=True was loaded as a bidirectional encoder (3e-2 off, silently).
    transformers runs it causally, so qkv must refuse it — via qkv.models.from_hf too."""
    d = _hf_bert_dir(tmp_path / "dec", "BertModel", is_decoder=True)
    with pytest.raises(CheckpointError, match=r"is_decoder=True"):
        qkv.models.from_hf(d)
    with pytest.raises(AssertionError, match="hidden"):  # the refusal is not overcautious
        _compare_bert(d, "BertModel",
                      model=BERT.from_hf(_edit_config(d, tmp_path / "enc", is_decoder=False)))


def test_gpt2_checkpoint_built_with_refused_options_is_refused(tmp_path):
    for field, value in [("add_cross_attention", True),
                         ("scale_attn_by_inverse_layer_idx", True),
                         ("scale_attn_weights", False)]:
        d = _hf_gpt2_dir(tmp_path / field, **{field: value})
        with pytest.raises(CheckpointError, match=_names(field, value)):
            qkv.models.from_hf(d)


def test_bert_untied_mlm_decoder_refused_names_tie_word_embeddings(tmp_path):
    d = _hf_bert_dir(tmp_path / "untied", "BertForMaskedLM", tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="tie_word_embeddings=False"):
        qkv.models.from_hf(d)
    # the decoder left out of the file: undefined, refused too
    from safetensors.torch import load_file, save_file
    state = load_file(d / "model.safetensors")
    del state["cls.predictions.decoder.weight"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings=False.*no cls\.predictions"):
        qkv.models.from_hf(d)


def test_gpt2_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    """transformers 5 keeps a stored lm_head.weight that differs from wte apart even with
    tie_word_embeddings=True; qkv would tie them, so it refuses."""
    d = _hf_gpt2_dir(tmp_path / "untied", tie_word_embeddings=False)
    tied = _edit_config(d, tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from wte\.weight"):
        qkv.models.from_hf(tied)


# ----------------------------------------------------------------- warnings

def test_unknown_field_warns_naming_it(gpt2_dir, bert_dir, tmp_path):
    for src, name in ((gpt2_dir, "gpt2"), (bert_dir, "bert")):
        d = _edit_config(src, tmp_path / name, rotary_from_the_future=True)
        with pytest.warns(UserWarning, match="rotary_from_the_future"):
            qkv.models.from_hf(d)


def test_gpt2_embedding_dropout_unlike_resid_pdrop_warns(gpt2_dir, tmp_path):
    d = _edit_config(gpt2_dir, tmp_path, embd_pdrop=GPT2_WARNED["embd_pdrop"])
    with pytest.warns(UserWarning, match="embd_pdrop=0.25"):
        model = qkv.models.from_hf(d)
    _compare_gpt2(d, model=model)  # eval outputs are unaffected
