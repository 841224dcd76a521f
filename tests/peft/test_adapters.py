"""Bottleneck adapters (qkv.peft.adapters): identity at init, an fp64 oracle per placement,
frozen base, save/load round trip, named adapters, clear errors.

Shapes: B batch, N length, C width, M bottleneck width, V vocab.
Tolerances: fp32 layer vs the fp64 oracle written here: atol 5e-5, rtol 5e-6
(docs/ARCHITECTURE.md: Tolerances); "bit-identical" is torch.equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from qkv.models import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
from qkv.models.hub import CheckpointError
from qkv.modules.layers import DecoderLayer, EncoderLayer
from qkv.peft.adapters import (
    AdaptedSublayer,
    AdapterConfig,
    add_adapters,
    load_adapters,
    remove_adapters,
    save_adapters,
)
from qkv.peft.summary import count_parameters
from qkv.peft.switch import disable_adapters

PLACEMENTS = ("houlsby", "pfeiffer", "parallel")
KINDS = ("gpt", "bert", "transformer")


def _model(kind: str):
    if kind == "gpt":
        return GPT(GPTConfig.from_name("gpt-tiny")).eval()
    if kind == "bert":
        return BERT(BERTConfig.from_name("bert-tiny")).eval()
    return Transformer(TransformerConfig.from_name("transformer-tiny")).eval()


def _run(model, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Outputs of ``model`` on a fixed padded batch (padding exercised where the model
    takes it)."""
    if kind == "gpt":
        ids = torch.randint(0, 256, (3, 9), generator=gen)
        keep = torch.ones(3, 9, dtype=torch.bool)
        keep[0, :4] = False  # left padding
        return model(ids, attention_mask=keep)
    if kind == "bert":
        ids = torch.randint(1, 1000, (3, 9), generator=gen)
        keep = torch.ones(3, 9, dtype=torch.long)
        keep[1, 6:] = 0
        return model(ids, attention_mask=keep).last_hidden_state
    src = torch.randint(1, 32, (2, 7), generator=gen)
    tgt = torch.randint(1, 32, (2, 5), generator=gen)
    return model(src, tgt, src_lengths=torch.tensor([7, 4]))


def _randomise_adapters(model, gen: torch.Generator, std: float = 0.3) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AdaptedSublayer):
                for p in m.adapters.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)


