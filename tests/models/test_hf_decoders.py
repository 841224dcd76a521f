"""Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2 and Phi-3 directories load into qkv's GPT and
compute what transformers computes (docs/ARCHITECTURE.md: Adding a model family).

Oracle: transformers' own CausalLM classes, built from tiny configs with random weights
(tests/models/_hf_decoders.py), eager attention, fp32. Tolerances: logits within 1e-5 of
the logits' largest magnitude (the issue's "relative to the logits' scale"); greedy tokens
exactly equal; cached decoding equal to the full forward within 1e-5 likewise.
"""

from __future__ import annotations

import json

import pytest
import torch
from _hf_decoders import FAMILIES, hf_logits, hf_model, left_padded, save_hf, transformers

from qkv.files import CheckpointError
from qkv.models import GPT, from_pretrained
from qkv.modules.quantized import QuantizedLinear

NAMES = sorted(FAMILIES)


def _close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> None:
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x logits scale {scale:.3g}"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """name -> (HF model, qkv model loaded from its saved directory, the directory)."""
    out = {}
    for name in NAMES:
        hf = hf_model(name)
        d = save_hf(hf, tmp_path_factory.mktemp(name))
        out[name] = (hf, from_pretrained(d), d)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(loaded, name):
    hf, ours, _ = loaded[name]
    assert isinstance(ours, GPT)
    ids, mask = left_padded()
    with torch.no_grad():
        full = ours(ids[:1])
        padded = ours(ids, attention_mask=mask)
    _close(full, hf_logits(hf, ids[:1]))
    theirs = hf_logits(hf, ids, mask)
    keep = mask.bool()
    _close(padded[keep], theirs[keep])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_hf_generate(loaded, name):
    import qkv

    hf, ours, _ = loaded[name]
    ids, mask = left_padded(seed=2, lengths=(6, 4))
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
    mine = qkv.generate(ours, ids, attention_mask=mask, max_new_tokens=32, eos_token_id=None,
                        pad_token_id=0)[:, ids.shape[1]:]  # the same arguments as HF's
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_cache_decode_equals_full_forward(loaded, name):
    _, ours, _ = loaded[name]
    ids, mask = left_padded(seed=3, lengths=(12, 9))
    n = ids.shape[1]
    with torch.no_grad():
        full = ours(ids, attention_mask=mask)
        cache = ours.new_cache(2, n)
        steps = [ours(ids[:, :5], attention_mask=mask[:, :5], cache=cache)]
        for t in range(5, n):
            steps.append(ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache))
    stepped = torch.cat(steps, dim=1)
    keep = mask.bool()
    _close(stepped[keep], full[keep])


@pytest.mark.parametrize("name", ["llama", "llama3-scaled", "phi3", "gemma2"])
def test_both_rope_spellings_load_the_same(loaded, name, tmp_path):
    hf, ours, _ = loaded[name]
    d = save_hf(hf, tmp_path / "legacy", legacy_rope=True)
    assert "rope_parameters" not in json.loads((d / "config.json").read_text())
    legacy = from_pretrained(d)
    assert legacy.config == ours.config
    ids, _ = left_padded()
    with torch.no_grad():
        assert torch.equal(legacy(ids), ours(ids))


def test_variants_reach_the_config(loaded):
    """What each family's own fields turn into (a mapping that dropped one would still load)."""
    c = {name: loaded[name][1].config for name in NAMES}
    assert c["llama"].rope_base == 500000.0 and not c["llama"].tie_embeddings
    assert c["llama-bias-tied"].biases() == (True, True, True)
    assert c["llama-bias-tied"].attention_head_dim == 16 and c["llama-bias-tied"].tie_embeddings
    assert c["llama3-scaled"].rope_scaling["rope_type"] == "llama3"
    assert c["mistral"].attention_window == 5 and c["mistral"].windowed_layers is None
    assert c["qwen2"].biases() == (True, False, False) and c["qwen2"].tie_embeddings
    assert c["qwen3"].qk_norm and c["qwen3"].head_dim == 16
    assert c["gemma"].norm == "rmsnorm_plus_one" and c["gemma"].embed_scale
    assert c["gemma"].activation == "geglu_tanh"
    g2 = c["gemma2"]
    assert (g2.post_norms, g2.attn_softcap, g2.logit_softcap) == (True, 5.0, 3.0)
    assert g2.windowed_layers == (0, 2) and g2.attention_window == 4
    assert g2.attention_scale == pytest.approx(12 ** -0.5)
    assert c["phi3"].attention_window == 6


def _write_config(d, **changes):
    path = d / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_bad_directories_refused_in_one_line(tmp_path):
    hf = hf_model("llama")
    d = save_hf(hf, tmp_path / "ok")
    # an unknown rope type
    bad = save_hf(hf, tmp_path / "rope")
    _write_config(bad, rope_parameters={"rope_type": "warp", "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="warp") as err:
        from_pretrained(bad)
    assert "\n" not in str(err.value)
    # longrope: refused, not approximated
    bad = save_hf(hf, tmp_path / "longrope")
    _write_config(bad, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                        "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    with pytest.raises(CheckpointError, match="longrope"):
        from_pretrained(bad)
    # a model_type qkv does not know
    bad = save_hf(hf, tmp_path / "type")
    _write_config(bad, model_type="falcon")
    with pytest.raises(CheckpointError, match="falcon"):
        from_pretrained(bad)
    # an index naming a shard that is not there
    shard = save_hf(hf, tmp_path / "shards")
    (shard / "model.safetensors").rename(shard / "model-00001-of-00002.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="00002"):
        from_pretrained(shard)
    # a config whose head count does not fit the weights
    bad = save_hf(hf, tmp_path / "heads")
    _write_config(bad, num_key_value_heads=4)
    with pytest.raises(CheckpointError):
        from_pretrained(bad)
    assert from_pretrained(d) is not None  # the untouched directory still loads


def test_gemma_legacy_gelu_is_the_tanh_gelu(tmp_path):
    """Gemma 1 configs say hidden_act "gelu" and mean the tanh GELU (as transformers reads
    them); a hidden_activation that disagrees is refused."""
    hf = hf_model("gemma")
    d = save_hf(hf, tmp_path / "g")
    _write_config(d, hidden_act="gelu")
    assert from_pretrained(d).config.activation == "geglu_tanh"
    _write_config(d, hidden_act="gelu", hidden_activation="silu")
    with pytest.raises(CheckpointError, match="hidden_activation"):
        from_pretrained(d)


FAMILY_MAPPINGS = {m.model_type: m for m in GPT.hf_mappings if m.model_type != "gpt2"}


@pytest.mark.parametrize("model_type", sorted(FAMILY_MAPPINGS))
def test_every_field_of_transformers_config_is_classified(model_type):
    """Every field transformers writes for the family (5.x names) is used, ignored with a
    reason, or checked: a new transformers field fails here, not silently in a user's run."""
    from qkv.models import hf_gemma, hf_llama, hf_phi3
    families = {f.model_type: f for mod in (hf_llama, hf_gemma, hf_phi3)
                for f in vars(mod).values() if hasattr(f, "table") and hasattr(f, "extra")}
    table = families[model_type].table()
    written = set(transformers.AutoConfig.for_model(model_type).to_dict())
    assert sorted(written - set(table)) == []


def test_a_refused_value_names_the_field(tmp_path):
    hf = hf_model("gemma2")
    d = save_hf(hf, tmp_path / "g2")
    _write_config(d, use_bidirectional_attention=True)
    with pytest.raises(CheckpointError, match="use_bidirectional_attention"):
        from_pretrained(d)


def test_an_unknown_field_warns(tmp_path):
    d = save_hf(hf_model("qwen3"), tmp_path / "q3")
    _write_config(d, some_future_option=3)
    with pytest.warns(UserWarning, match="some_future_option"):
        from_pretrained(d)


def _chain(g: torch.Generator, v: int, succ: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, 25) token sequences of a seeded order-1 chain: each token's successor
    ``succ[token]`` with probability 0.9, else a uniform token."""
    ids = torch.empty(rows, 25, dtype=torch.long)
    ids[:, 0] = torch.randint(3, v, (rows,), generator=g)
    for t in range(1, 25):
        noise = torch.randint(3, v, (rows,), generator=g)
        keep = torch.rand(rows, generator=g) < 0.9
        ids[:, t] = torch.where(keep, succ[ids[:, t - 1]], noise)
    return ids


def _trained(d, g: torch.Generator, succ: torch.Tensor, steps: int = 60) -> GPT:
    """The family's model from ``d``, trained ``steps`` Adam steps on ``_chain`` (so that
    its next-token choices have the margins of a trained model, not the near-ties of random
    weights)."""
    model = from_pretrained(d).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids = _chain(g, model.config.vocab_size, succ, 16)
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "phi3"])
def test_int8_top1_agrees_with_fp32(loaded, name, tmp_path, capsys):
    """qkv.quantize's int8 model picks fp32's next token at >= 99 % of the positions of a
    seeded prompt set (16 prompts x 24 tokens) on the family's model after a short training
    run on a seeded token chain; the fraction is printed."""
    import qkv

    _, _, d = loaded[name]
    g = torch.Generator().manual_seed(7)
    succ = torch.randint(3, FAMILIES[name][2]["vocab_size"], (FAMILIES[name][2]["vocab_size"],),
                         generator=g)
    trained = _trained(d, g, succ)
    trained.save_pretrained(tmp_path / "trained")
    ids = _chain(g, trained.config.vocab_size, succ, 16)[:, :24]  # the seeded prompt set
    with torch.no_grad():
        fp32 = trained(ids)
        int8 = qkv.quantize(from_pretrained(tmp_path / "trained"), "int8")  # in place
        assert isinstance(int8.layers[0].attn.in_proj, QuantizedLinear)
        low = int8(ids)
    assert (low - fp32).abs().max() > 1e-4  # quantized: not the fp32 model again
    agree = (low.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\n{name}: int8 top-1 agreement with fp32 {agree:.4f} (384 positions)")
    assert agree >= 0.99


def test_a_window_longer_than_the_caches_decodes_on_the_plan(tmp_path):
    """Mistral's window W: caches of at most W positions never drop a key, so the decode
    plan serves the model (full causal attention); one more position and the window matters,
    so the model decodes on its modules (with its window caches). Tokens equal HF's both
    ways."""
    import qkv
    from qkv.generation.engine import choose

    _, _, kw = FAMILIES["mistral"]
    config = transformers.MistralConfig(**{**kw, "sliding_window": 38})
    config._attn_implementation = "eager"
    torch.manual_seed(5)
    hf = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = from_pretrained(save_hf(hf, tmp_path / "m"))
    assert choose(ours, 2, capacity=38).backend.name != "modules"
    why = choose(ours, 2, capacity=39).why_no_plan
    assert choose(ours, 2, capacity=39).backend.name == "modules" and "39" in why
    ids, mask = left_padded(seed=4, lengths=(6, 4))
    for new in (32, 40):  # capacity 38 (the plan) and 46 (the modules, the window)
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        mine = qkv.generate(ours, ids, attention_mask=mask, max_new_tokens=new)
        assert torch.equal(mine[:, 6:], theirs[:, 6:]), new
