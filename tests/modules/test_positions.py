"""Tests for qkv.modules.positions: sinusoidal, learned and rotary position encodings.

Shapes: B batch, N length, C model width, H heads, D head dim.

Oracles are written here from the papers' formulas (plain Python/numpy loops, fp64, complex
numbers for RoPE) and the HF Llama ``rotate_half`` convention; tolerances are stated at each
comparison.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkv.modules.positions import (
    Learned,
    PositionError,
    RoPE,
    Sinusoidal,
    positions_from_mask,
)

# ----------------------------------------------------------------------------- oracles


def paper_sinusoidal(positions, dim: int, base: float = 10000.0) -> np.ndarray:
    """Vaswani et al. 2017, literally: PE[pos, 2i] = sin(pos / base^(2i/dim)), 2i+1 -> cos."""
    positions = np.asarray(positions)
    out = np.zeros((*positions.shape, dim), dtype=np.float64)
    for idx in np.ndindex(positions.shape):
        pos = float(positions[idx])
        for i in range(dim // 2):
            angle = pos / base ** (2 * i / dim)
            out[(*idx, 2 * i)] = math.sin(angle)
            out[(*idx, 2 * i + 1)] = math.cos(angle)
    return out


def complex_rope(x: torch.Tensor, positions: torch.Tensor, *, interleaved: bool,
                 base: float = 10000.0) -> np.ndarray:
    """RoPE as complex multiplication, fp64/complex128.

    x (B, H, N, D), positions (N,) or (B, N). Pair i is z_i = x[2i] + i·x[2i+1] (interleaved)
    or z_i = x[i] + i·x[i + D/2] (half-split); z_i ← z_i · exp(i · pos · base^(-2i/D)).
    """
    xs = x.detach().double().numpy()
    d = xs.shape[-1]
    half = d // 2
    pos = positions.numpy().astype(np.float64)
    if pos.ndim == 1:
        pos = np.broadcast_to(pos, (xs.shape[0], xs.shape[2]))
    theta = np.array([base ** (-2 * i / d) for i in range(half)])
    rot = np.exp(1j * pos[:, None, :, None] * theta)  # (B, 1, N, D/2)
    re_, im = (xs[..., 0::2], xs[..., 1::2]) if interleaved else (xs[..., :half], xs[..., half:])
    z = (re_ + 1j * im) * rot
    out = np.empty_like(xs)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:] = z.real, z.imag
    return out


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers.models.llama.modeling_llama.rotate_half, copied."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_cos_sin(positions: torch.Tensor, d: int, base: float, dtype=torch.float64):
    """cos/sin as HF's LlamaRotaryEmbedding builds them: emb = cat(freqs, freqs), (..., D)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.to(torch.float64)[..., None] * inv_freq  # (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- Sinusoidal


@pytest.mark.parametrize("dim", [2, 24, 80])
@pytest.mark.parametrize("max_len", [None, 8])
def test_sinusoidal_encoding_matches_paper(dim, max_len):
    # fp64 oracle, fp32 result: atol 1e-6 (positions up to 16384, inside and past the cache).
    enc = Sinusoidal(dim, max_len=max_len)
    positions = torch.tensor([0, 1, 2, 7, 16, 17, 113, 1023, 16384])
    got = enc.encoding(positions)
    assert got.dtype == torch.float32 and got.shape == (9, dim)
    np.testing.assert_allclose(got.numpy(), paper_sinusoidal(positions.numpy(), dim), atol=1e-6)
    grid = torch.tensor([[3, 4], [5, 100]])
    np.testing.assert_allclose(enc.encoding(grid).numpy(), paper_sinusoidal(grid.numpy(), dim),
                               atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 17])
def test_sinusoidal_forward_adds_table_and_offset(n):
    # x + PE against the fp64 oracle: atol 1e-6.
    dim = 24
    enc = Sinusoidal(dim)
    x = torch.randn(2, n, dim, generator=gen(), dtype=torch.float64).float()
    want = x.double().numpy() + paper_sinusoidal(np.arange(n), dim)
    np.testing.assert_allclose(enc(x).numpy(), want, atol=1e-6)
    want = x.double().numpy() + paper_sinusoidal(np.arange(5, 5 + n), dim)
    np.testing.assert_allclose(enc(x, offset=5).numpy(), want, atol=1e-6)
    np.testing.assert_allclose(enc(x, torch.arange(5, 5 + n)).numpy(), want, atol=1e-6)