# ------------------------------------------------------------------ identity at init


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_bit_identical_at_init(kind, placement, gen):
    """A fresh adapter is the identity: the adapted model's outputs equal, bit for bit, the
    base computation on the same code path (the same model inside ``disable_adapters``,
    where every adapter steps aside: y + A(y) with A(y) == 0 exactly is y).

    Against the unwrapped base model, the outputs agree within fp32 rounding only: the
    encoder-decoder's eval encoder runs a plain layer on the real tokens' rows
    (``EncoderLayer.forward`` with ``rows=``, T rows) but a layer whose attention is wrapped
    on the padded batch (B·N rows), and with more than one thread the GEMMs round differently by
    row count (seen: OMP_NUM_THREADS=2, Houlsby). Tolerance there: atol 1e-5, rtol 1e-5
    (logits ~1-4, fp32 sums over C = 32)."""
    model = _model(kind)
    state = gen.get_state()
    base = _run(model, kind, gen)
    add_adapters(model, AdapterConfig(reduction_factor=8, placement=placement))
    assert any(isinstance(m, AdaptedSublayer) for m in model.modules())
    gen.set_state(state)
    adapted = _run(model, kind, gen)
    with disable_adapters(model):
        gen.set_state(state)
        same_path = _run(model, kind, gen)
    assert torch.equal(adapted, same_path)
    torch.testing.assert_close(adapted, base, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_nonzero_adapters_change_outputs(kind, gen):
    """The identity test above is not vacuous: once up ≠ 0 the outputs move."""
    model = _model(kind)
    state = gen.get_state()
    base = _run(model, kind, gen)
    add_adapters(model, AdapterConfig(reduction_factor=8))
    _randomise_adapters(model, gen)
    gen.set_state(state)
    assert not torch.allclose(_run(model, kind, gen), base, atol=1e-3)


# ------------------------------------------------------------------ fp64 oracle


def _ln(x, norm):
    return F.layer_norm(x, (x.shape[-1],), norm.weight.double(), norm.bias.double(), norm.eps)


def _lin(x, lin):
    return x @ lin.weight.double().T + lin.bias.double()


def _attn(x, mha, heads):
    """Self-attention (no mask), written from the formula in fp64."""
    b, n, c = x.shape
    q, k, v = _lin(x, mha.in_proj).split(c, dim=-1)
    q, k, v = (t.reshape(b, n, heads, c // heads).transpose(1, 2) for t in (q, k, v))
    w = torch.softmax(q @ k.transpose(-1, -2) / (c // heads) ** 0.5, dim=-1)
    return _lin((w @ v).transpose(1, 2).reshape(b, n, c), mha.out_proj)


def _ffn(x, ffn):
    return _lin(torch.relu(_lin(x, ffn.fc_in)), ffn.fc_out)


def _adapter(x, a, act):
    return _lin(act(_lin(x, a.down)), a.up)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_encoder_layer_matches_oracle(placement, norm_first, activation, gen):
    c, heads = 24, 3
    layer = EncoderLayer.build(c, heads, ffn_hidden=40, norm_first=norm_first).eval()
    base = copy.deepcopy(layer)
    add_adapters(layer, AdapterConfig(reduction_factor=4, placement=placement,
                                      activation=activation, scaling=2.5))
    _randomise_adapters(layer, gen)
    x = torch.randn(2, 5, c, generator=gen)
    got = layer(x)
    act = torch.relu if activation == "relu" else F.gelu
    attn_a = layer.attn.adapters["default"] if placement == "houlsby" else None
    ffn_a = layer.ffn.adapters["default"]
    xd = x.double()

    def attn_out(h):
        a = _attn(h, base.attn, heads)
        return a + _adapter(a, attn_a, act) if attn_a is not None else a

    def ffn_out(h):
        f = _ffn(h, base.ffn)
        if placement == "parallel":  # He et al.: beside the FFN, on its input, scaled
            return f + 2.5 * _adapter(h, ffn_a, act)
        return f + _adapter(f, ffn_a, act)  # after the FFN, before the residual

    if norm_first:
        h = xd + attn_out(_ln(xd, base.norm1))
        want = h + ffn_out(_ln(h, base.norm2))
    else:
        h = _ln(xd + attn_out(xd), base.norm1)
        want = _ln(h + ffn_out(h), base.norm2)
    torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-6)


def test_decoder_layer_houlsby_matches_oracle(gen):
    """Houlsby in a decoder layer: adapters after self-attention and after the FFN; the
    cross-attention has none."""
    c, heads = 24, 3
    layer = DecoderLayer.build(c, heads, ffn_hidden=40, norm_first=True).eval()
    add_adapters(layer, AdapterConfig(reduction_factor=4))
    _randomise_adapters(layer, gen)
    assert not isinstance(layer.cross_attn, AdaptedSublayer)
    x, mem = torch.randn(2, 5, c, generator=gen), torch.randn(2, 6, c, generator=gen)
    got = layer(x, mem, causal=False)
    sa, fa = layer.self_attn.adapters["default"], layer.ffn.adapters["default"]
    xd, md = x.double(), mem.double()
    a = _attn(_ln(xd, layer.norm1), layer.self_attn.base, heads)
    h = xd + a + _adapter(a, sa, torch.relu)
    q = _lin(_ln(h, layer.norm2), layer.cross_attn.in_proj)[..., :c]
    kv = _lin(md, layer.cross_attn.in_proj)[..., c:]
    k, v = kv.split(c, dim=-1)
    q, k, v = (t.reshape(2, -1, heads, c // heads).transpose(1, 2) for t in (q, k, v))
    w = torch.softmax(q @ k.transpose(-1, -2) / (c // heads) ** 0.5, dim=-1)
    h = h + _lin((w @ v).transpose(1, 2).reshape(2, 5, c), layer.cross_attn.out_proj)
    f = _ffn(_ln(h, layer.norm3), layer.ffn.base)
    want = h + f + _adapter(f, fa, torch.relu)
    torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-6)


# ------------------------------------------------------------------ frozen base, counts


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_trainable_count_and_frozen_base(placement, gen):
    model = GPT(GPTConfig.from_name("gpt-tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, total0 = count_parameters(model)
    add_adapters(model, AdapterConfig(reduction_factor=16, placement=placement))
    c, m, layers = 128, 8, 2
    per = 2 * c * m + m + c
    sites = 2 if placement == "houlsby" else 1
    trainable, total = count_parameters(model)
    assert trainable == layers * sites * per
    assert total == total0 + trainable
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 256, (2, 8), generator=gen)
    model.train()
    for _ in range(2):
        opt.zero_grad()
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        opt.step()
    for name, p in model.named_parameters():
        if ".adapters." in name:
            assert p.grad is not None
        else:
            assert p.grad is None, name
    after = model.state_dict()
    for k, v in before.items():
        key = k
        for site in (".attn.", ".ffn."):
            if key not in after:
                key = key.replace(site, site + "base.", 1)
        assert torch.equal(after[key], v), k
    ups = [p for n, p in model.named_parameters() if n.endswith("up.weight")]
    assert all(bool(p.ne(0).any()) for p in ups)  # the adapters did train


# ------------------------------------------------------------------ files


def test_save_load_round_trip(tmp_path, gen):
    torch.manual_seed(1)
    model = GPT(GPTConfig.from_name("gpt-tiny")).eval()
    fresh = copy.deepcopy(model)
    add_adapters(model, AdapterConfig(reduction_factor=8, placement="parallel",
                                      activation="gelu"), name="task")
    _randomise_adapters(model, gen)
    ids = torch.randint(0, 256, (2, 6), generator=gen)
    want = model(ids)
    save_adapters(model, tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    size = (tmp_path / "a" / "adapter_model.safetensors").stat().st_size
    assert size < 40_000  # the adapter only (the base is ~2 MB)
    assert load_adapters(fresh, tmp_path / "a") == "task"
    assert torch.equal(fresh(ids), want)
    assert fresh.layers[0].ffn.active == "task"
    a = {k: v for k, v in fresh.state_dict().items() if ".adapters." in k}
    b = {k: v for k, v in model.state_dict().items() if ".adapters." in k}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_mismatch_loads_nothing(tmp_path, gen):
    model = GPT(GPTConfig.from_name("gpt-tiny"))
    add_adapters(model, AdapterConfig(reduction_factor=8))
    save_adapters(model, tmp_path / "a")
    other = GPT(GPTConfig.from_name("gpt-tiny", dim=64, num_heads=2))
    keys = set(other.state_dict())
    grads = [p.requires_grad for p in other.parameters()]
    with pytest.raises(CheckpointError, match="do not fit"):
        load_adapters(other, tmp_path / "a")
    assert set(other.state_dict()) == keys
    assert [p.requires_grad for p in other.parameters()] == grads
    assert not any(isinstance(m, AdaptedSublayer) for m in other.modules())
    bert = BERT(BERTConfig.from_name("bert-tiny"))
    with pytest.raises(CheckpointError, match="made for a GPT"):
        load_adapters(bert, tmp_path / "a")


# ------------------------------------------------------------------ names, errors


def test_named_adapters_switch_and_remove(gen):
    model = GPT(GPTConfig.from_name("gpt-tiny")).eval()
    ids = torch.randint(0, 256, (2, 6), generator=gen)
    base = model(ids)
    keys = set(model.state_dict())
    add_adapters(model, AdapterConfig(reduction_factor=8), name="a")
    _randomise_adapters(model, gen)
    out_a = model(ids)
    add_adapters(model, AdapterConfig(reduction_factor=8, placement="pfeiffer"), name="b")
    assert torch.equal(model(ids), base)  # b is fresh (zero up) and active
    for m in model.modules():
        if isinstance(m, AdaptedSublayer):
            m.set_active("a")
    assert torch.equal(model(ids), out_a)
    with pytest.raises(ValueError, match="already has an adapter named 'a'"):
        add_adapters(model, AdapterConfig(), name="a")
    remove_adapters(model, "a")
    remove_adapters(model, "b")
    assert set(model.state_dict()) == keys
    assert torch.equal(model(ids), base)


@pytest.mark.parametrize("kwargs, match", [
    ({"reduction_factor": 0}, "reduction_factor"),
    ({"reduction_factor": -2}, "reduction_factor"),
    ({"reduction_factor": True}, "reduction_factor"),
    ({"reduction_factor": "16"}, "reduction_factor"),
    ({"placement": "after"}, "placement"),
    ({"activation": "tanhh"}, "activation"),
    ({"dropout": 1.0}, "dropout"),
    ({"dropout": -0.1}, "dropout"),
    ({"scaling": float("nan")}, "scaling"),
])
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdapterConfig(**kwargs)


def test_bad_calls():
    model = GPT(GPTConfig.from_name("gpt-tiny"))
    with pytest.raises(ValueError, match=r"reduction_factor=1000 leaves no bottleneck"):
        add_adapters(model, AdapterConfig(reduction_factor=1000))
    with pytest.raises(TypeError, match="AdapterConfig"):
        add_adapters(model, {"reduction_factor": 16})
    with pytest.raises(ValueError, match="name"):
        add_adapters(model, AdapterConfig(), name="a.b")
    with pytest.raises(ValueError, match="no qkv EncoderLayer"):
        add_adapters(torch.nn.Linear(4, 4), AdapterConfig())
    with pytest.raises(ValueError, match="no adapter named"):
        remove_adapters(model, "nope")


def test_dropout_only_in_training(gen):
    model = GPT(GPTConfig.from_name("gpt-tiny"))
    add_adapters(model, AdapterConfig(reduction_factor=8, dropout=0.5))
    _randomise_adapters(model, gen)
    ids = torch.randint(0, 256, (2, 6), generator=gen)
    model.eval()
    assert torch.equal(model(ids), model(ids))
    model.train()
    assert not torch.equal(model(ids), model(ids))


def test_generate_uses_the_adapters(gen):
    """qkv.generate's cached path (its fast GPT decoder must step aside) == the uncached
    recomputation, with adapters that change the outputs."""
    import qkv

    model = GPT(GPTConfig.from_name("gpt-tiny")).eval()
    ids = torch.randint(0, 256, (2, 5), generator=gen)
    base = qkv.generate(model, ids, max_new_tokens=6)
    add_adapters(model, AdapterConfig(reduction_factor=8))
    _randomise_adapters(model, gen, std=1.0)
    cached = qkv.generate(model, ids, max_new_tokens=6)
    assert torch.equal(cached, qkv.generate(model, ids, max_new_tokens=6, use_cache=False))
    assert not torch.equal(cached, base)
