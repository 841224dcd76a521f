"""Checks shared by the ``qkv`` commands: numeric flag types that refuse a bad value while
the arguments are parsed (one line naming the flag and the value, exit status 2), the seed
range, and the memory this machine has available for a size the user asked for.

Each type is an argparse ``type=`` callable: ``p.add_argument("--top-p",
type=float_in(0, 1, low_open=True))``. argparse turns the ``ArgumentTypeError`` into
``qkv CMD: error: argument --top-p: must be in (0, 1], got '2'`` (see ``qkv.cli``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["SEED_MAX", "available_memory", "check_fits", "float_in", "format_bytes", "int_in",
           "seed"]

#: the largest seed a command accepts (torch and the data generators take any int in
#: 0..SEED_MAX; it fits a signed 64-bit integer wherever a seed is stored)
SEED_MAX = 2**63 - 1


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def int_in(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer with ``low <= value <= high`` (None: unbounded)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be an integer {_range_text(low, high, False, False)}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float | None = None, high: float | None = None, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in the range (open ends excluded; None: unbounded).
    NaN and infinities are always refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        bad = (not math.isfinite(value)
               or (low is not None and (value < low or (low_open and value == low)))
               or (high is not None and (value > high or (high_open and value == high))))
        if bad:
            where = _range_text(low, high, low_open, high_open) if (low, high) != (None, None) \
                else ""
            raise argparse.ArgumentTypeError(
                f"must be a finite number{' ' + where if where else ''}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def seed(text: str) -> int:
    """An argparse type for every ``--seed``: an integer in 0..``SEED_MAX``."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer in 0..{SEED_MAX}, got {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{SEED_MAX}, got {text!r}")
    return value


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation on this machine (``MemAvailable`` of
    /proc/meminfo, else ``os.sysconf``; None when neither can be read and the caller skips
    its check): ``qkv.train.memory.available_bytes`` for the CPU, the one reader of it."""
    from ..train.memory import available_bytes

    return available_bytes()


def format_bytes(n: float) -> str:
    """``n`` bytes as ``"12.3 GiB"`` / ``"512 MiB"``."""
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    return f"{n / 2**20:,.0f} MiB"


def check_fits(what: str, need: float, *, available: int | None = None) -> None:
    """Raise ``qkv.cli.UserError`` when ``need`` bytes (a lower bound of what ``what`` will
    allocate) exceed the memory available (``available``, default ``available_memory()``);
    nothing when the available memory cannot be read."""
    from . import UserError

    have = available_memory() if available is None else available
    if have is not None and need > have:
        raise UserError(f"{what} needs at least {format_bytes(need)} of memory; this machine "
                        f"has {format_bytes(have)} available")
