"""The optional fused C int8 layer (``qkv.generation.int8_kernel``): bit-equal to the torch
ops of ``qkv.modules.quantized.int8_linear`` (K with a tail past the 64-byte blocks, several
rows, with and without a bias, a residual, zero and NaN rows, activations on exact .5 ties),
both for the build for this CPU and for the portable build (the plain C loops); the decode
engine's int8 backends with it ("c-layer-int8": every layer one C call, ``row_step_kernel``;
"int8-kernel": one call per projection where the C layer refuses): each row as alone, bit
for bit, its tokens == the "int8-torch" backend's (torch ops) == the quantized model's
uncached greedy forward; and the fallbacks."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.generation import c_kernels, int8_kernel, kernel_registry
from qkv.generation.engine import decoder_stepper
from qkv.generation.linears import Int8Linears
from qkv.generation.torch_layer import TorchLayers
from qkv.models import GPT, GPTConfig
from qkv.modules.quantized import int8_linear, quantize_weight, scale127

KERNEL = int8_kernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the int8 kernel cannot be built here "
                                  "(no C compiler, or QKV_INT8_KERNEL=0)")
# the build for this CPU (its VNNI branch where the CPU has it) and the one that keeps the
# plain C loops whatever the CPU (-DQKV_PORTABLE): both checked against the torch ops
BUILDS = {"native": KERNEL,
          "portable": None if KERNEL is None else
          int8_kernel._load("qkv_int8_linear", portable=True)}
builds = pytest.mark.parametrize("build", list(BUILDS))


def _call(x, wq, s127, bias, res=None, build="native"):
    """The C function (of ``build``) on torch tensors: x (M, K) -> (M, N) (+ res, in
    place)."""
    fn = BUILDS[build]
    if fn is None:
        pytest.skip(f"the {build} build of the int8 kernel cannot be made here")
    m, k = x.shape
    n = wq.shape[0]
    y = res if res is not None else torch.empty(m, n)
    xq = torch.empty(m, k, dtype=torch.int8)
    acc = torch.empty(m, n, dtype=torch.int32)
    amax = torch.empty(m)
    fn(x.data_ptr(), m, k, wq.data_ptr(), n, s127.data_ptr(),
       None if bias is None else bias.data_ptr(), None if res is None else res.data_ptr(),
       y.data_ptr(), xq.data_ptr(), acc.data_ptr(), amax.data_ptr())
    return y


@needs_kernel
def test_portable_build_has_no_vnni_branch():
    """The portable build compiles the plain C loops (the VNNI branch is what the native
    build compiles on a CPU with AVX-512 VNNI), so the tests below cover both."""
    assert int8_kernel._load("qkv_int8_vnni", portable=True)() == 0
    assert int8_kernel._load("qkv_int8_vnni")() in (0, 1)


@needs_kernel
@builds
@pytest.mark.parametrize("m,k,n", [(1, 384, 1152), (1, 1536, 384), (3, 17, 5), (2, 130, 9),
                                   (5, 64, 77), (4, 1, 3), (1, 203, 113), (16, 130, 9),
                                   (6, 70, 8), (8, 768, 33)])
def test_kernel_bit_equal_to_the_torch_ops(m, k, n, build):
    """From 4 rows the VNNI build takes the offset form (x + 128 unsigned, 128·Σw off),
    below it the signed form; K tails and N % 4 remainders in both: bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(n, k) * torch.rand(n, 1)
    wq, s = quantize_weight(w)
    s127, b = scale127(s), torch.randn(n)
    for trial in range(6):
        x = torch.randn(m, k) * 10.0 ** torch.randn(m, 1)
        if m > 2 and trial == 0:
            x[1] = 0.0  # a zero row: the bias alone
        for bias in (b, None):
            want = int8_linear(x, wq.t(), s127, bias)
            assert torch.equal(_call(x, wq, s127, bias, build=build), want)
        res = torch.randn(m, n)
        want = int8_linear(x, wq.t(), s127, b) + res
        assert torch.equal(_call(x, wq, s127, b, res=res, build=build), want)  # into res


def _ties(k: int, scales: list[float]) -> torch.Tensor:
    """(len(scales), k) rows whose 127·x/a lands exactly on .5 ties: row r holds
    ±127·2^j (its max, so a = 127·2^j) and (i + 0.5)·2^j for i in [-127, 126], shuffled
    (every product and quotient is exact in fp32)."""
    halves = torch.arange(-127, 127, dtype=torch.float32) + 0.5  # (254,)
    rows = []
    for r, j in enumerate(scales):
        g = torch.Generator().manual_seed(r)
        row = halves[torch.randint(0, 254, (k,), generator=g)]
        row[int(torch.randint(0, k, (1,), generator=g))] = 127.0 if r % 2 == 0 else -127.0
        rows.append(row * 2.0 ** j)
    return torch.stack(rows)


@needs_kernel
@builds
@pytest.mark.parametrize("k", [254, 64, 17])
def test_kernel_rounds_ties_half_to_even(k, build):
    """Activations on exact .5 ties after scaling (where round-half-even and
    round-half-away differ): the kernel equals the torch ops (``torch.round``: half to
    even) bit for bit, and half-away rounding would have changed the outputs."""
    x = _ties(k, [0.0, -3.0, 5.0])  # (3, k)
    v = 127.0 * x / x.abs().amax(dim=1, keepdim=True)
    assert int((v.frac().abs() == 0.5).sum()) >= 2 * k  # the ties are there
    torch.manual_seed(1)
    wq, s = quantize_weight(torch.randn(9, k))
    s127, b = scale127(s), torch.randn(9)
    want = int8_linear(x, wq.t(), s127, b)
    away = torch.addcmul(b, (torch.sign(v) * torch.floor(v.abs() + 0.5)) @ wq.t().float(),
                         x.abs().amax(dim=1, keepdim=True) * s127)
    assert not torch.equal(away, want)  # the tie rule shows in the outputs
    assert torch.equal(_call(x, wq, s127, b, build=build), want)
    assert torch.equal(_call(x, wq, s127, None, build=build), int8_linear(x, wq.t(), s127, None))


@needs_kernel
@builds
def test_kernel_nan_row_gives_nan_and_leaves_the_others(build):
    wq, s = quantize_weight(torch.randn(4, 70))
    x = torch.randn(2, 70)
    x[0, 3] = float("nan")
    b = torch.randn(4)
    y = _call(x, wq, scale127(s), b, build=build)
    assert bool(y[0].isnan().all())
    assert torch.equal(y[1], int8_linear(x[1:], wq.t(), scale127(s), b)[0])


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt-tiny", **overrides)).eval()
    with torch.no_grad():  # confident, varied predictions; biases and norms off their init
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p), alpha=0.1)
    return qkv.quantize(model)


def _decode(model, ids, keep, steps, backend):
    """Greedy tokens (R, steps) and the logits (steps - 1, R, V) of the steps after the
    prefill, on the engine's ``backend`` (forced)."""
    with torch.inference_mode():
        st = decoder_stepper(model, ids, keep, ids.shape[1] + steps, backend=backend)
        logits, out, all_logits = st.prefill(), [], []
        for i in range(steps):
            out.append(logits.argmax(-1))
            if i < steps - 1:
                logits = st.step(out[-1])
                all_logits.append(logits.clone())
    return torch.stack(out, dim=1), torch.stack(all_logits)


def _uncached(model, ids, keep, steps):
    with torch.no_grad():
        for _ in range(steps):
            tok = model(ids, attention_mask=keep)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, tok], dim=1)
            if keep is not None:
                keep = torch.cat([keep, torch.ones_like(keep[:, :1])], dim=1)
    return ids[:, -steps:]


def _mostly_equal(fast_logits: torch.Tensor, plain_logits: torch.Tensor) -> None:
    """The C layers round the norms and attention in another order than torch's ops: the
    logits agree to fp32 rounding, except where a tiny difference moved an activation across
    an int8 rounding boundary (one quantization step, then propagated): allowed in at most a
    fifth of the (step, row) logit vectors."""
    worst = (fast_logits - plain_logits).abs().amax(dim=-1)  # (T - 1, R)
    assert (worst <= 1e-4).float().mean() >= 0.8, worst


