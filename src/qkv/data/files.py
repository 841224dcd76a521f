"""Read training data from files: TSV pairs for sequence-to-sequence, plain text for a
language model. Every problem is a ``DataError`` (a ``ValueError``) naming the file and,
where there is one, the line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DataError", "read_pairs", "read_text", "tab_lines"]


class DataError(ValueError):
    """A data or tokenizer file cannot be used: missing, undecodable or malformed."""


def _read_utf8(path: str | os.PathLike) -> str:
    """The file's text (a leading UTF-8 BOM dropped); errors name the file and line."""
    path = Path(path)
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
    for number, line in enumerate(_read_utf8(path).split("\n"), start=1):
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
    text = _read_utf8(path)
    if not text.strip():
        raise DataError(f"{path}: the file holds no text")
    return text
