"""linear_attention / linear_attention_step with ``keep=`` (key padding).

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim.

Oracle: the fp64 quadratic form of tests/ops/test_linear.py with the masked keys' columns of
A = φ(Q) φ(K)ᵀ set to zero. Tolerances: fp64 vs the oracle atol/rtol 1e-10 (summation order);
fp32 padded vs the same row run alone atol/rtol 1e-5 (outputs O(1)).
"""

from __future__ import annotations

import pytest
import torch
from test_linear import F32, F64, close, phi_of, unscaled

from conftest import randn
from qkv.ops.linear import FavorFeatures, linear_attention, linear_attention_step

MAPS = ("elu", "favor")


def feats(feature_map, d, m=16, seed=3):
    return FavorFeatures(d, m, seed=seed) if feature_map == "favor" else None


def masked_quadratic(q, k, v, phi, keep, *, causal, eps=1e-6):
    """A V / (A 1 + eps) with A's masked key columns zero, (B, H, N, Dv)."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    a = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, N, S)
    a = a * keep[:, None, None, :].to(a.dtype)
    if causal:
        a = a * torch.ones(a.shape[-2:], dtype=a.dtype).tril()
    return (a @ v.nan_to_num(0.0)) / (a.sum(-1, keepdim=True) + eps)


def left_keep(lengths, n):
    """(B, N) bool, True on the last ``lengths[b]`` positions (left padding)."""
    return torch.arange(n)[None, :] >= (n - torch.tensor(lengths))[:, None]


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal,chunk", [(True, 4), (True, 64), (False, 64)])
def test_keep_equals_masked_quadratic_fp64(feature_map, causal, chunk, gen):
    b, h, hkv, n, d = 3, 4, 2, 17, 8
    q = randn(b, h, n, d, gen=gen, dtype=torch.float64)
    k = randn(b, hkv, n, d, gen=gen, dtype=torch.float64)
    v = randn(b, hkv, n, d, gen=gen, dtype=torch.float64)
    keep = left_keep([17, 9, 1], n)
    keep[0, 5] = False  # a hole in the middle too
    f = feats(feature_map, d)
    out = linear_attention(q, k, v, feature_map=feature_map, features=f, causal=causal,
                           chunk_size=chunk, keep=keep)
    want = masked_quadratic(q, k, v, phi_of(feature_map, f), keep, causal=causal)
    close(out, want, f"{feature_map} causal={causal} C={chunk}", **F64)
    if causal:  # queries before a row's first real key see nothing: zeros
        assert torch.equal(out[2, :, :n - 1], torch.zeros_like(out[2, :, :n - 1]))


@pytest.mark.parametrize("feature_map", MAPS)
def test_left_padded_row_equals_row_alone_with_grads(feature_map, gen):
    d, n, pad = 8, 13, 5
    q, k, v = (randn(1, 2, n, d, gen=gen) for _ in range(3))
    junk = [randn(1, 2, pad, d, gen=gen) * 30 for _ in range(3)]  # large, to show leaks
    junk[2][0, 0, 0, 0] = float("nan")  # a NaN in a padded value must not leak either
    qp, kp, vp = (torch.cat([j, t], dim=2).requires_grad_() for j, t in zip(junk, (q, k, v),
                                                                           strict=True))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    keep = torch.arange(n + pad)[None] >= pad  # (1, pad + N)
    f = feats(feature_map, d)
    kw = {"feature_map": feature_map, "features": f, "causal": True, "chunk_size": 4}
    out_p = linear_attention(qp, kp, vp, keep=keep, **kw)
    out = linear_attention(q, k, v, **kw)
    close(out_p[:, :, pad:], out, f"{feature_map}: padded row vs alone", **F32)
    g = torch.randn_like(out)
    grads_p = torch.autograd.grad(out_p[:, :, pad:], (qp, kp, vp), g)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for name, gp, g1 in zip("qkv", grads_p, grads, strict=True):
        assert torch.isfinite(gp).all(), name
        close(gp[:, :, pad:], g1, f"{feature_map}: grad {name}", **F32)
        if name in "kv":  # padded keys/values get no gradient
            assert torch.equal(gp[:, :, :pad], torch.zeros_like(gp[:, :, :pad])), name


@pytest.mark.parametrize("feature_map", MAPS)
def test_step_keep_leaves_state_and_matches_chunked(feature_map, gen):
    b, h, n, d = 2, 2, 9, 8
    q, k, v = (randn(b, h, n, d, gen=gen, dtype=torch.float64) for _ in range(3))
    keep = left_keep([9, 4], n)
    f = feats(feature_map, d)
    kw = {"feature_map": feature_map, "features": f}
    want, final = linear_attention(q, k, v, causal=True, keep=keep, return_state=True, **kw)
    state, outs = None, []
    for t in range(n):
        sl = slice(t, t + 1)
        out, new = linear_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state,
                                         keep=keep[:, sl], **kw)
        if state is not None and not bool(keep[1, t]):  # a padded step changes nothing
            assert torch.equal(new.kv[1], state.kv[1]) and torch.equal(new.z[1], state.z[1])
        state = new
        outs.append(out)
    close(torch.cat(outs, dim=2), want, f"{feature_map}: steps vs chunked", **F64)
    for got, ref, name in zip(unscaled(state), unscaled(final), ("kv", "z"), strict=True):
        close(got, ref, f"{feature_map}: final state {name}", **F64)


def test_bad_keep_raises():
    q = k = v = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"keep must be a \(B, S\) = \(2, 4\) bool tensor"):
        linear_attention(q, k, v, keep=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep must be"):
        linear_attention(q, k, v, keep=torch.ones(2, 4))
