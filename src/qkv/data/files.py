"""Read training data from files: TSV pairs for sequence-to-sequence, plain text for a
language model. Every problem is a ``DataError`` (a ``ValueError``) naming the file and,
where there is one, the line.

Only regular files are read (``regular_file``): a device (``/dev/zero``), a FIFO or pipe (a
shell's ``<(...)``), a socket or a directory is refused before a byte is read, naming what
it is — reading one would never end (``/dev/zero``), block (a FIFO with no writer), or
consume data that a second pass (a fingerprint, then the training data) would not see.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DataError", "file_kind", "read_pairs", "read_text", "read_utf8", "regular_file",
           "tab_lines"]


class DataError(ValueError):
    """A data or tokenizer file cannot be used: missing, undecodable or malformed."""


#: (stat test, what such a file is), for ``file_kind``
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO or pipe"),
          (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a file of ``os.stat`` mode ``mode`` is, in words: "a regular file", "a directory",
    "a character device", "a FIFO or pipe", "a socket", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, *, name: str | None = None) -> Path:
    """``path`` as a ``Path`` if it names a regular file (through links), checked without
    opening it; otherwise a ``DataError`` of one line, ``cannot read [NAME ]PATH: ...``,
    saying why: it does not exist, or what it is instead (a directory, a device, a FIFO or
    pipe, a socket; a link says where it points). ``name`` is the argument it came from
    (e.g. ``"--data"``)."""
    path = Path(path)
    label = f"{name} {path}" if name else str(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise DataError(f"cannot read {label}: {err.strerror or err}") from err
    if stat.S_ISREG(mode):
        return path
    link = ""
    if path.is_symlink():
        try:
            link = f" (a link to {os.readlink(path)})"
        except OSError:
            link = " (a link)"
    raise DataError(f"cannot read {label}: not a regular file but {file_kind(mode)}{link}; "
                    f"qkv reads data from regular files only: save it to a file first")


def read_utf8(path: str | os.PathLike, *, name: str | None = None) -> str:
    """The UTF-8 text of the regular file ``path`` (a leading BOM dropped); a ``DataError``
    names the file (and ``name``, the argument it came from) and, for bad UTF-8, the line."""
    path = regular_file(path, name=name)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from err
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x} at offset "
                        f"{err.start})") from err


def tab_lines(path: str | os.PathLike, left: str, right: str
              ) -> Iterator[tuple[int, str, str]]:
    """The non-blank lines of a UTF-8 TSV file of two columns as ``(line number, left text,
    right text)`` (a ``\\r\\n`` ending dropped); a line without exactly one tab is a
    ``DataError`` naming the file, the line and the columns ``left<TAB>right``."""
    for number, line in enumerate(read_utf8(path).split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        tabs = line.count("\t")
        if tabs != 1:
            what = "no tab" if tabs == 0 else f"{tabs} tabs"
            raise DataError(f"{path}:{number}: expected {left}<TAB>{right}, found {what}")
        a, b = line.split("\t")
        yield number, a, b


def read_pairs(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Read ``source<TAB>target`` lines (UTF-8) into ``(source, target)`` pairs.

    Blank lines are skipped; a line ending (``\\n`` or ``\\r\\n``) is not part of the target.
    Each non-blank line must hold exactly one tab with text on both sides; otherwise a
    ``DataError`` names the file and line number. A file with no pairs is an error too.
    """
    pairs = []
    for number, source, target in tab_lines(path, "source", "target"):
        for side, value in (("source", source), ("target", target)):
            if not value.strip():
                raise DataError(f"{path}:{number}: empty {side}")
        pairs.append((source, target))
    if not pairs:
        raise DataError(f"{path}: no source<TAB>target pairs in the file")
    return pairs


def read_text(path: str | os.PathLike) -> str:
    """The whole UTF-8 text of ``path`` (for language-model training); empty is an error."""
    text = read_utf8(path)
    if not text.strip():
        raise DataError(f"{path}: the file holds no text")
    return text
