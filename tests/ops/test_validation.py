"""``qkv.attention`` refuses bad requests with errors that name the offending argument, and
explains per backend why it cannot serve (docs/ARCHITECTURE.md: Errors; Backends (attention)).

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim.
"""

from __future__ import annotations

import re

import pytest
import torch

import qkv
from qkv import NoBackendError
from qkv.masks import Causal, Padding

B, H, HKV, N, S, D = 2, 4, 2, 5, 7, 8


def _qkv(**over):
    shapes = {"q": (B, H, N, D), "k": (B, HKV, S, D), "v": (B, HKV, S, D)}
    shapes.update(over)
    return tuple(torch.randn(*shapes[name]) for name in ("q", "k", "v"))


def _raises(exc, pattern: str, **kw):
    """pytest.raises matching ``pattern`` literally (case-sensitive)."""
    return pytest.raises(exc, match=re.escape(pattern), **kw)


SHAPE_ERRORS = {
    # id: (tensor shape overrides, exception, text the message must contain)
    "batch-mismatch": ({"k": (1, HKV, S, D), "v": (1, HKV, S, D)}, ValueError,
                       "batch sizes differ"),
    "H-not-multiple-of-Hkv": ({"k": (B, 3, S, D), "v": (B, 3, S, D)}, ValueError,
                              "H=4 must be a multiple of key/value heads Hkv=3"),
    "k-v-heads-differ": ({"v": (B, 1, S, D)}, ValueError, "k and v must have the same heads"),
    "k-v-lengths-differ": ({"v": (B, HKV, S - 1, D)}, ValueError,
                           "k and v must have the same length S"),
    "q-k-head-dim-differ": ({"k": (B, HKV, S, D + 2)}, ValueError, "q and k head dims differ"),
    "q-rank-3": ({"q": (H, N, D)}, ValueError, "q must be 4-D"),
    "k-rank-5": ({"k": (1, B, HKV, S, D)}, ValueError, "k must be 4-D"),
    "v-rank-2": ({"v": (S, D)}, ValueError, "v must be 4-D"),
    "empty-keys": ({"k": (B, HKV, 0, D), "v": (B, HKV, 0, D)}, ValueError, "empty keys"),
    "zero-Hkv": ({"k": (B, 0, S, D), "v": (B, 0, S, D)}, ValueError, "Hkv=0"),
}


@pytest.mark.parametrize("case_id", list(SHAPE_ERRORS))
def test_shape_errors_name_the_argument(case_id):
    over, exc, text = SHAPE_ERRORS[case_id]
    q, k, v = _qkv(**over)
    with _raises(exc, text):
        qkv.attention(q, k, v)


def test_dtype_mismatch():
    q, k, v = _qkv()
    with _raises(TypeError, "dtypes differ"):
        qkv.attention(q, k.double(), v)
    with _raises(TypeError, "dtypes differ"):
        qkv.attention(q.half(), k, v)


def test_non_float_and_non_tensor_inputs():
    q, k, v = _qkv()
    with _raises(TypeError, "q must be a floating tensor"):
        qkv.attention(q.long(), k, v)
    with _raises(TypeError, "v must be a torch.Tensor"):
        qkv.attention(q, k, v.tolist())


def test_device_mismatch():
    q, k, v = _qkv()
    with _raises(ValueError, "devices differ"):
        qkv.attention(q, k.to("meta"), v.to("meta"))


def test_float_tensor_as_mask_points_to_bias():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"mask.*bool.*bias="):
        qkv.attention(q, k, v, mask=torch.zeros(N, S))


def test_bool_tensor_as_bias_points_to_mask():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"bias.*float.*mask="):
        qkv.attention(q, k, v, bias=torch.ones(N, S, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(N - 1, S), (B, H, N, S + 1), (3, 1, N, S), (1, 3, N, S),
                                   (1, 1, 1, N, S)], ids=str)
def test_mask_of_wrong_shape(shape):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask.*shape"):
        qkv.attention(q, k, v, mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(N - 1, S), (B, H, N, S + 1), (3, 1, N, S), (1, 3, N, S),
                                   (1, 1, 1, N, S)], ids=str)
def test_bias_of_wrong_shape(shape):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"bias shape"):
        qkv.attention(q, k, v, bias=torch.zeros(shape))


