"""NaN in, NaN out — the same on every backend; what a row may not attend to never reaches it.

The contract (``qkv.attention``): a query row holding a NaN gives a NaN output row if it may
attend to at least one key, and zeros if it may attend to none (the fully-masked rule); a key
holding a NaN makes NaN every row that may attend to it; a NaN in a value makes NaN that
dimension of every row that may attend to its key, the other dimensions unchanged. A NaN in a
key or value the mask hides from a row changes nothing in that row. The oracle is plain fp64
softmax over each row's visible keys only, written apart from qkv (only visible keys are
read), which satisfies that contract by construction.

What the backends did before (found trying qkv as an adversary): torch's CPU flash kernel,
used by ``sdpa``/``auto`` and by the ``chunked`` fused paths, skips NaN logits in its row
maximum when they fall outside its vector lanes (key lengths that are not a multiple of the
lane width) and then returns zeros for the row — a NaN query row came back as 0 while
``chunked``/``reference`` gave NaN; and 0 · NaN = NaN let a masked NaN value (and, under
SDPA's additive -inf mask, a masked NaN key) leak into rows that may not see it.

Shapes: B batch, H heads, N query length, S key length, D head dim.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import Tensor

import qkv
from conftest import make_qkv, randn
from qkv.masks import Causal, Padding
from qkv.modules.relative import ALiBi
from qkv.ops.sparse_masks import BigBird, SlidingWindow

BACKENDS = ("sdpa", "auto", "chunked", "reference")
NAN = float("nan")
TOL = {torch.float32: dict(atol=5e-5, rtol=5e-6), torch.float64: dict(atol=1e-10, rtol=1e-10),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _visible(kind: str, b: int, n: int, s: int) -> tuple[dict, Tensor]:
    """(keyword arguments for qkv.attention, visible (B, 1, N, S) bool) for one mask kind.

    The visibility is written out from each mask's documented rule (query i sits at
    position i + S - N), except BigBird, whose random layout is taken from its ``dense``."""
    i = torch.arange(n)[:, None] + (s - n)  # query positions (N, 1)
    j = torch.arange(s)[None, :]  # key positions (1, S)
    lengths = torch.tensor([s, max(1, s // 2)] + [s] * (b - 2))[:b]
    if kind == "none":
        return {}, torch.ones(b, 1, n, s, dtype=torch.bool)
    if kind == "causal":
        return {"causal": True}, (j <= i).expand(b, 1, n, s)
    if kind == "padding":
        return ({"mask": Padding(lengths)},
                (j < lengths[:, None, None, None]).expand(b, 1, n, s))
    if kind == "window":
        return {"mask": SlidingWindow(3)}, ((j <= i) & (j > i - 3)).expand(b, 1, n, s)
    if kind == "bool":
        keep = torch.rand(n, s, generator=torch.Generator().manual_seed(n * 1000 + s)) > 0.4
        keep[:, 0] = True  # every row sees a key (the fully-masked case is tested apart)
        return {"mask": keep}, keep.expand(b, 1, n, s)
    if kind == "bigbird":
        mask = BigBird(2, window_blocks=3, global_blocks=1, random_blocks=0)
        return {"mask": mask}, mask.dense(n, s, torch.device("cpu")).expand(b, 1, n, s)
    if kind == "causal+alibi":
        return {"causal": True, "bias": ALiBi(2)}, (j <= i).expand(b, 1, n, s)
    raise AssertionError(kind)


def _oracle(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, bias: Tensor | None) -> Tensor:
    """fp64 softmax(q kᵀ / sqrt(D) + bias) v over each row's visible keys only; zeros for a
    row that sees none. NaN propagates by plain arithmetic on what the row may see."""
    b, h, n, d = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for r in range(n):
                cols = visible[bi, 0, r].nonzero().squeeze(1)
                if cols.numel() == 0:
                    continue
                logits = k[bi, hi, cols].double() @ q[bi, hi, r].double() / math.sqrt(d)
                if bias is not None:
                    logits = logits + bias[0 if bias.shape[0] == 1 else bi, hi, r, cols].double()
                out[bi, hi, r] = torch.softmax(logits, dim=0) @ v[bi, hi, cols].double()
    return out


def _poison(q: Tensor, k: Tensor, v: Tensor, where: str, visible: Tensor) -> None:
    """Put NaN into q, k or v in place. ``*_hidden`` picks a key of batch 0 that some row may
    not attend to while another row may (so a leak shows)."""
    n, s = q.shape[2], k.shape[2]
    with torch.no_grad():
        if where == "q_row":
            q[0, 1, n // 2, 3] = NAN
        elif where == "q_all":
            q.fill_(NAN)
        elif where == "k_row":
            k[0, 1, s // 2, 0] = NAN
        elif where == "k_all":
            k[0].fill_(NAN)
        elif where == "v_elem":
            v[0, 1, s // 2, 2] = NAN
        elif where in ("k_hidden", "v_hidden"):
            hidden = (~visible[0, 0]) & visible[0, 0].any(0)  # (N, S)
            assert hidden.any(), "no key is hidden from one row and seen by another"
            col = int(hidden.nonzero()[0, 1])
            (k if where == "k_hidden" else v)[0, :, col] = NAN
        else:
            raise AssertionError(where)


def _check(out: Tensor, want: Tensor, dtype) -> None:
    nan_out, nan_want = torch.isnan(out), torch.isnan(want)
    assert torch.equal(nan_out, nan_want), (
        f"NaN pattern differs: {int((nan_out & ~nan_want).sum())} unexpected NaN, "
        f"{int((nan_want & ~nan_out).sum())} missing (rows given as zeros or finite)")
    torch.testing.assert_close(out.double(), want, equal_nan=True, **TOL[dtype])


MASKS = ("none", "causal", "padding", "window", "bool", "bigbird", "causal+alibi")
WHERE = ("q_row", "q_all", "k_row", "k_all", "v_elem", "k_hidden", "v_hidden")
# (no key is hidden from one row and not another without a mask, or with key padding alone)
CASES = [(kind, where) for kind in MASKS for where in WHERE
         if not (kind in ("none", "padding") and where.endswith("_hidden"))]


@pytest.mark.parametrize("shape", [(5, 7), (16, 16)], ids=lambda t: f"N{t[0]}S{t[1]}")
@pytest.mark.parametrize(("kind", "where"), CASES, ids=[f"{k}-{w}" for k, w in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_propagates_alike_on_every_backend(backend, kind, where, shape, gen):
    """fp32, every backend against the fp64 visible-keys-only oracle, NaN pattern exact.
    N5S7 puts every logit outside the flash kernel's vector lanes (where it dropped NaN)."""
    n, s = shape
    b, h, d = 2, 2, 8
    kw, visible = _visible(kind, b, n, s)
    q, k, v = (t.detach() for t in make_qkv(b, h, n, s, d, gen=gen))
    _poison(q, k, v, where, visible)
    bias = kw["bias"].dense(n, s, scale=1 / math.sqrt(d)) if "bias" in kw else None
    out = qkv.attention(q, k, v, backend=backend, **kw)
    _check(out, _oracle(q, k, v, visible, bias), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64],
                         ids=["bf16", "fp16", "fp64"])
