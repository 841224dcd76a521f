"""qkv.models.BERT against HuggingFace transformers' BERT built from a config with random
weights (code nobody here wrote), plus equivalences, round trips and clean errors.

Shapes: B batch, N length, C width, H heads, V vocabulary.

Tolerances: fp32 against HF fp32 (same math, different kernels and summation order):
atol 1e-5, rtol 1e-5 on hidden states, pooler output, MLM logits and attention weights;
batch row vs single run: atol 1e-5, rtol 1e-5 (different matmul blockings); gradients of a
padded batch vs per-row runs: atol 1e-4, rtol 1e-4 (sums over ~40 tokens of squared outputs);
save/load and two eval forwards: exact.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.masks import Padding
from qkv.models.bert import (
    BERT,
    BERTConfig,
    BERTOutput,
    key_padding_mask,
    load_tokenizer,
    mean_pool,
)
from qkv.models.hub import CheckpointError
from qkv.positions import positions_from_mask

transformers = pytest.importorskip("transformers")

ATOL = RTOL = 1e-5
V, C, MAXLEN = 101, 64, 64


def hf_config(**kw):
    base = dict(hidden_size=C, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=V, max_position_embeddings=MAXLEN, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**base, **kw})


def perturb_(model: torch.nn.Module) -> None:
    """Random non-trivial values everywhere (HF init zeroes biases and sets LayerNorm to 1,
    which would hide a mapping error between biases or norms)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """HF BertModel (eager and sdpa views of the same weights) and BertForMaskedLM, saved."""
    torch.manual_seed(1234)
    base = transformers.BertModel(hf_config(attn_implementation="eager"))
    perturb_(base)
    d_base = tmp_path_factory.mktemp("hf_bert")
    base.save_pretrained(d_base, safe_serialization=True)
    mlm = transformers.BertForMaskedLM(hf_config(attn_implementation="eager"))
    perturb_(mlm)
    d_mlm = tmp_path_factory.mktemp("hf_bert_mlm")
    mlm.save_pretrained(d_mlm, safe_serialization=True)
    return {"base": (base.eval(), d_base), "mlm": (mlm.eval(), d_mlm)}


