"""The registry of the C decode kernels (``qkv.generation.kernel_registry``): every registered
kernel builds from the shipped ``kernels/*.c`` files (``-Wall -Werror``: a warning fails a
build) and its symbol loads; the ``qkv_row_layer`` struct Python fills has C's layout; the
checked boundary (``call`` / ``check`` / ``make_struct``) gives the kernels' results
(against fp64 math and the torch int8 ops) and refuses a wrong dtype, device, contiguity,
size, overlap or argument before any pointer reaches C — ``RowLayers.build`` included.

Every test that builds points ``QKV_CACHE_DIR`` at its own temporary directory. Without a C
compiler they skip; under ``CI=true`` that is a failure (as the browser test's rule).

Shapes: K input features, N output features, M rows, R rows, H heads, Hkv kv heads,
g = H / Hkv, S keys, cap capacity, D head dim.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import platform
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _fast_gpt_models import tiny_gpt

from qkv.generation import attention_kernel, c_kernels, kernel_registry, row_step_kernel
from qkv.generation.kernel_registry import KERNELS, LIBRARIES, ROW_LAYER
from qkv.generation.plan import decode_plan
from qkv.generation.row_step_kernel import RowLayers
from qkv.modules.quantized import int8_linear, quantize_weight, scale127

CC = shutil.which("cc") or shutil.which("gcc")
KERNEL_DIR = Path(kernel_registry.__file__).parent / "kernels"
ROOT = Path(__file__).resolve().parents[2]
# gemv vs the fp64 product: |error| <= 4 eps·S (S = the sum of |x_i·w_ij| + |b_j| + |res_j|,
# what fp32 summation error scales with), the bound of tests/generation/test_row_kernels.py
GEMV_ULPS = 4.0


def _need_compiler() -> None:
    if CC is not None and platform.system() == "Linux":
        return
    reason = "no C compiler (cc or gcc) on Linux here"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason}; the C kernels must build in CI", pytrace=False)
    pytest.skip(f"{reason} (under CI=true this is a failure)")


@pytest.fixture
def fresh(tmp_path, monkeypatch) -> Path:
    """A fresh process's view of the kernels (nothing loaded, no memo), every switch on, the
    cache in ``tmp_path/cache``; needs a C compiler."""
    _need_compiler()
    monkeypatch.setattr(c_kernels, "_memo", {})
    monkeypatch.setattr(kernel_registry, "_loaded", {})
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    for k in KERNELS.values():
        if k.switch:
            monkeypatch.delenv(k.switch, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """As ``fresh``, one cache for the module's tests that only use the kernels (each
    library built once here); needs no compiler itself (the refusals never reach C)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(c_kernels, "_memo", {})
        mp.setattr(kernel_registry, "_loaded", {})
        mp.setenv("QKV_CACHE_DIR", str(tmp_path_factory.mktemp("kernels") / "cache"))
        for k in KERNELS.values():
            if k.switch:
                mp.delenv(k.switch, raising=False)
        yield


# ------------------------------------------------------------------- building, loading


@pytest.mark.parametrize("library", LIBRARIES, ids=[lib.stem for lib in LIBRARIES])
def test_every_registered_kernel_builds_and_loads(library, fresh):
    """Each library builds (warnings are errors here too) from its shipped files into the
    private cache, and each kernel registered on it loads with its symbol."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile failure's warning fails with its message
        names = [n for n, k in KERNELS.items() if k.library == library]
        assert names
        for name in names:
            fn = kernel_registry.load(name)
            assert fn is not None, name
            assert fn.__name__ == KERNELS[name].symbol
            assert len(fn.argtypes) == len(KERNELS[name].args)
    (lib,) = fresh.glob(f"{library.stem}-*.so")
    assert hasattr(ctypes.CDLL(str(lib)), KERNELS[names[0]].symbol)


def test_a_warning_fails_the_build(fresh):
    """``-Wall -Werror``: an unused variable turns that kernel off (said once); the same
    source without it builds."""
    with pytest.warns(RuntimeWarning, match="did not compile"):
        assert c_kernels.load_function("int f(void) { int unused; return 1; }", "warns", "f",
                                       []) is None
    fn = c_kernels.load_function("int f(void) { return 1; }", "warns", "f", [])
    assert fn is not None and fn() == 1


def test_sources_are_shipped_as_package_data():
    """Every file a library is built from is in ``kernels/`` (read through
    ``importlib.resources``), every file there belongs to a library, each ``.c`` includes the
    header, and pyproject.toml's package data covers them all."""
    tomllib = pytest.importorskip("tomllib")
    used = {f for lib in LIBRARIES for f in kernel_registry.source_files(lib)}
    assert used == {p.name for p in KERNEL_DIR.iterdir() if p.suffix in (".c", ".h")}
    for f in used:
        assert f.endswith(".h") or '#include "qkv_kernels.h"' in (KERNEL_DIR / f).read_text(), f
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["qkv.generation"]
    for f in used:
        assert any(fnmatch.fnmatch(f"kernels/{f}", p) for p in patterns), f


