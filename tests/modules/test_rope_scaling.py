"""Tests for qkv.modules.rope_scaling, ``RoPE(scaling=...)`` and qkv.models.hf_rope.

Shapes: B batch, H heads, N length, D head dim.

Oracle: transformers' own ``LlamaRotaryEmbedding`` (built from ``LlamaConfig.from_dict`` of the
same config.json dict qkv reads) and ``apply_rotary_pos_emb``, at positions up to 3x the
original context. transformers computes in fp32: its ``inv_freq`` to ~1 ulp (rtol 4e-7 here)
and the angle ``pos · inv_freq`` rounded to fp32 again, so its cos/sin are off by up to
~2·2^-24·angle (measured 1.7); the bound used is ``2e-7 + 3·2^-24·angle·attention_factor``
per element (≈ 1e-6 at angle 10, 3.6e-5 at angle 192). Each case also checks the scaling
moves cos/sin by far more than that (> 1e-2), so a scaling ignored would fail.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from qkv.files import CheckpointError  # noqa: E402
from qkv.models.hf_rope import rope_from_hf, rope_to_hf  # noqa: E402
from qkv.modules.positions import RoPE  # noqa: E402
from qkv.modules.rope_scaling import RopeScaling, rope_frequencies  # noqa: E402

D = 32  # head dim: 16 frequencies
COMMON = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
          "intermediate_size": 64, "vocab_size": 16}

# name -> (rope_theta, max_position_embeddings, rope_parameters without rope_theta, O,
#          extra top-level config fields)
CASES = {
    "linear": (10000.0, 64, {"rope_type": "linear", "factor": 4.0}, 64, {}),
    "dynamic": (10000.0, 64, {"rope_type": "dynamic", "factor": 4.0}, 64, {}),
    "llama3": (10000.0, 256, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}, 64, {}),
    "llama3_theta500k": (500000.0, 256, {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}, 64, {}),
    "yarn": (10000.0, 256, {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64}, 64, {}),
    "yarn_attention_factor": (10000.0, 256, {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 64,
                                             "attention_factor": 0.8}, 64, {}),
    "yarn_mscale": (10000.0, 256, {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64, "mscale": 0.707,
                                   "mscale_all_dim": 1.0}, 64, {}),
    "yarn_lone_mscale": (10000.0, 256, {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 64,
                                        "mscale": 0.707}, 64, {}),
    "yarn_betas_untruncated": (1e6, 256, {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 64,
                                          "beta_fast": 16.0, "beta_slow": 2.0,
                                          "truncate": False}, 64, {}),
    # a ramp past D/2 (transformers clips its end at D - 1, not D/2 - 1)
    "yarn_wide_ramp": (100.0, 256, {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64,
                                    "beta_fast": 1.0, "beta_slow": 0.1}, 64, {}),
    # both ends clipped to 0: transformers widens the ramp by 0.001 (else 0/0)
    "yarn_collapsed_ramp": (10000.0, 16, {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 4}, 4, {}),
    # O from max_position_embeddings (transformers' standardisation fills it)
    "yarn_implicit_original": (10000.0, 64, {"rope_type": "yarn", "factor": 4.0}, 64, {}),
    # factor null: max_position_embeddings / O (DeepSeek-V3's convention)
    "yarn_null_factor": (10000.0, 256, {"rope_type": "yarn", "factor": None,
                                        "original_max_position_embeddings": 64}, 64, {}),
    # beta 0 is transformers' default (`or 32`), truncate null is False (`get(.., True)`)
    "yarn_falsy_fields": (10000.0, 256, {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 64,
                                         "beta_fast": 0, "truncate": None}, 64, {}),
    # a top-level original_max_position_embeddings (Phi-3 writes one) wins over the dict's
    "llama3_top_level_original": (10000.0, 256, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}, 64,
        {"original_max_position_embeddings": 64}),
}


def hf_dict(name: str, *, legacy: bool = False) -> dict:
    """The config.json dict of a case, in 5.x (``rope_parameters``) or 4.x spelling."""
    base, max_pos, params, _, extra = CASES[name]
    d = {**COMMON, "max_position_embeddings": max_pos, **extra}
    if legacy:
        kind = params["rope_type"]
        d["rope_theta"] = base
        d["rope_scaling"] = {"type": kind, **{k: v for k, v in params.items()
                                               if k != "rope_type"}}
    else:
        d["rope_parameters"] = {**params, "rope_theta": base}
    return json.loads(json.dumps(d))  # as read from a file


def hf_module(d: dict) -> LlamaRotaryEmbedding:
    """transformers' rotary embedding of config.json ``d`` (a fresh one: dynamic has state)."""
    return LlamaRotaryEmbedding(LlamaConfig.from_dict(json.loads(json.dumps(d))))


