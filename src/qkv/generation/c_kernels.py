"""Building and loading the optional C kernels of the decode steps (``int8_kernel``,
``attention_kernel``, ``gemv_kernel``, ``row_step_kernel``; which files make which library,
and every function's signature, are declared once in ``kernel_registry``): compile C sources
once with the system's C compiler (``cc``, else ``gcc``; ``-O3 -march=native -Wall -Werror``,
shared) into a cache directory, load the library with ``ctypes`` (no torch headers, no Python
extension build). Any failure gives None: the caller stays on its torch ops.

A source is one C text (compiled as ``{stem}.c``) or a mapping of file names to texts: its
``.c`` files are compiled together into one library (separate translation units), its ``.h``
files sit beside them for ``#include "..."``. A warning is a compile error (``-Werror``).
This module imports nothing of qkv's (the tests load it on its own in a child process).

The cache directory is ``$QKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/qkv``, else
``~/.cache/qkv``. A library is ``{stem}-{key}.so`` (``key``: a hash of the source, the flags,
the compiler's version and the CPU's flags; every file of the source, by name) with its
SHA-256 beside it in
``{stem}-{key}.so.sha256``; both are written atomically (temp + rename). The rules, since a
loaded library runs its code in this process:

- Directories qkv creates for the cache are made 0700 and the files 0700/0600, whatever the
  umask.
- A cached library is loaded only if its directory and the file itself (and its ``.sha256``)
  belong to this user and are not writable by group or others, the file is a regular file
  (not a symbolic link), and its bytes match the recorded SHA-256. The check and the load go
  through one open file (``/proc/self/fd``), so the file cannot be swapped between them.
- A cache directory that fails these checks (writable by others, owned by someone else, not
  creatable) is not used: the kernels are built for this process in a private temporary
  directory (``mkdtemp``, 0700, removed at exit), with one warning naming the directory,
  the reason and the fix (``QKV_CACHE_DIR``). A file in a good directory that fails them is
  rebuilt over (one warning); a missing, zero-byte, truncated or overwritten one (no hash, or
  a hash that does not match) is rebuilt quietly.
- The compiler is bounded: ``cc --version`` gets ``_VERSION_TIMEOUT_S`` seconds, a compile
  ``_COMPILE_TIMEOUT_S`` (its whole process group is killed past that). A compiler that hangs
  or cannot run is given up for the rest of the process (no further kernel tries it), with
  one warning; ``QKV_ATTN_KERNEL`` / ``QKV_GEMV_KERNEL`` / ``QKV_INT8_KERNEL`` /
  ``QKV_ROW_KERNEL`` ``=0`` turn the kernels off without trying it. A source that does not
  compile turns off that kernel only (one warning).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["FLAGS", "Source", "build_shared", "env_off", "first_error", "load_function",
           "load_library"]

#: The compiler flags of every kernel (``-march=native``: the code paths of the CPU it runs
#: on; tests/generation/test_kernel_levels.py compiles every kernel at each x86-64 level).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-Wall", "-Werror", "-fPIC", "-shared"]

Source = str | Mapping[str, str]
"""One C text, or file name -> text (``.c`` files compiled together, ``.h`` files beside)."""

#: Seconds ``cc --version`` may take, and one compile (its process group is killed after).
_VERSION_TIMEOUT_S = 10.0
_COMPILE_TIMEOUT_S = 60.0

_SWITCHES = "QKV_ATTN_KERNEL, QKV_GEMV_KERNEL, QKV_INT8_KERNEL, QKV_ROW_KERNEL"

_lock = threading.Lock()
# per process: ("version", compiler) -> its version text; "broken" -> why the compiler was
# given up; "private" -> the fallback build directory; "said" -> the warnings given
_memo: dict = {}
_open_fds: list[int] = []  # the descriptors loaded libraries were opened through (kept open)


class _Untrusted(PermissionError):
    """A cached library, its hash or its directory that may not be trusted (the message says
    why); ``directory``: whether it is the directory."""

    def __init__(self, reason: str, directory: bool = False) -> None:
        super().__init__(reason)
        self.directory = directory


class _CompilerUnusable(subprocess.SubprocessError):
    """The compiler hung or could not run: no kernel tries it again in this process."""


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


def _say_once(key: object, text: str) -> None:
    with _lock:
        said = _memo.setdefault("said", set())
        if key in said:
            return
        said.add(key)
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1  # blame the first caller outside this file
    warnings.warn(text, RuntimeWarning, stacklevel=level)


# ------------------------------------------------------------------------------ trust


def _untrusted(st: os.stat_result, kind: str) -> str:
    """Why a file or directory with status ``st`` may not be trusted ("" when it may)."""
    if kind == "directory" and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if kind != "directory" and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _open_checked(dfd: int, name: str, prefix: str = "") -> int:
    """A descriptor of ``name`` in the directory ``dfd``: not following a symbolic link, not
    blocking on a FIFO; raises ``_Untrusted`` saying why it may not be trusted (after
    ``prefix``)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Untrusted(prefix + "is a symbolic link") from None
        raise
    reason = _untrusted(os.fstat(fd), "file")
    if reason:
        os.close(fd)
        raise _Untrusted(prefix + reason)
    return fd