@pytest.mark.parametrize("value", [[1.0], "0", 3])
def test_bias_of_wrong_type(value):
    q, k, v = _qkv()
    with _raises(TypeError, "bias must be"):
        qkv.attention(q, k, v, bias=value)


def test_mask_of_wrong_type():
    q, k, v = _qkv()
    with _raises(TypeError, "mask: expected a bool tensor or a qkv.masks.Mask"):
        qkv.attention(q, k, v, mask=[[True]])


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), "0.1"], ids=repr)
def test_dropout_outside_unit_interval(p):
    q, k, v = _qkv()
    with _raises(ValueError, "dropout_p must be in [0, 1)"):
        qkv.attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("scale", [-1.0, 0, 0.0, float("nan"), float("inf")], ids=repr)
def test_bad_scale(scale):
    q, k, v = _qkv()
    with _raises(ValueError, "scale must be a positive finite number"):
        qkv.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", ["1", True, torch.tensor(0.5)], ids=repr)
def test_scale_of_wrong_type(scale):
    q, k, v = _qkv()
    with _raises(TypeError, "scale must be a Python float"):
        qkv.attention(q, k, v, scale=scale)


def test_unknown_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend must be one of .*'flash'"):
        qkv.attention(q, k, v, backend="flash")


# ----------------------------------------------------------------------------- masks


def test_padding_lengths_longer_than_keys():
    q, k, v = _qkv()
    with _raises(ValueError, "Padding: a length (8) exceeds the key length S=7"):
        qkv.attention(q, k, v, mask=Padding(torch.tensor([S + 1, 3])))
    with _raises(ValueError, "Padding"):  # also inside a composition
        qkv.attention(q, k, v, mask=Causal() & Padding(torch.tensor([3, S + 1])))


def test_padding_for_another_batch_or_key_length():
    q, k, v = _qkv()
    with _raises(ValueError, "Padding: built for batch 3"):
        qkv.attention(q, k, v, mask=Padding(torch.tensor([1, 2, 3])))
    with _raises(ValueError, "Padding: keep has 6 keys"):
        qkv.attention(q, k, v, mask=Padding(keep=torch.ones(B, S - 1, dtype=torch.bool)))


def test_padding_broadcasts_a_single_row():
    q, k, v = _qkv()
    out = qkv.attention(q, k, v, mask=Padding(torch.tensor([3])), backend="reference")
    want = qkv.attention(q, k, v, mask=Padding(torch.tensor([3, 3])), backend="reference")
    assert torch.equal(out, want)


@pytest.mark.parametrize(("args", "kwargs", "text"), [
    pytest.param((torch.tensor([-1, 2]),), {}, "lengths must be >= 0", id="negative"),
    pytest.param((torch.tensor([1.0, 2.0]),), {}, "lengths must be a 1-D integer tensor",
                 id="float-lengths"),
    pytest.param((torch.tensor([[1, 2]]),), {}, "lengths must be a 1-D integer tensor",
                 id="2d-lengths"),
    pytest.param((), {}, "give exactly one of", id="neither"),
    pytest.param((torch.tensor([1]),), {"keep": torch.ones(1, 3, dtype=torch.bool)},
                 "give exactly one of", id="both"),
    pytest.param((), {"keep": torch.ones(2, 3)}, "keep must be a (B, S) bool tensor",
                 id="float-keep"),
    pytest.param((), {"keep": torch.ones(3, dtype=torch.bool)},
                 "keep must be a (B, S) bool tensor", id="1d-keep"),
])
def test_padding_constructor_errors(args, kwargs, text):
    with _raises(ValueError, "Padding: " + text):
        Padding(*args, **kwargs)


def test_causal_alignment_checked():
    with _raises(ValueError, "Causal: alignment must be 'bottom_right' or 'top_left'"):
        Causal("left")


# ------------------------------------------------------------- backends and explain()


def test_shaw_on_sdpa_raises_no_backend_error_with_reason():
    from qkv.modules.relative import ShawRelative

    q, k, v = _qkv()
    shaw = ShawRelative(D, max_distance=4)
    with pytest.raises(NoBackendError) as info:
        qkv.attention(q, k, v, bias=shaw, backend="sdpa")
    msg = str(info.value)
    assert "sdpa" in msg and "ShawRelative depends on the queries" in msg
    assert isinstance(info.value, ValueError)  # catchable as a ValueError too
    out = qkv.attention(q, k, v, bias=shaw)  # auto finds a backend that can
    assert out.shape == (B, H, N, D)


def test_explain_gives_per_backend_reasons():
    from qkv.modules.relative import ShawRelative

    q, k, v = _qkv()
    plain = qkv.explain(q, k, v, causal=True)
    assert set(plain) == set(qkv.BACKENDS) and all(r is None for r in plain.values())
    shaw = qkv.explain(q, k, v, bias=ShawRelative(D, max_distance=4))
    assert set(shaw) == set(qkv.BACKENDS)
    assert "depends on the queries" in shaw["sdpa"]
    assert shaw["chunked"] is None and shaw["reference"] is None


def test_reference_refuses_huge_problems_and_says_why():
    """Shapes only: meta tensors allocate nothing."""
    q = torch.empty(1, 1, 1 << 15, 8, device="meta")
    k = torch.empty(1, 1, 1 << 14, 8, device="meta")
    reasons = qkv.explain(q, k, k)
    assert reasons["sdpa"] is None and reasons["chunked"] is None
    assert "would materialise" in reasons["reference"]
    with pytest.raises(NoBackendError, match=r"reference: would materialise"):
        qkv.attention(q, k, k, backend="reference")


def test_producer_built_for_other_head_count():
    from qkv.modules.relative import T5Bias

    q, k, v = _qkv()
    with _raises(ValueError, "T5Bias is built for 3 heads, q has H=4"):
        qkv.attention(q, k, v, bias=T5Bias(3))


# ------------------------------------------------------------- degenerate but legal


@pytest.mark.parametrize("backend", qkv.BACKENDS)
@pytest.mark.parametrize("dims", [(0, H, N), (B, H, 0)], ids=["B=0", "N=0"])
def test_empty_batch_or_queries(backend, dims):
    b, h, n = dims
    q = torch.randn(b, h, n, D, requires_grad=True)
    k = torch.randn(b, HKV, S, D, requires_grad=True)
    v = torch.randn(b, HKV, S, 3, requires_grad=True)
    out = qkv.attention(q, k, v, mask=Causal(), backend=backend)
    assert out.shape == (b, h, n, 3)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_empty_batch_with_padding():
    q = torch.randn(0, H, N, D)
    k = torch.randn(0, HKV, S, D)
    out = qkv.attention(q, k, k, mask=Padding(torch.zeros(0, dtype=torch.long)))
    assert out.shape == (0, H, N, D)


# --------------------------------------------------------------- bias dtype != q dtype


@pytest.mark.parametrize("backend", qkv.BACKENDS)
def test_fp32_bias_with_fp16_inputs_is_honoured(backend):
    """An fp32 bias with fp16 q/k/v is accepted and honoured the same way by every backend
    (no backend may refuse it: a refusal fails this test rather than passing it). Values
    chosen to leave the fp16 range: 7e4 (> 65504) on keys 0..2 of row 1, fp32 finfo.min on
    every key of row 2 (a shift, not a mask: the row's softmax is uniform over its keys).
    Compared with the fp64 formula on fp64 copies within 1e-2 (fp16 output rounding,
    |out| < 4); row 1 == attention over keys 0..2 alone, row 2 == the mean of all v."""
    q, k, v = (torch.randn(1, 1, N, D, dtype=torch.float16) for _ in range(3))
    k = v = k.expand(1, 1, N, D)
    bias = torch.zeros(N, N)
    bias[1, :3] = 7e4
    bias[2] = torch.finfo(torch.float32).min
    assert qkv.explain(q, k, v, bias=bias)[backend] is None
    out = qkv.attention(q, k, v, bias=bias, backend=backend)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    q64, k64, v64 = q.double(), k.double(), v.double()
    logits = q64 @ k64.transpose(-2, -1) * D ** -0.5 + bias.double()  # (1, 1, N, N)
    ref = torch.softmax(logits, dim=-1) @ v64
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=0)
    row1 = torch.softmax(logits[0, 0, 1, :3] - 7e4, dim=-1) @ v64[0, 0, :3]  # keys 0..2 only
    torch.testing.assert_close(out[0, 0, 1].double(), row1, atol=1e-2, rtol=0)
    torch.testing.assert_close(out[0, 0, 2].double(), v64[0, 0].mean(0), atol=1e-2, rtol=0)