def test_sinusoidal_per_row_positions_equal_per_row_offsets():
    # (B, N) positions: row b == the row run alone with offset off_b (bit-equal, same math).
    enc = Sinusoidal(16)
    offsets = [0, 3, 11]
    x = torch.randn(3, 5, 16, generator=gen(1))
    positions = torch.stack([torch.arange(o, o + 5) for o in offsets])  # (B, N)
    out = enc(x, positions)
    for b, o in enumerate(offsets):
        torch.testing.assert_close(out[b : b + 1], enc(x[b : b + 1], offset=o), atol=0, rtol=0)


def test_sinusoidal_left_padding_equals_unpadded():
    # Left-padded batch with positions from the mask: real tokens == the unpadded row (exact).
    enc = Sinusoidal(8, max_len=16)
    n, pads = 6, [2, 0, 5]
    x = torch.randn(3, n, 8, generator=gen(2))
    keep = torch.stack([torch.arange(n) >= p for p in pads])  # (B, N)
    out = enc(x, positions_from_mask(keep))
    for b, p in enumerate(pads):
        torch.testing.assert_close(out[b, p:], enc(x[b : b + 1, p:])[0], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinusoidal_half_precision_keeps_dtype(dtype):
    # Sum in fp32, one rounding: equals the fp32 result rounded to dtype.
    enc = Sinusoidal(32)
    x = torch.randn(2, 9, 32, generator=gen(3)).to(dtype)
    out = enc(x, offset=1000)
    assert out.dtype == dtype
    torch.testing.assert_close(out, enc(x.float(), offset=1000).to(dtype), atol=0, rtol=0)


def test_sinusoidal_has_no_state_and_survives_half():
    enc = Sinusoidal(8, max_len=32)
    assert dict(enc.state_dict()) == {} and list(enc.parameters()) == []
    before = enc.encoding(torch.arange(40))
    enc.half()
    torch.testing.assert_close(enc.encoding(torch.arange(40)), before, atol=0, rtol=0)


# ----------------------------------------------------------------------------- Learned


def test_learned_equals_x_plus_weight_rows():
    emb = Learned(16, 12)
    assert emb.weight.shape == (16, 12)
    x = torch.randn(2, 5, 12, generator=gen(4))
    torch.testing.assert_close(emb(x), x + emb.weight[:5], atol=0, rtol=0)
    torch.testing.assert_close(emb(x, offset=11), x + emb.weight[11:16], atol=0, rtol=0)
    positions = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    torch.testing.assert_close(emb(x, positions), x + emb.weight[positions], atol=0, rtol=0)
    torch.testing.assert_close(emb.encoding(positions), emb.weight[positions], atol=0, rtol=0)


def test_learned_gradients_reach_used_rows_only():
    emb = Learned(8, 4)
    emb(torch.zeros(1, 3, 4), offset=2).sum().backward()
    used = torch.zeros(8, dtype=torch.bool)
    used[2:5] = True
    assert torch.all(emb.weight.grad[used] == 1) and torch.all(emb.weight.grad[~used] == 0)


@pytest.mark.parametrize(("positions", "bad"), [
    (torch.tensor([6, 7, 8, 9]), 8),
    (torch.tensor([[0, 1, 2, 3], [0, 1, -1, 3]]), -1),
])
def test_learned_out_of_range_names_position_and_max_len(positions, bad):
    emb = Learned(8, 4)
    with pytest.raises(IndexError, match=rf"position {bad} .*max_len=8"):
        emb(torch.zeros(2, 4, 4), positions)
    with pytest.raises(ValueError, match=rf"position {bad} "):  # PositionError is both
        emb.encoding(positions)
    with pytest.raises(PositionError, match="max_len=8"):
        emb(torch.zeros(1, 2, 4), offset=7)


# ----------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("n", "d"), [(1, 2), (17, 24), (5, 80)])
def test_rope_matches_complex_reference(interleaved, n, d):
    # fp64 input vs complex128 oracle: atol 1e-12; fp32 input: atol 2e-5 (positions to 16384).
    rope = RoPE(d, interleaved=interleaved)
    x = torch.randn(2, 3, n, d, generator=gen(5), dtype=torch.float64)
    for positions in (torch.arange(n), torch.arange(16384 - n, 16384),
                      torch.randint(0, 20000, (2, n), generator=gen(6))):
        want = complex_rope(x, positions, interleaved=interleaved)
        np.testing.assert_allclose(rope.rotate(x, positions).numpy(), want, atol=1e-12)
        got32 = rope.rotate(x.float(), positions)
        assert got32.dtype == torch.float32
        np.testing.assert_allclose(got32.numpy(), want, atol=2e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_dot_product_depends_only_on_distance(interleaved):
    # <rot(q, m), rot(k, n)> == <rot(q, m+t), rot(k, n+t)> in fp32, atol 1e-4, up to 16384;
    # and == <rot(q, m-n), k> (the fp64 relative form).
    d = 64
    rope = RoPE(d, interleaved=interleaved)
    q = torch.randn(1, 1, 1, d, generator=gen(7))
    k = torch.randn(1, 1, 1, d, generator=gen(8))

    def dot(m: int, n: int) -> float:
        qm = rope.rotate(q, torch.tensor([m]))
        kn = rope.rotate(k, torch.tensor([n]))
        return float((qm * kn).sum())

    for m, n, t in [(0, 0, 16384), (5, 3, 100), (3, 5, 9000), (16000, 1, 384), (0, 16384, 7)]:
        assert abs(dot(m, n) - dot(m + t, n + t)) < 1e-4
        rel = (rope.rotate(q.double(), torch.tensor([m - n])) * k.double()).sum()
        assert abs(dot(m, n) - float(rel)) < 1e-4


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_preserves_pair_norms(interleaved):
    # A rotation: each pair's norm, hence the vector's, is unchanged (fp64, rtol 1e-12).
    d = 24
    rope = RoPE(d, interleaved=interleaved)
    x = torch.randn(2, 2, 7, d, generator=gen(9), dtype=torch.float64)
    y = rope.rotate(x, torch.arange(100, 107))

    def pair_norms(t):
        if interleaved:
            return t[..., 0::2] ** 2 + t[..., 1::2] ** 2
        return t[..., : d // 2] ** 2 + t[..., d // 2 :] ** 2

    torch.testing.assert_close(pair_norms(y), pair_norms(x), atol=0, rtol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=0, rtol=1e-12)


def test_rope_half_split_is_hf_rotate_half_convention():
    # Self-contained: HF Llama's q*cos + rotate_half(q)*sin with cos = cat(freqs, freqs);
    # fp64, atol 1e-12.
    d, base = 40, 500000.0
    rope = RoPE(d, base=base)
    x = torch.randn(2, 4, 6, d, generator=gen(10), dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [90, 91, 92, 93, 94, 95]])
    cos, sin = hf_cos_sin(positions, d, base)  # (B, N, D)
    want = x * cos[:, None] + hf_rotate_half(x) * sin[:, None]
    torch.testing.assert_close(rope.rotate(x, positions), want, atol=1e-12, rtol=0)


def test_rope_half_split_matches_transformers():
    # transformers' own apply_rotary_pos_emb with the cos/sin built above, called as Llama's
    # attention calls it (q, k, cos, sin: cos/sin (B, N, D) broadcast over the heads); the
    # outputs are compared, not its signature. fp64, atol 1e-12. transformers is a dev
    # dependency: plain import (missing must fail, not skip).
    from transformers.models.llama import modeling_llama as llama

    d = 32
    rope = RoPE(d)
    q = torch.randn(2, 4, 9, d, generator=gen(11), dtype=torch.float64)
    k = torch.randn(2, 2, 9, d, generator=gen(12), dtype=torch.float64)
    positions = torch.arange(30, 39).expand(2, 9)
    cos, sin = hf_cos_sin(positions, d, 10000.0)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope(q, k, positions)
    torch.testing.assert_close(got_q, want_q, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=1e-12, rtol=0)


def test_rope_conventions_differ_by_a_fixed_permutation():
    # interleaved(x) == unperm(half_split(perm(x))) where perm puts x[2i] at i, x[2i+1] at i+D/2.
    d = 16
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    unperm = torch.argsort(perm)
    x = torch.randn(1, 2, 5, d, generator=gen(13), dtype=torch.float64)
    positions = torch.arange(5)
    a = RoPE(d, interleaved=True).rotate(x, positions)
    b = RoPE(d).rotate(x[..., perm], positions)[..., unperm]
    torch.testing.assert_close(a, b, atol=1e-14, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_half_precision(dtype, interleaved):
    # Keeps dtype; equals the fp32 rotation of the same input rounded once (atol 0); error vs
    # the fp64 oracle ≤ 2× that of a naive same-dtype rotate_half (checklist line 2).
    d = 64
    rope = RoPE(d, interleaved=interleaved)
    x = torch.randn(2, 2, 8, d, generator=gen(14)).to(dtype)
    positions = torch.arange(16000, 16008)
    out = rope.rotate(x, positions)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rope.rotate(x.float(), positions).to(dtype), atol=0, rtol=0)
    want = torch.from_numpy(complex_rope(x, positions, interleaved=interleaved))
    err = (out.double() - want).abs().max()
    cos, sin = hf_cos_sin(positions, d, 10000.0, dtype=dtype)
    xs = x
    if interleaved:  # the naive path works in half-split layout; permute in and out exactly
        perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
        xs = x[..., perm]
    naive = xs * cos + hf_rotate_half(xs) * sin
    if interleaved:
        naive = naive[..., torch.argsort(perm)]
    naive_err = (naive.double() - want).abs().max()
    assert err <= 2 * naive_err, (err, naive_err)


def test_rope_per_row_positions_and_decode_step():
    # (B, N) positions == each row alone at its offset; a decode step after a left-padded
    # prefill sits at the row's count of real tokens (checklist line 20). Exact.
    d = 8
    rope = RoPE(d)
    pads, n = [0, 2, 3], 5
    keep = torch.stack([torch.arange(n) >= p for p in pads])  # (B, N) prefill mask
    prefill = positions_from_mask(keep)
    assert prefill.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2], [0, 0, 0, 0, 1]]
    step_keep = torch.cat((keep, torch.ones(3, 1, dtype=torch.bool)), dim=1)  # (B, N + 1)
    step = positions_from_mask(step_keep)[:, -1:]  # (B, 1)
    assert step[:, 0].tolist() == [n - p for p in pads]
    x = torch.randn(3, 2, 1, d, generator=gen(15))
    out = rope.rotate(x, step)
    for b, p in enumerate(pads):
        alone = rope.rotate(x[b : b + 1], offset=n - p)
        torch.testing.assert_close(out[b : b + 1], alone, atol=0, rtol=0)


def test_rope_forward_rotates_q_and_k_gqa():
    rope = RoPE(16)
    q = torch.randn(2, 4, 3, 16, generator=gen(16))
    k = torch.randn(2, 1, 3, 16, generator=gen(17))
    qr, kr = rope(q, k, offset=7)
    torch.testing.assert_close(qr, rope.rotate(q, torch.arange(7, 10)), atol=0, rtol=0)
    torch.testing.assert_close(kr, rope.rotate(k, torch.arange(7, 10)), atol=0, rtol=0)
    qr, kr = rope(q, k.double())
    assert qr.dtype == torch.float32 and kr.dtype == torch.float64


def test_rope_gradcheck_and_no_state():
    rope = RoPE(8, interleaved=True)
    x = torch.randn(1, 2, 3, 8, generator=gen(18), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rope.rotate(t, torch.tensor([4, 900, 17])), (x,))
    assert dict(rope.state_dict()) == {}
    y = torch.randn(1, 1, 2, 8, generator=gen(19))
    before = rope.rotate(y)
    torch.testing.assert_close(rope.half().rotate(y), before, atol=0, rtol=0)


# ----------------------------------------------------------------------------- bad input


def test_odd_dims_rejected():
    with pytest.raises(ValueError, match=r"head_dim must be even.*7"):
        RoPE(7)
    with pytest.raises(ValueError, match=r"dim must be even.*5"):
        Sinusoidal(5)
    with pytest.raises(ValueError, match="base"):
        RoPE(8, base=1.0)
    with pytest.raises(ValueError, match="max_len"):
        Learned(0, 4)


