"""The ``qkv`` command line.

One module per command under ``qkv.cli``; each exposes ``register(subparsers)``, which adds
its parser and sets ``func`` (called with the parsed arguments, returns the exit status).
Errors a user can fix (a bad argument value, an unreadable file, a broken checkpoint) end
the command with one line on stderr and exit status 2, not a traceback; set ``QKV_DEBUG=1``
to see the traceback. argparse's own errors (an unknown flag, a value its ``type`` refuses,
see ``qkv.cli.checks``) are one line too, with a pointer to ``--help`` instead of the usage.
``qkv --version`` prints the version; ``python -m qkv`` runs the same command as ``qkv``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing

__all__ = ["COMMANDS", "UserError", "build_parser", "main", "version"]

#: modules of ``qkv.cli`` that register a command, in ``qkv --help`` order
COMMANDS = ("demo", "train", "attention", "bench", "generate", "peft", "export")


class UserError(Exception):
    """A problem the user can fix (bad input, missing file): printed as one line."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2): ``qkv CMD:
    error: MESSAGE (see qkv CMD --help)``, where argparse prints the usage first."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the package's
    ``qkv.__version__`` (a source tree on ``sys.path`` without an install)."""
    from importlib import metadata

    try:
        return metadata.version("qkv")
    except metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``qkv`` parser with every command of ``COMMANDS`` registered."""
    parser = _Parser(
        prog="qkv", description="qkv: one exact attention core and the Transformers built on "
        "it. Run `qkv COMMAND --help` for a command's options and examples.")
    parser.add_argument("--version", action="version", version=f"qkv {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def _bytes_or_backslash(err: UnicodeError) -> tuple[bytes | str, int]:
    """Codec error handler for output: a surrogate-escaped byte (U+DC80..U+DCFF, how Python
    holds an undecodable byte of an argument or file name) is written as that byte; any
    other unencodable character as a backslash escape. Output never fails."""
    if not isinstance(err, UnicodeEncodeError):
        raise err
    out = bytearray()
    for char in err.object[err.start:err.end]:
        code = ord(char)
        out += bytes([code - 0xDC00]) if 0xDC80 <= code <= 0xDCFF else (
            char.encode("ascii", "backslashreplace"))
    return bytes(out), err.end


def _utf8_io(argv: list[str] | None) -> list[str] | None:
    """Read arguments and write output as UTF-8 whatever the locale (an ASCII ``LC_ALL=C``
    without Python's UTF-8 mode would read ``2021年3月3日`` as undecodable bytes and fail
    to print CJK). stdout and stderr not in UTF-8 are switched to it (errors: the bytes of
    surrogate-escaped characters, a backslash escape for anything else). When the file-system
    encoding is not UTF-8, each argument of the command line (``argv`` None) is decoded again
    from its bytes as UTF-8, where they are valid UTF-8 and the argument (or the VALUE of
    ``--opt=VALUE``) does not name an existing file as given: a path keeps working (a new
    non-ASCII path may then fail to encode: one error line). Returns the arguments."""
    import codecs

    codecs.register_error("qkv.bytes_or_backslash", _bytes_or_backslash)
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "ascii"
        if codecs.lookup(encoding).name != "utf-8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="qkv.bytes_or_backslash")
    if argv is not None or codecs.lookup(sys.getfilesystemencoding()).name == "utf-8":
        return argv

    def utf8(arg: str) -> str:
        value = arg.partition("=")[2] if arg.startswith("--") and "=" in arg else arg
        if value and os.path.lexists(value):
            return arg
        try:
            return os.fsencode(arg).decode("utf-8")
        except UnicodeDecodeError:  # not UTF-8 (e.g. Latin-1 typed in a Latin-1 locale)
            return arg

    return [utf8(arg) for arg in sys.argv[1:]]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qkv`` console script; returns the exit status."""
    from ..files import CheckpointError

    argv = _utf8_io(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, CheckpointError, OSError, ValueError) as exc:
        if os.environ.get("QKV_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"qkv {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