def _kernel_step_agrees(model, ids, keep) -> torch.Tensor:
    """20 greedy steps on the C layer ("c-layer-int8"): tokens == the torch-ops backend's
    ("int8-torch") == the uncached forward's (and varied), logits ``_mostly_equal`` to the
    torch-ops backend's; returns the C layer's logits (T - 1, R, V)."""
    fast, fast_logits = _decode(model, ids, keep, 20, "c-layer-int8")
    plain, plain_logits = _decode(model, ids, keep, 20, "int8-torch")
    _mostly_equal(fast_logits, plain_logits)
    _same_tokens_until_a_near_tie(fast, plain, fast_logits, plain_logits)
    assert torch.equal(plain, _uncached(model, ids, keep, 20))
    assert len(set(fast.flatten().tolist())) > 3
    return fast_logits


def _same_tokens_until_a_near_tie(fast, plain, fast_logits, plain_logits) -> None:
    """Each row's tokens (R, T) are equal up to its first step whose logits' difference
    could flip the argmax (plain's top-1 margin within twice the largest |difference|:
    the activation rounding ``_mostly_equal`` allows; after it the rows decode different
    prefixes). Measured on an AVX2-only CPU: one row flipped at step 19 of 20 (margin 0.14,
    difference 0.34); on AVX-512 none. At least 80 % of the row-steps are compared."""
    compared = 0
    for r in range(fast.shape[0]):
        for t in range(fast.shape[1]):
            if t > 0:
                top = plain_logits[t - 1, r].topk(2).values
                diff = (fast_logits[t - 1, r] - plain_logits[t - 1, r]).abs().max()
                if top[0] - top[1] <= 2 * diff:
                    break
            assert fast[r, t] == plain[r, t], (r, t)
            compared += 1
    assert compared >= 0.8 * fast.numel(), compared


@needs_kernel
@pytest.mark.parametrize("overrides", [{}, {"positions": "rope", "num_kv_heads": 2},
                                       {"activation": "relu", "bias": False,
                                        "tie_embeddings": False}],
                         ids=["learned", "rope-gqa", "relu-nobias-untied"])
def test_step_with_kernel_equals_rows_alone_plain_step_and_uncached_forward(overrides):
    """Three rows (two padded) with the kernel (every layer one C call): each row's logits
    equal that row decoded alone, bit for bit; the tokens equal the torch-ops step's and the
    quantized model's uncached forward; the logits the torch-ops step's (``_mostly_equal``)."""
    model = _model(**overrides)
    torch.manual_seed(1)
    keep = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0] * 5 + [1]], dtype=torch.bool)
    ids = torch.randint(0, 256, (3, 6)).masked_fill(~keep, 0)
    for k in (None, keep):
        fast_logits = _kernel_step_agrees(model, ids, k)
        for r in range(3):
            _, alone = _decode(model, ids[r:r + 1], None if k is None else k[r:r + 1], 20,
                               "c-layer-int8")
            assert torch.equal(fast_logits[:, r], alone[:, 0])