def batch_inputs(b=3, n=17, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    ids = torch.randint(1, V, (b, n), generator=g)  # (B, N)
    tt = torch.randint(0, 2, (b, n), generator=g)  # (B, N)
    am = torch.ones(b, n, dtype=torch.long)  # (B, N) right padding in rows 1, 2
    am[1, n - 6:] = 0
    if b > 2:
        am[2, 4:] = 0
    return ids, am, tt


def close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------- HF parity

def test_hidden_states_and_pooler_match_hf_bertmodel(hf_dirs):
    hf, d = hf_dirs["base"]
    model = BERT.from_hf(d)
    assert not model.training  # loaded models start in eval mode
    assert model.pooler is not None and model.mlm is None
    ids, am, tt = batch_inputs()
    keep = am.bool()
    with torch.no_grad():
        ref = hf(ids, attention_mask=am, token_type_ids=tt)
        out = model(ids, am, tt)
    assert isinstance(out, BERTOutput) and out.last_hidden_state.shape == (3, 17, C)
    close(out.last_hidden_state[keep], ref.last_hidden_state[keep], "hidden (non-pad)")
    close(out.pooler_output, ref.pooler_output, "pooler")


def test_no_mask_and_default_token_types_match_hf(hf_dirs):
    hf, d = hf_dirs["base"]
    model = BERT.from_pretrained(d).eval()  # from_pretrained dispatches to from_hf
    ids, _, _ = batch_inputs(b=2, n=MAXLEN)
    with torch.no_grad():
        ref = hf(ids)
        out = model(ids)
    close(out.last_hidden_state, ref.last_hidden_state, "hidden")


def test_hf_sdpa_model_matches_too(hf_dirs):
    _, d = hf_dirs["base"]
    hf = transformers.BertModel.from_pretrained(d, attn_implementation="sdpa").eval()
    model = BERT.from_hf(d).eval()
    ids, am, tt = batch_inputs(b=4, n=9, gen_seed=3)
    with torch.no_grad():
        ref = hf(ids, attention_mask=am, token_type_ids=tt).last_hidden_state
        out = model(ids, am, tt).last_hidden_state
    close(out[am.bool()], ref[am.bool()], "hidden vs HF sdpa")


def test_attentions_match_hf_eager(hf_dirs):
    hf, d = hf_dirs["base"]
    model = BERT.from_hf(d).eval()
    ids, am, tt = batch_inputs()
    with torch.no_grad():
        ref = hf(ids, attention_mask=am, token_type_ids=tt, output_attentions=True).attentions
        out = model(ids, am, tt, output_attentions=True).attentions
    assert len(out) == len(ref) == 2
    keep = am.bool()
    for i, (a, r) in enumerate(zip(out, ref, strict=True)):
        assert a.shape == (3, 4, 17, 17)
        # rows of real queries: equal (HF gives exactly 0 weight to padded keys too)
        close(a.permute(0, 2, 1, 3)[keep], r.permute(0, 2, 1, 3)[keep], f"layer {i}")
        sums = a.sum(-1)[keep[:, None, :].expand(-1, 4, -1)]
        close(sums, torch.ones_like(sums), "rows sum to 1")


def test_mlm_logits_match_hf_bertformaskedlm(hf_dirs):
    hf, d = hf_dirs["mlm"]
    keys = load_file(Path(d) / "model.safetensors")
    assert all(k.startswith(("bert.", "cls.")) for k in keys)  # the prefixed layout
    model = BERT.from_hf(d).eval()
    assert model.pooler is None and model.mlm is not None
    ids, am, tt = batch_inputs()
    with torch.no_grad():
        ref = hf(ids, attention_mask=am, token_type_ids=tt).logits
        got = model.masked_lm(ids, am, tt)
    assert got.shape == (3, 17, V)
    close(got[am.bool()], ref[am.bool()], "MLM logits")


def test_old_layout_gamma_beta_decoder_and_nsp_keys_are_understood(hf_dirs, tmp_path):
    hf, d = hf_dirs["mlm"]
    state = load_file(Path(d) / "model.safetensors")
    old = {}
    for k, t in state.items():
        if k.endswith("LayerNorm.weight"):
            k = k[: -len("weight")] + "gamma"
        elif k.endswith("LayerNorm.bias"):
            k = k[: -len("bias")] + "beta"
        old[k] = t
    old["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"].clone()
    old["cls.predictions.decoder.bias"] = state["cls.predictions.bias"].clone()
    old["cls.seq_relationship.weight"] = torch.zeros(2, C)
    old["cls.seq_relationship.bias"] = torch.zeros(2)
    old["bert.embeddings.position_ids"] = torch.arange(MAXLEN)[None]
    save_file({k: v.contiguous() for k, v in old.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(d) / "config.json").read_text())
    model = BERT.from_hf(tmp_path).eval()
    ids, am, tt = batch_inputs(b=2)
    with torch.no_grad():
        close(model.masked_lm(ids, am, tt)[am.bool()],
              hf(ids, attention_mask=am, token_type_ids=tt).logits[am.bool()], "old layout")


# ------------------------------------------------------------------------ equivalences

def tiny(**kw) -> BERT:
    return BERT(BERTConfig.from_name("bert-tiny", vocab_size=V, max_len=MAXLEN, **kw))


def test_batch_row_equals_single_run():
    model = tiny().eval()
    ids, am, tt = batch_inputs()
    with torch.no_grad():
        full = model(ids, am, tt)
        for b in range(3):
            n = int(am[b].sum())
            one = model(ids[b:b + 1, :n], None, tt[b:b + 1, :n])  # unpadded, alone
            close(full.last_hidden_state[b, :n], one.last_hidden_state[0], f"row {b}")
            close(full.pooler_output[b], one.pooler_output[0], f"pooler row {b}")


def test_key_padding_mask_equals_padding_mask():
    model = tiny().eval()
    x = torch.randn(3, 17, 128)  # (B, N, C)
    _, am, _ = batch_inputs()
    keep = am.bool()
    layer = model.layers[0]
    with torch.no_grad():
        a = layer(x, mask=Padding(keep=keep))
        b = layer(x, mask=key_padding_mask(keep))
    close(b[keep], a[keep], "dense (B, 1, 1, N) mask vs Padding")


def test_fully_padded_row_is_finite_and_leaves_other_rows_alone():
    model = tiny().eval()
    ids, am, tt = batch_inputs()
    am[2] = 0
    with torch.no_grad():
        out = model(ids, am, tt).last_hidden_state
        ref = model(ids[:2], am[:2], tt[:2]).last_hidden_state
    assert torch.isfinite(out).all()
    assert torch.equal(out[~am.bool()], torch.zeros_like(out[~am.bool()]))  # padded: zeros
    close(out[:2][am[:2].bool()], ref[am[:2].bool()], "rows 0-1")


def test_padded_batch_gradients_equal_per_row_gradients():
    """The packed (real tokens only) path backpropagates like unpadded single runs."""
    model = tiny(dropout=0.0, attn_dropout=0.0).train()
    ids, am, tt = batch_inputs()
    keep = am.bool()
    out = model(ids, am, tt).last_hidden_state  # (B, N, C)
    (out[keep] ** 2).sum().backward()
    batched = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for b in range(3):
        n = int(am[b].sum())
        (model(ids[b:b + 1, :n], None, tt[b:b + 1, :n]).last_hidden_state ** 2).sum().backward()
    for k, g in batched.items():
        torch.testing.assert_close(g, model.get_parameter(k).grad, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, k=k: f"grad {k}: {m}")


class _Scaled(torch.nn.Module):
    """A stand-in for an adapter: wraps a Linear and changes its output."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return 2 * self.lin(x)


@pytest.mark.parametrize("padded", [False, True])
def test_swapped_in_parts_are_honoured(padded):
    """A layer whose parts were replaced runs its own forward (no shortcut through them)."""
    model = tiny().eval()
    ids, am, tt = batch_inputs()
    am = am if padded else None
    keep = torch.ones(3, 17, dtype=torch.bool) if am is None else am.bool()
    model.layers[1].ffn.fc_in = _Scaled(model.layers[1].ffn.fc_in)
    with torch.no_grad():
        got = model(ids, am, tt).last_hidden_state
        x = model.embed(ids, tt)
        mask = None if am is None else key_padding_mask(keep)
        for layer in model.layers:
            x = layer(x, mask=mask)
    close(got[keep], x[keep], "swapped-in fc_in")


@pytest.mark.parametrize("padded", [False, True])
def test_no_grad_fast_path_equals_autograd_path(padded):
    """Without grad, activations run in place and projections reuse buffers: same values."""
    model = tiny().eval()
    ids, am, tt = batch_inputs()
    am = am if padded else None
    with_grad = model(ids, am, tt).last_hidden_state
    with torch.inference_mode():
        fast = model(ids, am, tt).last_hidden_state
    torch.testing.assert_close(fast, with_grad.detach(), atol=1e-6, rtol=1e-6)


def test_minilm_l6_preset_matches_hf_at_that_shape(tmp_path):
    """The minilm-l6 preset's shape (all-MiniLM-L6-v2) loads from HF and matches it."""
    c = BERTConfig.from_name("minilm-l6")
    hf = transformers.BertModel(hf_config(
        hidden_size=c.dim, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        intermediate_size=c.ffn_hidden, vocab_size=c.vocab_size,
        max_position_embeddings=c.max_len)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = BERT.from_hf(tmp_path)
    cfg = model.config
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.ffn_hidden, cfg.vocab_size,
            cfg.max_len) == (c.dim, c.num_layers, c.num_heads, c.ffn_hidden, c.vocab_size,
                             c.max_len)
    ids = torch.randint(0, c.vocab_size, (2, 40))
    am = torch.ones(2, 40, dtype=torch.long)
    am[1, 25:] = 0
    with torch.no_grad():
        ref = hf(ids, attention_mask=am).last_hidden_state
        out = model(ids, am).last_hidden_state
    close(out[am.bool()], ref[am.bool()], "minilm-l6 shape")
    close(mean_pool(out, am), mean_pool(ref * am[..., None], am), "mean-pooled")


def test_left_padding_with_positions_equals_unpadded():
    model = tiny().eval()
    ids = torch.randint(1, V, (2, 9))
    am = torch.ones(2, 9, dtype=torch.long)
    am[0, :4] = 0  # left padding
    pos = positions_from_mask(am.bool())  # (B, N)
    with torch.no_grad():
        out = model(ids, am, position_ids=pos).last_hidden_state
        alone = model(ids[:1, 4:]).last_hidden_state
    close(out[0, 4:], alone[0], "left-padded row")


def test_two_eval_forwards_identical_and_save_load_round_trip_exact(tmp_path):
    model = tiny().eval()
    perturb_(model)
    ids, am, tt = batch_inputs()
    with torch.no_grad():
        a = model(ids, am, tt)
        b = model(ids, am, tt)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qkv-bert"
    loaded = BERT.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    with torch.no_grad():
        c = loaded(ids, am, tt)
        assert torch.equal(a.last_hidden_state, c.last_hidden_state)
        assert torch.equal(model.masked_lm(ids, am, tt), loaded.masked_lm(ids, am, tt))


def test_mlm_head_is_tied_to_word_embeddings():
    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    assert not any("decoder" in n for n in names)  # the decoder is word_embeddings.weight
    logits = model.masked_lm(torch.tensor([[5, 6]]))
    logits.sum().backward()
    assert model.word_embeddings.weight.grad is not None


def test_tiny_model_overfits_tiny_mlm_batch():
    torch.manual_seed(0)
    model = tiny(dropout=0.0, attn_dropout=0.0).train()
    ids, am, tt = batch_inputs(b=4, n=12, gen_seed=5)
    labels = torch.full_like(ids, -100)
    masked = ids.clone()
    pos = torch.tensor([[1, 3], [2, 5], [0, 4], [1, 2]])
    for b in range(4):
        labels[b, pos[b]] = ids[b, pos[b]]
        masked[b, pos[b]] = 100  # a "[MASK]" id
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(80):
        loss, _ = model.masked_lm(masked, am, tt, labels=labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, loss.item()


def test_mean_pool_ignores_padding():
    h = torch.randn(2, 5, 3)  # (B, N, C)
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = mean_pool(h, am)  # (B, C)
    close(got[0], h[0, :3].mean(0), "row 0")
    close(got[1], h[1].mean(0), "row 1")
    assert torch.equal(mean_pool(h), h.mean(1))


def test_presets():
    base = BERTConfig.from_name("bert-base")
    assert (base.dim, base.num_layers, base.num_heads, base.ffn_hidden, base.vocab_size,
            base.max_len, base.norm_eps) == (768, 12, 12, 3072, 30522, 512, 1e-12)
    mini = BERTConfig.from_name("minilm-l6")
    assert (mini.dim, mini.num_layers, mini.num_heads, mini.ffn_hidden) == (384, 6, 12, 1536)
    t = BERTConfig.from_name("bert-tiny")
    assert (t.dim, t.num_layers, t.num_heads) == (128, 2, 2)
    with pytest.raises(ValueError, match="num_heads"):
        BERTConfig(dim=100, num_heads=12)


def test_load_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello world").ids == [2, 3]


# ------------------------------------------------------------------------------ errors

@pytest.mark.parametrize(("kwargs", "match"), [
    ({"input_ids": torch.tensor([[1, V]])}, r"input_ids holds token id 101, outside \[0, 101\)"),
    ({"input_ids": torch.tensor([[1, -1]])}, r"input_ids holds token id -1"),
    ({"input_ids": torch.ones(1, MAXLEN + 1, dtype=torch.long)}, "exceeds max_len=64"),
    ({"token_type_ids": torch.tensor([[0, 2]])},
     r"token_type_ids holds token id 2.*type_vocab_size"),
    ({"token_type_ids": torch.tensor([[0, 1, 1]])}, r"token_type_ids must have shape"),
    ({"attention_mask": torch.ones(1, 3)}, r"attention_mask must have shape"),
    ({"input_ids": torch.ones(2, 3)}, r"input_ids must be an integer tensor"),
])
def test_bad_inputs_raise_naming_the_problem(kwargs, match):
    model = tiny().eval()
    args = {"input_ids": torch.tensor([[1, 2]]), **kwargs}
    err = TypeError if "integer tensor" in match else ValueError
    with pytest.raises(err, match=match):
        model(**args)


def _copy_checkpoint(src: Path, dst: Path, edit) -> Path:
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: s.pop("encoder.layer.1.attention.self.key.weight"),
     r"missing keys \['encoder.layer.1.attention.self.key.weight'\]"),
    (lambda s: s.pop("encoder.layer.0.output.LayerNorm.bias"),
     r"missing keys \['encoder.layer.0.output.LayerNorm.bias'\]"),
    (lambda s: s.__setitem__("encoder.layer.0.intermediate.dense.weight", torch.zeros(96, C)),
     r"encoder.layer.0.intermediate.dense.weight: checkpoint \(96, 64\) vs expected \(128, 64\)"),
    (lambda s: s.__setitem__("encoder.layer.0.attention.self.value.bias", torch.zeros(65)),
     r"attention.self.value.bias: checkpoint \(65,\) vs expected \(64,\)"),
    (lambda s: s.__setitem__("encoder.layer.0.attention.self.extra", torch.zeros(1)),
     r"unknown keys \['encoder.layer.0.attention.self.extra'\]"),
])
def test_mismatched_hf_checkpoint_gives_clear_error(hf_dirs, tmp_path, edit, match):
    _, d = hf_dirs["base"]
    bad = _copy_checkpoint(Path(d), tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        BERT.from_hf(bad)


def test_mismatched_qkv_checkpoint_gives_clear_error(tmp_path):
    tiny().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["layers.0.attn.in_proj.weight"]
    state["pooler.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys.*in_proj.*pooler.weight"):
        BERT.from_pretrained(tmp_path)


def test_unsupported_hf_config_refused(hf_dirs, tmp_path):
    _, d = hf_dirs["base"]
    _copy_checkpoint(Path(d), tmp_path, lambda s: None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["position_embedding_type"] = "relative_key"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="position_embedding_type"):
        BERT.from_hf(tmp_path)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_crafted_pickle_refused_by_default_and_by_weights_only(hf_dirs, tmp_path):
    _, d = hf_dirs["base"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((Path(d) / "config.json").read_text())
    marker = tmp_path / "marker"
    with open(ckpt / "pytorch_model.bin", "wb") as f:
        pickle.dump({"embeddings.word_embeddings.weight": _Evil(str(marker))}, f, protocol=2)
    with pytest.raises(CheckpointError, match="pickle"):
        BERT.from_hf(ckpt)
    with pytest.raises(CheckpointError, match="pickle"):
        BERT.from_pretrained(ckpt)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="weights_only"):
        BERT.from_hf(ckpt, allow_pickle=True)
    assert not marker.exists()


def test_tensor_only_pickle_loads_when_allowed(hf_dirs, tmp_path):
    hf, d = hf_dirs["base"]
    torch.save(load_file(Path(d) / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((Path(d) / "config.json").read_text())
    model = BERT.from_hf(tmp_path, allow_pickle=True).eval()
    ids = torch.tensor([[2, 3, 4]])
    with torch.no_grad():
        close(model(ids).last_hidden_state, hf(ids).last_hidden_state, "pickle-loaded")


def test_mlm_logits_without_head_raises():
    model = tiny(with_mlm_head=False)
    with pytest.raises(ValueError, match="no masked-LM head"):
        model.mlm_logits(torch.zeros(1, 2, 128))
