"""qkv.models.GPT against HF transformers' GPT-2 (random weights) and its own equivalences.

Shapes: B batch, N length, S key length (cached + new), V vocab, C width, H heads, L layers.

Tolerances: logits and attention weights vs HF in fp32: atol 1e-5 (the two compute the same
math with different kernels: fused GELU, SDPA). Cache/batch/padding equivalences within qkv:
atol 1e-5, rtol 1e-5. Save/load: exact (torch.equal).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.models.gpt import GPT, GPTConfig, GPTOutput, load_tokenizer
from qkv.models.hf_gpt2 import convert_hf_state_dict
from qkv.models.hub import CheckpointError

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
RTOL = 1e-5
VOCAB = 97


def _close(a, b, atol=ATOL, rtol=RTOL, what=""):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _hf_model(attn: str = "sdpa"):
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  vocab_size=VOCAB, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1234)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = attn  # "eager" for output_attentions
    with torch.no_grad():  # non-trivial norms and biases, so a mapping mistake shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An HF GPT-2 directory (config.json + model.safetensors) and the model that wrote it."""
    path = tmp_path_factory.mktemp("hf_gpt2")
    model = _hf_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, safe_serialization=True)
    return path, model


def _left_pad(rows: list[torch.Tensor], pad_id: int = 0):
    """ids (B, N) left-padded with pad_id and mask (B, N) long, 1 = real token."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = r
        mask[i, n - len(r):] = 1
    return ids, mask


def _tiny(**overrides) -> GPT:
    cfg = GPTConfig.from_name("gpt-tiny", vocab_size=VOCAB, max_len=64, dim=64, **overrides)
    torch.manual_seed(7)
    return GPT(cfg).eval()


# ------------------------------------------------------------------------- HF equivalence


def test_from_hf_logits_equal_hf(hf_dir):
    path, hf = hf_dir
    model = GPT.from_hf(path)
    assert not model.training
    ids = torch.randint(0, VOCAB, (3, 23))
    with torch.no_grad():
        _close(model(ids), hf(ids).logits, what="logits vs HF")


def test_from_pretrained_dispatches_to_hf(hf_dir):
    path, hf = hf_dir
    model = GPT.from_pretrained(path)
    assert model.config.dim == 64 and model.config.activation == "gelu_tanh"
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        _close(model(ids), hf(ids).logits, what="logits via from_pretrained")


def test_left_padding_matches_hf(hf_dir):
    path, hf = hf_dir
    model = GPT.from_hf(path)
    rows = [torch.randint(1, VOCAB, (n,)) for n in (11, 5, 8)]
    ids, mask = _left_pad(rows)
    pos = mask.cumsum(-1) - 1
    pos = pos.masked_fill(mask == 0, 1)  # what HF's generate does
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = model(ids, attention_mask=mask)
    real = mask.bool()
    _close(got[real], want[real], what="left-padded logits vs HF (real tokens)")


def test_attention_weights_match_hf_eager(hf_dir):
    path, _ = hf_dir
    hf = _hf_model("eager")
    model = GPT.from_hf(path)
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        want = hf(ids, output_attentions=True)
        got = model(ids, output_attentions=True)
    assert isinstance(got, GPTOutput)
    assert len(got.attentions) == 2 == len(want.attentions)
    _close(got.logits, want.logits, what="logits")
    for i, (a, b) in enumerate(zip(got.attentions, want.attentions, strict=True)):
        assert a.shape == (2, 4, 13, 13)
        _close(a, b, what=f"layer {i} attention weights")
        _close(a.sum(-1), torch.ones(2, 4, 13), what="rows sum to 1")


def test_convert_hf_state_without_prefix(hf_dir):
    _, hf = hf_dir
    model = _tiny()
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    state.pop("lm_head.weight")
    conv = convert_hf_state_dict(state, model.config)
    model.load_state_dict(conv, strict=True)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        _close(model(ids), hf(ids).logits, what="logits from GPT2Model-style keys")


def test_hf_buffers_ignored(tmp_path, hf_dir):
    path, hf = hf_dir
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    state["transformer.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64)).bool()
    state["transformer.h.1.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = GPT.from_hf(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        _close(model(ids), hf(ids).logits, what="logits with old mask buffers present")


# ---------------------------------------------------------------------- broken checkpoints


def _copy_ckpt(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_key_is_a_clear_error(tmp_path, hf_dir):
    path, _ = hf_dir
    _copy_ckpt(path, tmp_path, lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(CheckpointError, match=r"missing keys.*layers\.1\.ffn\.fc_in\.bias"):
        GPT.from_hf(tmp_path)


def test_shape_mismatch_is_a_clear_error(tmp_path, hf_dir):
    path, _ = hf_dir
    def edit(s):
        s["transformer.h.0.attn.c_proj.weight"] = torch.zeros(64, 32)
    _copy_ckpt(path, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"shape mismatches.*layers\.0\.attn\.out_proj"):
        GPT.from_hf(tmp_path)


def test_unexpected_key_is_a_clear_error(tmp_path, hf_dir):
    path, _ = hf_dir
    def edit(s):
        s["transformer.h.0.attn.q_attn.weight"] = torch.zeros(64, 64)
    _copy_ckpt(path, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected keys.*q_attn"):
        GPT.from_hf(tmp_path)


def test_failed_load_leaves_nothing_half_loaded(tmp_path, hf_dir):
    """check_and_load semantics: the error comes before any tensor is copied."""
    path, _ = hf_dir
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from safetensors.torch import load_file

    from qkv.models.hub import check_and_load

    state = convert_hf_state_dict(load_file(path / "model.safetensors"), model.config)
    state.pop("layers.1.norm2.bias")
    with pytest.raises(CheckpointError):
        check_and_load(model, state, "test")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_non_gpt2_config_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="gpt2"):
        GPT.from_hf(tmp_path)


class _Evil:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_crafted_pickle_refused(tmp_path, hf_dir):
    path, _ = hf_dir
    marker = tmp_path / "marker.txt"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((path / "config.json").read_text())
    torch.save({"transformer.wte.weight": _Evil(str(marker))}, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        GPT.from_hf(ckpt)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="weights_only"):
        GPT.from_hf(ckpt, allow_pickle=True)
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        GPT.from_pretrained(ckpt, allow_pickle=True)
    assert not marker.exists()
    # the crafted file does run code when loaded unsafely: the test's premise holds
    torch.load(ckpt / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert load_tokenizer(tmp_path) is None
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello world foo").ids == [1, 2, 0]


# --------------------------------------------------------------------------------- cache


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cache_decode_equals_full_forward(positions):
    model = _tiny(positions=positions)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 16)
        steps = [model(ids[:, :5], cache=cache)]
        for t in range(5, 12):
            steps.append(model(ids[:, t:t + 1], cache=cache))
    assert cache[0].length == 12
    _close(torch.cat(steps, dim=1), full, what=f"cached decode vs full ({positions})")


def _greedy(model: GPT, ids: torch.Tensor, steps: int, cache):
    """Greedy decoding with a cache: prefill ``ids``, then ``steps`` new tokens (B, steps)."""
    out = []
    x = ids
    for _ in range(steps):
        x = model(x, cache=cache)[:, -1:].argmax(-1)  # (B, 1)
        out.append(x)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_generate_continue_equivalence(positions):
    model = _tiny(positions=positions)
    prompt = torch.randint(0, VOCAB, (2, 6))
    n = 8
    with torch.no_grad():
        cache = model.new_cache(2, 32)
        all_n = _greedy(model, prompt, n, cache=cache)
        cache2 = model.new_cache(2, 32)
        first = _greedy(model, prompt, n - 1, cache=cache2)
        last = model(first[:, -1:], cache=cache2)[:, -1:].argmax(-1)
        # and without any cache: re-run the whole sequence each step
        seq = prompt
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(all_n, torch.cat([first, last], dim=1))
    assert torch.equal(all_n, seq[:, prompt.shape[1]:])


def test_cache_with_left_padding_equals_unpadded():
    model = _tiny(positions="rope")
    rows = [torch.randint(1, VOCAB, (n,)) for n in (7, 3)]
    ids, mask = _left_pad(rows)
    with torch.no_grad():
        cache = model.new_cache(2, 20)
        logits = model(ids, attention_mask=mask, cache=cache)
        nxt = logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        step = model(nxt, attention_mask=mask, cache=cache)
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[i]])[None])
            _close(step[i, -1], alone[0, -1], what=f"row {i} decode step vs alone")


def test_cache_attention_mask_must_cover_past():
    model = _tiny()
    with torch.no_grad():
        cache = model.new_cache(1, 8)
        model(torch.randint(0, VOCAB, (1, 3)), cache=cache)
        with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, S\) = \(1, 4\)"):
            model(torch.randint(0, VOCAB, (1, 1)), cache=cache,
                  attention_mask=torch.ones(1, 1, dtype=torch.long))


# ------------------------------------------------------------------------ equivalences


def test_batch_row_equals_single_run():
    model = _tiny()
    ids = torch.randint(0, VOCAB, (4, 19))
    with torch.no_grad():
        batch = model(ids)
        for i in range(4):
            _close(batch[i], model(ids[i:i + 1])[0], what=f"row {i}")


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_left_padded_batch_equals_unpadded(positions):
    model = _tiny(positions=positions)
    rows = [torch.randint(1, VOCAB, (n,)) for n in (9, 2, 5)]
    ids, mask = _left_pad(rows)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask.bool())
        for i, r in enumerate(rows):
            _close(padded[i, -len(r):], model(r[None])[0], what=f"row {i} ({positions})")


def test_two_eval_forwards_identical():
    model = _tiny(dropout=0.1, attn_dropout=0.1)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids))


def test_save_load_round_trip(tmp_path):
    model = _tiny()
    path = model.save_pretrained(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qkv-gpt"
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # tied: not saved
    loaded = GPT.from_pretrained(path).eval()
    assert loaded.config == model.config
    assert loaded.lm_head.weight is loaded.embed.weight
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_save_load_untied(tmp_path):
    model = _tiny(tie_embeddings=False)
    assert model.lm_head.weight is not model.embed.weight
    loaded = GPT.from_pretrained(model.save_pretrained(tmp_path))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.embed.weight)


def test_loss_equals_cross_entropy_of_logits():
    model = _tiny().train()
    ids = torch.randint(0, VOCAB, (3, 15))
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    targets[0, 3] = -100
    loss = model.loss(ids, targets, chunk=7)  # chunk not dividing B·N
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    _close(loss, ref, what="loss")
    for g, r in zip(grads, ref_grads, strict=True):
        _close(g, r, atol=1e-6, rtol=1e-4, what="grad")


@pytest.mark.parametrize("tie", [True, False])
def test_lm_head_and_loss_on_the_onednn_path_against_fp64(monkeypatch, tie):
    """The LM head (forward) and the fused linear cross-entropy (its chunked GEMMs) through
    qkv.ops.fast_linear with oneDNN forced on these small shapes: logits, loss and every
    parameter's gradient (full fine-tuning: the head's weight gradient too) against an fp64
    copy of the model with the full logits and F.cross_entropy.
    Tolerances: logits and loss atol 5e-5 rtol 5e-6 (docs/ARCHITECTURE.md: Tolerances);
    gradients atol 1e-6 rtol 1e-4 (fp32 sums over B·N rows)."""
    import qkv.ops.fast_linear as fl

    if not fl.onednn_linear_active():
        pytest.skip("no working oneDNN linear in this torch build")
    monkeypatch.setattr(fl, "MIN_ROWS", 1)
    monkeypatch.setattr(fl, "MIN_MACS", 1)
    shapes = []
    op = fl.onednn_op()

    def counting_op(x, w, *rest):
        shapes.append(tuple(w.shape))
        return op(x, w, *rest)

    monkeypatch.setitem(fl._checked, "op", counting_op)
    model = _tiny(tie_embeddings=tie).train()
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, VOCAB, (3, 15))
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    targets[2, 5] = -100
    with torch.no_grad():
        _close(model(ids).double(), ref(ids), atol=5e-5, rtol=5e-6, what="logits")
    assert (VOCAB, model.config.dim) in shapes  # the head's forward went through oneDNN
    shapes.clear()
    loss = model.loss(ids, targets, chunk=7)  # chunk not dividing B·N
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert (VOCAB, model.config.dim) in shapes and (model.config.dim, VOCAB) in shapes
    want = F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten())
    want_grads = torch.autograd.grad(want, list(ref.parameters()))
    _close(loss.double(), want, atol=5e-5, rtol=5e-6, what="loss")
    for (name, _), g, w in zip(model.named_parameters(), grads, want_grads, strict=True):
        _close(g.double(), w, atol=1e-6, rtol=1e-4, what=name)


def test_tiny_model_overfits_tiny_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=32, max_len=16, dim=64)).train()
    ids = torch.randint(0, 32, (4, 16))
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(100):
        loss = model.loss(ids, targets)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.0  # ~ln(32) at init
    assert loss.item() < 0.1, loss.item()


def test_rope_model_has_no_position_table():
    model = _tiny(positions="rope")
    assert model.positions is None
    assert all(layer.attn.rope is model.rope for layer in model.layers)
    with torch.no_grad():  # no max_len limit with rope
        assert model(torch.randint(0, VOCAB, (1, 70))).shape == (1, 70, VOCAB)


# ------------------------------------------------------------------------------- errors


def test_bad_token_ids():
    model = _tiny()
    with pytest.raises(ValueError, match=r"token id 97, .*vocab_size=97"):
        model(torch.tensor([[1, 97, 3]]))
    with pytest.raises(ValueError, match=r"token id -1, .*vocab_size=97"):
        model(torch.tensor([[1, -1, 3]]))


def test_too_long_input():
    model = _tiny()  # max_len 64, learned positions
    with pytest.raises(ValueError, match="max_len=64"):
        model(torch.randint(0, VOCAB, (1, 65)))
    with torch.no_grad():
        cache = model.new_cache(1, 80)
        model(torch.randint(0, VOCAB, (1, 60)), cache=cache)
        with pytest.raises(ValueError, match=r"cached 60 \+ new 5.*max_len=64"):
            model(torch.randint(0, VOCAB, (1, 5)), cache=cache)


def test_wrong_dtype_and_rank():
    model = _tiny()
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        model([[1, 2, 3]])
    with pytest.raises(TypeError, match="attention_mask"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.tensor([[1, 2]]), position_ids=torch.arange(3))


def test_config_presets_and_validation():
    assert GPTConfig.from_name("gpt2").dim == 768
    cfg = GPTConfig.from_name("gpt-small-cpu")
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.vocab_size, cfg.max_len) == (
        6, 384, 6, 8192, 256)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="num_heads"):
        GPTConfig.from_name("gpt-tiny", num_heads=5)
    with pytest.raises(ValueError, match="positions"):
        GPTConfig.from_name("gpt-tiny", positions="alibi")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 3


def test_gpt2_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("gpt2"))
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_cache_past_capacity_raises():
    model = _tiny()
    with torch.no_grad():
        cache = model.new_cache(1, 4)
        model(torch.randint(0, VOCAB, (1, 3)), cache=cache)
        with pytest.raises(ValueError, match="capacity 4"):
            model(torch.randint(0, VOCAB, (1, 2)), cache=cache)


def test_grouped_query_cache_decode():
    model = _tiny(num_kv_heads=2, positions="rope")
    assert model.new_cache(1, 8)[0].num_kv_heads == 2
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 9)
        steps = [model(ids[:, t:t + 1], cache=cache) for t in range(9)]
    _close(torch.cat(steps, dim=1), full, what="GQA cached decode vs full")


def test_padded_attention_weights():
    """Real query rows sum to 1 and give padding keys 0; padding query rows are all 0."""
    model = _tiny()
    ids, mask = _left_pad([torch.randint(1, VOCAB, (n,)) for n in (6, 3)])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    keep = mask.bool()
    for w in out.attentions:  # (B, H, N, S)
        assert w.shape == (2, 4, 6, 6)
        rows = w.sum(-1)  # (B, H, N)
        _close(rows, keep[:, None, :].expand_as(rows).float(), what="row sums")
        assert (w * ~keep[:, None, None, :]).abs().max() == 0


def test_float64_model_matches_float32():
    model = _tiny()
    model64 = _tiny().double()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        _close(model(ids).double(), model64(ids), atol=1e-4, rtol=1e-4, what="fp32 vs fp64")


def test_small_integer_ids_accepted():
    model = _tiny()
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(ids.to(torch.uint8)), model(ids))
        assert torch.equal(model(ids.int()), model(ids))
