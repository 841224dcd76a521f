"""qkv.peft LoRA with the roles of Llama-style decoders: "gate" / "up" (row blocks of the
gated FFN's fused fc_in), "down" (= "ffn_out") and "all-linear", on a qkv Llama-style
``GPT``; HF PEFT's LoRA files for Llama, Phi-3, Qwen2, Mistral and Gemma loaded by
``load_adapter``.

Oracles: HF PEFT's ``get_nb_trainable_parameters`` on the equivalent HF model (exact counts);
an fp64 copy of the model with W + scale · B A written into the gate / up rows by this file
(1e-10); HF PEFT's own logits for its saved adapter on a right-padded batch (real positions,
fp32, atol 1e-5 · max|logits|, rtol 1e-5), with the base loaded by this file's own copy of
the HF weights (Llama, Phi-3) and, once it exists, by ``qkv.models.from_pretrained``
(``qkv.models.hf_llama``; every family)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qkv.models import GPT, CheckpointError, GPTConfig  # noqa: E402
from qkv.peft import (  # noqa: E402
    TARGETS,
    LoraConfig,
    adapter_names,
    add_lora,
    count_parameters,
    disable_adapters,
    load_adapter,
    merge,
    save_adapter,
    unmerge,
)

V, C, L, H, HKV, F = 67, 32, 2, 4, 2, 48
D = C // H
HAVE_LOADER = importlib.util.find_spec("qkv.models.hf_llama") is not None


def llama_gpt(**kw) -> GPT:
    """A qkv Llama-style decoder with HF Llama's sizes below."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, max_len=64, dim=C, num_layers=L, num_heads=H, num_kv_heads=HKV,
               ffn_hidden=F, activation="swiglu", norm="rmsnorm", norm_eps=1e-6,
               positions="rope", bias=False, tie_embeddings=False)
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


def hf_config(family: str):
    kw = dict(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
              num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    if family == "qwen2":
        return (transformers.Qwen2Config(use_sliding_window=False, **kw),
                transformers.Qwen2ForCausalLM)
    if family == "gemma":
        return (transformers.GemmaConfig(head_dim=D, hidden_activation="gelu_pytorch_tanh",
                                         pad_token_id=0, **kw), transformers.GemmaForCausalLM)
    if family == "mistral":
        return (transformers.MistralConfig(sliding_window=None, **kw),
                transformers.MistralForCausalLM)
    return (transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                    resid_pdrop=0.0, embd_pdrop=0.0, **kw),
            transformers.Phi3ForCausalLM)


def hf_model(family: str, tmp_path):
    torch.manual_seed(0)
    cfg, cls = hf_config(family)
    model = cls(cfg).eval()
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    return model


def copy_into_qkv(hf) -> GPT:
    """This file's own mapping of an HF Llama / Phi-3 state onto a qkv GPT (written apart
    from qkv's loader): in_proj = [q; k; v] rows, fc_in = [gate; up] rows."""
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ours = {"embed.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"],
            "lm_head.weight": sd["lm_head.weight"]}
    for i in range(L):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        ours[p + "norm1.weight"] = sd[p + "input_layernorm.weight"]
        ours[p + "norm2.weight"] = sd[p + "post_attention_layernorm.weight"]
        ours[p + "attn.in_proj.weight"] = (
            sd[a + "qkv_proj.weight"] if a + "qkv_proj.weight" in sd else
            torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                       sd[a + "v_proj.weight"]]))
        ours[p + "attn.out_proj.weight"] = sd[a + "o_proj.weight"]
        ours[p + "ffn.fc_in.weight"] = (
            sd[m + "gate_up_proj.weight"] if m + "gate_up_proj.weight" in sd else
            torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]))
        ours[p + "ffn.fc_out.weight"] = sd[m + "down_proj.weight"]
    model = llama_gpt()
    model.load_state_dict(ours, strict=True)
    return model


