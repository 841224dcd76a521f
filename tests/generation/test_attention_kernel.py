"""The optional C attention kernel of the batched decode step
(``qkv.generation.attention_kernel``) against an fp64 softmax(q·kᵀ·scale + bias)·v written
here: MHA, GQA and MQA groups, head dims 24 / 64 / 80, one key, padding biases (-inf keys
skipped), a query whose keys are all masked (zeros), queries inside a wider projection row.

Shapes: R rows, H heads, Hkv kv heads, g = H / Hkv, S keys, cap capacity, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation import attention_kernel, c_kernels, kernel_registry

KERNEL = attention_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler / kernel here")


def _reference(q, keys, values, bias, scale):
    """fp64: q (R, H, D), keys/values (R, Hkv, S, D), bias (R, Hkv, S) -> (R, H, D)."""
    h = q.shape[1]
    hkv = keys.shape[1]
    g = h // hkv
    k = keys.double().repeat_interleave(g, dim=1)  # (R, H, S, D)
    v = values.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("rhd,rhsd->rhs", q.double(), k) * scale
    scores = scores + bias.double().repeat_interleave(g, dim=1)
    out = torch.einsum("rhs,rhsd->rhd", scores.softmax(-1), v)
    return torch.where(torch.isneginf(scores).all(-1, keepdim=True), 0.0, out)


def _run(q_rows, h, hkv, d, keys, values, bias, s, scale):
    """The kernel on q_rows (R, ≥ H·D) (queries in the first H·D columns), the caches
    (R, Hkv, cap, D) and bias (R, Hkv, cap) or None -> (R, H, D)."""
    r, cap = keys.shape[0], keys.shape[2]
    g = h // hkv
    out = torch.full((r, h * d), float("nan"))
    scratch = torch.empty(g * cap)
    rc = KERNEL(q_rows.data_ptr(), q_rows.stride(0), keys.data_ptr(), values.data_ptr(),
                cap * d, r * hkv, hkv, g, s, d, None if bias is None else bias.data_ptr(),
                cap, scale, out.data_ptr(), scratch.data_ptr())
    assert rc == 0
    return out.view(r, h, d)


@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (6, 2, 24), (8, 1, 80), (3, 3, 17)],
                         ids=["mha-64", "gqa-24", "mqa-80", "odd-17"])
@pytest.mark.parametrize("s", [1, 5, 33])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_kernel_equals_fp64_reference(h, hkv, d, s, padded):
    torch.manual_seed(0)
    r, cap = 5, 40
    extra = 2 * hkv * d  # queries inside a (R, (H + 2·Hkv)·D) projection row, as the step
    q_rows = torch.randn(r, h * d + extra)
    keys, values = torch.randn(r, hkv, cap, d), torch.randn(r, hkv, cap, d)
    keys[:, :, s:] = float("nan")  # past the filled part: never read
    values[:, :, s:] = float("nan")
    bias = torch.zeros(r, hkv, cap)
    if padded:
        for row in range(r):
            bias[row, :, :min(row, s - 1)] = float("-inf")  # the last key is always real
            keys[row, :, :min(row, s - 1)] = float("nan")  # skipped pads are never read
    scale = d ** -0.5
    got = _run(q_rows, h, hkv, d, keys, values, bias if padded else None, s, scale)
    want = _reference(q_rows[:, :h * d].view(r, h, d), keys[:, :, :s].nan_to_num(0.0),
                      values[:, :, :s], bias[:, :, :s], scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_all_keys_masked_gives_zeros():
    torch.manual_seed(1)
    r, h, d, cap, s = 2, 2, 32, 8, 4
    keys, values = torch.randn(r, h, cap, d), torch.randn(r, h, cap, d)
    bias = torch.zeros(r, h, cap)
    bias[1, 0, :s] = float("-inf")
    got = _run(torch.randn(r, h * d), h, h, d, keys, values, bias, s, 0.1)
    assert torch.equal(got[1, 0], torch.zeros(d))
    assert torch.isfinite(got).all()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("QKV_ATTN_KERNEL", "0")
    assert attention_kernel.disabled() and attention_kernel.load() is None


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """``kernels/attention.c`` that does not compile: load() None, said once, no library."""
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_registry, "_loaded", {})
    monkeypatch.setattr(c_kernels, "_memo", {})
    read = kernel_registry._read
    monkeypatch.setattr(kernel_registry, "_read",
                        lambda f: "this is not C" if f == "attention.c" else read(f))
    with pytest.warns(RuntimeWarning, match="'decode-attention' did not compile"):
        assert attention_kernel.load() is None
    assert not list(tmp_path.glob("*.so"))
