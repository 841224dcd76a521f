"""The chunked backend (online softmax in tiles, custom autograd Function).

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim.

- gradcheck in fp64, contiguous and strided inputs, dense bias (its gradient too), masks
  (Checklist 3);
- chunked == full for every block size, including 1 and non-divisors: outputs, gradients
  and the returned LSE (Checklist 8), "full" being ``oracle_attention`` (conftest, plain
  fp64 math) over a keep matrix built here without qkv.masks. Run in fp64, where merging
  partial results through the LSE must be exact up to summation order: atol 1e-12,
  rtol 1e-10 (``TOL[float64]``); and in fp32 against that fp64 oracle at atol 5e-5,
  rtol 5e-6 (Checklist 1);
- dropout: reproducible under a fixed seed, fresh otherwise, backward consistent with
  forward (gradcheck of a function that reseeds before each call);
- a long causal sequence with a T5 bias producer (slow).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from conftest import TOL, assert_close_to, fp64, grads_of, make_qkv, oracle_attention, randn
from qkv.masks import Causal, DenseMask, Padding
from qkv.ops.chunked import chunked_attention

# ------------------------------------------------------------------ gradcheck (fp64)


def _strided_leaf(t: Tensor, layout: str):
    """A leaf holding ``t``'s values in another memory layout, and the view that shows them
    as ``t`` again, non-contiguous: (leaf, view_fn)."""
    t = t.detach()
    if layout == "contiguous":
        return t.clone().requires_grad_(), None
    if t.dim() < 4:  # a 2-D bias (N, S): stored transposed
        return t.t().contiguous().requires_grad_(), lambda x: x.t()
    if layout == "transposed":  # stored (B, L, H, D), viewed (B, H, L, D)
        return t.transpose(1, 2).contiguous().requires_grad_(), lambda x: x.transpose(1, 2)
    base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)  # every other column
    base[..., ::2] = t
    return base.requires_grad_(), lambda x: x[..., ::2]


GRADCHECK_CASES = {
    # id: (B, H, Hkv, N, S, D, Dv, mask factory, bias shape or None, block_q, block_k)
    "plain": (1, 2, 2, 4, 6, 3, 3, lambda n, s: None, None, 2, 4),
    "causal-N<S": (1, 2, 2, 3, 5, 3, 2, lambda n, s: Causal(), None, 2, 2),
    "causal-N>S-empty-rows": (1, 2, 2, 5, 3, 3, 3, lambda n, s: Causal(), (1, 2, 5, 3), 2, 2),
    "causal-top-left": (1, 2, 2, 5, 4, 2, 3, lambda n, s: Causal("top_left"), None, 3, 1),
    "padding+bias(B,H,N,S)": (2, 2, 2, 4, 5, 3, 3,
                              lambda n, s: Padding(torch.tensor([5, 2])), (2, 2, 4, 5), 3, 2),
    "causal&padding+bias(N,S)": (2, 1, 1, 4, 5, 3, 2,
                                 lambda n, s: Causal() & Padding(torch.tensor([4, 0])),
                                 (4, 5), 1, 3),
    "bool+bias(1,H,1,S)": (1, 2, 2, 4, 6, 2, 2,
                           lambda n, s: DenseMask(torch.rand(1, 2, n, s) < 0.6), (1, 2, 1, 6),
                           2, 5),
    "gqa-H4-Hkv2+bias": (1, 4, 2, 3, 4, 2, 3, lambda n, s: Causal(), (1, 4, 3, 4), 2, 3),
    "mqa-H3-Hkv1": (1, 3, 1, 3, 4, 2, 2, lambda n, s: None, None, 64, 64),
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("case_id", list(GRADCHECK_CASES))
def test_gradcheck_fp64(case_id, layout):
    b, h, hkv, n, s, d, dv, mask_fn, bias_shape, bq, bk = GRADCHECK_CASES[case_id]
    mask = mask_fn(n, s)
    q, k, v = make_qkv(b, h, n, s, d, hkv=hkv, dv=dv, dtype=torch.float64)
    tensors = [q, k, v]
    if bias_shape is not None:
        tensors.append(randn(*bias_shape, dtype=torch.float64).requires_grad_())
    leaves, views = zip(*(_strided_leaf(t, layout) for t in tensors), strict=True)

    def fn(*args):
        args = [a if view is None else view(a) for a, view in zip(args, views, strict=True)]
        if layout != "contiguous":  # the layout really differs from the canonical one
            assert any(a.stride() != torch.empty(a.shape).stride() for a in args)
        bias = args[3] if len(args) > 3 else None
        out, _ = chunked_attention(args[0], args[1], args[2], mask=mask, bias=bias,
                                   scale=0.7, block_q=bq, block_k=bk)
        return out

    assert torch.autograd.gradcheck(fn, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_default_blocks_and_non_divisor_blocks():
    """Default block sizes (no block_q/block_k) and blocks that do not divide N or S."""
    q, k, v = make_qkv(1, 1, 7, 9, 2, dtype=torch.float64)
    bias = randn(1, 1, 7, 9, dtype=torch.float64).requires_grad_()
    mask = Causal() & Padding(torch.tensor([8]))
    for bq, bk in ((None, None), (3, 4)):
        assert torch.autograd.gradcheck(
            lambda q, k, v, b, bq=bq, bk=bk: chunked_attention(
                q, k, v, mask=mask, bias=b, scale=0.5, block_q=bq, block_k=bk)[0],
            (q, k, v, bias), eps=1e-6, atol=1e-7)


# --------------------------------------------------- chunked == full (Checklist 8)

BLOCKS = [1, 3, 7, 16, 64, 100]  # 1, non-divisors of N=23/S=37, and larger than N and S


def _lse_oracle(q: Tensor, k: Tensor, *, keep: Tensor | None, bias: Tensor | None,
                scale: float) -> Tensor:
    """torch.logsumexp of the fp64 reference logits (B, H, N); -inf for empty rows."""
    k = torch.repeat_interleave(k, q.shape[1] // k.shape[1], dim=1)
    logits = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, N, S)
    if bias is not None:
        logits = logits + bias
    if keep is not None:
        logits = logits.masked_fill(~keep, -torch.inf)
    return torch.logsumexp(logits, dim=-1)


def _block_problem(n: int, s: int, dtype: torch.dtype, gen):
    b, h, hkv, d, dv = 2, 4, 2, 8, 12
    q, k, v = make_qkv(b, h, n, s, d, hkv=hkv, dv=dv, dtype=dtype, gen=gen)
    bias = randn(1, h, n, s, gen=gen, dtype=dtype).requires_grad_()
    lengths = torch.tensor([s, s // 3])
    mask = Causal() & Padding(lengths)
    d_out = randn(b, h, n, dv, gen=gen, dtype=torch.float64)
    return q, k, v, bias, mask, d_out


def _block_keep(n: int, s: int) -> Tensor:
    """The keep matrix of ``_block_problem``'s mask from its documented meaning, without
    qkv.masks: bottom-right causal ``j <= i + S - N`` and padding ``j < length``."""
    lengths = [s, s // 3]
    return torch.tensor([[[j <= i + s - n and j < length for j in range(s)] for i in range(n)]
                         for length in lengths])[:, None]  # (B, 1, N, S)


@pytest.mark.parametrize("block_k", BLOCKS, ids=lambda x: f"bk{x}")
@pytest.mark.parametrize("block_q", BLOCKS, ids=lambda x: f"bq{x}")
@pytest.mark.parametrize(("n", "s"), [(23, 37), (37, 23)], ids=["N23-S37", "N37-S23"])
def test_every_block_size_matches_full_fp64(n, s, block_q, block_k, gen):
    """fp64, causal & padding & dense bias, GQA, Dv != D (N37-S23 has empty rows):
    outputs, grads and LSE equal the full computation at atol 1e-12, rtol 1e-10."""
    q, k, v, bias, mask, d_out = _block_problem(n, s, torch.float64, gen)
    scale = 0.3
    (out, lse), grads = _chunked_with_grads(q, k, v, bias, mask, d_out, scale, block_q, block_k)
    q2, k2, v2, b2 = fp64(q), fp64(k), fp64(v), fp64(bias)
    keep = _block_keep(n, s)
    ref, ref_grads = grads_of(lambda: oracle_attention(q2, k2, v2, keep=keep, bias=b2,
                                                       scale=scale),
                              [q2, k2, v2, b2], d_out)
    atol, rtol = TOL[torch.float64]
    assert_close_to(out, ref, atol=atol, rtol=rtol, what="out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert_close_to(g, r, atol=atol, rtol=rtol, what=name)
    want_lse = _lse_oracle(q.detach(), k.detach(), keep=keep, bias=bias.detach(), scale=scale)
    assert lse.shape == (2, 4, n)
    assert_close_to(lse, want_lse, atol=atol, rtol=rtol, what="lse")


def _chunked_with_grads(q, k, v, bias, mask, d_out, scale, block_q, block_k):
    for t in (q, k, v, bias):
        t.grad = None
    out, lse = chunked_attention(q, k, v, mask=mask, bias=bias, scale=scale,
                                 block_q=block_q, block_k=block_k)
    grads = torch.autograd.grad(out, [q, k, v, bias], d_out.to(out.dtype))
    return (out, lse), grads


@pytest.mark.parametrize("block_q", [1, 7, 64], ids=lambda x: f"bq{x}")
@pytest.mark.parametrize("block_k", [1, 16, 100], ids=lambda x: f"bk{x}")
def test_block_sizes_fp32_against_fp64_oracle(block_q, block_k, gen):
    """fp32 chunked at odd blocks vs the fp64 oracle: atol 5e-5, rtol 5e-6; LSE too."""
    n, s = 23, 37
    q, k, v, bias, mask, d_out = _block_problem(n, s, torch.float32, gen)
    (out, lse), grads = _chunked_with_grads(q, k, v, bias, mask, d_out, 0.3, block_q, block_k)
    q2, k2, v2, b2 = fp64(q), fp64(k), fp64(v), fp64(bias)
    keep = _block_keep(n, s)
    ref, ref_grads = grads_of(lambda: oracle_attention(q2, k2, v2, keep=keep, bias=b2,
                                                       scale=0.3),
                              [q2, k2, v2, b2], d_out)
    atol, rtol = TOL[torch.float32]
    assert_close_to(out, ref, atol=atol, rtol=rtol, what="out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert_close_to(g, r, atol=atol, rtol=rtol, what=name)
    want_lse = _lse_oracle(q2.detach(), k2.detach(), keep=keep,
                           bias=b2.detach(), scale=0.3)
    assert_close_to(lse, want_lse, atol=atol, rtol=rtol, what="lse")


def test_lse_merges_split_keys_exactly(gen):
    """Two halves of the keys, merged through their LSEs, give the whole (xFormers merge):
    out = sum_i exp(lse_i - lse) out_i, lse = logaddexp(lse_1, lse_2). fp64, 1e-12."""
    q, k, v = make_qkv(1, 2, 9, 20, 8, dtype=torch.float64, gen=gen)
    q, k, v = q.detach(), k.detach(), v.detach()
    whole, lse = chunked_attention(q, k, v, scale=0.4, block_q=4, block_k=3)
    o1, l1 = chunked_attention(q, k[:, :, :7], v[:, :, :7], scale=0.4)
    o2, l2 = chunked_attention(q, k[:, :, 7:], v[:, :, 7:], scale=0.4)
    merged_lse = torch.logaddexp(l1, l2)
    merged = (torch.exp(l1 - merged_lse)[..., None] * o1
              + torch.exp(l2 - merged_lse)[..., None] * o2)
    atol, rtol = TOL[torch.float64]
    assert_close_to(merged_lse, lse, atol=atol, rtol=rtol, what="lse")
    assert_close_to(merged, whole, atol=atol, rtol=rtol, what="out")


# ------------------------------------------------------------------------- dropout


def test_chunked_dropout_reproducible_under_seed_and_fresh_otherwise(gen):
    q, k, v = make_qkv(1, 2, 16, 24, 8, gen=gen)
    kw = {"mask": Causal(), "scale": 0.3, "dropout_p": 0.3, "block_q": 5, "block_k": 7}
    torch.manual_seed(7)
    a, _ = chunked_attention(q, k, v, **kw)
    torch.manual_seed(7)
    b, _ = chunked_attention(q, k, v, **kw)
    c, _ = chunked_attention(q, k, v, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize(("block_q", "block_k"), [(2, 3), (64, 64)], ids=["bq2-bk3", "bq64-bk64"])
def test_chunked_dropout_gradcheck_with_reseeding(block_q, block_k):
    """Reseeding before each call fixes the dropout mask, so the chunked function with
    dropout is deterministic and fp64 gradcheck tests that backward regenerates exactly
    the forward's per-tile masks."""
    q, k, v = make_qkv(1, 2, 5, 7, 3, hkv=1, dtype=torch.float64)
    bias = randn(1, 2, 5, 7, dtype=torch.float64).requires_grad_()

    def fn(q, k, v, bias):
        torch.manual_seed(99)
        out, _ = chunked_attention(q, k, v, mask=Causal(), bias=bias, scale=0.5,
                                   dropout_p=0.35, block_q=block_q, block_k=block_k)
        return out

    with torch.random.fork_rng():
        assert torch.equal(fn(q, k, v, bias), fn(q, k, v, bias))
        assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-7)