def randomise_b(model, std: float = 0.3) -> None:
    """B != 0 (A is already random): the adapter changes the outputs."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ".B_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


# --- the roles on a qkv Llama-style GPT ---------------------------------------------------
def test_targets_accept_the_new_roles_and_normalise():
    assert {"gate", "up", "down", "all-linear"} <= set(TARGETS)
    assert LoraConfig(targets=("down", "up", "gate")).targets == ("gate", "up", "ffn_out")
    assert LoraConfig(targets=["all-linear"]).targets == ("all-linear",)
    assert LoraConfig(targets=("v", "q")).targets == ("q", "v")  # today's order, unchanged
    for bad, match in [(("ffn_in", "gate"), "same rows"), (("up", "ffn_in"), "same rows"),
                       (("down", "ffn_out"), "duplicates.*'down' is 'ffn_out'"),
                       (("all-linear", "q"), "give it alone"), (("gate_proj",), "roles from")]:
        with pytest.raises(ValueError, match=match):
            LoraConfig(targets=bad)


@pytest.mark.parametrize("peft_targets, qkv_targets", [
    (["q_proj", "v_proj"], ("q", "v")),
    (["q_proj", "k_proj", "v_proj", "o_proj"], ("q", "k", "v", "out")),
    ("all-linear", ("all-linear",)),
    (["gate_proj", "up_proj", "down_proj"], ("gate", "up", "down")),
    (["up_proj"], ("up",)),
])
def test_trainable_parameter_counts_equal_peft_on_llama(peft_targets, qkv_targets):
    cfg, cls = hf_config("llama")
    pm = peft.get_peft_model(cls(cfg), peft.LoraConfig(r=4, lora_alpha=8,
                                                       target_modules=peft_targets))
    model = add_lora(llama_gpt(), LoraConfig(r=4, alpha=8, targets=qkv_targets))
    assert count_parameters(model) == tuple(pm.get_nb_trainable_parameters())


def test_phi3_fused_roles_count_as_peft():
    cfg, cls = hf_config("phi3")
    pm = peft.get_peft_model(cls(cfg), peft.LoraConfig(
        r=4, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    model = add_lora(llama_gpt(), LoraConfig(r=4, targets=("qkv", "out", "ffn_in", "down")))
    assert count_parameters(model) == tuple(pm.get_nb_trainable_parameters())


def test_all_linear_picks_the_finest_roles():
    model = add_lora(llama_gpt(), LoraConfig(r=2, targets=("all-linear",)))
    upd = {n: {r for r, _, _ in m.segments} for n, m in model.named_modules()
           if hasattr(m, "segments")}
    assert upd["layers.1.attn.in_proj.lora.default"] == {"q", "k", "v"}
    assert upd["layers.1.ffn.fc_in.lora.default"] == {"gate", "up"}
    assert upd["layers.1.ffn.fc_out.lora.default"] == {"ffn_out"}
    assert len(upd) == 4 * L and not any("lm_head" in n for n in upd)
    plain = add_lora(llama_gpt(activation="silu", norm="layernorm"),
                     LoraConfig(r=2, targets=("all-linear",)))
    segs = {r for m in plain.modules() if hasattr(m, "segments") for r, _, _ in m.segments}
    assert segs == {"q", "k", "v", "out", "ffn_in", "ffn_out"}


def test_gate_on_a_plain_ffn_is_a_clear_error():
    model = llama_gpt(activation="gelu", norm="layernorm")
    for targets in [("gate",), ("up", "q")]:
        with pytest.raises(ValueError, match=r"no gated FFN.*'ffn_in'"):
            add_lora(model, LoraConfig(targets=targets))
    assert adapter_names(model) == [] and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("targets", [("gate",), ("up",), ("gate", "up", "down"),
                                     ("all-linear",)])
def test_gate_up_rows_against_an_fp64_oracle_and_merge(targets):
    """W_eff = W + scale · B A written into fc_in's gate rows [0, F) / up rows [F, 2F) by
    this test, in fp64; merge == unmerged (1e-5); unmerge restores the base."""
    model = add_lora(llama_gpt(), LoraConfig(r=3, alpha=5, targets=targets, rslora=True))
    randomise_b(model)
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(2))
    oracle = llama_gpt().double()
    scale = 5 / 3 ** 0.5
    rows = {"gate": slice(0, F), "up": slice(F, 2 * F), "ffn_out": slice(0, C),
            "q": slice(0, H * D), "k": slice(H * D, (H + HKV) * D),
            "v": slice((H + HKV) * D, (H + 2 * HKV) * D), "out": slice(0, C)}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not hasattr(mod, "segments"):
                continue
            w = oracle.get_submodule(name.removesuffix(".lora.default")).weight
            for role, _, _ in mod.segments:
                a = getattr(mod, f"A_{role}").double()
                b = getattr(mod, f"B_{role}").double()
                w[rows[role]] += scale * b @ a
        want = oracle(ids).float()
        got = model(ids)
        base = llama_gpt()(ids)
        assert (want - base).abs().max() > 1e-2  # the adapter is felt
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        merge(model)
        torch.testing.assert_close(model(ids), got, atol=1e-5, rtol=1e-5)
        unmerge(model)
        with disable_adapters(model):
            torch.testing.assert_close(model(ids), base, atol=1e-5, rtol=1e-5)


def test_qkv_files_of_the_new_roles_and_of_today_round_trip(tmp_path):
    model = add_lora(llama_gpt(), LoraConfig(r=2, targets=("all-linear",)))
    randomise_b(model)
    ids = torch.randint(0, V, (1, 9))
    save_adapter(model, tmp_path / "new")
    conf = json.loads((tmp_path / "new" / "adapter_config.json").read_text())
    assert conf["config"]["targets"] == ["all-linear"]
    again = llama_gpt()
    load_adapter(again, tmp_path / "new")
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    # a file as qkv writes it today: "ffn_in" on SwiGLU's fc_in is one update over 2F rows
    old = add_lora(llama_gpt(), LoraConfig(r=2, targets=("ffn_in", "ffn_out")))
    randomise_b(old)
    save_adapter(old, tmp_path / "old")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "old" / "adapter_model.safetensors"), "pt") as f:
        assert f.get_slice("layers.0.ffn.fc_in.B_ffn_in").get_shape() == [2 * F, 2]
    fresh = llama_gpt()
    load_adapter(fresh, tmp_path / "old")
    with torch.no_grad():
        assert torch.equal(fresh(ids), old(ids))


# --- HF PEFT's files ---------------------------------------------------------------------
ALL_LINEAR = {"q", "k", "v", "out", "gate", "up", "ffn_out"}
CASES = [  # (family, PEFT target_modules, qkv roles, use_rslora)
    ("llama", ["q_proj", "v_proj"], {"q", "v"}, False),
    ("llama", "all-linear", ALL_LINEAR, True),
    ("llama", ["gate_proj", "up_proj", "down_proj"], {"gate", "up", "ffn_out"}, False),
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
     {"qkv", "out", "ffn_in", "ffn_out"}, False),
    ("phi3", "all-linear", {"qkv", "out", "ffn_in", "ffn_out"}, False),
]
LOADER_ONLY = [("qwen2", "all-linear", ALL_LINEAR, False),  # q/k/v biases
               ("mistral", ["q_proj", "k_proj", "up_proj", "down_proj"],
                {"q", "k", "up", "ffn_out"}, False),
               ("gemma", "all-linear", ALL_LINEAR, True)]  # GeGLU, (1 + w) norms
_LOADER = pytest.mark.skipif(not HAVE_LOADER, reason="qkv.models.hf_llama (the HF "
                                                     "Llama-style loader) not there yet")
PARAMS = ([pytest.param(*case, "copy") for case in CASES]
          + [pytest.param(*case, "from_pretrained", marks=_LOADER)
             for case in CASES + LOADER_ONLY])


def padded_batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding: positions agree with HF's arange
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("family, targets, roles, rslora, via", PARAMS)
def test_peft_adapter_gives_peft_outputs(tmp_path, family, targets, roles, rslora, via):
    hf = hf_model(family, tmp_path)
    copied = None if via != "copy" else copy_into_qkv(hf)  # before PEFT wraps its linears
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets,
                                                 use_rslora=rslora)).eval()
    randomise_b(pm)
    pm.save_pretrained(tmp_path / "adapter")
    ids, mask = padded_batch()
    keep = mask.bool()
    with torch.no_grad():
        want = pm(input_ids=ids, attention_mask=mask).logits
        with pm.disable_adapter():
            base = pm(input_ids=ids, attention_mask=mask).logits
    assert (want - base)[keep].abs().max() > 1e-2  # the adapter is felt
    if via == "copy":
        model = copied
    else:
        from qkv.models import from_pretrained
        model = from_pretrained(tmp_path / "base")
    assert load_adapter(model, tmp_path / "adapter") == "default"
    assert {r for m in model.modules() if hasattr(m, "segments")
            for r, _, _ in m.segments} == roles
    atol = 1e-5 * float(want.abs().max())
    with torch.no_grad():
        got = model(ids, attention_mask=mask)
        torch.testing.assert_close(got[keep], want[keep], atol=atol, rtol=1e-5)
        with disable_adapters(model):
            torch.testing.assert_close(model(ids, attention_mask=mask)[keep], base[keep],
                                       atol=atol, rtol=1e-5)
        merge(model)
        torch.testing.assert_close(model(ids, attention_mask=mask)[keep], want[keep],
                                   atol=atol, rtol=1e-5)


def test_peft_llama_files_that_do_not_fit_give_one_error_and_load_nothing(tmp_path):
    hf = hf_model("llama", tmp_path)
    model = copy_into_qkv(hf)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
                        ).save_pretrained(tmp_path / "qv")
    conf_file = tmp_path / "qv" / "adapter_config.json"
    conf = json.loads(conf_file.read_text())

    def refused(match):
        with pytest.raises(CheckpointError, match=match):
            load_adapter(model, tmp_path / "qv")
        assert adapter_names(model) == [] and all(p.requires_grad for p in model.parameters())

    for targets, match in [(["q_proj"], "does not name.*v_proj"),
                           (["q_proj", "v_proj", "o_proj"], r"names \['o_proj'\] but"),
                           ("model\\.layers\\.0\\..*", "does not name.*layers.1")]:
        conf_file.write_text(json.dumps({**conf, "target_modules": targets}))
        refused(match)
    for field, value in [("use_dora", True), ("alora_invocation_tokens", [5, 6]),
                         ("rank_pattern", {"q_proj": 8})]:
        conf_file.write_text(json.dumps({**conf, field: value}))
        refused(field)
    conf_file.write_text(json.dumps(conf))
    # a Llama adapter's gate_proj on a qkv GPT with a plain FFN
    peft.get_peft_model(hf_model("llama", tmp_path / "g"),
                        peft.LoraConfig(r=4, target_modules=["gate_proj"])
                        ).save_pretrained(tmp_path / "gate")
    plain = llama_gpt(activation="silu", ffn_hidden=2 * F)
    with pytest.raises(CheckpointError, match="no gated FFN"):
        load_adapter(plain, tmp_path / "gate")
    assert adapter_names(plain) == []
    assert load_adapter(model, tmp_path / "qv") == "default"  # the untouched file loads
