"""Shared fixtures and helpers for the qkv test suite.

Shapes: B batch, H query heads, Hkv key/value heads, N query length, S key length,
D head dim, Dv value dim. Internal layout (B, H, N, D).

Oracles live here so every test file compares against the same ones:
- ``oracle_attention``: plain fp64 math written independently of ``qkv.ops.reference``
  (dense keep-matrix, explicit head expansion, softmax with empty rows -> 0);
- ``reference64``: ``qkv.attention(backend="reference")`` on fp64 copies of the inputs,
  the oracle the issue asks for (itself checked against ``oracle_attention``).

Tolerances (``TOL``) are stated once, in one table, and quoted at each use.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import re
import signal
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

import qkv

# ------------------------------------------------------------------------- tolerances

#: (atol, rtol) of a tensor computed in ``dtype`` against an fp64 oracle.
#: fp32: PyTorch's own OpInfo bar for SDPA (docs/ARCHITECTURE.md: Tolerances).
#: fp64: two fp64 implementations of the same math (summation order differs only).
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (5e-5, 5e-6),
}

#: Half precision is judged relative to a naive same-dtype implementation
#: (docs/ARCHITECTURE.md: Tolerances): our error <= HALF_FACTOR_OUT x naive's (outputs)
#: and HALF_FACTOR_GRAD x (gradients).
HALF_FACTOR_OUT = 2.0
HALF_FACTOR_GRAD = 3.0

HALF_DTYPES = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_id(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# ---------------------------------------------------------------------------- threads


def pytest_configure(config) -> None:
    """Under xdist each worker gets one torch thread: two workers with two spinning OpenMP
    threads each on two cores made small-op tests 20–40× slower on a loaded machine. The
    decode engine does not time its backends against each other (``QKV_DECODE_MEASURE=0``,
    for this process and the commands tests start): which one runs must not depend on the
    machine's load; the tests of measuring turn it on themselves."""
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)
    os.environ["QKV_DECODE_MEASURE"] = "0"
    _WATCHDOG["stderr"] = os.dup(2)


# ------------------------------------------------------------------------- scheduling

#: The files that take longest, in the order the xdist workers start them; every other file
#: comes after them, in the usual order. ``make test`` runs ``-n 2 --dist loadfile
#: --no-loadscope-reorder``: each file goes whole to the next worker that runs short of work,
#: in collection order (without the flag xdist first sorts the files by their number of
#: tests, which put the demos, a few tests of minutes each, among the last: in one run the
#: Flamingo and LoRA demos' full tests started 70 % and 80 % of the way through, and ended
#: it on both workers). Longest first leaves the
#: short files for the end, where they even out the two workers' finishing times. The dates
#: demo comes first: its full test builds the session's shared ``qkv demo`` run
#: (tests/shared_runs.py) while the other worker runs the Flamingo demo, so that the LoRA
#: demo's and the README's slow tests, which read that run, find it built instead of waiting
#: for it. Figures: one worker's CPU-seconds for the whole file on an idle 2-core machine
#: (the dates file: the run's 600 training steps and its evaluation).
LONG_FIRST = (
    "tests/demos/test_dates_demo.py",  # ~120 s (the shared run)
    "tests/demos/test_flamingo_demo.py",  # ~265 s
    "tests/demos/test_clip_demo.py",  # ~225 s
    "tests/test_benchmarks.py",  # ~135 s
    "tests/demos/test_lora_demo.py",  # ~105 s (its base: the shared dates run)
    "tests/train/test_train_fsdp.py",  # ~70 s
    "tests/train/test_gloo_teardown_stress.py",  # ~45 s
    "tests/generation/test_static_layer.py",  # ~60 s (one torch.compile of the static step)
    "tests/test_readme.py",  # ~35 s (its training block: the shared dates run)
    "tests/test_suite_guards.py",  # ~30 s
    "tests/train/test_sharded_checkpoint.py",  # 20-30 s each, down to test_rundir.py
    "tests/demos/test_coref_demo.py",
    "tests/train/test_distributed.py",
    "tests/train/test_shutdown.py",
    "tests/train/test_sharding.py",
    "tests/train/test_sigterm.py",
    "tests/train/test_clip_kind.py",
    "tests/train/test_rundir.py",
    "tests/ops/test_chunked.py",  # ~20 s
    "tests/modules/test_relative.py",
    "tests/test_cli_inputs_utf8.py",  # ~15 s; every file after this list takes less
)


