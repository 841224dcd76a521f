"""qkv.peft LoRA: config validation, identity at init, an fp64 oracle written apart from the
code (W_eff = W + scale · B A on the right rows of the fused matrix), merge/unmerge, adapters
on/off, named adapters, mixed-adapter batches == rows alone, save/load, gradcheck, frozen
parameters, and the fast GPT decode path."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.generation import generate
from qkv.generation.plan import Unplannable, decode_plan
from qkv.models import (
    BERT,
    GPT,
    BERTConfig,
    CheckpointError,
    GPTConfig,
    Transformer,
    TransformerConfig,
)
from qkv.modules.attention import MultiHeadAttention
from qkv.modules.feedforward import FeedForward
from qkv.peft import (
    LoraConfig,
    LoraLinear,
    adapter_names,
    adapter_rows,
    add_lora,
    count_parameters,
    disable_adapters,
    load_adapter,
    merge,
    save_adapter,
    set_adapter,
    trainable_summary,
    unload,
    unmerge,
)

ALL = ("q", "k", "v", "out", "ffn_in", "ffn_out")


def tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, max_len=32, dim=48, num_layers=2, num_heads=4)
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


def tiny_bert() -> BERT:
    torch.manual_seed(0)
    return BERT(BERTConfig(vocab_size=61, max_len=32, dim=32, num_layers=2, num_heads=2,
                           ffn_hidden=64)).eval()


def tiny_transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig.from_name("transformer-tiny")).eval()


def randomise_lora(model: nn.Module, seed: int = 1, std: float = 0.3) -> None:
    """Give every LoRA parameter random values (B = 0 at init makes every update vanish)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


# --- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    ({"r": 0}, "r"), ({"r": 2.0}, "r"), ({"r": True}, "r"), ({"alpha": 0}, "alpha"),
    ({"alpha": float("nan")}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"dropout": -0.1}, "dropout"), ({"targets": ()}, "targets"), ({"targets": "q"}, "targets"),
    ({"targets": ("q", "query")}, "targets"), ({"targets": ("q", "q")}, "targets"),
    ({"targets": ("qkv", "v")}, "targets"), ({"rslora": 1}, "rslora"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kw)


def test_config_scale_and_round_trip():
    assert LoraConfig(r=8, alpha=16).scale == 2.0
    assert LoraConfig(r=16, alpha=8, rslora=True).scale == pytest.approx(8 / 4)
    c = LoraConfig(r=4, alpha=8, targets=["v", "q", "ffn_out"])
    assert c.targets == ("q", "v", "ffn_out")
    assert LoraConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="unknown fields"):
        LoraConfig.from_dict({"rank": 4})


# --- identity at init ---------------------------------------------------------------------
def test_identity_at_init_gpt_bitwise():
    model = tiny_gpt()
    ids = torch.randint(0, 61, (3, 11))
    base = model(ids)
    add_lora(model, LoraConfig(r=4, targets=ALL))
    assert isinstance(model.layers[0].attn.in_proj, LoraLinear)
    assert torch.equal(model(ids), base)


def test_identity_at_init_bert_and_encoder_decoder():
    bert = tiny_bert()
    ids = torch.randint(0, 61, (2, 9))
    base = bert(ids).last_hidden_state
    add_lora(bert, LoraConfig(r=4, targets=("qkv", "out", "ffn_in", "ffn_out")))
    torch.testing.assert_close(bert(ids).last_hidden_state, base, atol=1e-6, rtol=0)
    tr = tiny_transformer()
    src, tgt = torch.randint(4, 32, (2, 7)), torch.randint(4, 32, (2, 5))
    base = tr(src, tgt)
    add_lora(tr, LoraConfig(r=2, targets=ALL))
    assert torch.equal(tr(src, tgt), base)


def test_init_matches_peft_kaiming_and_zeros():
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=4, targets=("q",)))
    upd = model.layers[0].attn.in_proj.lora["default"]
    bound = 1 / math.sqrt(48)  # kaiming_uniform(a=√5): gain √(1/3) · √(3 / fan_in)
    assert upd.A_q.abs().max() <= bound and upd.A_q.abs().max() > 0.8 * bound
    assert torch.count_nonzero(upd.B_q) == 0
    assert upd.A_q.shape == (4, 48) and upd.B_q.shape == (48, 4)


