"""The C kernel cache (``qkv.generation.c_kernels``): no foreign code is loaded from it, a
cache of the user's own is reused, it is private whatever the umask, a damaged library is
rebuilt (never loaded), and a hanging compiler is bounded and said once.

The foreign code is a real shared library whose constructor writes a marker file, planted
under the exact name qkv uses (learnt by letting qkv build there first) with a matching
``.sha256`` beside it, so only the ownership and mode checks stand between it and the
process. Another user's file or directory is made with ``os.chown`` when the tests run as
root, and otherwise (and also as root) simulated: the owner ``c_kernels`` reads of that very
file (``os.fstat``'s ``st_uid``, matched by inode) is another uid. Every test points
``QKV_CACHE_DIR`` at its own temporary directory."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from qkv.generation import c_kernels, int8_kernel, kernel_registry
from qkv.modules.quantized import int8_linear, quantize_weight, scale127

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None or platform.system() != "Linux",
                                reason="needs a C compiler on Linux")

STEM = "cache-test"
SOURCE = "int qkv_test_add(long a, long b) { return (int)(a + b); }\n"
ARGS = [ctypes.c_int64, ctypes.c_int64]

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("QKV_TEST_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("the planted constructor ran\n", f); fclose(f); }
}
int qkv_test_add(long a, long b) { return (int)(a * b + 1000); }
int qkv_int8_linear(void) { return 1000; }
"""