def _read_fd(fd: int, limit: int | None = None) -> bytes:
    chunks, total = [], 0
    while limit is None or total < limit:
        chunk = os.pread(fd, 1 << 20, total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _open_cached(directory: Path, name: str) -> int | None:
    """A descriptor of the cached library ``directory/name`` once checked (its directory, the
    file and its ``.sha256`` are this user's and private, the file is regular and its bytes
    match the recorded hash), None when it is missing or does not match its hash (rebuild).
    Raises ``_Untrusted`` (with the reason) for a directory or file that may not be trusted,
    ``OSError`` when the directory cannot be opened."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        reason = _untrusted(os.fstat(dfd), "directory")
        if reason:
            raise _Untrusted(reason, directory=True)
        try:
            fd = _open_checked(dfd, name)
        except FileNotFoundError:
            return None
        try:
            try:
                hfd = _open_checked(dfd, name + ".sha256", "has a .sha256 that ")
            except FileNotFoundError:
                os.close(fd)
                return None
            try:
                want = _read_fd(hfd, 256).decode("ascii", "replace").strip()
            finally:
                os.close(hfd)
            if hashlib.sha256(_read_fd(fd)).hexdigest() != want:
                os.close(fd)
                return None
            return fd
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dfd)


def _make_private(root: Path) -> None:
    """Create ``root`` and the parents it lacks, each 0700 whatever the umask (existing
    directories are left as they are)."""
    missing = []
    p = root
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: checked, never chmod-ed
        os.chmod(p, 0o700)


def _private_dir() -> Path:
    """This process's own build directory (``mkdtemp``, 0700), removed at exit."""
    with _lock:
        if "private" not in _memo:
            path = Path(tempfile.mkdtemp(prefix="qkv-kernels-"))
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            _memo["private"] = path
        return _memo["private"]


def _build_dir() -> Path:
    """The cache directory, when it may be trusted; else this process's private one (said
    once)."""
    root = _cache_dir()
    try:
        _make_private(root)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            reason = _untrusted(os.fstat(fd), "directory")
        finally:
            os.close(fd)
    except OSError as e:
        reason = f"cannot be created or opened ({e.strerror or e})"
    if not reason:
        return root
    private = _private_dir()
    _say_once(("directory", str(root)),
              f"qkv: not using the C kernel cache {root}: it {reason}. The kernels are built "
              f"for this process in {private} instead. Point QKV_CACHE_DIR at a directory "
              "that belongs to you and only you can write (e.g. chmod 700 it).")
    return private


# --------------------------------------------------------------------------- building


def _run(cmd: list[str], timeout: float, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in its own process group, output captured; past ``timeout`` seconds the whole
    group is killed and ``subprocess.TimeoutExpired`` raised."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a member that left the group holds the pipes
            proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _give_up(compiler: str, why: str) -> _CompilerUnusable:
    with _lock:
        _memo.setdefault("broken", f"{compiler} {why}")
    _say_once("broken", f"qkv: the C kernels are off for this process: the C compiler "
                        f"{compiler} {why}; decoding uses torch ops. Fix or remove the compiler, "
                        f"or set {_SWITCHES} to 0 to skip it.")
    return _CompilerUnusable(f"{compiler} {why}")


def _compiler_version(compiler: str) -> str:
    with _lock:
        if "broken" in _memo:
            raise _CompilerUnusable(_memo["broken"])
        known = _memo.get(("version", compiler))
    if known is not None:
        return known
    try:
        done = _run([compiler, "--version"], _VERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise _give_up(compiler, f"did not answer `--version` within {_VERSION_TIMEOUT_S:g} s"
                       ) from None
    except OSError as e:
        raise _give_up(compiler, f"cannot run ({e.strerror or e})") from None
    if done.returncode != 0:
        raise _give_up(compiler, f"failed `--version` (exit {done.returncode})")
    version = done.stdout.decode(errors="replace")
    with _lock:
        _memo[("version", compiler)] = version
    return version


def _files(source: Source, stem: str) -> dict[str, str]:
    """``source`` as file name -> text (one text is ``{stem}.c``); raises ``ValueError`` for
    a name that is not a plain ``.c`` / ``.h`` file name, or no ``.c`` file."""
    files = {f"{stem}.c": source} if isinstance(source, str) else dict(source)
    for name in files:
        if (not name.endswith((".c", ".h")) or name.startswith(".") or "/" in name
                or os.sep in name):
            raise ValueError(f"c_kernels: source file names must be plain .c or .h names, "
                             f"got {name!r}")
    if not any(name.endswith(".c") for name in files):
        raise ValueError(f"c_kernels: the source of {stem!r} has no .c file")
    return files


def first_error(stderr: str) -> str:
    """The compiler's first error line in full (``file:line:col: error: ...``), else its
    first non-empty line (GCC opens with "In function ...", which says no error)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines
                else "no message")


def _compile(files: dict[str, str], stem: str, compiler: str, flags: list[str],
             directory: Path, name: str) -> None:
    """Compile the ``.c`` files of ``files`` into ``directory/name`` (0700) and its hash
    ``name.sha256`` (0600), each written atomically."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        for file, text in files.items():
            Path(tmp, file).write_text(text)
        units = sorted(f for f in files if f.endswith(".c"))
        try:  # relative names: the library's bytes do not depend on the temp directory
            done = _run([compiler, *flags, "-o", name, *units, "-lm"],
                        _COMPILE_TIMEOUT_S, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise _give_up(compiler, f"did not finish compiling {stem!r} within "
                                     f"{_COMPILE_TIMEOUT_S:g} s") from None
        except OSError as e:
            raise _give_up(compiler, f"cannot run ({e.strerror or e})") from None
        if done.returncode != 0:
            first = first_error(done.stderr.decode(errors="replace"))
            _say_once(("compile", stem),
                      f"qkv: the C kernel {stem!r} did not compile with {compiler} (exit "
                      f"{done.returncode}: {first.strip()}); it is off for this process, "
                      "decoding uses torch ops.")
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                done.stderr)
        lib = Path(tmp, name)
        os.chmod(lib, 0o700)
        digest = Path(tmp, name + ".sha256")
        digest.write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")
        os.chmod(digest, 0o600)
        os.replace(lib, directory / name)  # atomic: a reader sees no half-written library
        os.replace(digest, directory / digest.name)


def _library(source: Source, stem: str, compiler: str, flags: Sequence[str]
             ) -> tuple[Path, int]:
    """(path, checked descriptor) of the library of ``source``, built unless a good one is
    cached. Raises ``OSError`` / ``subprocess.SubprocessError`` on failure."""
    files = _files(source, stem)
    flags = [*FLAGS, *flags]
    version = _compiler_version(compiler)
    texts = [source] if isinstance(source, str) else [
        part for file in sorted(files) for part in (file, files[file])]
    key = hashlib.sha256("\0".join([*texts, *flags, version, _cpu_flags(),
                                     platform.machine()]).encode()).hexdigest()[:16]
    name = f"{stem}-{key}.so"
    directory = _build_dir()
    try:
        fd = _open_cached(directory, name)
    except _Untrusted as e:
        if e.directory:
            raise  # changed since _build_dir checked it: build nothing there
        _say_once(("file", str(directory / name)),
                  f"qkv: not loading the cached C kernel {directory / name}: it {e}; "
                  "rebuilding it.")
        fd = None
    if fd is None:
        _compile(files, stem, compiler, flags, directory, name)
        fd = _open_cached(directory, name)
        if fd is None:
            raise OSError(f"{directory / name} does not match its hash just after building")
    return directory / name, fd


def build_shared(source: Source, stem: str, compiler: str, flags: Sequence[str] = ()
                 ) -> Path:
    """The checked shared library of C ``source`` (one text or file name -> text) compiled
    with ``compiler`` (``-O3 -march=native -Wall -Werror``, shared, + ``flags``):
    ``{stem}-{hash}.so`` in the cache directory (or this process's private one when the
    cache may not be trusted; module docstring), built unless a good one is there. Raises
    ``OSError`` / ``subprocess.SubprocessError`` on failure."""
    path, fd = _library(source, stem, compiler, flags)
    os.close(fd)
    return path


def load_library(source: Source, stem: str, flags: Sequence[str] = ()
                 ) -> ctypes.CDLL | None:
    """The loaded shared library of C ``source`` (one text or file name -> text; built as
    ``stem`` with the extra compiler ``flags``; the cache rules are the module docstring's),
    or None when there is no compiler, this is not Linux, or building or loading fails (a
    hanging or broken compiler, a compile error: said once). Raises ``ValueError`` for a
    file name that is not a plain ``.c`` / ``.h`` name."""
    _files(source, stem)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    try:
        path, fd = _library(source, stem, compiler, flags)
    except (OSError, subprocess.SubprocessError):
        return None
    via = f"/proc/self/fd/{fd}"  # the very file that was checked
    try:
        lib = ctypes.CDLL(via if os.path.exists(via) else str(path))
    except OSError:
        os.close(fd)
        return None
    with _lock:
        _open_fds.append(fd)  # kept open: a reused number would name the loaded library
    return lib


def load_function(source: Source, stem: str, symbol: str, argtypes: list,
                  flags: Sequence[str] = ()) -> object | None:
    """The C function ``symbol`` of ``source`` (``load_library``'s arguments) with
    ``argtypes`` and an int result, or None when the library cannot be built or loaded here
    (``load_library``) or has no ``symbol``."""
    lib = load_library(source, stem, flags)
    fn = None if lib is None else getattr(lib, symbol, None)
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn
