"""The ``qkv`` command line.

One module per command under ``qkv.cli``; each exposes ``register(subparsers)``, which adds
its parser and sets ``func`` (called with the parsed arguments, returns the exit status).
Errors a user can fix (a bad argument value, an unreadable file, a broken checkpoint) end
the command with one line on stderr and exit status 2, not a traceback; set ``QKV_DEBUG=1``
to see the traceback. argparse's own errors (an unknown flag, a value its ``type`` refuses,
see ``qkv.cli.checks``) are one line too, with a pointer to ``--help`` instead of the usage.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing

__all__ = ["COMMANDS", "UserError", "build_parser", "main"]

#: modules of ``qkv.cli`` that register a command, in ``qkv --help`` order
COMMANDS = ("demo", "train", "attention", "bench", "generate", "peft", "export")


class UserError(Exception):
    """A problem the user can fix (bad input, missing file): printed as one line."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2): ``qkv CMD:
    error: MESSAGE (see qkv CMD --help)``, where argparse prints the usage first."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``qkv`` parser with every command of ``COMMANDS`` registered."""
    parser = _Parser(
        prog="qkv", description="qkv: one exact attention core and the Transformers built on "
        "it. Run `qkv COMMAND --help` for a command's options and examples.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qkv`` console script; returns the exit status."""
    from ..models.hub import CheckpointError

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