def _cc(args: list[str], cwd: Path) -> None:
    done = subprocess.run([CC, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def planted_lib(tmp_path_factory) -> Path:
    """The planted library, and a check that loading it does run its constructor."""
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED)
    _cc(["-shared", "-fPIC", "-o", "planted.so", "planted.c"], d)
    marker = d / "control-marker"
    probe = ("import ctypes, os, sys; os.environ['QKV_TEST_MARKER'] = sys.argv[2]; "
             "ctypes.CDLL(sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", probe, str(d / "planted.so"), str(marker)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert marker.exists()  # the marker is a working witness
    return d / "planted.so"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh process's view of the kernels (the per-process memo cleared) with its cache in
    ``tmp_path/cache`` and the planted constructor's marker at ``tmp_path/marker``."""
    monkeypatch.setattr(c_kernels, "_memo", {})
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QKV_TEST_MARKER", str(tmp_path / "marker"))
    return tmp_path / "cache"


@pytest.fixture
def counting_cc(tmp_path, monkeypatch) -> Path:
    """A ``cc`` first on PATH that logs each call's arguments, then runs the real one;
    returns the log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "cc.log"
    bin_dir.mkdir()
    script = bin_dir / "cc"
    script.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{CC}" "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    log.write_text("")
    return log


def _compiles(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line != "--version")


def _load(source: str = SOURCE):
    return c_kernels.load_function(source, STEM, "qkv_test_add", ARGS)


def _sha_ok(lib: Path) -> bool:
    want = Path(f"{lib}.sha256").read_text().strip()
    return hashlib.sha256(lib.read_bytes()).hexdigest() == want


def _plant(lib: Path, planted: Path) -> None:
    """``planted`` in place of qkv's ``lib``, with a ``.sha256`` that matches it."""
    lib.unlink()
    shutil.copyfile(planted, lib)
    Path(f"{lib}.sha256").write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")


def _private(path: Path) -> bool:
    st = os.lstat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


# -------------------------------------------------------------------------- no foreign code

NOBODY = 65534


def _foreign_maker(how: str, monkeypatch):
    """``foreign(*paths)`` that makes those paths another user's (uid 65534): ``how`` is
    "chown" (root only), or "simulated": ``os.fstat`` (what ``c_kernels`` checks owners with)
    reports uid 65534 for those very files, by inode, so a file rebuilt in their place is
    this user's again."""
    if how == "chown":
        return lambda *paths: [os.chown(p, NOBODY, NOBODY) for p in paths]
    inodes: set[tuple[int, int]] = set()
    real_fstat = os.fstat

    def fstat(fd):
        st = real_fstat(fd)
        if (st.st_dev, st.st_ino) not in inodes:
            return st
        fields = list(st[:10])
        fields[4] = fields[5] = NOBODY  # st_uid, st_gid
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", fstat)

    def make(*paths):
        for p in paths:
            st = os.lstat(p)
            inodes.add((st.st_dev, st.st_ino))
    return make


def test_simulated_owner_is_seen_by_the_check(tmp_path, monkeypatch):
    """The simulation changes what the trust check reads, for the marked file only."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a")
    b.write_text("b")
    _foreign_maker("simulated", monkeypatch)(a)
    for path, owner in ((a, NOBODY), (b, os.geteuid())):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.fstat(fd).st_uid == owner
        finally:
            os.close(fd)


def _shared_dir(d, lib, foreign):
    d.chmod(0o777)


def _sticky_dir_foreign_file(d, lib, foreign):
    for p in (lib, Path(f"{lib}.sha256")):
        foreign(p)
        p.chmod(0o777)
    d.chmod(0o1777)


def _foreign_dir(d, lib, foreign):
    foreign(d)


def _foreign_file(d, lib, foreign):
    for p in (lib, Path(f"{lib}.sha256")):
        foreign(p)
        p.chmod(0o755)


def _group_writable_file(d, lib, foreign):
    lib.chmod(0o775)


def _foreign_hash(d, lib, foreign):
    foreign(f"{lib}.sha256")


def _symlink(d, lib, foreign):
    target = d.parent / "elsewhere.so"
    lib.rename(target)
    lib.symlink_to(target)


# (how the planted library is left, whether qkv may rebuild over it in place)
PLANTS = {"shared-0777-dir": (_shared_dir, False),
          "sticky-1777-dir-foreign-file": (_sticky_dir_foreign_file, False),
          "foreign-dir": (_foreign_dir, False),
          "foreign-file": (_foreign_file, True),
          "group-writable-file": (_group_writable_file, True),
          "foreign-hash": (_foreign_hash, True),
          "symlink": (_symlink, True)}


_AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="plants another user's files (chown); "
                              "the simulated-owner case runs instead")
# another user's files both ways where a case has them: chown (as root) and simulated
CASES = [pytest.param(c, how, id=f"{c}-{how}", marks=[_AS_ROOT] if how == "chown" else [])
         for c in PLANTS for how in (("chown", "simulated") if "foreign" in c else (None,))]


@pytest.mark.parametrize("case,how", CASES)
def test_planted_library_is_never_loaded(case, how, cache, planted_lib, tmp_path, monkeypatch):
    """A library with a matching hash under qkv's exact name, in a directory writable by
    others, owned by someone else, or itself foreign, group-writable, a symbolic link or
    with a foreign hash (another user's: chown-ed as root, or simulated): never loaded (its
    constructor never runs); the kernel is rebuilt (privately, or in place when the
    directory is the user's own) and works; said once."""
    lib = c_kernels.build_shared(SOURCE, STEM, CC)
    assert lib.parent == cache
    _plant(lib, planted_lib)
    leave, in_place = PLANTS[case]
    leave(cache, lib, how and _foreign_maker(how, monkeypatch))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fn = _load()
        again = _load()
    assert not (tmp_path / "marker").exists(), "the planted library was loaded"
    assert fn is not None and fn(2, 3) == 5 and again(20, 3) == 23
    assert len(said) == 1, [str(w.message) for w in said]
    text = str(said[0].message)
    assert str(cache) in text
    if in_place:
        assert not lib.is_symlink() and _private(lib) and _sha_ok(lib)
    else:
        assert "QKV_CACHE_DIR" in text
        assert lib.read_bytes() == planted_lib.read_bytes()  # nothing written there


def test_planted_int8_kernel_in_a_shared_cache_is_never_loaded(cache, planted_lib, tmp_path,
                                                                 monkeypatch):
    """The same through a real kernel's loader: ``int8_kernel.load()`` in a 0777 cache
    builds privately and matches the torch ops, the planted constructor never runs."""
    monkeypatch.setattr(kernel_registry, "_loaded", {})
    monkeypatch.delenv("QKV_INT8_KERNEL", raising=False)
    assert int8_kernel.load() is not None
    (lib,) = cache.glob("int8-linear-*.so")
    _plant(lib, planted_lib)
    cache.chmod(0o777)
    monkeypatch.setattr(kernel_registry, "_loaded", {})
    monkeypatch.setattr(c_kernels, "_memo", {})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fn = int8_kernel.load()
    assert not (tmp_path / "marker").exists(), "the planted library was loaded"
    assert len(said) == 1, [str(w.message) for w in said]
    assert str(said[0].message).startswith(f"qkv: not using the C kernel cache {cache}: ")
    torch.manual_seed(0)
    wq, s = quantize_weight(torch.randn(5, 70))
    x, b = torch.randn(2, 70), torch.randn(5)
    y, xq = torch.empty(2, 5), torch.empty(2, 70, dtype=torch.int8)
    acc, amax = torch.empty(2, 5, dtype=torch.int32), torch.empty(2)
    s127 = scale127(s)
    fn(x.data_ptr(), 2, 70, wq.data_ptr(), 5, s127.data_ptr(), b.data_ptr(), None,
       y.data_ptr(), xq.data_ptr(), acc.data_ptr(), amax.data_ptr())
    assert torch.equal(y, int8_linear(x, wq.t(), s127, b))


# ------------------------------------------------------------------------ reuse, privacy


def test_own_cache_is_reused_not_rebuilt(cache, counting_cc, monkeypatch):
    """The user's own cache: built once (one compile), then a fresh process (memo cleared)
    loads it with no compile."""
    fn = _load()
    assert fn is not None and fn(40, 2) == 42
    assert _compiles(counting_cc) == 1
    (lib,) = cache.glob(f"{STEM}-*.so")
    assert _sha_ok(lib)
    monkeypatch.setattr(c_kernels, "_memo", {})
    fn = _load()
    assert fn is not None and fn(1, 2) == 3
    assert _compiles(counting_cc) == 1  # reused


def test_each_library_loads_its_own_code(cache):
    """Libraries loaded one after another through the descriptors they were checked on
    each give their own function (a reused descriptor name would hand back the first)."""
    fns = [c_kernels.load_function(f"int qkv_test_n(void) {{ return {n}; }}\n", f"n{n}",
                                   "qkv_test_n", []) for n in range(4)]
    assert [fn() for fn in fns] == [0, 1, 2, 3]


def test_cache_is_private_whatever_the_umask(tmp_path, monkeypatch):
    """Under ``umask 000`` the directories qkv creates for the cache are 0700, and the
    library and its hash are writable by no one else."""
    monkeypatch.setattr(c_kernels, "_memo", {})
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("QKV_CACHE_DIR", str(root))
    old = os.umask(0)
    try:
        fn = _load()
    finally:
        os.umask(old)
    assert fn is not None and fn(2, 2) == 4
    for d in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
    (lib,) = root.glob(f"{STEM}-*.so")
    assert _private(lib) and _private(Path(f"{lib}.sha256"))
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no build dirs


# ------------------------------------------------------------------- damaged libraries

_CHILD = r"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("c_kernels", sys.argv[1])
c_kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(c_kernels)
fn = c_kernels.load_function(sys.argv[2], sys.argv[3], "qkv_test_add",
                             [ctypes.c_int64, ctypes.c_int64])
print(None if fn is None else fn(2, 3))
"""


@pytest.mark.parametrize("damage", ["truncated", "zero-byte", "garbage", "no-hash"])
def test_damaged_cached_library_is_rebuilt(damage, cache, counting_cc):
    """A cached library cut to its first 1000 bytes, emptied, overwritten with garbage, or
    without its hash is rebuilt, never loaded: a fresh process (a child, so that loading a
    damaged library could not take this one down with a bus error) gets a working kernel,
    and the cache holds a good library after."""
    lib = c_kernels.build_shared(SOURCE, STEM, shutil.which("cc"))  # built, not loaded here
    good = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(good[:1000])
    elif damage == "zero-byte":
        lib.write_bytes(b"")
    elif damage == "garbage":
        lib.write_bytes(bytes(range(256)) * 40)
    else:
        Path(f"{lib}.sha256").unlink()
    done = subprocess.run([sys.executable, "-c", _CHILD, c_kernels.__file__, SOURCE, STEM],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "error"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5", (done.stdout, done.stderr)
    assert _compiles(counting_cc) == 2  # rebuilt once, by the child
    assert _sha_ok(lib) and lib.stat().st_size > 1000


def test_compile_error_turns_off_that_kernel_only(cache):
    """A source that does not compile: None, said once; the compiler is not given up, so
    the next kernel still builds."""
    with pytest.warns(RuntimeWarning, match="did not compile") as said:
        assert _load("this is not C") is None
        assert _load("this is not C") is None
    assert len(said) == 1
    fn = _load()
    assert fn is not None and fn(3, 4) == 7


# ------------------------------------------------------------------- a hanging compiler


def _exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # exited (a zombie waits for its parent, not for qkv)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` exits within ``within_s`` seconds. SIGKILL is delivered at once, but
    the process closes its files (which ends qkv's wait on the pipes) before the kernel marks
    it exited, so a look made straight after can still see it running (seen once in CI);
    a process qkv did not kill sleeps on for 60 s and fails this."""
    deadline = time.monotonic() + within_s
    while not _exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("hangs_on", ["version", "compile"])
def test_hanging_compiler_is_bounded_and_said_once(hangs_on, cache, tmp_path, monkeypatch):
    """A ``cc`` that hangs (on ``--version``, or compiling): bounded by the module's limit
    (shortened here), its whole process group killed, one warning that the kernels are off
    and why (naming the off switches), and no other kernel tries it again."""
    bin_dir, log, pids = tmp_path / "bin", tmp_path / "cc.log", tmp_path / "pids"
    bin_dir.mkdir()
    hang = '[ "$1" = "--version" ]' if hangs_on == "version" else '[ "$1" != "--version" ]'
    script = bin_dir / "cc"
    script.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n'
                      f'if {hang}; then sleep 60 & echo $! >> "{pids}"; wait; fi\n'
                      'echo "fake cc 1.0"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(c_kernels, "_VERSION_TIMEOUT_S", 0.5)
    monkeypatch.setattr(c_kernels, "_COMPILE_TIMEOUT_S", 0.5)
    with pytest.warns(RuntimeWarning, match="C kernels are off") as said:
        assert _load() is None
        assert c_kernels.load_function("int f(void) { return 1; }", "other", "f", []) is None
    assert len(said) == 1
    text = str(said[0].message)
    assert str(bin_dir / "cc") in text and "QKV_INT8_KERNEL" in text
    assert ("--version" in text) == (hangs_on == "version")
    calls = log.read_text().splitlines()
    assert len(calls) == (1 if hangs_on == "version" else 2), calls  # tried once
    (pid,) = map(int, pids.read_text().split())
    assert _gone(pid), "the hanging compiler's child was left running"
    assert not list(cache.glob("*.so"))