# --- fp64 oracle ----------------------------------------------------------------------------
def _oracle_weight(w, upd, rows, alpha, r):
    """W + (alpha / r) · B A placed on each role's rows, from the parameters directly."""
    w = w.detach().clone()
    for role, (lo, hi) in rows.items():
        a, b = getattr(upd, f"A_{role}").detach(), getattr(upd, f"B_{role}").detach()
        w[lo:hi] += (alpha / r) * (b @ a)
    return w


@pytest.mark.parametrize("targets", [("q", "v"), ("k",), ("q", "k", "v"), ("qkv",)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fused_rows_against_fp64_oracle(targets, kv_heads):
    """Self- and cross-attention (kv_dim == dim: queries and keys/values from row blocks of
    in_proj) against a plain module whose in_proj weight is the oracle's W_eff."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, dtype=torch.float64).eval()
    ref, base = copy.deepcopy(mha), copy.deepcopy(mha)
    holder = nn.Module()
    holder.attn = mha
    add_lora(holder, LoraConfig(r=3, alpha=5, targets=targets))
    randomise_lora(holder)
    q, kv = 32, 8 * kv_heads
    rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "qkv": (0, q + 2 * kv)}
    upd = holder.attn.in_proj.lora["default"]
    with torch.no_grad():
        ref.in_proj.weight.copy_(_oracle_weight(ref.in_proj.weight, upd,
                                                {t: rows[t] for t in targets}, 5, 3))
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    ctx = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(holder.attn(x, causal=True), ref(x, causal=True),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(holder.attn(x, ctx), ref(x, ctx), atol=1e-12, rtol=0)
    with disable_adapters(holder):
        torch.testing.assert_close(holder.attn(x, ctx), base(x, ctx), atol=0, rtol=0)


def test_cross_attention_separate_projections_against_oracle():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, kv_dim=24, dtype=torch.float64).eval()
    ref = copy.deepcopy(mha)
    holder = nn.Module()
    holder.attn = mha
    add_lora(holder, LoraConfig(r=2, alpha=3, targets=("q", "v", "out")))
    randomise_lora(holder)
    a = holder.attn
    with torch.no_grad():
        ref.q_proj.weight.copy_(_oracle_weight(ref.q_proj.weight, a.q_proj.lora["default"],
                                               {"q": (0, 32)}, 3, 2))
        ref.kv_proj.weight.copy_(_oracle_weight(ref.kv_proj.weight, a.kv_proj.lora["default"],
                                                {"v": (32, 64)}, 3, 2))
        ref.out_proj.weight.copy_(_oracle_weight(ref.out_proj.weight,
                                                 a.out_proj.lora["default"], {"out": (0, 32)},
                                                 3, 2))
    assert not hasattr(a.kv_proj.lora["default"], "A_k")
    x, ctx = torch.randn(2, 6, 32, dtype=torch.float64), torch.randn(2, 9, 24,
                                                                     dtype=torch.float64)
    torch.testing.assert_close(a(x, ctx), ref(x, ctx), atol=1e-12, rtol=0)


def test_linear_attention_and_ffn_against_merged_oracle():
    """GPT with linear attention and SwiGLU: the unmerged LoRA model == a plain copy whose
    weights are W + scale · B A (computed here in fp64), and == merge()."""
    model = tiny_gpt(attention="linear", activation="swiglu").double()
    add_lora(model, LoraConfig(r=2, alpha=6, targets=ALL, rslora=True))
    randomise_lora(model, std=0.1)
    ref = unload(copy.deepcopy(model))
    scale = 6 / math.sqrt(2)
    plain_modules = dict(ref.named_modules())
    with torch.no_grad():
        for name, lin in model.named_modules():
            if isinstance(lin, LoraLinear):
                plain = plain_modules[name]
                upd = lin.lora["default"]
                for role, lo, hi in upd.segments:
                    a, b = getattr(upd, f"A_{role}"), getattr(upd, f"B_{role}")
                    plain.weight[lo:hi] += scale * (b @ a)
    ids = torch.randint(0, 61, (2, 13))
    torch.testing.assert_close(model(ids), ref(ids), atol=1e-10, rtol=0)
    merge(model)
    torch.testing.assert_close(model(ids), ref(ids), atol=1e-10, rtol=0)


# --- merge / unmerge / unload ---------------------------------------------------------------
def test_merge_unmerge_round_trip_and_wrappers_step_aside():
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=4, targets=ALL))
    randomise_lora(model, std=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 61, (2, 9))
    y = model(ids)
    merge(model)
    assert all(type(m) is nn.Linear for m in (model.layers[0].attn.in_proj,
                                               model.layers[1].ffn.fc_out))
    assert list(model.state_dict()) == list(before)  # keys unchanged
    torch.testing.assert_close(model(ids), y, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="merged"):
        merge(model)
    with pytest.raises(ValueError, match="unmerge"), disable_adapters(model):
        pass
    unmerge(model)
    assert isinstance(model.layers[0].attn.in_proj, LoraLinear)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-6, rtol=0)
    torch.testing.assert_close(model(ids), y, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no adapter is merged"):
        unmerge(model)
    merge(model)
    plain = unload(model)
    assert not any(".lora." in k for k in plain.state_dict())
    torch.testing.assert_close(plain(ids), y, atol=1e-5, rtol=1e-5)


def test_adapters_on_off_and_named_adapters():
    model = tiny_gpt()
    ids = torch.randint(0, 61, (2, 9))
    base = model(ids)
    add_lora(model, LoraConfig(r=4, targets=("q", "v")), name="a")
    randomise_lora(model, seed=1)
    add_lora(model, LoraConfig(r=2, targets=("ffn_in",)), name="b")
    randomise_lora(model, seed=2)  # re-randomises a too: fine, read a's output after
    assert adapter_names(model) == ["a", "b"]
    y_b = model(ids)
    set_adapter(model, "a")
    y_a = model(ids)
    assert (y_a - base).abs().max() > 1e-3 and (y_b - base).abs().max() > 1e-3
    assert (y_a - y_b).abs().max() > 1e-3
    with disable_adapters(model):
        assert torch.equal(model(ids), base)
        assert type(model.layers[0].attn.in_proj) is nn.Linear
        with pytest.raises(ValueError, match="not inside disable_adapters"):
            add_lora(model, LoraConfig(), name="c")
    assert torch.equal(model(ids), y_a)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora.a." in n for n in trainable)
    with pytest.raises(ValueError, match="no adapter named 'c'"):
        set_adapter(model, "c")
    with pytest.raises(ValueError, match="already has an adapter named 'a'"):
        add_lora(model, LoraConfig(), name="a")
    for bad in ("base", "a.b", "", "keys", 3):
        with pytest.raises(ValueError, match="adapter name"):
            add_lora(model, LoraConfig(), name=bad)
    with pytest.raises(ValueError, match="match no projection"):
        add_lora(nn.Sequential(MultiHeadAttention(16, 2)), LoraConfig(targets=("ffn_in",)))


# --- mixed-adapter batches --------------------------------------------------------------------
def test_mixed_adapter_batch_equals_rows_alone_gpt():
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=4, targets=("q", "v", "out")), name="a")
    add_lora(model, LoraConfig(r=2, targets=("k", "ffn_out")), name="b")
    randomise_lora(model)
    ids = torch.randint(0, 61, (4, 8))
    names = ["b", "base", "a", "b"]
    with adapter_rows(model, names):
        mixed = model(ids)
    for i, name in enumerate(names):
        if name == "base":
            with disable_adapters(model):
                alone = model(ids[i:i + 1])
        else:
            set_adapter(model, name)
            alone = model(ids[i:i + 1])
        torch.testing.assert_close(mixed[i:i + 1], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="adapter_rows"), adapter_rows(model, ["a", "b"]):
        model(ids)
    with pytest.raises(ValueError, match="unknown adapter names"), \
            adapter_rows(model, ["a", "zz", "base", "b"]):
        pass


def test_mixed_adapter_batch_encoder_decoder_cross_attention():
    """Tolerance atol 5e-5, rtol 5e-6 (the fp32 bar, docs/ARCHITECTURE.md: Tolerances): a
    batch of 3 and a row alone run GEMMs of other row counts, which with 2 threads round
    differently (seen: 1.5e-5 on logits ~0.4 at OMP_NUM_THREADS=2; 0 at 1 thread)."""
    tr = tiny_transformer()
    add_lora(tr, LoraConfig(r=2, targets=("q", "k", "v")), name="x")
    add_lora(tr, LoraConfig(r=2, targets=("qkv",)), name="y")
    randomise_lora(tr)
    src, tgt = torch.randint(4, 32, (3, 7)), torch.randint(4, 32, (3, 5))
    with adapter_rows(tr, ["y", "x", "base"]):
        mixed = tr(src, tgt)
    for i, name in enumerate(["y", "x"]):
        set_adapter(tr, name)
        torch.testing.assert_close(mixed[i:i + 1], tr(src[i:i + 1], tgt[i:i + 1]),
                                   atol=5e-5, rtol=5e-6)
    with disable_adapters(tr):
        torch.testing.assert_close(mixed[2:], tr(src[2:], tgt[2:]), atol=5e-5, rtol=5e-6)


# --- gradients ----------------------------------------------------------------------------------
def test_gradcheck_lora_path_fp64():
    torch.manual_seed(0)
    holder = nn.Module()
    holder.attn = MultiHeadAttention(8, 2, num_kv_heads=1, dtype=torch.float64)
    add_lora(holder, LoraConfig(r=2, alpha=3, targets=("q", "v")))
    randomise_lora(holder)
    lin = holder.attn.in_proj
    upd = lin.lora["default"]
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    params = (upd.A_q, upd.B_q, upd.A_v, upd.B_v)

    def g(x, a_q, b_q, a_v, b_v):  # the parameters routed in as gradcheck's inputs
        upd._parameters.update(A_q=a_q, B_q=b_q, A_v=a_v, B_v=b_v)
        return lin(x), lin.project_rows(x, 8, 16), lin.project_rows(x, 0, 8)

    inputs = (x, *(p.detach().clone().requires_grad_(True) for p in params))
    assert torch.autograd.gradcheck(g, inputs)
    strided = torch.randn(3, 2, 8, dtype=torch.float64).transpose(0, 1).requires_grad_(True)
    assert torch.autograd.gradcheck(g, (strided, *inputs[1:]))


def test_frozen_parameters_get_no_grad_and_stay_unchanged():
    model = tiny_gpt()
    model.train()
    add_lora(model, LoraConfig(r=4, targets=("q", "k", "v"), dropout=0.1))
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_count, _ = count_parameters(model)
    assert trainable_count == sum(p.numel() for p in trainable) == 2 * 3 * (4 * 48 + 48 * 4)
    assert "trainable params: 2,304 || all params:" in trainable_summary(model)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 61, (2, 9))
    for _ in range(2):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None, n
            assert torch.equal(p, frozen[n]), n
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if ".B_" in n)


def test_dropout_on_lora_input_only_in_training():
    torch.manual_seed(0)
    holder = nn.Module()
    holder.ffn = FeedForward(8, 16)
    add_lora(holder, LoraConfig(r=2, alpha=2, targets=("ffn_in",), dropout=0.5))
    randomise_lora(holder)
    lin = holder.ffn.fc_in
    upd = lin.lora["default"]
    x = torch.randn(4, 8)
    base = F.linear(x, lin.weight, lin.bias)
    lin.train()
    torch.manual_seed(5)
    y = lin(x)
    torch.manual_seed(5)
    xd = F.dropout(x, 0.5, training=True)
    torch.testing.assert_close(y, base + xd @ upd.A_ffn_in.t() @ upd.B_ffn_in.t(), atol=1e-6,
                               rtol=1e-6)
    lin.eval()
    torch.testing.assert_close(lin(x), base + x @ upd.A_ffn_in.t() @ upd.B_ffn_in.t(),
                               atol=1e-6, rtol=1e-6)


# --- files ----------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=4, alpha=8, targets=("q", "v", "ffn_out")), name="task")
    randomise_lora(model)
    ids = torch.randint(0, 61, (2, 9))
    y = model(ids)
    save_adapter(model, tmp_path / "ad")
    files = sorted(p.name for p in (tmp_path / "ad").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    meta = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert meta["kind"] == "lora" and meta["config"]["targets"] == ["q", "v", "ffn_out"]
    n_adapter = count_parameters(model)[0] * 4
    assert (tmp_path / "ad" / "adapter_model.safetensors").stat().st_size < n_adapter + 4096
    fresh = tiny_gpt()
    assert load_adapter(fresh, tmp_path / "ad") == "task"
    assert torch.equal(fresh(ids), y)
    assert load_adapter(fresh, tmp_path / "ad", name="again") == "again"
    assert adapter_names(fresh) == ["task", "again"]


def test_mismatched_adapters_give_one_error_and_load_nothing(tmp_path):
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=4, targets=("q", "v")))
    save_adapter(model, tmp_path / "ad")
    wider = tiny_gpt(dim=64)
    with pytest.raises(CheckpointError, match="file \\(4, 48\\), model \\(4, 64\\)"):
        load_adapter(wider, tmp_path / "ad")
    deeper = tiny_gpt(num_layers=3)
    with pytest.raises(CheckpointError, match="missing"):
        load_adapter(deeper, tmp_path / "ad")
    bert = tiny_bert()
    with pytest.raises(CheckpointError, match="made for a GPT"):
        load_adapter(bert, tmp_path / "ad")
    for m in (wider, deeper, bert):
        assert adapter_names(m) == [] and not any(".lora." in k for k in m.state_dict())
        assert all(p.requires_grad for p in m.parameters())
    with pytest.raises(CheckpointError, match=r"adapter_config\.json"):
        load_adapter(tiny_gpt(), tmp_path / "nowhere")
    meta = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    meta["config"]["targets"] = ["q", "v", "out"]
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="missing"):
        load_adapter(tiny_gpt(), tmp_path / "ad")


# --- generation: the fast decode path ---------------------------------------------------------
def _plannable(model) -> bool:
    """The model has an fp32/fp64 decode plan (``decode_plan`` describes it, not int8)."""
    try:
        return not decode_plan(model).int8
    except Unplannable:
        return False


def test_generate_with_unmerged_lora_equals_uncached_and_merged():
    """An unmerged LoRA wrapper has no decode plan (it decodes on the modules); disabled or
    merged, the projections are plain ``nn.Linear`` again and the model has one."""
    model = tiny_gpt()
    add_lora(model, LoraConfig(r=4, targets=("q", "v", "ffn_in")))
    randomise_lora(model, std=0.5)
    assert not _plannable(model)
    ids = torch.randint(0, 61, (2, 5))
    out = generate(model, ids, max_new_tokens=8)
    slow = generate(model, ids, max_new_tokens=8, use_cache=False)
    assert torch.equal(out, slow)
    seq = ids
    for _ in range(8):  # greedy by hand on the full forward
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    with disable_adapters(model):
        assert _plannable(model)
        assert not torch.equal(generate(model, ids, max_new_tokens=8), out)
    merge(model)
    assert _plannable(model)
    assert torch.equal(generate(model, ids, max_new_tokens=8), out)


def test_no_bias_projections_and_state_dict_reload():
    model = tiny_gpt(bias=False)
    add_lora(model, LoraConfig(r=2, targets=("q", "v", "ffn_out")))
    randomise_lora(model)
    ids = torch.randint(0, 61, (2, 6))
    y = model(ids)
    state = model.state_dict()
    assert "layers.0.attn.in_proj.bias" not in state
    other = tiny_gpt(bias=False)
    add_lora(other, LoraConfig(r=2, targets=("q", "v", "ffn_out")))
    other.load_state_dict(state)  # same keys whether a wrapper or a plain linear is in place
    assert torch.equal(other(ids), y)
    merge(other)
    assert list(other.state_dict()) == list(state)
    torch.testing.assert_close(other(ids), y, atol=1e-5, rtol=1e-5)


def test_encoder_decoder_generation_unmerged_equals_merged():
    """Cached decoding (self-attention caches, cross-attention keys/values projected once
    through project_kv) with an unmerged adapter == the merged model's plain path."""
    tr = tiny_transformer()
    add_lora(tr, LoraConfig(r=2, targets=("q", "k", "v", "out")))
    randomise_lora(tr, std=0.5)
    src = torch.randint(4, 32, (2, 7))
    out = generate(tr, src, max_new_tokens=6)
    assert torch.equal(out, generate(tr, src, max_new_tokens=6, use_cache=False))
    with disable_adapters(tr):
        base = generate(tr, src, max_new_tokens=6)
    merge(tr)
    assert torch.equal(generate(tr, src, max_new_tokens=6), out)
    assert not torch.equal(base, out)
