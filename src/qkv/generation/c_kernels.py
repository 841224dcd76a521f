"""Building and loading the optional C kernels of the decode steps (``int8_kernel``,
``attention_kernel``): compile a C source once with the system's C compiler (``cc``, else
``gcc``; ``-O3 -march=native``, shared) into a cache directory (``$QKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``), keyed by a hash of the source, the flags,
the compiler's version and the CPU's flags, written atomically; load it with ``ctypes`` (no
torch headers, no Python extension build). Any failure gives None: the caller stays on its
torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["build_shared", "env_off", "load_function"]

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared"]


def env_off(name: str) -> bool:
    """True when the environment variable ``name`` is "0", "false", "off" or "no" (a kernel's
    off switch; unset means on)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def _cache_dir() -> Path:
    root = os.environ.get("QKV_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "qkv"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_shared(source: str, stem: str, compiler: str) -> Path:
    """Compile C ``source`` with ``compiler`` (``-O3 -march=native``, shared) into the cache
    directory as ``{stem}-{hash}.so`` (hash of the source, flags, compiler version and CPU
    flags), unless it is already there; written atomically. Raises ``OSError`` /
    ``subprocess.SubprocessError`` on failure."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([source, *_FLAGS, version, _cpu_flags(),
                                     platform.machine()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / f"{stem}.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        subprocess.run([compiler, *_FLAGS, "-o", str(lib), str(src), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, out)  # atomic: a reader sees no half-written library
    return out


def load_function(source: str, stem: str, symbol: str, argtypes: list) -> object | None:
    """The C function ``symbol`` of ``source`` (built by ``build_shared`` as ``stem``) with
    ``argtypes`` and an int result, or None when there is no compiler, this is not Linux, or
    building or loading fails."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    try:
        fn = getattr(ctypes.CDLL(str(build_shared(source, stem, compiler))), symbol)
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn
