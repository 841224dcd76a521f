"""qkv.peft LoRA on the HF encoder-decoders ``qkv.models.from_pretrained`` loads into a
``Transformer`` (T5 v1.0, Flan-T5 with its gated FFN and H·D != C, BART, Marian): the roles
on the encoder's self-attention, the decoder's self- and cross-attention (its fused
``in_proj``: q rows for the queries, k / v rows for the memory) and the FFNs; HF PEFT's LoRA
files for those families loaded by ``load_adapter`` (``qkv.peft.peft_names``).

The tiny HF models with random weights come from tests/models/_hf_t5.py and
_hf_bart_marian.py. Oracles: HF PEFT's ``get_nb_trainable_parameters`` on the HF model with
the equivalent ``target_modules`` (exact trainable counts; totals too for T5); an fp64 copy
of the qkv model with W + scale · B A written into each role's rows by this file; HF PEFT's
own logits for its saved adapter (B randomised, so the adapter is felt). All on a
right-padded source batch, the fp32 logits within atol 1e-5 · max|logits| and rtol 1e-5 of
the oracle; merge == unmerged and ``disable_adapters`` == the base (PEFT's
``disable_adapter``) within the same bound."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qkv.models import CheckpointError, Transformer, from_pretrained  # noqa: E402
from qkv.peft import (  # noqa: E402
    LoraConfig,
    adapter_names,
    add_lora,
    count_parameters,
    disable_adapters,
    load_adapter,
    merge,
    unmerge,
)


def _helper(name: str):
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "models" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_t5 = _helper("_hf_t5")
_bm = _helper("_hf_bart_marian")
FAMILIES = ("t5-v1.0", "flan-t5", "bart", "marian")


def hf_seq2seq(family: str):
    """The family's tiny HF model (random weights, eval mode, dropout 0)."""
    return _t5.hf_t5(family) if "t5" in family else _bm.hf_model(family)


def save_base(family: str, directory: Path):
    """A fresh HF model of ``family`` saved to ``directory``; returns the model."""
    model = hf_seq2seq(family)
    (_t5.save_hf if "t5" in family else _bm.save_hf)(model, directory)
    return model


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("s2s-bases")
    for family in FAMILIES:
        save_base(family, root / family)
    return {family: root / family for family in FAMILIES}


def randomise_b(model, std: float = 0.3) -> None:
    """B != 0 (A is already random): the adapter changes the outputs."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ".B_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def batch(vocab: int = 40):
    """Right-padded sources (3, 12) with their mask, and decoder inputs (3, 7); ids in
    [3, vocab) so that no real token is a pad, eos or start id of these configs."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(3, vocab, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 4:] = 0
    tgt = torch.randint(3, vocab, (3, 7), generator=gen)
    return src, mask, tgt


def segments(model) -> dict[str, set[str]]:
    """Adapted site path -> its roles."""
    return {n.removesuffix(".lora.default"): {r for r, _, _ in m.segments}
            for n, m in model.named_modules() if hasattr(m, "segments")}


# --- the roles on the stacks ----------------------------------------------------------------
def test_all_linear_covers_both_stacks_and_cross_attention(bases):
    flan = add_lora(from_pretrained(bases["flan-t5"]), LoraConfig(r=2, targets=("all-linear",)))
    segs = segments(flan)
    att, gated = {"q", "k", "v"}, {"gate", "up"}
    for i in range(2):
        assert segs[f"encoder_layers.{i}.attn.in_proj"] == att
        assert segs[f"encoder_layers.{i}.ffn.fc_in"] == gated
    for i in range(3):
        for sub in ("self_attn", "cross_attn"):
            assert segs[f"decoder_layers.{i}.{sub}.in_proj"] == att
            assert segs[f"decoder_layers.{i}.{sub}.out_proj"] == {"out"}
        assert segs[f"decoder_layers.{i}.ffn.fc_in"] == gated
        assert segs[f"decoder_layers.{i}.ffn.fc_out"] == {"ffn_out"}
    assert len(segs) == 4 * 2 + 6 * 3 and not any("lm_head" in s for s in segs)
    bart = add_lora(from_pretrained(bases["bart"]), LoraConfig(r=2, targets=("all-linear",)))
    assert segments(bart)["decoder_layers.1.ffn.fc_in"] == {"ffn_in"}
    with pytest.raises(ValueError, match="no gated FFN"):
        add_lora(from_pretrained(bases["bart"]), LoraConfig(targets=("gate",)))


@pytest.mark.parametrize("family, peft_targets, qkv_targets", [
    ("t5-v1.0", ["q", "v"], ("q", "v")),
    ("t5-v1.0", ["k", "o", "wi", "wo"], ("k", "out", "ffn_in", "ffn_out")),
    ("flan-t5", ["wi_0", "wi_1", "wo"], ("gate", "up", "ffn_out")),
    ("flan-t5", ["wi_1"], ("up",)),
    ("flan-t5", "all-linear", ("all-linear",)),
    ("bart", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
     ("q", "k", "v", "out", "ffn_in", "ffn_out")),
    ("marian", "all-linear", ("all-linear",)),
])
def test_trainable_parameter_counts_equal_peft(bases, family, peft_targets, qkv_targets):
    pm = peft.get_peft_model(hf_seq2seq(family), peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=peft_targets))
    model = add_lora(from_pretrained(bases[family]), LoraConfig(r=3, alpha=6,
                                                                targets=qkv_targets))
    trainable, total = count_parameters(model)
    theirs, their_total = pm.get_nb_trainable_parameters()
    assert trainable == theirs
    if "t5" in family:  # BART / Marian: HF's final_logits_bias is a buffer, qkv's head bias
        assert total == their_total  # a parameter; Marian's sinusoids are HF parameters


@pytest.mark.parametrize("targets", [("q", "k", "v", "out"), ("k", "v"),
                                     ("gate", "up", "ffn_out"), ("ffn_in",), ("all-linear",)])
def test_rows_against_an_fp64_oracle_and_merge(bases, targets):
    """Flan-T5 (H·D = 24 != C = 16; gated FFN): W_eff = W + scale · B A written by this test
    into each role's rows of an fp64 copy (cross-attention's k / v rows are read by
    project_rows over the memory); merge == unmerged; unmerge restores the base."""
    model = add_lora(from_pretrained(bases["flan-t5"]),
                     LoraConfig(r=3, alpha=5, targets=targets, rslora=True))
    randomise_b(model)
    oracle = from_pretrained(bases["flan-t5"]).double()
    hd, f = 3 * 8, 32
    rows = {"q": slice(0, hd), "k": slice(hd, 2 * hd), "v": slice(2 * hd, 3 * hd),
            "qkv": slice(0, 3 * hd), "out": slice(0, 16), "ffn_in": slice(0, 2 * f),
            "gate": slice(0, f), "up": slice(f, 2 * f), "ffn_out": slice(0, 16)}
    scale = 5 / 3 ** 0.5
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not hasattr(mod, "segments"):
                continue
            w = oracle.get_submodule(name.removesuffix(".lora.default")).weight
            for role, _, _ in mod.segments:
                w[rows[role]] += scale * (getattr(mod, f"B_{role}").double()
                                          @ getattr(mod, f"A_{role}").double())
        src, mask, tgt = batch()
        keep = mask.bool()
        want = oracle(src, tgt, src_mask=keep).float()
        got = model(src, tgt, src_mask=keep)
        base = from_pretrained(bases["flan-t5"])(src, tgt, src_mask=keep)
        assert (want - base).abs().max() > 1e-2  # the adapter is felt
        atol = 1e-5 * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
        merge(model)
        torch.testing.assert_close(model(src, tgt, src_mask=keep), got, atol=atol, rtol=1e-5)
        unmerge(model)
        with disable_adapters(model):
            torch.testing.assert_close(model(src, tgt, src_mask=keep), base, atol=atol,
                                       rtol=1e-5)


@pytest.mark.parametrize("family", ["flan-t5", "marian"])
def test_generation_with_an_unmerged_adapter_equals_merged(bases, family):
    """Cached decoding (greedy and 3 beams) with every projection adapted, unmerged: the
    tokens of the merged model; the adapter changes them."""
    from qkv import generate

    model = add_lora(from_pretrained(bases[family]), LoraConfig(r=2, targets=("all-linear",)))
    randomise_b(model, std=0.5)
    src = batch()[0][:2, :9]  # (2, 9)
    greedy = generate(model, src, max_new_tokens=6)
    beams = generate(model, src, max_new_tokens=6, num_beams=3)
    with disable_adapters(model):
        base = generate(model, src, max_new_tokens=6)
    merge(model)
    assert torch.equal(generate(model, src, max_new_tokens=6), greedy)
    assert torch.equal(generate(model, src, max_new_tokens=6, num_beams=3), beams)
    assert not torch.equal(greedy, base)


# --- HF PEFT's files ------------------------------------------------------------------------
ALL_T5 = {"q", "k", "v", "out", "ffn_in", "ffn_out"}
CASES = [  # (family, PEFT target_modules, qkv roles, use_rslora)
    ("t5-v1.0", ["q", "v"], {"q", "v"}, False),
    ("t5-v1.0", ["q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1"], ALL_T5, True),
    ("flan-t5", ["q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1"],
     {"q", "k", "v", "out", "gate", "up", "ffn_out"}, False),
    ("flan-t5", ["k", "wi_0"], {"k", "gate"}, True),
    ("bart", ["q_proj", "v_proj"], {"q", "v"}, False),
    ("bart", "all-linear", ALL_T5, True),
    ("marian", ["k_proj", "out_proj", "fc1", "fc2"], {"k", "out", "ffn_in", "ffn_out"}, False),
    ("marian", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], ALL_T5, True),
]


@pytest.mark.parametrize("family, targets, roles, rslora", CASES)
def test_peft_adapter_gives_peft_outputs(tmp_path, family, targets, roles, rslora):
    hf = save_base(family, tmp_path / "base")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets,
                                                 use_rslora=rslora,
                                                 init_lora_weights=False)).eval()
    randomise_b(pm)
    pm.save_pretrained(tmp_path / "adapter")
    src, mask, tgt = batch()
    with torch.no_grad():
        want = pm(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        with pm.disable_adapter():
            base = pm(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        # merged: held to PEFT's merged model run in fp64, within twice that model's own fp32
        # error (a random T5 amplifies one-ulp weight roundings past 1e-5 of the logits)
        merged = pm.merge_and_unload()
        merged_32 = merged(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        merged_64 = copy.deepcopy(merged).double()(input_ids=src, attention_mask=mask,
                                                   decoder_input_ids=tgt).logits
        merged_tol = 2 * float((merged_32.double() - merged_64).abs().max())
    assert (want - base).abs().max() > 1e-2  # the adapter is felt
    model = from_pretrained(tmp_path / "base")
    assert isinstance(model, Transformer)
    assert load_adapter(model, tmp_path / "adapter") == "default"
    assert set().union(*segments(model).values()) == roles
    atol = 1e-5 * float(want.abs().max())
    keep = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt, src_mask=keep), want, atol=atol, rtol=1e-5)
        with disable_adapters(model):
            torch.testing.assert_close(model(src, tgt, src_mask=keep), base, atol=atol,
                                       rtol=1e-5)
        merge(model)
        got = model(src, tgt, src_mask=keep).double()
        assert float((got - merged_64).abs().max()) <= merged_tol + atol


def test_peft_seq2seq_files_that_do_not_fit_give_one_error_and_load_nothing(bases, tmp_path):
    def saved(family: str, targets, name: str) -> Path:
        peft.get_peft_model(hf_seq2seq(family), peft.LoraConfig(
            r=2, target_modules=targets)).save_pretrained(tmp_path / name)
        return tmp_path / name

    plain_wi = saved("t5-v1.0", ["wi"], "wi")
    qv = saved("bart", ["q_proj", "v_proj"], "qv")
    conf_file = qv / "adapter_config.json"
    conf = json.loads(conf_file.read_text())
    cases = [
        (bases["flan-t5"], plain_wi, r"do not map onto a T5 Transformer.*DenseReluDense\.wi"),
        (bases["t5-v1.0"], qv, r"do not map onto a T5 Transformer.*encoder_attn"),
        (bases["bart"], plain_wi, "do not map onto a BART / Marian Transformer"),
    ]
    for base, adapter, match in cases:
        model = from_pretrained(base)
        with pytest.raises(CheckpointError, match=match):
            load_adapter(model, adapter)
        assert adapter_names(model) == [] and all(p.requires_grad for p in model.parameters())
    bart = from_pretrained(bases["bart"])
    for targets, match in [(r".*encoder\.layers.*\.(q|v)_proj", "does not name"),
                           (["q_proj", "v_proj", "fc1"], r"names \['fc1'\] but")]:
        conf_file.write_text(json.dumps({**conf, "target_modules": targets}))
        with pytest.raises(CheckpointError, match=match):
            load_adapter(bart, qv)
        assert adapter_names(bart) == []
    # only the encoder's self-attention: qkv adapters cover every site of a role
    enc = saved("bart", r".*encoder\.layers\.\d+\.self_attn\.q_proj", "enc")
    with pytest.raises(CheckpointError, match=r"role 'q' covers.*qkv adapters cover every"):
        load_adapter(bart, enc)
    conf_file.write_text(json.dumps(conf))
    assert load_adapter(bart, qv) == "default"  # the untouched file loads