@needs_kernel
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_kernel_step_reorder_follows_rows(padded):
    """On the C layer ("c-layer-int8"): after reorder([1, 1]) both rows continue as row 1
    alone (its cache, and its padding: row 0 is unpadded, row 1 has two pads)."""
    model = _model()
    ids = torch.randint(0, 256, (2, 5))
    keep = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]], dtype=torch.bool) if padded else None
    if padded:
        ids = ids.masked_fill(~keep, 0)
    with torch.inference_mode():
        a = decoder_stepper(model, ids, keep, ids.shape[1] + 4, backend="c-layer-int8")
        a.prefill()
        a.step(torch.tensor([7, 9]))
        a.reorder(torch.tensor([1, 1]))
        got = a.step(torch.tensor([3, 3]))
        b = decoder_stepper(model, ids[1:], None if keep is None else keep[1:],
                            ids.shape[1] + 4, backend="c-layer-int8")  # the row alone
        b.prefill()
        b.step(torch.tensor([9]))
        want = b.step(torch.tensor([3]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[0])


def test_turned_off_falls_back_or_refuses(monkeypatch):
    """``QKV_INT8_KERNEL=0``: the engine decodes on the torch ops ("int8-torch"); forcing a
    backend that needs the kernel is a ValueError with its reason."""
    model = _model()
    ids = torch.randint(0, 256, (1, 3))
    monkeypatch.setenv("QKV_INT8_KERNEL", "0")
    assert int8_kernel.disabled() and int8_kernel.load() is None
    with torch.inference_mode():
        assert decoder_stepper(model, ids, None, 5).backend == "int8-torch"  # the torch ops
        for backend in ("c-layer-int8", "int8-kernel"):
            with pytest.raises(ValueError, match="int8 kernel is off"):
                decoder_stepper(model, ids, None, 5, backend=backend)
    monkeypatch.delenv("QKV_INT8_KERNEL")


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """A compiler that fails leaves load() None (the plain path), not an exception."""
    monkeypatch.setattr(kernel_registry, "_loaded", {})
    monkeypatch.setattr(c_kernels, "_memo", {})
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    read = kernel_registry._read
    monkeypatch.setattr(kernel_registry, "_read",
                        lambda f: "this is not C" if f == "int8.c" else read(f))
    with pytest.warns(RuntimeWarning, match="'int8-linear' did not compile"):
        assert int8_kernel.load() is None
    assert not list(tmp_path.glob("*.so"))


@needs_kernel
@pytest.mark.parametrize("overrides", [{"activation": "quick_gelu", "num_kv_heads": 1},
                                       {"activation": "gelu", "positions": "rope"}],
                         ids=["quick_gelu-mqa", "gelu-rope"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_one_row_through_the_c_layer(overrides, padded, one_torch_thread):
    """One row, the activations the three-row test leaves out: the engine picks the C layer
    ("c-layer-int8"; one torch thread: at more the engine times it against "int8-torch"),
    whose tokens equal the torch-ops backend's and the uncached forward's, its logits the
    torch-ops backend's (``_mostly_equal``); "int8-torch" runs no C layer (torch's layer over
    ``int8_linear``)."""
    model = _model(**overrides)
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 6))
    keep = None
    if padded:
        keep = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
        ids = ids.masked_fill(~keep, 0)
    with torch.inference_mode():
        assert decoder_stepper(model, ids, keep, ids.shape[1] + 2).backend == "c-layer-int8"
        plain = decoder_stepper(model, ids, keep, ids.shape[1] + 2, backend="int8-torch")
        assert type(plain.runner) is TorchLayers and type(plain.runner.lin) is Int8Linears
    _kernel_step_agrees(model, ids, keep)


@needs_kernel
def test_int8_step_under_a_float64_default_dtype():
    """The C layers read fp32 buffers: a float64 default dtype (the key bias and outputs
    would be made in it) changes nothing — the same logits as under fp32."""
    model = _model(positions="rope")
    keep = torch.tensor([[0, 0, 1, 1, 1], [1] * 5], dtype=torch.bool)
    ids = torch.randint(0, 256, (2, 5)).masked_fill(~keep, 0)
    _, want = _decode(model, ids, keep, 6, "c-layer-int8")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, got = _decode(model, ids, keep, 6, "c-layer-int8")
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


@needs_kernel
def test_int8_wide_groups_decode_without_the_c_layer(one_torch_thread):
    """More query heads per key/value head than the C attention takes (66 > MAX_GROUP):
    the engine (one torch thread) skips the C layer for "int8-kernel" (torch's attention, the
    int8 products in C) and still equals the uncached forward."""
    model = _model(dim=132, num_heads=66, num_kv_heads=1)
    ids = torch.randint(0, 256, (1, 4))
    with torch.inference_mode():
        assert decoder_stepper(model, ids, None, ids.shape[1] + 2).backend == "int8-kernel"
    fast, _ = _decode(model, ids, None, 8, "int8-kernel")
    assert torch.equal(fast, _uncached(model, ids, None, 8))