def pytest_collection_modifyitems(config, items) -> None:
    """Marks the tests of the files that compare against an outside oracle ``oracle``
    (``uses_oracle``). Under xdist: the files of ``LONG_FIRST`` first, in its order (a stable
    sort: every file's tests stay together and in their order). Every worker sorts its
    collection alike, as xdist requires; a run without xdist keeps the usual order."""
    for item in items:
        path = getattr(item, "path", None)
        if path is not None and uses_oracle(Path(path)):
            item.add_marker(pytest.mark.oracle)
    if not hasattr(config, "workerinput"):
        return
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# ------------------------------------------------------------------------- oracles

#: The outside libraries the tests compare qkv against (test-only, or runtime ones whose
#: behaviour a test pins: sentencepiece, tokenizers). Their versions are pinned in
#: constraints.txt; ``make test-latest`` runs the tests marked ``oracle`` on their newest
#: releases.
ORACLES = ("transformers", "peft", "sentencepiece", "tokenizers", "ctranslate2")
_NAMES = "|".join(ORACLES)
_ORACLE_IMPORT = re.compile(
    rf"^[ \t]*(?:from|import)[ \t]+(?:{_NAMES})\b|importorskip\([ \t]*[\"'](?:{_NAMES})\b",
    re.M)
_HELPER_IMPORT = re.compile(r"^[ \t]*(?:from|import)[ \t]+(_\w+)", re.M)
TESTS_DIR = Path(__file__).parent
#: Files that reach an oracle another way: the benchmark scripts they run (--quick) time
#: qkv against transformers and ctranslate2.
ORACLE_FILES = frozenset({TESTS_DIR / "test_benchmarks.py"})


@functools.cache
def uses_oracle(path: Path) -> bool:
    """Whether the test file ``path`` imports an oracle of ``ORACLES``, itself or through
    a helper module of the tests (``_name.py`` beside it or in tests/) it imports."""
    if path in ORACLE_FILES:
        return True
    if path.suffix != ".py" or not path.is_file():
        return False
    text = path.read_text(encoding="utf-8")
    if _ORACLE_IMPORT.search(text):
        return True
    for name in _HELPER_IMPORT.findall(text):
        for helper in (path.with_name(f"{name}.py"), TESTS_DIR / f"{name}.py"):
            if helper != path and uses_oracle(helper):
                return True
    return False