def test_chunked_dropout_pattern_matches_backward_pattern():
    """With one-hot values and uniform logits the forward output exposes the dropout mask
    (out[i, j] = keep[i, j] / (S (1 - p))); dV = Wᵀ dO must use the same mask: with dO = 1
    at (i, j) only, dV[j] = kept weight of (i, j)."""
    n, s, p = 6, 8, 0.5
    q = torch.zeros(1, 1, n, 4, dtype=torch.float64)
    k = torch.randn(1, 1, s, 4, dtype=torch.float64)
    v = torch.eye(s, dtype=torch.float64)[None, None].requires_grad_()
    torch.manual_seed(5)
    out, _ = chunked_attention(q, k, v, scale=1.0, dropout_p=p, block_q=4, block_k=3)
    weights = out.detach()[0, 0]  # (N, S): dropped-and-rescaled weights
    (dv,) = torch.autograd.grad(out, [v], torch.ones_like(out))
    # dV[j, c] = sum_i W[i, j] * dO[i, c] = column sum of W for every c
    want = weights.sum(0)[:, None].expand(s, s)
    torch.testing.assert_close(dv[0, 0], want, atol=1e-12, rtol=0)


# ------------------------------------------------------------------ memory and args


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["causal&padding", "bool(B,1,1,S)"])
def test_never_materialises_n_by_s(kind):
    """N = S = 2048 with a typed mask, forward and backward: the largest tensor stays
    below N·S/8 (the default tiles are 128 x 512 = N·S/64)."""
    n, d = 2048, 16
    q, k, v = make_qkv(1, 1, n, n, d)
    mask = (Causal() & Padding(torch.tensor([n - 100])) if kind == "causal&padding"
            else torch.rand(1, 1, 1, n) < 0.9)
    with _LargestTensor() as watch:
        out = qkv.attention(q, k, v, mask=mask, backend="chunked")
        out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert watch.largest < n * n // 8, watch.largest