def test_a_missing_source_file_falls_back_with_a_warning(fresh, monkeypatch):
    """A kernel file missing from the installed package: that library's kernels are None
    (the torch ops), said with the library's name; nothing is compiled."""
    def read(f):
        raise FileNotFoundError(f"no such file: kernels/{f}")

    monkeypatch.setattr(kernel_registry, "_read", read)
    with pytest.warns(RuntimeWarning, match="sources of 'gemv' are missing"):
        assert kernel_registry.load("gemv") is None
    assert not fresh.exists() or not list(fresh.glob("*.so"))


def test_switches_are_the_ones_c_kernels_names():
    """The off switches the compiler warning names (``c_kernels``) are the registry's."""
    switches = {k.switch for k in KERNELS.values() if k.switch}
    assert switches == {s.strip() for s in c_kernels._SWITCHES.split(",")}


def test_max_group_agrees_everywhere():
    """``QKV_MAX_GROUP`` of the header == ``attention_kernel.MAX_GROUP`` == the bound the
    declarations of the attention kernel and of ``qkv_row_layer`` check g against."""
    header = (KERNEL_DIR / "qkv_kernels.h").read_text()
    (value,) = re.findall(r"#define QKV_MAX_GROUP (\d+)", header)
    assert int(value) == attention_kernel.MAX_GROUP
    for rules in (KERNELS["attention"].rules, ROW_LAYER.rules):
        assert f"1 <= g <= {attention_kernel.MAX_GROUP}" in rules


def test_row_layer_struct_has_the_c_layout(shared):
    """Each ``qkv_row_layer`` field's offset and the struct's size, as C reports them, equal
    the ctypes struct ``RowLayers`` fills (``row_step_kernel._Layer``)."""
    _need_compiler()
    out = torch.full((64,), -1, dtype=torch.int64)
    count = kernel_registry.call("row_layer_layout", out=out, n=64)
    layer = row_step_kernel._Layer
    want = [getattr(layer, f.name).offset for f in ROW_LAYER.fields] + [ctypes.sizeof(layer)]
    assert count == len(want) and out[:count].tolist() == want


# ------------------------------------------------------------------- checked: results


def test_checked_gemv_equals_fp64_product(shared):
    _need_compiler()
    torch.manual_seed(0)
    k, n = 37, 45
    x, w, b, r = torch.randn(k), torch.randn(k, n), torch.randn(n), torch.randn(n)
    y = torch.full((n,), float("nan"))
    assert kernel_registry.call("gemv", x=x, w=w, b=b, res=r, y=y, k=k, n=n) == 0
    want = x.double() @ w.double() + b.double() + r.double()
    scale = x.double().abs() @ w.double().abs() + b.double().abs() + r.double().abs()
    assert bool(((y.double() - want).abs() <= GEMV_ULPS * 2.0 ** -23 * scale).all())


