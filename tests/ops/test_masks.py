"""Typed masks (True = may attend): documented matrices, block/key-range consistency, and
the mask/bias equivalences every backend must honour (Checklist 5, 6).

Shapes: B batch, H query heads, N query length, S key length, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import qkv
from conftest import ALL_DTYPES, HALF_DTYPES, dtype_id, grads_of, make_qkv, randn
from qkv.masks import And, Causal, DenseMask, Padding, as_mask

BACKENDS = ("sdpa", "chunked", "reference")

# ------------------------------------------------- documented causal matrices (Checklist 6)
# Written literally (FlashAttention README convention): bottom-right puts the N queries at
# the end of the S keys; top-left is torch's is_causal for N != S.

CAUSAL_2x5 = {
    "bottom_right": [[1, 1, 1, 1, 0],
                     [1, 1, 1, 1, 1]],
    "top_left": [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0]],
}
CAUSAL_5x2 = {
    "bottom_right": [[0, 0],
                     [0, 0],
                     [0, 0],
                     [1, 0],
                     [1, 1]],
    "top_left": [[1, 0],
                 [1, 1],
                 [1, 1],
                 [1, 1],
                 [1, 1]],
}
CAUSAL_4x4 = [[1, 0, 0, 0],
              [1, 1, 0, 0],
              [1, 1, 1, 0],
              [1, 1, 1, 1]]
DOCUMENTED = [
    pytest.param(2, 5, "bottom_right", CAUSAL_2x5["bottom_right"], id="2x5-bottom_right"),
    pytest.param(2, 5, "top_left", CAUSAL_2x5["top_left"], id="2x5-top_left"),
    pytest.param(5, 2, "bottom_right", CAUSAL_5x2["bottom_right"], id="5x2-bottom_right"),
    pytest.param(5, 2, "top_left", CAUSAL_5x2["top_left"], id="5x2-top_left"),
    pytest.param(4, 4, "bottom_right", CAUSAL_4x4, id="4x4-bottom_right"),
    pytest.param(4, 4, "top_left", CAUSAL_4x4, id="4x4-top_left"),
]


@pytest.mark.parametrize(("n", "s", "alignment", "matrix"), DOCUMENTED)
def test_causal_dense_is_documented_matrix(n, s, alignment, matrix):
    got = Causal(alignment).dense(n, s)
    assert got.dtype == torch.bool
    assert torch.equal(got.expand(1, 1, n, s)[0, 0], torch.tensor(matrix, dtype=torch.bool))


def test_causal_default_is_bottom_right():
    assert torch.equal(Causal().dense(2, 5), Causal("bottom_right").dense(2, 5))


def _attended(backend: str, n: int, s: int, **kw) -> Tensor:
    """Which (i, j) a backend lets attend: q = 0 gives equal logits and one-hot values
    v[j] = e_j make out[i, j] = weight[i, j] > 0 exactly where j is attended."""
    q = torch.zeros(1, 1, n, 8)
    k = torch.randn(1, 1, s, 8)
    v = torch.eye(s)[None, None]  # (1, 1, S, S)
    out = qkv.attention(q, k, v, backend=backend, **kw)
    return out[0, 0] != 0  # (N, S)


@pytest.mark.parametrize(("n", "s", "alignment", "matrix"), DOCUMENTED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_applies_documented_causal_matrix(backend, n, s, alignment, matrix):
    want = torch.tensor(matrix, dtype=torch.bool)
    assert torch.equal(_attended(backend, n, s, mask=Causal(alignment)), want)
    if alignment == "bottom_right":
        assert torch.equal(_attended(backend, n, s, causal=True), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_applies_causal_and_padding(backend):
    # N=3, S=5, bottom-right (offset 2), keys 0..3 real: literal expected matrix
    want = torch.tensor([[1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 0]], dtype=torch.bool)
    got = _attended(backend, 3, 5, mask=Causal() & Padding(torch.tensor([4])))
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- Padding


def test_padding_lengths_and_keep_agree():
    lengths = torch.tensor([5, 2, 0])
    keep = torch.tensor([[1, 1, 1, 1, 1],
                         [1, 1, 0, 0, 0],
                         [0, 0, 0, 0, 0]], dtype=torch.bool)
    a = Padding(lengths).dense(4, 5)
    b = Padding(keep=keep).dense(4, 5)
    assert a.shape == b.shape == (3, 1, 1, 5)
    assert torch.equal(a, b)
    assert torch.equal(a[:, 0, 0], keep)


def test_padding_accepts_python_list():
    assert torch.equal(Padding([2, 1]).dense(1, 3)[:, 0, 0],
                       torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool))


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_lengths_equivalent_to_keep_in_attention(backend, gen):
    q, k, v = make_qkv(3, 2, 7, 9, 16, gen=gen)
    lengths = torch.tensor([9, 4, 1])
    keep = torch.arange(9)[None, :] < lengths[:, None]
    a = qkv.attention(q, k, v, mask=Padding(lengths), backend=backend)
    b = qkv.attention(q, k, v, mask=Padding(keep=keep), backend=backend)
    c = qkv.attention(q, k, v, mask=keep[:, None, None, :], backend=backend)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # same math, fp32
    torch.testing.assert_close(a, c, atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [None, "top_left"], ids=["padding", "top-left&padding"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_equals_unpadded_and_row_equals_single_run(backend, causal, gen):
    """Row b of a padded batch == attention over its first lengths[b] keys alone (a
    top-left causal mask does not depend on S, so it composes). fp32, same math on fewer
    keys: atol 1e-6, rtol 1e-5."""
    b, h, n, s, d = 3, 2, 7, 11, 16
    q, k, v = make_qkv(b, h, n, s, d, gen=gen)
    lengths = torch.tensor([11, 6, 1])
    mask = Padding(lengths)
    if causal:
        mask = Causal(causal) & mask
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    for row, length in enumerate(lengths.tolist()):
        kw = {"mask": Causal(causal)} if causal else {}
        alone = qkv.attention(q[row:row + 1], k[row:row + 1, :, :length],
                              v[row:row + 1, :, :length], backend=backend, **kw)
        torch.testing.assert_close(out[row:row + 1], alone, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------ composition


def test_and_flattens_and_dense_is_conjunction():
    t = torch.rand(1, 1, 4, 6) < 0.5
    m = (Causal() & Padding(torch.tensor([5, 3]))) & t
    assert isinstance(m, And) and len(m.parts) == 3
    want = Causal().dense(4, 6) & Padding(torch.tensor([5, 3])).dense(4, 6) & t
    assert torch.equal(m.dense(4, 6).expand(2, 1, 4, 6), want.expand(2, 1, 4, 6))


def test_tensor_and_mask_both_orders():
    t = torch.rand(3, 5) < 0.5
    for m in (t & Causal(), Causal() & t):
        assert isinstance(m, And)
        assert torch.equal(m.dense(3, 5)[0, 0], t & Causal().dense(3, 5)[0, 0])


def test_as_mask():
    assert as_mask(None) is None
    c = Causal()
    assert as_mask(c) is c
    t = torch.ones(2, 3, dtype=torch.bool)
    m = as_mask(t)
    assert isinstance(m, DenseMask) and m.tensor.shape == (1, 1, 2, 3)


# --------------------------------------------- blocks and key ranges agree with dense()
# The chunked backend trusts ``block`` (True/False/tensor) and ``key_range`` to skip
# tiles; any disagreement with ``dense`` silently drops or adds keys.

def _mask_zoo() -> list:
    keep = torch.rand(2, 13) < 0.6
    dense = torch.rand(2, 1, 11, 13) < 0.5
    return [
        pytest.param(Causal(), 11, 13, id="causal-br-N<S"),
        pytest.param(Causal(), 13, 11, id="causal-br-N>S"),
        pytest.param(Causal("top_left"), 11, 13, id="causal-tl-N<S"),
        pytest.param(Causal("top_left"), 13, 11, id="causal-tl-N>S"),
        pytest.param(Causal(), 12, 12, id="causal-N=S"),
        pytest.param(Padding(torch.tensor([13, 4])), 11, 13, id="padding-lengths"),
        pytest.param(Padding(keep=keep), 11, 13, id="padding-keep"),
        pytest.param(DenseMask(dense), 11, 13, id="dense"),
        pytest.param(Causal() & Padding(torch.tensor([0, 7])), 11, 13, id="causal&padding"),
        pytest.param(Causal("top_left") & DenseMask(dense), 11, 13, id="causal-tl&dense"),
    ]


@pytest.mark.parametrize("block", [1, 3, 7, 64])
@pytest.mark.parametrize(("mask", "n", "s"), _mask_zoo())
def test_block_and_key_range_agree_with_dense(mask, n, s, block):
    full = mask.dense(n, s)
    full = full.expand(full.shape[0], full.shape[1], n, s)
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        lo, hi = mask.key_range(i0, i1, n, s)
        assert 0 <= lo <= hi <= s
        rows = full[:, :, i0:i1]
        # key_range is a promise: nothing outside [lo, hi) is attended by these rows
        assert not rows[..., :lo].any() and not rows[..., hi:].any()
        for j0 in range(0, s, block):
            j1 = min(s, j0 + block)
            want = rows[..., j0:j1]
            got = mask.block(i0, i1, j0, j1, n, s, torch.device("cpu"))
            if got is True:
                assert want.all(), (i0, j0)
            elif got is False:
                assert not want.any(), (i0, j0)
            else:
                assert torch.equal(torch.broadcast_to(got, want.shape), want), (i0, j0)


# ------------------------------------- bool ≡ -inf bias ≡ finfo.min bias (Checklist 5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_equals_additive_inf_and_finfo_min(backend, dtype, gen):
    """Outputs and grads of the three spellings of one mask agree. Every row keeps at
    least one key (a row of only finfo.min logits is uniform, not empty, by design).
    Tolerance: torch.testing's per-dtype defaults (fp32 1.3e-6/1e-5, fp16 1e-3/1e-5,
    bf16 1.6e-2/1e-5 rtol/atol) — the three runs do the same arithmetic."""
    b, h, n, s = 2, 2, 9, 13
    q, k, v = make_qkv(b, h, n, s, 16, dtype=dtype, gen=gen)
    d_out = randn(b, h, n, 16, gen=gen)
    keep = torch.rand(b, 1, n, s) < 0.6
    keep[..., 0] = True
    spellings = {
        "bool": {"mask": keep},
        "-inf": {"bias": torch.zeros(b, 1, n, s, dtype=dtype).masked_fill(~keep, -torch.inf)},
        "finfo.min": {"bias": torch.zeros(b, 1, n, s, dtype=dtype).masked_fill(
            ~keep, torch.finfo(dtype).min)},
    }
    results = {}
    for name, kw in spellings.items():
        out, grads = grads_of(lambda kw=kw: qkv.attention(q, k, v, backend=backend, **kw),
                              [q, k, v], d_out)
        assert all(torch.isfinite(t).all() for t in (out, *grads)), name
        results[name] = (out, *grads)
    for name in ("-inf", "finfo.min"):
        for what, a, c in zip(("out", "dq", "dk", "dv"), results["bool"], results[name],
                              strict=True):
            torch.testing.assert_close(c, a, msg=lambda m, w=what, nm=name: f"{nm} {w}: {m}")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_composed_masks_stay_finite_in_half(backend, dtype, gen):
    """HF PR 27114: adding finfo.min masks in half precision overflows to -inf; a row whose
    logits are all -inf must give zeros, not NaN, and rows of only finfo.min stay finite.
    Here causal, padding (batch 1 has length 0) and a "drop query row 0" mask are written
    as finite finfo.min biases and summed in ``dtype``: row 0 of batch 1 becomes all -inf,
    other rows of batch 1 are finfo.min where causal allows (uniform weights, finite)."""
    b, h, n, s = 2, 2, 6, 8
    q, k, v = make_qkv(b, h, n, s, 16, dtype=dtype, gen=gen)
    low = torch.finfo(dtype).min
    causal_bias = torch.zeros(n, s, dtype=dtype).masked_fill(~Causal().dense(n, s)[0, 0], low)
    lengths = torch.tensor([8, 0])
    pad_bias = torch.zeros(b, 1, 1, s, dtype=dtype).masked_fill(
        ~Padding(lengths).dense(n, s), low)
    row_bias = torch.zeros(n, 1, dtype=dtype)
    row_bias[0] = low
    bias = causal_bias + pad_bias + row_bias  # (B, 1, N, S); min + min = -inf in half
    assert torch.isneginf(bias[1, 0, 0]).all() and torch.isfinite(bias[1, 0, 1:, 0]).all()
    for kw in ({"bias": bias}, {"bias": bias, "mask": Causal() & Padding(lengths)},
               {"bias": causal_bias + row_bias, "mask": Padding(lengths)}):
        out = qkv.attention(q, k, v, backend=backend, **kw)
        out.float().sum().backward()
        for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            assert torch.isfinite(t).all(), (name, sorted(kw))
        assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
        q.grad = k.grad = v.grad = None


# -------------------------------- memory past a sequence's end is ignored (Checklist 9)
# xFormers' nanify_oob_seqlen: keys/values past each row's length (Padding) are filled
# with NaN; valid outputs and gradients must not change (qkv.attention zeroes that memory:
# otherwise 0 * NaN = NaN in weights @ V, and SDPA keeps a NaN logit under its -inf mask).


@pytest.mark.parametrize("what", ["out", "grads"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_past_sequence_end_changes_nothing(backend, where, what, gen):
    b, h, n, s, d = 3, 2, 6, 9, 8
    lengths = torch.tensor([9, 4, 1])
    q, k, v = make_qkv(b, h, n, s, d, gen=gen)
    d_out = randn(b, h, n, d, gen=gen)
    past_end = torch.arange(s)[None, :] >= lengths[:, None]  # (B, S)
    poisoned = {"k": k, "v": v}[where].detach().clone()
    poisoned[past_end[:, None, :, None].expand_as(poisoned)] = float("nan")
    poisoned.requires_grad_()
    k2, v2 = (poisoned, v) if where == "k" else (k, poisoned)

    def run(kk, vv):
        return grads_of(lambda: qkv.attention(q, kk, vv, mask=Padding(lengths),
                                              backend=backend), [q, kk, vv], d_out)

    clean_out, clean_grads = run(k, v)
    out, grads = run(k2, v2)
    if what == "out":
        assert torch.isfinite(out).all(), "NaN in valid rows' output"
        torch.testing.assert_close(out, clean_out, atol=1e-6, rtol=0)  # same math, fp32
        return
    live = ~past_end[:, None, :, None]  # (B, 1, S, 1): gradients of real keys
    dq, dk, dv = grads
    assert torch.isfinite(dq).all(), "dQ"
    torch.testing.assert_close(dq, clean_grads[0], atol=1e-6, rtol=0)
    for name, g, c in (("dk", dk, clean_grads[1]), ("dv", dv, clean_grads[2])):
        g, c = g.masked_select(live), c.masked_select(live)
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, c, atol=1e-6, rtol=0)