@pytest.mark.parametrize("blocks", [{"block_q": -1}, {"block_k": -2}, {"block_q": 0}],
                         ids=["block_q=-1", "block_k=-2", "block_q=0"])
def test_chunked_rejects_non_positive_blocks(blocks):
    q, k, v = make_qkv(1, 1, 4, 6, 8)
    name = next(iter(blocks))
    with pytest.raises(ValueError, match=name):
        chunked_attention(q, k, v, scale=1.0, **blocks)


# -------------------------------------------------------------------- long sequence


@pytest.mark.slow
def test_long_causal_t5_bias_matches_reference():
    """N = S = 4096, causal, T5 relative bias (fast fused path) vs the reference backend in
    fp64 on fp64 copies (it materialises 4096² per head: B=1, H=2, D=32). atol 5e-5,
    rtol 5e-6 on the fp32 output."""
    import copy

    from qkv.modules.relative import T5Bias

    torch.manual_seed(0)
    h, n, d = 2, 4096, 32
    t5 = T5Bias(h, bidirectional=False)
    with torch.no_grad():
        t5.embedding.weight.normal_()
    q = torch.randn(1, h, n, d)
    k = torch.randn(1, h, n, d)
    v = torch.randn(1, h, n, d)
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask=Causal(), bias=t5, backend="chunked")
        ref = qkv.attention(q.double(), k.double(), v.double(), mask=Causal(),
                            bias=copy.deepcopy(t5).double(), backend="reference")
    atol, rtol = TOL[torch.float32]
    assert_close_to(out, ref, atol=atol, rtol=rtol, what="N=4096 causal T5")