def qkv_rope(d: dict) -> RoPE:
    base, scaling = rope_from_hf(d, "test", D)
    return RoPE(D, base=base, scaling=scaling)


def hf_cos_sin(module: LlamaRotaryEmbedding, positions: torch.Tensor):
    """transformers' cos, sin (B, N, D) for position_ids (B, N), fp32."""
    return module(torch.zeros(1, dtype=torch.float32), positions)


def angle_tol(rope: RoPE, positions: torch.Tensor) -> torch.Tensor:
    """(..., D/2) bound of transformers' fp32 error (module docstring)."""
    length = positions.max() + 1 if rope.position_dependent else None
    inv, factor = rope_frequencies(D, rope.base, rope.scaling, seq_len=length)
    angles = positions.double().unsqueeze(-1) * inv  # (..., D/2)
    return 2e-7 + 3 * 2.0 ** -24 * angles.abs() * factor


def assert_close_to_hf(ours: torch.Tensor, theirs: torch.Tensor, tol: torch.Tensor) -> None:
    err = (ours.double() - theirs.double()).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}, " \
                                     f"max error {err.max().item():.3g}"


# ----------------------------------------------------------------------------- against HF


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_equal_transformers(name: str) -> None:
    d = hf_dict(name)
    o = CASES[name][3]
    rope, hf = qkv_rope(d), hf_module(d)
    positions = torch.arange(3 * o)  # (N,) to 3x the original context
    cos, sin = rope.cos_sin(positions)  # (N, D/2) fp32
    hcos, hsin = hf_cos_sin(hf, positions[None])  # (1, N, D)
    tol = angle_tol(rope, positions)
    for half in (slice(0, D // 2), slice(D // 2, D)):  # HF repeats the D/2 columns
        assert_close_to_hf(cos, hcos[0, :, half], tol)
        assert_close_to_hf(sin, hsin[0, :, half], tol)
    # the frequencies and the attention factor themselves (HF's after the call: dynamic's
    # are for this call's length)
    inv, factor = rope_frequencies(D, rope.base, rope.scaling, seq_len=3 * o)
    torch.testing.assert_close(inv, hf.inv_freq.double(), rtol=4e-7, atol=0)
    assert math.isclose(factor, hf.attention_scaling, rel_tol=1e-12)
    # the scaling matters here: unscaled RoPE is far from transformers past the context
    plain, _ = RoPE(D, base=rope.base).cos_sin(positions)
    assert (plain[o:] - hcos[0, o:, :D // 2]).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(CASES))
def test_both_spellings_and_a_saved_config_agree(name: str) -> None:
    new, old = hf_dict(name), hf_dict(name, legacy=True)
    expected = rope_from_hf(new, "test", D)
    assert rope_from_hf(old, "test", D) == expected
    saved = json.loads(LlamaConfig.from_dict(new).to_json_string())  # what 5.24 writes
    assert rope_from_hf(saved, "test", D) == expected
    # transformers reads the 4.x spelling to the same angles as well
    positions = torch.arange(3 * CASES[name][3])[None]  # (1, N)
    a, b = hf_cos_sin(hf_module(new), positions), hf_cos_sin(hf_module(old), positions)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("name", ["linear", "dynamic", "llama3", "yarn", "yarn_mscale"])
def test_rotate_equals_apply_rotary_pos_emb(name: str) -> None:
    d = hf_dict(name)
    o = CASES[name][3]
    rope, hf = qkv_rope(d), hf_module(d)
    n = 2 * o
    positions = torch.stack((torch.arange(n), torch.arange(n) + o))  # (B, N) rows apart
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, n, D, generator=g)  # (B, H, N, D)
    k = torch.randn(2, 1, n, D, generator=g)  # (B, Hkv, N, D)
    hcos, hsin = hf_cos_sin(hf, positions)  # (B, N, D)
    hq, hk = apply_rotary_pos_emb(q, k, hcos, hsin)
    oq, ok = rope(q, k, positions)
    assert torch.equal(rope.rotate(q, positions), oq)
    tol = angle_tol(rope, positions).unsqueeze(1)  # (B, 1, N, D/2)
    for x, ours, theirs in ((q, oq, hq), (k, ok, hk)):
        pair = x[..., :D // 2].abs() + x[..., D // 2:].abs()  # (B, H, N, D/2)
        bound = torch.cat((pair * tol, pair * tol), dim=-1) + 1e-6  # + fp32 products
        assert_close_to_hf(ours, theirs, bound)


def test_dynamic_during_generation_equals_transformers() -> None:
    """transformers' dynamic NTK keeps the largest length seen; during generation the length
    only grows, so qkv's per-call angles equal it at every step."""
    d = hf_dict("dynamic")
    o = CASES["dynamic"][3]
    rope, hf = qkv_rope(d), hf_module(d)  # one stateful HF module for the whole run
    assert rope.position_dependent
    prefill = torch.arange(o - 10)  # (N,) a prompt inside the original context
    hcos, _ = hf_cos_sin(hf, prefill[None])
    cos, _ = rope.cos_sin(prefill)
    assert_close_to_hf(cos, hcos[0, :, :D // 2], angle_tol(rope, prefill))
    for p in range(o - 10, 3 * o):  # one position a step, past O
        pos = torch.tensor([p])
        hcos, hsin = hf_cos_sin(hf, pos[None])  # (1, 1, D)
        cos, sin = rope.cos_sin(pos)  # (1, D/2)
        tol = angle_tol(rope, pos)
        assert_close_to_hf(cos, hcos[0, :, :D // 2], tol)
        assert_close_to_hf(sin, hsin[0, :, :D // 2], tol)
    # a table for arange(cap) is not the per-call angles (why position_dependent exists)
    table, _ = rope.cos_sin(torch.arange(3 * o))
    step, _ = rope.cos_sin(torch.tensor([2 * o]))
    assert (table[2 * o] - step[0]).abs().max() > 1e-2
    # under O nothing is rescaled: bit-identical to unscaled RoPE
    short = torch.arange(o)
    assert torch.equal(rope.cos_sin(short)[0], RoPE(D, base=rope.base).cos_sin(short)[0])
    # a batch takes the largest position over every row, as transformers does
    rows = torch.stack((torch.arange(8), torch.arange(8) + 2 * o))  # (B, N)
    batch, _ = rope.cos_sin(rows)  # (B, N, D/2)
    alone, _ = rope.cos_sin(rows[0])  # (N, D/2): row 0 alone is under O, unscaled
    assert (batch[0] - alone).abs().max() > 1e-3
    hcos, _ = hf_cos_sin(hf_module(d), rows)
    assert_close_to_hf(rope.cos_sin(rows)[0], hcos[..., :D // 2], angle_tol(rope, rows))


# ----------------------------------------------------------------------------- unscaled


def test_unscaled_rope_bit_identical() -> None:
    """No scaling (or a no-op one) keeps RoPE's computation bit for bit: θ_i = base^(-2i/D)
    and angles in fp64, as before scaling existed (replicated here)."""
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 100000, (3, 17), generator=g)  # (B, N)
    x = torch.randn(3, 2, 17, D, generator=g)  # (B, H, N, D)
    for base in (10000.0, 500000.0):
        plain, none = RoPE(D, base=base), RoPE(D, base=base, scaling=None)
        assert none.scaling is None and not none.position_dependent
        assert repr(none) == f"RoPE(head_dim={D}, base={base:g}, interleaved=False)"
        exponent = torch.arange(0, D // 2, dtype=torch.float64) * (2.0 / D)
        inv = torch.pow(torch.tensor(base, dtype=torch.float64), -exponent)
        angles = positions.double().unsqueeze(-1) * inv  # (B, N, D/2)
        linear1 = RoPE(D, base=base, scaling={"rope_type": "linear", "factor": 1.0})
        for rope in (plain, none, linear1):
            cos, sin = rope.cos_sin(positions)
            assert torch.equal(cos, angles.cos().float()) and torch.equal(sin,
                                                                          angles.sin().float())
            assert torch.equal(rope.rotate(x, positions), plain.rotate(x, positions))
        assert torch.equal(rope_frequencies(D, base)[0], inv)


# ----------------------------------------------------------------------------- the dataclass


def test_round_trip_and_json() -> None:
    s = RopeScaling.from_dict({"rope_type": "yarn", "factor": 4, "beta_fast": 16,
                               "original_max_position_embeddings": 64, "truncate": False})
    assert s.factor == 4.0 and isinstance(s.factor, float) and s.beta_fast == 16.0
    d = s.to_dict()
    assert d == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 16.0, "truncate": False}
    assert RopeScaling.from_dict(json.loads(json.dumps(d))) == s
    rope = RoPE(D, scaling=s)
    assert rope.scaling is s and "scaling={'rope_type': 'yarn'" in repr(rope)
    assert RoPE(D, scaling=d).scaling == s


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(("data", "match"), [
    ({"rope_type": "ntk", "factor": 2.0}, r"rope_type must be one of .*'ntk'"),
    ({"rope_type": "default", "factor": 2.0}, r"use None for unscaled RoPE"),
    ({"factor": 2.0}, r"needs 'rope_type'"),
    ({"rope_type": "linear"}, r"needs 'factor'"),
    ({"rope_type": "linear", "factor": 0.5}, r"factor must be a finite number >= 1.*0\.5"),
    ({"rope_type": "linear", "factor": True}, r"factor must be .*True"),
    ({"rope_type": "linear", "factor": float("inf")}, r"factor must be a finite"),
    ({"rope_type": "linear", "factor": 2.0, "scale": 2}, r"unknown keys \['scale'\]"),
    ({"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64},
     r"original_max_position_embeddings=64 is not read by rope_type 'linear'"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic' needs original_max_position"),
    ({**YARN, "low_freq_factor": 1.0}, r"low_freq_factor=1.0 is not read by rope_type 'yarn'"),
    ({**LLAMA3, "high_freq_factor": None}, r"'llama3' needs high_freq_factor"),
    ({**LLAMA3, "low_freq_factor": 4.0}, r"0 < low_freq_factor < high_freq_factor"),
    ({**LLAMA3, "beta_fast": 4.0}, r"beta_fast=4.0 is not read by rope_type 'llama3'"),
    ({**YARN, "original_max_position_embeddings": 64.0}, r"must be a positive int, got 64.0"),
    ({**YARN, "original_max_position_embeddings": 0}, r"must be a positive int, got 0"),
    ({**YARN, "beta_fast": 1.0, "beta_slow": 2.0}, r"beta_fast >= beta_slow"),
    ({**YARN, "beta_slow": -1.0}, r"beta_slow must be > 0"),
    ({**YARN, "attention_factor": 0.0}, r"attention_factor must be > 0"),
    ({**YARN, "truncate": 1}, r"truncate must be a bool, got 1"),
    ({**YARN, "mscale": "1"}, r"mscale must be a finite number, got '1'"),
])
def test_bad_dicts_raise(data: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RopeScaling.from_dict(data)
    with pytest.raises(ValueError, match=match):
        RoPE(D, scaling=data)


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match="expected a dict, got list"):
        RopeScaling.from_dict([("rope_type", "linear")])
    with pytest.raises(TypeError, match="scaling must be a RopeScaling, its dict or None"):
        RoPE(D, scaling="linear")
    with pytest.raises(ValueError, match=r"dynamic needs head_dim > 2"):
        RoPE(2, scaling={"rope_type": "dynamic", "factor": 2.0,
                         "original_max_position_embeddings": 8})
    with pytest.raises(TypeError, match="seq_len must be an int"):
        dynamic = RopeScaling("dynamic", 2.0, original_max_position_embeddings=64)
        rope_frequencies(D, 1e4, dynamic, seq_len=3.5)
    with pytest.raises(TypeError, match="scaling must be a RopeScaling or None"):
        rope_frequencies(D, 1e4, {"rope_type": "linear", "factor": 2.0})


# ----------------------------------------------------------------------------- hf_rope


def _llama(**fields) -> dict:
    return {**COMMON, "max_position_embeddings": 64, **fields}


def test_rope_from_hf_defaults_and_theta_priority() -> None:
    assert rope_from_hf(_llama(), "t", D) == (10000.0, None)
    assert rope_from_hf(_llama(rope_theta=5e5, rope_scaling=None), "t", D) == (5e5, None)
    assert rope_from_hf(_llama(rope_parameters={"rope_type": "default", "rope_theta": 7e5},
                               rope_theta=5e5), "t", D) == (7e5, None)
    # a rope_scaling dict wins over rope_parameters, as in transformers 5.24
    both = _llama(rope_scaling={"type": "linear", "factor": 2.0},
                  rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4})
    assert rope_from_hf(both, "t", D)[1]["factor"] == 2.0
    assert LlamaConfig.from_dict(both).rope_parameters["factor"] == 2.0


def test_dynamic_reads_max_position_embeddings_and_warns_of_the_dicts_value() -> None:
    d = _llama(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4,
                                "original_max_position_embeddings": 32})
    with pytest.warns(UserWarning, match=r"\['original_max_position_embeddings'\] ignored"):
        base, scaling = rope_from_hf(d, "t", D)
    assert scaling["original_max_position_embeddings"] == 64  # transformers' O
    positions = torch.arange(192)
    hcos, _ = hf_cos_sin(hf_module(d), positions[None])
    rope = RoPE(D, base=base, scaling=scaling)
    assert_close_to_hf(rope.cos_sin(positions)[0], hcos[0, :, :D // 2],
                       angle_tol(rope, positions))


@pytest.mark.parametrize(("fields", "match"), [
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5: qkv's RoPE rotates the "
                                     r"whole head"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.25}}, r"partial_rotary_factor=0\.25"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16,
                       "long_factor": [2.0] * 16}},
     r"rope_type 'longrope': qkv does not compute longrope \(transformers switches"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},
     r"rope_type 'su' is not supported; qkv computes \['default', 'linear', 'dynamic', "
     r"'llama3', 'yarn'\]"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "default"}}},
     r"per-layer-type RoPE parameters \['full_attention', 'sliding_attention'\]"),
    ({"rope_scaling": {"type": "linear"}}, r"rope_scaling \(linear\): rope_type 'linear' "
                                           r"needs factor"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     r"'llama3' needs low_freq_factor"),
    ({"rope_scaling": "linear"}, r"rope_scaling must be a dict or null, got 'linear'"),
    ({"rope_theta": 1.0}, r"rope_theta must be a finite number > 1, got 1\.0"),
])
def test_rope_from_hf_refuses(fields: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as info:
        rope_from_hf(_llama(**fields), "ckpt", D)
    assert "\n" not in str(info.value) and str(info.value).startswith("ckpt: config.json")


def test_rope_from_hf_checks_head_dim() -> None:
    d = _llama(rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(CheckpointError, match=r"dynamic needs head_dim > 2"):
        rope_from_hf(d, "ckpt", 2)


@pytest.mark.parametrize("name", ["linear", "dynamic", "llama3", "yarn_mscale",
                                  "yarn_betas_untruncated"])
def test_rope_to_hf_round_trips_through_transformers(name: str) -> None:
    base, scaling = rope_from_hf(hf_dict(name), "test", D)
    fields = rope_to_hf(base, scaling)
    written = {**COMMON, "max_position_embeddings": 256, **fields}  # fields last
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no key is left for us to ignore
        assert rope_from_hf(written, "test", D) == (base, scaling)
        saved = json.loads(LlamaConfig.from_dict(written).to_json_string())
        assert rope_from_hf(saved, "test", D) == (base, scaling)
        old = {k: v for k, v in written.items() if k != "rope_parameters"}  # a 4.x reader's
        assert rope_from_hf(old, "test", D) == (base, scaling)
    rope, positions = RoPE(D, base=base, scaling=scaling), torch.arange(192)
    hcos, hsin = hf_cos_sin(hf_module(written), positions[None])
    tol = angle_tol(rope, positions)
    assert_close_to_hf(rope.cos_sin(positions)[0], hcos[0, :, :D // 2], tol)
    assert_close_to_hf(rope.cos_sin(positions)[1], hsin[0, :, :D // 2], tol)
    assert rope_to_hf(1e4, None) == {"rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 1e4},
                                     "rope_theta": 1e4, "rope_scaling": None}