@pytest.mark.parametrize(("kind", "where"), [
    ("none", "q_row"), ("none", "k_all"), ("causal", "q_row"), ("causal", "k_all"),
    ("causal", "v_hidden"), ("bool", "q_row"), ("bool", "k_hidden"), ("bool", "v_hidden")],
    ids=lambda x: x)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_propagates_alike_in_other_precisions(backend, kind, where, dtype, gen):
    """Half precision (computed in fp32 by every backend) and fp64: the same contract."""
    b, h, n, s, d = 2, 2, 5, 7, 8
    kw, visible = _visible(kind, b, n, s)
    q, k, v = (t.detach() for t in make_qkv(b, h, n, s, d, gen=gen, dtype=dtype))
    _poison(q, k, v, where, visible)
    out = qkv.attention(q, k, v, backend=backend, **kw)
    assert out.dtype == dtype
    _check(out, _oracle(q, k, v, visible, None), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_row_that_sees_nothing_stays_zero(backend, gen):
    """The fully-masked rule wins over NaN: a NaN query row with no key to attend to is 0."""
    q, k, v = (t.detach() for t in make_qkv(2, 2, 4, 6, 8, gen=gen))
    q[1, 0, 2] = NAN
    q[0, 1, 1] = NAN
    lengths = torch.tensor([6, 0])
    out = qkv.attention(q, k, v, mask=Padding(lengths), backend=backend)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isnan(out[0, 1, 1]).all() and torch.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_row_leaves_the_other_rows_and_all_gradients_finite(backend, gen):
    """Outputs and gradients of the finite rows equal those of the same inputs with the NaN
    row's query zeroed; every gradient is finite and the NaN entries get none."""
    b, h, n, s, d = 2, 2, 5, 7, 8
    q, k, v = make_qkv(b, h, n, s, d, gen=gen)
    d_out = randn(b, h, n, d, gen=gen)
    d_out[0, 1, 2] = 0.0
    bad = torch.zeros_like(q, dtype=torch.bool)
    bad[0, 1, 2, 5] = True

    def run(qq):
        qq = qq.detach().requires_grad_()
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = qkv.attention(qq, kk, vv, mask=Causal(), backend=backend)
        (out.nan_to_num(0.0) * d_out).sum().backward()
        return out.detach(), qq.grad, kk.grad, vv.grad

    out, dq, dk, dv = run(q.detach().masked_fill(bad, NAN))
    clean_out, cq, ck, cv = run(q.detach().masked_fill(bad, 0.0))
    assert torch.isnan(out[0, 1, 2]).all()
    keep = torch.ones(b, h, n, 1, dtype=torch.bool)
    keep[0, 1, 2] = False
    torch.testing.assert_close(out.masked_select(keep), clean_out.masked_select(keep),
                               atol=1e-6, rtol=0)
    for name, g, c in (("dq", dq, cq), ("dk", dk, ck), ("dv", dv, cv)):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, c, atol=1e-6, rtol=0)
    assert not dq[bad].any()


def test_finite_inputs_take_the_plain_path(gen, monkeypatch):
    """On finite inputs (no row without keys) the backend runs once: the guard only reads."""
    attn_mod = sys.modules["qkv.ops.attention"]  # (the package re-exports the function)
    calls = []
    real = attn_mod.sdpa_attention
    monkeypatch.setattr(attn_mod, "sdpa_attention", lambda *a, **kw: calls.append(1) or real(
        *a, **kw))
    q, k, v = (t.detach() for t in make_qkv(1, 2, 5, 7, 8, gen=gen))
    qkv.attention(q, k, v, causal=True, backend="sdpa")
    assert len(calls) == 1