def test_wrong_shapes_rejected():
    rope, sin, emb = RoPE(8), Sinusoidal(8), Learned(4, 8)
    with pytest.raises(ValueError, match=r"\(B, H, N, D\).*\(2, 3, 8\)"):
        rope.rotate(torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"head dim 6.*head_dim=8"):
        rope.rotate(torch.zeros(1, 1, 3, 6))
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        sin(torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="dim=8"):
        emb(torch.zeros(1, 2, 6))
    with pytest.raises(ValueError, match=r"length 4 .*N=3"):
        rope.rotate(torch.zeros(1, 1, 3, 8), torch.arange(4))
    with pytest.raises(ValueError, match=r"batch 3 .*B=2"):
        sin(torch.zeros(2, 3, 8), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(N,\) or \(B, N\)"):
        rope.rotate(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="either positions or offset"):
        emb(torch.zeros(1, 2, 8), torch.arange(2), offset=1)
    with pytest.raises(ValueError, match="matching q"):
        rope(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4, 8))


def test_non_integer_positions_rejected():
    rope, sin, emb = RoPE(8), Sinusoidal(8), Learned(4, 8)
    for bad in (torch.arange(3.0), torch.ones(3, dtype=torch.bool)):
        with pytest.raises(TypeError, match=f"integer tensor.*{bad.dtype}"):
            rope.rotate(torch.zeros(1, 1, 3, 8), bad)
        with pytest.raises(TypeError, match="integer tensor"):
            sin(torch.zeros(1, 3, 8), bad)
        with pytest.raises(TypeError, match="integer tensor"):
            emb.encoding(bad)
    with pytest.raises(TypeError, match=r"integer torch\.Tensor, got list"):
        rope.cos_sin([0, 1])
    with pytest.raises(TypeError, match="floating-point"):
        rope.rotate(torch.zeros(1, 1, 3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="bool tensor"):
        positions_from_mask(torch.ones(2, 3))
