"""Kernelised linear attention (qkv.ops.linear), Checklist 11.

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim, D' feature dim, C chunk length.

The oracle is the quadratic form written here in fp64 from the formula:
A = φ(Q) φ(K)ᵀ (lower-triangular for causal), out = A V / (A 1 + eps), with φ written
plainly (elu(x) + 1, or the FAVOR+ exponential of the projection held by FavorFeatures).

Tolerances:
- fp64, chunked vs recurrent vs quadratic (summation order only): atol 1e-10, rtol 1e-10,
  outputs, final state and gradients of q, k, v;
- fp32 vs the fp64 quadratic form: atol 1e-5, rtol 1e-5 (inputs ~ N(0, 1), outputs O(1));
- fp16/bf16 inputs at N=8192 vs fp32 on the same (rounded) inputs: outputs within one
  rounding (fp16 atol 2e-3; bf16 atol 1e-3, rtol 2^-8), final state rtol 1e-4 (both
  accumulate in fp32);
- FAVOR+ vs exact softmax attention (q, k ~ N(0, 1)/D^{1/4}): mean |error| over 4 seeds
  decreases with the number of features and is below 0.015 at m=1024 (measured 0.0075).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from conftest import randn
from qkv.ops.linear import FavorFeatures, LinearState, linear_attention, linear_attention_step

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)
MAPS = ("elu", "favor")


# ------------------------------------------------------------------------------ oracle


def phi_of(feature_map: str, features: FavorFeatures | None):
    """φ written from the formula, in fp64: x (..., D) -> (..., D')."""
    if feature_map == "elu":
        return lambda x: torch.where(x > 0, x + 1.0, torch.exp(x))

    def favor(x: Tensor) -> Tensor:
        w = features.projection.double()  # (m, D)
        xs = x / x.shape[-1] ** 0.25  # (..., D)
        return torch.exp(xs @ w.T - (xs * xs).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])

    return favor


def quadratic(q, k, v, phi, *, causal: bool, eps: float = 1e-6) -> Tensor:
    """out = A V / (A 1 + eps), A = φ(q) φ(k)ᵀ (masked to j <= i for causal), (B, H, N, Dv)."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)  # (B, H, S, Dv)
    a = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, N, S)
    if causal:
        a = a * torch.ones(a.shape[-2:], dtype=a.dtype).tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def state_ref(k, v, heads, phi) -> tuple[Tensor, Tensor]:
    """Σ_j φ(k_j) v_jᵀ (B, H, D', Dv) and Σ_j φ(k_j) (B, H, D')."""
    fk = phi(k.repeat_interleave(heads // k.shape[1], dim=1))  # (B, H, S, D')
    v = v.repeat_interleave(heads // v.shape[1], dim=1)  # (B, H, S, Dv)
    return fk.transpose(-1, -2) @ v, fk.sum(2)


def unscaled(state: LinearState) -> tuple[Tensor, Tensor]:
    """A state's sums with the FAVOR+ shift undone."""
    if state.log_scale is None:
        return state.kv, state.z
    r = torch.exp(state.log_scale.double())  # (B, H)
    return state.kv.double() * r[..., None, None], state.z.double() * r[..., None]