def _pins() -> dict[str, str]:
    pins = {}
    for line in (TESTS_DIR.parent / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[name.strip().lower()] = version.strip()
    return pins


def pytest_report_header(config) -> list[str]:
    """The oracles' versions, and each one's pin where the two differ (make test-latest)."""
    from importlib import metadata

    pins, parts = _pins(), []
    for name in ORACLES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "not installed"
        pinned = pins.get(name)
        parts.append(f"{name} {version}" + ("" if pinned in (None, version)
                                             else f" (pinned {pinned})"))
    return ["oracles: " + ", ".join(parts)]


# --------------------------------------------------------------------------- hangs

#: pytest-timeout (pyproject.toml: ``timeout``) fails a test that runs too long, with its
#: stack, through SIGALRM; a hang inside native code that holds the GIL (a C++ destructor
#: joining a thread, say) never returns to Python, so the signal's handler cannot run. Past
#: its timeout + NATIVE_GRACE_S, faulthandler's watchdog thread (C, no GIL) dumps every
#: thread's stack to the terminal and ends the worker: one failed test ("worker crashed"),
#: never a CI run that waits out its limit.
NATIVE_GRACE_S = 60
_WATCHDOG: dict[str, int] = {}


def _timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 300)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(_timeout_of(item) + NATIVE_GRACE_S, exit=True,
                                      file=_WATCHDOG.get("stderr", 2))
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (the C decode paths run only then, as under xdist),
    restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_bounded(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` for a child that may hang,
    with its own children (torchrun ranks, say): it runs in a session of its own with Python's
    faulthandler on, and after ``timeout`` seconds the whole session gets SIGABRT (every
    Python process there prints all its threads' stacks to stderr), then SIGKILL; the test
    fails with that stderr. Keep ``timeout`` under the test's own limit."""
    env = {**(kwargs.pop("env", None) or os.environ), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGABRT, 10), (signal.SIGKILL, 30)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    out, err = proc.communicate(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                out, err = "", ""
            pytest.fail(f"{' '.join(cmd)} still ran after {timeout:.0f} s; its stacks "
                        f"(stderr):\n{(err or '')[-6000:]}", pytrace=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# ------------------------------------------------------------------ thread-local state

def _thread_state() -> dict[str, object]:
    """What a test could leave installed on this thread for the tests after it (modes and
    hooks are captured into every later collective's thread-local state: the gloo hang)."""
    return {
        "torch function modes": torch._C._len_torch_function_stack(),
        "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True)
        is not None,
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _restore_thread_state(before: dict[str, object]) -> None:
    while torch._C._len_torch_function_stack() > before["torch function modes"]:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > before["torch dispatch modes"]:
        torch._C._pop_torch_dispatch_stack()
    while (not before["saved-tensor hooks"]
           and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None):
        torch._C._autograd._pop_saved_tensors_default_hooks()
    torch.set_grad_enabled(before["grad enabled"])
    torch.set_default_dtype(before["default dtype"])
    torch.use_deterministic_algorithms(before["deterministic algorithms"])


@pytest.fixture(autouse=True)
def _no_leaked_thread_state():
    """Fail the test that leaves a mode, hook or global autograd/dtype setting behind (and
    put it back, so that the tests after it run as they would alone)."""
    before = _thread_state()
    yield
    after = _thread_state()
    leaked = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
    if leaked:
        _restore_thread_state(before)
        pytest.fail("the test left thread-local state behind (before -> after): "
                    + "; ".join(f"{k}: {b} -> {a}" for k, (b, a) in leaked.items()),
                    pytrace=False)


# ---------------------------------------------------------------------------- seeding


@pytest.fixture(autouse=True)
def _seed_from_test_id(request) -> None:
    """Seed torch's global RNG from the test id: order- and worker-independent (xdist)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A private generator seeded from the test id, for inputs that must not depend on
    how much of the global RNG the code under test consumed."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ 0x5EED)
    return g


def randn(*shape: int, gen: torch.Generator | None = None,
          dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard normal tensor drawn in fp64 then cast (same values across dtypes)."""
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def make_qkv(b: int, h: int, n: int, s: int, d: int, *, hkv: int | None = None,
             dv: int | None = None, dtype: torch.dtype = torch.float32,
             gen: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), leaves requiring grad."""
    hkv = h if hkv is None else hkv
    dv = d if dv is None else dv
    q = randn(b, h, n, d, gen=gen, dtype=dtype).requires_grad_()
    k = randn(b, hkv, s, d, gen=gen, dtype=dtype).requires_grad_()
    v = randn(b, hkv, s, dv, gen=gen, dtype=dtype).requires_grad_()
    return q, k, v


def fp64(t: Tensor | None) -> Tensor | None:
    """An fp64 leaf copy with the same requires_grad (None stays None)."""
    if t is None:
        return None
    return t.detach().double().requires_grad_(t.requires_grad)


# ------------------------------------------------------------------------------ oracles


def oracle_weights(q: Tensor, k: Tensor, *, keep: Tensor | None = None,
                   bias: Tensor | None = None, scale: float | None = None) -> Tensor:
    """softmax(q kᵀ·scale + bias) over allowed keys, (B, H, N, S), written from the formula.

    ``keep`` is a bool tensor broadcastable to (B, H, N, S) (True = may attend); -inf logits
    are masked too. Rows with no allowed key get all-zero weights. Independent of
    qkv.ops.reference.
    """
    k = torch.repeat_interleave(k, q.shape[1] // k.shape[1], dim=1)  # (B, H, S, D)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    logits = torch.einsum("bhnd,bhsd->bhns", q, k) * scale  # (B, H, N, S)
    if bias is not None:
        logits = logits + bias
    allowed = logits != -torch.inf
    if keep is not None:
        allowed = allowed & keep
    logits = torch.where(allowed, logits, torch.zeros_like(logits))
    top = torch.where(allowed, logits, torch.full_like(logits, -torch.inf)).amax(-1, True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.where(allowed, torch.exp(logits - top), torch.zeros_like(logits))
    denom = e.sum(-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def oracle_attention(q: Tensor, k: Tensor, v: Tensor, *, keep: Tensor | None = None,
                     bias: Tensor | None = None, scale: float | None = None) -> Tensor:
    """``oracle_weights(...) @ v`` (B, H, N, Dv); fully masked rows give 0."""
    weights = oracle_weights(q, k, keep=keep, bias=bias, scale=scale)  # (B, H, N, S)
    v = torch.repeat_interleave(v, q.shape[1] // v.shape[1], dim=1)  # (B, H, S, Dv)
    return torch.einsum("bhns,bhsv->bhnv", weights, v)


def reference64(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    """``qkv.attention(backend="reference")`` on fp64 copies (grads flow to the copies)."""
    bias = kw.pop("bias", None)
    if isinstance(bias, Tensor):
        bias = fp64(bias)
    return qkv.attention(fp64(q), fp64(k), fp64(v), bias=bias, backend="reference", **kw)


# ------------------------------------------------------------------------------ helpers


def grads_of(fn: Callable[[], Tensor], inputs: list[Tensor | None], d_out: Tensor
             ) -> tuple[Tensor, list[Tensor | None]]:
    """Run ``fn`` and backpropagate ``d_out``; returns (out, grads of the inputs that need
    them, None for the rest). Inputs must be leaves; their .grad is reset first."""
    for t in inputs:
        if t is not None:
            t.grad = None
    out = fn()
    live = [t for t in inputs if t is not None and t.requires_grad]
    got = torch.autograd.grad(out, live, d_out.to(out.dtype), allow_unused=False)
    it = iter(got)
    return out, [next(it) if (t is not None and t.requires_grad) else None for t in inputs]


def assert_close_to(actual: Tensor, expected: Tensor, *, atol: float, rtol: float,
                    what: str = "") -> None:
    """``torch.testing.assert_close`` comparing in fp64 (dtype-agnostic), infs must match."""
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol,
                               equal_nan=False, msg=lambda m: f"{what}: {m}")


def max_err(actual: Tensor, expected: Tensor) -> float:
    """Max |actual - expected| in fp64."""
    return (actual.double() - expected.double()).abs().max().item()


# ------------------------------------------------------------------------- oneDNN linears

@pytest.fixture
def onednn_calls(monkeypatch):
    """Small shapes take ``qkv.ops.fast_linear``'s oneDNN path too (its size thresholds are
    set to 1); returns the list that counts oneDNN matmuls, so a test can tell the path ran.
    Tests using it should skip when ``onednn_linear_active()`` is False."""
    import qkv.ops.fast_linear as fl

    monkeypatch.setattr(fl, "MIN_ROWS", 1)
    monkeypatch.setattr(fl, "MIN_MACS", 1)
    calls: list[int] = []
    real = fl.onednn_op()
    monkeypatch.setitem(fl._checked, "op", lambda *a: calls.append(1) or real(*a))
    return calls
