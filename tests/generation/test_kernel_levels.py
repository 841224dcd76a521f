"""Every C kernel compiles with the project's flags at every x86-64 level (v1-v4) and, where
a cross compiler is installed, for aarch64: compile-only, so that it runs on any host (a
kernel that only built with AVX-512 left every AVX2 CPU on torch ops; docs/ARCHITECTURE.md:
Decode backends). On the machine running the suite, where a C compiler exists, the engine's
plan uses the C layer, whatever its CPU.

Oracles: the compiler's own exit status and messages; ``explain``'s backend lines."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from qkv.generation import c_kernels, explain
from qkv.generation.kernel_registry import LIBRARIES

KERNELS = Path(c_kernels.__file__).parent / "kernels"
COMPILER = shutil.which("cc") or shutil.which("gcc")
X86 = shutil.which("gcc") if shutil.which("gcc") and \
    subprocess.run(["gcc", "-dumpmachine"], capture_output=True, text=True,
                   timeout=10).stdout.startswith("x86_64") else None
LEVELS = ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"]


def _compile(compiler: str, march: str, library, tmp_path: Path) -> subprocess.CompletedProcess:
    flags = [f"-march={march}" if f == "-march=native" else f for f in c_kernels.FLAGS]
    flags = [f for f in flags if f != "-shared"]
    units = [str(KERNELS / f) for f in library.files]
    out = []
    for unit in units:  # compile-only: no link, no run
        obj = tmp_path / (Path(unit).stem + ".o")
        done = subprocess.run([compiler, *flags, *library.flags, "-I", str(KERNELS), "-c",
                               unit, "-o", str(obj)], capture_output=True, text=True,
                              timeout=120)
        out.append(done)
        if done.returncode:
            return done
    return out[-1]


@pytest.mark.skipif(X86 is None, reason="no x86-64 gcc here")
@pytest.mark.parametrize("march", LEVELS)
@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.stem)
def test_every_kernel_compiles_at_every_x86_64_level(library, march, tmp_path):
    done = _compile(X86, march, library, tmp_path)
    assert done.returncode == 0, c_kernels.first_error(done.stderr)


AARCH64 = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.stem)
def test_every_kernel_compiles_for_aarch64(library, tmp_path):
    """make test installs Debian's cross compiler (the Makefile's cross-compiler target);
    without it this skips locally and fails under CI=true."""
    if AARCH64 is None:
        message = "no aarch64 cross compiler (Debian's gcc-aarch64-linux-gnu) here"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; make test installs it")
        pytest.skip(message)
    done = _compile(AARCH64, "armv8-a", library, tmp_path)
    assert done.returncode == 0, c_kernels.first_error(done.stderr)


def test_first_error_is_the_error_line_in_full():
    stderr = ("gemv.c: In function 'load16':\n"
              "gemv.c:7:1: error: AVX512F vector return without AVX512F enabled changes the "
              "ABI [-Werror=psabi]\n    7 | static inline ...\n")
    assert c_kernels.first_error(stderr) == (
        "gemv.c:7:1: error: AVX512F vector return without AVX512F enabled changes the ABI "
        "[-Werror=psabi]")
    assert c_kernels.first_error("ld: warning x\n") == "ld: warning x"
    assert c_kernels.first_error("") == "no message"


@pytest.mark.skipif(COMPILER is None, reason="no C compiler here")
def test_the_plan_uses_the_c_layer_on_this_cpu(monkeypatch):
    """Whatever this CPU is (AVX2 only, AVX-512, AMX, aarch64), one-row fp32 decoding of a
    GPT runs on the C layer kernel at one thread."""
    from _fast_gpt_models import tiny_gpt

    for switch in ("QKV_ATTN_KERNEL", "QKV_GEMV_KERNEL", "QKV_INT8_KERNEL", "QKV_ROW_KERNEL"):
        monkeypatch.delenv(switch, raising=False)
    text = explain(tiny_gpt(), batch=1, threads=1)
    assert any(line.startswith("  * c-layer-fp32: runs") for line in text.splitlines()), text