def leaves(b, h, hkv, n, d, dv, dtype=torch.float64, gen=None, scale=1.0):
    q = (randn(b, h, n, d, gen=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    k = (randn(b, hkv, n, d, gen=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    v = randn(b, hkv, n, dv, gen=gen, dtype=dtype).requires_grad_()
    return q, k, v


def grads(out: Tensor, inputs, seed: int = 0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64).to(out.dtype)  # same values whatever the dtype
    return torch.autograd.grad(out, inputs, g)


def feats(feature_map, d, m=16, seed=3):
    return FavorFeatures(d, m, seed=seed) if feature_map == "favor" else None


def close(a, b, what, **tol):
    torch.testing.assert_close(a.double(), b.double(), **tol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------- chunked == recurrent == quadratic


def run_steps(q, k, v, feature_map, features, state=None):
    outs = []
    for t in range(q.shape[2]):
        sl = slice(t, t + 1)
        out, state = linear_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state,
                                           feature_map=feature_map, features=features)
        outs.append(out)
    return torch.cat(outs, dim=2), state  # (B, H, N, Dv)


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("n", [1, 2, 17, 203])
def test_causal_chunked_equals_recurrent_equals_quadratic(feature_map, n, gen):
    """fp64, GQA (H=4, Hkv=2), Dv=5 != D=8: outputs, final state, grads — atol 1e-10."""
    q, k, v = leaves(2, 4, 2, n, 8, 5, gen=gen)
    fe = feats(feature_map, 8)
    phi = phi_of(feature_map, fe)
    want = quadratic(q, k, v, phi, causal=True)
    want_g = grads(want, (q, k, v))
    want_kv, want_z = state_ref(k, v, 4, phi)

    got, st = run_steps(q, k, v, feature_map, fe)
    close(got, want, "recurrent out", **F64)
    for g, w, name in zip(grads(got, (q, k, v)), want_g, "qkv", strict=True):
        close(g, w, f"recurrent d{name}", **F64)
    kv, z = unscaled(st)
    close(kv, want_kv, "recurrent kv", **F64)
    close(z, want_z, "recurrent z", **F64)

    for chunk in sorted({1, 3, 7, 64, n + 5}):  # 7: a non-divisor of 17 and 203
        got, st = linear_attention(q, k, v, feature_map=feature_map, features=fe, causal=True,
                                   chunk_size=chunk, return_state=True)
        close(got, want, f"chunk {chunk} out", **F64)
        for g, w, name in zip(grads(got, (q, k, v)), want_g, "qkv", strict=True):
            close(g, w, f"chunk {chunk} d{name}", **F64)
        kv, z = unscaled(st)
        close(kv, want_kv, f"chunk {chunk} kv", **F64)
        close(z, want_z, f"chunk {chunk} z", **F64)
        assert st.kv.shape == (2, 4, want_kv.shape[2], 5) and st.z.shape == want_z.shape


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_against_fp64_quadratic(feature_map, causal, gen):
    """fp32, N=203, default chunk: outputs and grads within atol 1e-5, rtol 1e-5."""
    q, k, v = leaves(1, 4, 2, 203, 16, 24, dtype=torch.float32, gen=gen)
    fe = feats(feature_map, 16, m=32)
    phi = phi_of(feature_map, fe)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = quadratic(q64, k64, v64, phi, causal=causal)
    got, st = linear_attention(q, k, v, feature_map=feature_map, features=fe, causal=causal,
                               return_state=True)
    assert got.dtype == torch.float32 and st.kv.dtype == torch.float32
    close(got, want, "out", **F32)
    # the state sums 203 terms of size O(1): atol 1e-5 relative to its largest entry
    for got_s, want_s, name in zip(unscaled(st), state_ref(k64, v64, 4, phi), ("kv", "z"),
                                   strict=True):
        scale = want_s.abs().max().item()
        close(got_s, want_s.detach(), name, atol=1e-5 * scale, rtol=1e-5)
    for g, w, name in zip(grads(got, (q, k, v)), grads(want, (q64, k64, v64)), "qkv",
                          strict=True):
        close(g, w, f"d{name}", **F32)


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize(("n", "s"), [(1, 1), (17, 17), (5, 113), (203, 2)])
def test_noncausal_equals_quadratic(feature_map, n, s, gen):
    """fp64, N != S allowed, GQA, Dv != D: outputs, state and grads — atol 1e-10."""
    q = randn(2, 4, n, 8, gen=gen, dtype=torch.float64).requires_grad_()
    k = randn(2, 1, s, 8, gen=gen, dtype=torch.float64).requires_grad_()
    v = randn(2, 1, s, 3, gen=gen, dtype=torch.float64).requires_grad_()
    fe = feats(feature_map, 8)
    phi = phi_of(feature_map, fe)
    want = quadratic(q, k, v, phi, causal=False)
    got, st = linear_attention(q, k, v, feature_map=feature_map, features=fe,
                               return_state=True)
    close(got, want, "out", **F64)
    for g, w, name in zip(grads(got, (q, k, v)), grads(want, (q, k, v)), "qkv", strict=True):
        close(g, w, f"d{name}", **F64)
    want_kv, want_z = state_ref(k, v, 4, phi)
    kv, z = unscaled(st)
    close(kv, want_kv, "kv", **F64)
    close(z, want_z, "z", **F64)


@pytest.mark.parametrize("feature_map", MAPS)
def test_batch_row_and_strided_layout(feature_map, gen):
    """A batch row run alone == the same row in the batch (the FAVOR+ key shift is per
    (batch, head)); inputs stored (B, N, H, D) and viewed (B, H, N, D) == contiguous."""
    fe = feats(feature_map, 8)
    kw = dict(feature_map=feature_map, features=fe, causal=True, chunk_size=4)
    q, k, v = leaves(3, 2, 2, 13, 8, 5, gen=gen)
    k = (k.detach() * torch.tensor([1.0, 6.0, 0.2], dtype=torch.float64)[:, None, None, None])
    full = linear_attention(q, k, v, **kw)
    for i in range(3):
        alone = linear_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], **kw)
        close(alone, full[i:i + 1], f"row {i}", **F64)
    strided = [t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    close(linear_attention(*strided, **kw), full, "strided", **F64)


# ------------------------------------------------------------------- state continuation


@pytest.mark.parametrize("feature_map", MAPS)
def test_prompt_state_then_steps_equals_full_causal_run(feature_map, gen):
    """Prefill 23 positions (return_state), decode 12 by steps and then 9 more with a
    parallel call given the state: == one causal run over all 44 (fp64, atol 1e-10)."""
    q, k, v = leaves(2, 4, 2, 44, 8, 6, gen=gen)
    fe = feats(feature_map, 8)
    full = linear_attention(q, k, v, feature_map=feature_map, features=fe, causal=True,
                            chunk_size=5)
    kw = dict(feature_map=feature_map, features=fe)
    prompt, st = linear_attention(q[:, :, :23], k[:, :, :23], v[:, :, :23], causal=True,
                                  return_state=True, chunk_size=4, **kw)
    steps, st = run_steps(q[:, :, 23:35], k[:, :, 23:35], v[:, :, 23:35], feature_map, fe, st)
    rest = linear_attention(q[:, :, 35:], k[:, :, 35:], v[:, :, 35:], causal=True, state=st,
                            chunk_size=4, **kw)
    close(torch.cat([prompt, steps, rest], dim=2), full, "continued", **F64)
    # gradients flow through the state as through the full run
    g_cont = grads(torch.cat([prompt, steps, rest], dim=2), (q, k, v))
    for g, w, name in zip(g_cont, grads(full, (q, k, v)), "qkv", strict=True):
        close(g, w, f"d{name}", **F64)


@pytest.mark.parametrize("feature_map", MAPS)
def test_noncausal_state_split_keys(feature_map, gen):
    """Non-causal over keys split in two (state of the first half) == over all keys."""
    q = randn(1, 2, 9, 8, gen=gen, dtype=torch.float64)
    k = randn(1, 2, 30, 8, gen=gen, dtype=torch.float64)
    v = randn(1, 2, 30, 4, gen=gen, dtype=torch.float64)
    fe = feats(feature_map, 8)
    kw = dict(feature_map=feature_map, features=fe)
    _, st = linear_attention(q, k[:, :, :11], v[:, :, :11], return_state=True, **kw)
    got = linear_attention(q, k[:, :, 11:], v[:, :, 11:], state=st, **kw)
    close(got, linear_attention(q, k, v, **kw), "split", **F64)


# ------------------------------------------------------------------------------ FAVOR+


def test_favor_approximates_softmax_and_improves_with_features():
    """q, k ~ N(0, 1)/D^{1/4}, D=16, v ~ N(0, 1) (outputs: mean |out| ~ 0.11). Mean
    |favor - softmax attention| over 4 seeds of the projection must fall as m grows and be
    < 0.015 at m=1024 (measured 0.038, 0.023, 0.014, 0.0075 for m = 16, 64, 256, 1024).
    (At q, k ~ N(0, 1) the estimator's variance, ~exp(|q'+k'|²)/m, is far larger.)"""
    g = torch.Generator().manual_seed(1234)
    d = 16
    q, k, v = (torch.randn(1, 2, 64, d, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = q / d ** 0.25, k / d ** 0.25
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1) @ v
    err = {}
    for m in (16, 64, 256, 1024):
        errs = []
        for seed in range(4):
            fe = FavorFeatures(d, m, seed=seed)
            out = linear_attention(q, k, v, feature_map="favor", features=fe, eps=0.0)
            errs.append((out - exact).abs().mean().item())
        err[m] = sum(errs) / len(errs)
    assert err[1024] < err[256] < err[64] < err[16], err
    assert err[1024] < 0.015, err
    # the causal form approximates causal softmax attention as well
    fe = FavorFeatures(d, 1024, seed=0)
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    logits = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, -torch.inf)
    exact_c = torch.softmax(logits, dim=-1) @ v
    out_c = linear_attention(q, k, v, feature_map="favor", features=fe, causal=True, eps=0.0)
    assert (out_c - exact_c).abs().mean().item() < 0.03


def test_favor_features_seed_redraw_and_structure():
    a, b = FavorFeatures(8, 20, seed=7), FavorFeatures(8, 20, seed=7)
    torch.testing.assert_close(a.projection, b.projection, atol=0, rtol=0)
    assert not torch.equal(a.projection, FavorFeatures(8, 20, seed=8).projection)
    assert a.projection.shape == (20, 8) and a.projection.dtype == torch.float32
    held = a.projection  # a module would hold this tensor as a buffer
    before = held.clone()
    a.redraw()
    assert a.projection is held and not torch.equal(held, before)
    a.redraw(torch.Generator().manual_seed(5))
    b.redraw(torch.Generator().manual_seed(5))
    torch.testing.assert_close(a.projection, b.projection, atol=0, rtol=0)
    # blocks of D orthogonal directions (the last block truncated)
    w = a.projection.double()
    unit = w / w.norm(dim=1, keepdim=True)
    for lo in (0, 8, 16):
        blk = unit[lo:lo + 8]
        torch.testing.assert_close(blk @ blk.T, torch.eye(len(blk), dtype=torch.float64),
                                   atol=1e-6, rtol=0)
    # norms ~ chi(D): mean sqrt(2)·Γ((D+1)/2)/Γ(D/2) ≈ 2.74 for D=8
    norms = FavorFeatures(8, 4096, seed=0).projection.norm(dim=1)
    chi_mean = math.sqrt(2) * math.exp(math.lgamma(4.5) - math.lgamma(4))
    assert abs(norms.mean().item() - chi_mean) < 0.05


def test_redraw_changes_the_output(gen):
    q, k, v = leaves(1, 2, 2, 10, 8, 4, gen=gen)
    fe = FavorFeatures(8, 16, seed=0)
    before = linear_attention(q, k, v, feature_map="favor", features=fe, causal=True)
    fe.redraw()
    after = linear_attention(q, k, v, feature_map="favor", features=fe, causal=True)
    assert (before - after).abs().max() > 1e-3


def test_favor_large_inputs_stay_finite(gen):
    """Exponents in the hundreds (|x| ~ 40): the shifts keep every feature <= 1 in range;
    the result still matches the fp64 formula where the formula itself is finite."""
    q, k, v = leaves(1, 2, 2, 33, 8, 4, dtype=torch.float32, gen=gen, scale=12.0)
    fe = FavorFeatures(8, 64, seed=0)
    for causal in (False, True):
        out = linear_attention(q, k, v, feature_map="favor", features=fe, causal=causal)
        assert torch.isfinite(out).all()
        (dq, dk, dv) = grads(out, (q, k, v))
        assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


# ------------------------------------------------------------------ half precision, long


HALF_OUT_TOL = {torch.float16: dict(atol=2e-3, rtol=0.0),  # half an fp16 ulp at |out| < 4
                torch.bfloat16: dict(atol=1e-3, rtol=2 ** -8)}  # one bf16 rounding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_half_long_sequence_finite_and_close_to_fp32(feature_map, causal, dtype, gen):
    """N=8192, fp16/bf16 inputs scaled ×3: z sums 8192 positive features to ~15000, where an
    fp16 accumulator's ulp is 8 (bf16's 64), so the sums are kept in fp32. Output in the
    input dtype, finite, within one rounding of the fp32 run on the same values
    (HALF_OUT_TOL); final state (fp32) within rtol 1e-4 of it."""
    n = 8192
    q, k = ((randn(1, 2, n, 16, gen=gen) * 3).to(dtype) for _ in range(2))
    v = randn(1, 2, n, 16, gen=gen).to(dtype)
    fe = feats(feature_map, 16, m=32)
    kw = dict(feature_map=feature_map, features=fe, causal=causal, return_state=True)
    out, st = linear_attention(q, k, v, **kw)
    ref, st32 = linear_attention(q.float(), k.float(), v.float(), **kw)
    assert out.dtype == dtype and st.kv.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(st.kv).all()
    close(out, ref, "out", **HALF_OUT_TOL[dtype])
    close(st.kv, st32.kv, "kv", atol=0, rtol=1e-4)
    close(st.z, st32.z, "z", atol=0, rtol=1e-4)


# ----------------------------------------------------------------- gradcheck and memory


@pytest.mark.parametrize("feature_map", MAPS)
def test_gradcheck_causal_chunked(feature_map, gen):
    """fp64 gradcheck, N=7 in chunks of 3, GQA, with a state given (its grads too)."""
    fe = feats(feature_map, 4, m=6)
    q, k, v = leaves(1, 2, 1, 7, 4, 3, gen=gen)
    _, st = linear_attention(q.detach()[:, :, :3], k.detach()[:, :1, :3], v.detach()[:, :1, :3],
                             feature_map=feature_map, features=fe, causal=True,
                             return_state=True)
    kv0 = st.kv.clone().requires_grad_()
    z0 = st.z.clone().requires_grad_()

    def fn(q, k, v, kv0, z0):
        state = LinearState(kv0, z0, st.log_scale)
        return linear_attention(q, k, v, feature_map=feature_map, features=fe, causal=True,
                                chunk_size=3, state=state)

    assert torch.autograd.gradcheck(fn, (q, k, v, kv0, z0))

    def step(q_t, k_t, v_t, kv0, z0):
        out, new = linear_attention_step(q_t, k_t, v_t, LinearState(kv0, z0, st.log_scale),
                                         feature_map=feature_map, features=fe)
        return out, new.kv, new.z

    one = [t.detach()[:, :, 3:4].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(step, (*one, kv0, z0))


def _saved_numels(n: int) -> list[int]:
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_attention(q, k, v, causal=True, chunk_size=32).sum()
    return sizes


def test_causal_autograd_memory_is_linear_in_n():
    """What autograd saves for backward grows like N (x2 when N doubles), and no saved
    tensor is per-position state (B·H·N·D'·Dv elements)."""
    small, large = _saved_numels(1024), _saved_numels(2048)
    assert sum(large) <= 2.1 * sum(small)
    assert max(large) < 2 * 2048 * 16 * 16  # per-position (D', Dv) state: B·H·N·D'·Dv


# --------------------------------------------------------------------------- bad inputs


def _bad_cases():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 3)
    fe = FavorFeatures(8, 4, seed=0)
    good_state = linear_attention(q, k, v, return_state=True)[1]
    la, step = linear_attention, linear_attention_step
    return [
        ("rank", lambda: la(q[0], k, v), ValueError, "q must be 4-D"),
        ("type", lambda: la(q, k.numpy(), v), TypeError, "k must be a torch.Tensor"),
        ("int", lambda: la(q.long(), k.long(), v.long()), TypeError, "floating"),
        ("dtypes", lambda: la(q, k.double(), v), TypeError, "dtypes differ"),
        ("heads", lambda: la(torch.randn(1, 3, 4, 8), k, v), ValueError, "multiple of"),
        ("kv heads", lambda: la(q, k, v[:, :1]), ValueError, "same heads"),
        ("lengths", lambda: la(q, k, v[:, :, :3]), ValueError, "same length S"),
        ("head dim", lambda: la(q, k[..., :4], v), ValueError, "head dims differ"),
        ("batch", lambda: la(q, k.expand(2, -1, -1, -1), v), ValueError, "batch sizes"),
        ("map", lambda: la(q, k, v, feature_map="relu"), ValueError, "feature_map"),
        ("favor no features", lambda: la(q, k, v, feature_map="favor"), TypeError,
         "FavorFeatures"),
        ("features for elu", lambda: la(q, k, v, features=fe), ValueError, "features="),
        ("features dim", lambda: la(q, k, v, feature_map="favor",
                                    features=FavorFeatures(4, 4)), ValueError, "head_dim"),
        ("causal N != S", lambda: la(q[:, :, :2], k, v, causal=True), ValueError, "N == S"),
        ("chunk", lambda: la(q, k, v, causal=True, chunk_size=0), ValueError, "chunk_size"),
        ("eps", lambda: la(q, k, v, eps=-1.0), ValueError, "eps"),
        ("state type", lambda: la(q, k, v, state=(1, 2)), TypeError, "LinearState"),
        ("state shape", lambda: la(q, k, v[..., :2], state=good_state), ValueError,
         "state shapes"),
        ("step length", lambda: step(q, k, v, None), ValueError, "one position"),
        ("step state", lambda: step(q[:, :, :1], k[:, :, :1], v[:, :, :1], good_state,
                                    feature_map="favor", features=fe), ValueError,
         "state shapes"),
        ("favor state for elu", lambda: la(q, k, v, state=LinearState(
            torch.zeros(1, 2, 8, 3), torch.zeros(1, 2, 8), torch.zeros(1, 2))), ValueError,
         "log_scale"),
        ("favor args", lambda: FavorFeatures(8, 0), ValueError, "num_features"),
    ]


@pytest.mark.parametrize(("name", "call", "exc", "match"), _bad_cases(),
                         ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_clear_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()