def test_checked_int8_linear_equals_the_torch_ops(shared):
    """Bit for bit, as ``tests/generation/test_int8_kernel.py`` holds the raw call to."""
    _need_compiler()
    torch.manual_seed(1)
    m, k, n = 3, 70, 9
    wq, s = quantize_weight(torch.randn(n, k))
    s127, b, x = scale127(s), torch.randn(n), torch.randn(m, k)
    y = torch.empty(m, n)
    assert kernel_registry.call(
        "int8_linear", x=x, m=m, k=k, w=wq, n=n, s127=s127, bias=b, res=None, y=y,
        xq=torch.empty(m, k, dtype=torch.int8), acc=torch.empty(m, n, dtype=torch.int32),
        a=torch.empty(m)) == 0
    assert torch.equal(y, int8_linear(x, wq.t(), s127, b))


def test_checked_attention_equals_fp64_reference(shared):
    """GQA (H 6, Hkv 2), padded keys: against fp64 softmax(q·kᵀ·scale + bias)·v at 1e-5, the
    bound of ``tests/generation/test_attention_kernel.py``."""
    _need_compiler()
    torch.manual_seed(2)
    r, h, hkv, d, cap, s = 3, 6, 2, 24, 10, 7
    g = h // hkv
    q = torch.randn(r, h * d)
    keys, values = torch.randn(r, hkv, cap, d), torch.randn(r, hkv, cap, d)
    bias = torch.zeros(r, hkv, cap)
    bias[1, :, :2] = float("-inf")
    out = torch.full((r, h * d), float("nan"))
    assert kernel_registry.call(
        "attention", q=q, qr=h * d, k=keys, v=values, kb=cap * d, nbh=r * hkv, hkv=hkv, g=g,
        s=s, d=d, bias=bias, bb=cap, scale=d ** -0.5, out=out,
        scratch=torch.empty(g * cap)) == 0
    kk = keys[:, :, :s].double().repeat_interleave(g, dim=1)  # (R, H, S, D)
    vv = values[:, :, :s].double().repeat_interleave(g, dim=1)
    scores = torch.einsum("rhd,rhsd->rhs", q.double().view(r, h, d), kk) * d ** -0.5
    scores = scores + bias[:, :, :s].double().repeat_interleave(g, dim=1)
    want = torch.einsum("rhs,rhsd->rhd", scores.softmax(-1), vv)  # (R, H, D)
    torch.testing.assert_close(out.view(r, h, d).double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ checked: refusals


def _gemv_args(k: int = 8, n: int = 16) -> dict:
    torch.manual_seed(3)
    return dict(x=torch.randn(k), w=torch.randn(k, n), b=None, res=None,
                y=torch.full((n,), float("nan")), k=k, n=n)


def _bad(case: str, a: dict) -> dict:
    """The gemv arguments ``a`` broken one way."""
    if case == "dtype":
        a["w"] = a["w"].double()
    elif case == "non-contiguous":
        a["w"] = torch.randn(a["n"], a["k"]).t()  # (K, N), strides (1, K)
    elif case == "device":
        a["x"] = torch.empty(a["k"], device="meta")
    elif case == "too-few":
        a["w"] = a["w"][:-1]
    elif case == "required":
        a["y"] = None
    elif case == "raw-pointer":
        a["x"] = a["x"].data_ptr()
    elif case == "overlap":
        a["x"] = a["y"][:a["k"]]
    elif case == "float-size":
        a["k"] = 8.0
    elif case == "unknown":
        a["extra"] = 1
    elif case == "missing":
        del a["n"]
    elif case == "rule":
        a["k"] = -1
    return a


REFUSALS = {
    "dtype": (TypeError, r"w must be a torch.float32 tensor, got torch.float64"),
    "non-contiguous": (ValueError, r"w must be contiguous"),
    "device": (TypeError, r"x must be on the CPU .* got a tensor on meta"),
    "too-few": (ValueError, r"w must hold at least k \* n = 128 elements, got 112"),
    "required": (ValueError, r"y is required, got None"),
    "raw-pointer": (TypeError, r"x must be a tensor, got int"),
    "overlap": (ValueError, r"x and y must not overlap"),
    "float-size": (TypeError, r"k must be an int, got float"),
    "unknown": (TypeError, r"unknown extra"),
    "missing": (TypeError, r"missing n"),
    "rule": (ValueError, r"needs k >= 0, got k = -1"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_checked_call_refuses_before_c(case, shared):
    """Each bad argument is refused with a message naming the kernel and the argument, and
    the kernel never runs (y keeps its NaNs)."""
    a = _bad(case, _gemv_args())
    y = a["y"] if a.get("y") is not None else torch.full((16,), float("nan"))
    error, match = REFUSALS[case]
    with pytest.raises(error, match=r"qkv_gemv \(gemv kernel\): .*" + match):
        kernel_registry.call("gemv", **a)
    assert bool(y.isnan().all())


def test_checked_call_of_a_switched_off_kernel_says_so(shared, monkeypatch):
    monkeypatch.setenv("QKV_GEMV_KERNEL", "0")
    with pytest.raises(RuntimeError, match="QKV_GEMV_KERNEL=0 turns it off"):
        kernel_registry.call("gemv", **_gemv_args())
    with pytest.raises(KeyError, match="no kernel 'gemm'"):
        kernel_registry.check("gemm")


def test_attention_group_over_the_limit_is_refused():
    """g = 65 > QKV_MAX_GROUP: refused by the declaration's rule (the C code would return 1)."""
    r, hkv, g, d, s = 1, 1, 65, 4, 2
    with pytest.raises(ValueError, match=r"needs 1 <= g <= 64, got g = 65"):
        kernel_registry.check(
            "attention", q=torch.randn(g * d), qr=g * d, k=torch.randn(s * d),
            v=torch.randn(s * d), kb=s * d, nbh=r * hkv, hkv=hkv, g=g, s=s, d=d, bias=None,
            bb=s, scale=0.5, out=torch.empty(g * d), scratch=torch.empty(g * s))


def _row_inputs(model, capacity: int = 12):
    """``RowLayers.build``'s fp32 arguments for one row of ``model``: (in, out) weights."""
    linears = []
    for layer in model.layers:
        for m in (layer.attn.in_proj, layer.attn.out_proj, layer.ffn.fc_in, layer.ffn.fc_out):
            linears.append((m.weight.detach().t().contiguous(), None, m.bias))
    return linears, model.new_cache(1, capacity)


def test_row_layers_build_checks_every_pointer(shared):
    """``RowLayers.build`` fills each layer's struct through the declaration: a valid model
    builds; a float64 weight, int8 weights without their scales, a non-contiguous or
    meta-device cache, or a layer's cache smaller than the first's are refused, naming the
    layer and the field."""
    _need_compiler()
    model = tiny_gpt()
    linears, cache = _row_inputs(model)
    assert RowLayers.build(decode_plan(model), linears, cache, None, quant=False) is not None

    bad = list(linears)
    bad[6] = (bad[6][0].double(), None, bad[6][2])  # layer 1's fc_in
    with pytest.raises(TypeError, match=r"RowLayers: layer 1 \(qkv_row_layer\): w_fc must be "
                                        r"a torch.float32 tensor, got torch.float64"):
        RowLayers.build(decode_plan(model), bad, cache, None, quant=False)

    int8 = [(quantize_weight(w.t())[0], None, b) for w, _, b in linears]
    with pytest.raises(ValueError, match=r"layer 0 .*s_in is required when quant is 1"):
        RowLayers.build(decode_plan(model), int8, cache, None, quant=True)

    for case, error, match in (
            ("strided", ValueError, r"layer 1 .*keys must be contiguous"),
            ("meta", TypeError, r"layer 1 .*values must be on the CPU"),
            ("smaller", ValueError, r"layer 1 .*keys must hold at least rows \* hkv \* cap \* d")):
        _, cache = _row_inputs(model)
        kc = cache[1]
        if case == "strided":
            kc.keys = torch.empty(kc.keys.shape[:2] + kc.keys.shape[:1:-1]).transpose(2, 3)
        elif case == "meta":
            kc.values = torch.empty(kc.values.shape, device="meta")
        else:
            kc.keys = kc.keys[:, :, :-1].contiguous()
        with pytest.raises(error, match=match):
            RowLayers.build(decode_plan(model), linears, cache, None, quant=False)
