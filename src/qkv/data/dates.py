"""The date-normalisation task: a human-readable date in one of many formats -> ISO date.

Example pairs (source -> target)::

    "Sat, 3 March 2021"        -> "2021-03-03"
    "03/03/21"                 -> "2021-03-03"    (US order: MM/DD/YY)
    "the third of march 2021"  -> "2021-03-03"
    "二〇二一年三月三日"          -> "2021-03-03"

Dates lie in 1950-01-01 .. 2049-12-31, so a two-digit year is unambiguous: 50..99 means
19xx and 00..49 means 20xx. Each numeric format has ONE fixed field order, stated in
``DATE_FORMATS`` below; the separator tells them apart (``/`` with a two-digit first field is
US month/day, ``-`` is day-month, ``.`` and a leading four-digit year are year-month-day).
Weekdays, English or Chinese, are always the true weekday of the date.

Generation is counter-based: example ``i`` of ``(seed, split)`` comes from its own
``random.Random`` seeded with a BLAKE2 hash of ``(seed, split, i)``, so any example can be
produced without the ones before it (a trainer resumes from a data position), identically on
every machine and Python version.

Held-out splits are disjoint from training by calendar date: a BLAKE2 hash of the ISO date
(independent of ``seed``) puts ~2.5% of all dates in "valid" and ~2.5% in "test"; "train"
never produces those dates, whatever the format.

A second target format, for adapting a trained date model to an output it never produced
(``qkv demo lora``): ``long_date`` writes "3 March 2021" (day without a leading zero, English
month name, four-digit year); ``date_long_examples`` gives the very same sources as
``date_examples`` (same seed, split and index: same date, format and case) with that target.
"""

from __future__ import annotations

import datetime as _dt
import functools
import random
from collections.abc import Callable
from typing import NamedTuple

from .order import hash_int

__all__ = ["DATE_FORMATS", "DATE_MAX", "DATE_MIN", "LONG_DATE_MAX_LEN", "SPLITS", "DateSample",
           "chinese_number", "date_alphabet", "date_examples", "date_long_examples",
           "date_max_source_len", "date_sample", "date_split", "long_date", "render_date"]

DATE_MIN = _dt.date(1950, 1, 1)
DATE_MAX = _dt.date(2049, 12, 31)
SPLITS = ("train", "valid", "test")
#: Cases an English source may be written in ("natural" = as in the format table).
CASES = ("natural", "lower", "upper")

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_ORDINAL_UNITS = ("", "first", "second", "third", "fourth", "fifth", "sixth", "seventh",
                  "eighth", "ninth")
_ORDINAL_TEENS = ("tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth",
                  "sixteenth", "seventeenth", "eighteenth", "nineteenth")
_CN_DIGITS = "〇一二三四五六七八九"
_CN_WEEKDAYS = "一二三四五六日"  # Monday .. Sunday: 星期一 .. 星期六, 星期日


def _suffix(day: int) -> str:
    """English ordinal suffix: 1st 2nd 3rd 4th .. 11th 12th 13th .. 21st 22nd 23rd .. 31st."""
    if 11 <= day % 100 <= 13:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")


def _ordinal_word(day: int) -> str:
    """1 -> "first", 21 -> "twenty-first", 30 -> "thirtieth" (1 <= day <= 31)."""
    if day < 10:
        return _ORDINAL_UNITS[day]
    if day < 20:
        return _ORDINAL_TEENS[day - 10]
    tens = {2: "twenty", 3: "thirty"}[day // 10]
    if day % 10 == 0:
        return tens[:-1] + "ieth"
    return f"{tens}-{_ORDINAL_UNITS[day % 10]}"


def chinese_number(n: int) -> str:
    """Chinese numeral for 1 <= n <= 99 as written in dates: 3 -> 三, 10 -> 十, 12 -> 十二,
    20 -> 二十, 21 -> 二十一, 31 -> 三十一."""
    if not 1 <= n <= 99:
        raise ValueError(f"n must be in 1..99, got {n!r}")
    tens, units = divmod(n, 10)
    head = "" if tens == 0 else ("十" if tens == 1 else _CN_DIGITS[tens] + "十")
    return head + (_CN_DIGITS[units] if units else "")


def _cn_year(y: int) -> str:
    """Year digit by digit: 2021 -> 二〇二一."""
    return "".join(_CN_DIGITS[int(c)] for c in str(y))


# A format renders (year, month, day, weekday 0=Monday) into a source string.
_Render = Callable[[int, int, int, int], str]


def _mon(m: int) -> str:
    return _MONTHS[m - 1]


# name -> (render, whether English case variants apply). The name states the field order.
_FORMATS: dict[str, tuple[_Render, bool]] = {
    # English, month as a word
    "Www, D Month YYYY": (lambda y, m, d, w: f"{_WEEKDAYS[w][:3]}, {d} {_mon(m)} {y}", True),
    "D Month YYYY": (lambda y, m, d, w: f"{d} {_mon(m)} {y}", True),
    "Month D, YYYY": (lambda y, m, d, w: f"{_mon(m)} {d}, {y}", True),
    "mon D YYYY": (lambda y, m, d, w: f"{_mon(m)[:3].lower()} {d} {y}", True),
    "Mon Dth, YYYY": (lambda y, m, d, w: f"{_mon(m)[:3]} {d}{_suffix(d)}, {y}", True),
    "D Mon 'YY": (lambda y, m, d, w: f"{d} {_mon(m)[:3]} '{y % 100:02d}", True),
    "Dth of Month, YYYY": (lambda y, m, d, w: f"{d}{_suffix(d)} of {_mon(m)}, {y}", True),
    "the ordinal of month YYYY": (
        lambda y, m, d, w: f"the {_ordinal_word(d)} of {_mon(m).lower()} {y}", True),
    "month the ordinal, YYYY": (
        lambda y, m, d, w: f"{_mon(m).lower()} the {_ordinal_word(d)}, {y}", True),
    "Weekday, Month Dth YYYY": (
        lambda y, m, d, w: f"{_WEEKDAYS[w]}, {_mon(m)} {d}{_suffix(d)} {y}", True),
    "Weekday D Month YYYY": (lambda y, m, d, w: f"{_WEEKDAYS[w]} {d} {_mon(m)} {y}", True),
    "YYYY, Month D": (lambda y, m, d, w: f"{y}, {_mon(m)} {d}", True),
    # numeric; the separator fixes the field order
    "MM/DD/YY": (lambda y, m, d, w: f"{m:02d}/{d:02d}/{y % 100:02d}", False),
    "M/D/YYYY": (lambda y, m, d, w: f"{m}/{d}/{y}", False),
    "DD-MM-YYYY": (lambda y, m, d, w: f"{d:02d}-{m:02d}-{y}", False),
    "YYYY.MM.DD": (lambda y, m, d, w: f"{y}.{m:02d}.{d:02d}", False),
    "YYYY/M/D": (lambda y, m, d, w: f"{y}/{m}/{d}", False),
    "YYYYMMDD": (lambda y, m, d, w: f"{y}{m:02d}{d:02d}", False),
    # Chinese
    "YYYY年M月D日": (lambda y, m, d, w: f"{y}年{m}月{d}日", False),
    "YYYY年MM月DD日": (lambda y, m, d, w: f"{y}年{m:02d}月{d:02d}日", False),
    "中文 年月日": (
        lambda y, m, d, w: f"{_cn_year(y)}年{chinese_number(m)}月{chinese_number(d)}日", False),
    "YYYY年M月D日星期W": (lambda y, m, d, w: f"{y}年{m}月{d}日星期{_CN_WEEKDAYS[w]}", False),
    "中文 年月日星期W": (
        lambda y, m, d, w: (f"{_cn_year(y)}年{chinese_number(m)}月{chinese_number(d)}日"
                            f"星期{_CN_WEEKDAYS[w]}"), False),
    "YYYY年M月D日 周W": (lambda y, m, d, w: f"{y}年{m}月{d}日 周{_CN_WEEKDAYS[w]}", False),
}

#: Names of the source formats, in a fixed order (a sample picks one uniformly).
DATE_FORMATS: tuple[str, ...] = tuple(_FORMATS)


def _apply_case(text: str, case: str) -> str:
    return text.lower() if case == "lower" else text.upper() if case == "upper" else text


def render_date(date: _dt.date, fmt: str, *, case: str = "natural") -> str:
    """Write ``date`` in format ``fmt`` (a name from ``DATE_FORMATS``).

    ``case`` ("natural", "lower" or "upper") changes the letters of English formats only.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of DATE_FORMATS, got {fmt!r}")
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    render, cased = _FORMATS[fmt]
    text = render(date.year, date.month, date.day, date.weekday())
    return _apply_case(text, case) if cased else text


def date_split(date: _dt.date) -> str:
    """The split a calendar date belongs to: "valid" (~2.5%), "test" (~2.5%) or "train".

    A BLAKE2 hash of the ISO date, independent of any seed: the same dates are held out for
    every seed and format.
    """
    bucket = hash_int("qkv.data.dates/heldout", date.isoformat()) % 40
    return "valid" if bucket == 0 else "test" if bucket == 1 else "train"


@functools.cache
def _heldout(split: str) -> tuple[int, ...]:
    """Ordinals of every date of a held-out split, ascending."""
    lo, hi = DATE_MIN.toordinal(), DATE_MAX.toordinal()
    return tuple(o for o in range(lo, hi + 1) if date_split(_dt.date.fromordinal(o)) == split)


class DateSample(NamedTuple):
    """One example with how it was made: ``source`` is ``date`` written in ``format``/``case``,
    ``target`` is ``date.isoformat()``."""

    date: _dt.date
    format: str
    case: str
    source: str
    target: str


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def date_sample(*, seed: int, split: str, index: int) -> DateSample:
    """Example ``index`` of ``split`` for ``seed``: depends on these three values only."""
    _check_split(split)
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    rng = random.Random(hash_int("qkv.data.dates", seed, split, index))
    if split == "train":
        lo, hi = DATE_MIN.toordinal(), DATE_MAX.toordinal()
        while True:
            date = _dt.date.fromordinal(rng.randint(lo, hi))
            if date_split(date) == "train":
                break
    else:
        date = _dt.date.fromordinal(rng.choice(_heldout(split)))
    fmt = rng.choice(DATE_FORMATS)
    case = rng.choice(CASES) if _FORMATS[fmt][1] else "natural"
    return DateSample(date, fmt, case, render_date(date, fmt, case=case), date.isoformat())


def date_examples(split: str, start: int, count: int, *, seed: int = 0) -> list[tuple[str, str]]:
    """Examples ``start .. start+count-1`` of ``split`` as ``(source, target)`` pairs."""
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    _check_split(split)
    out = []
    for i in range(start, start + count):
        s = date_sample(seed=seed, split=split, index=i)
        out.append((s.source, s.target))
    return out


def long_date(date: _dt.date) -> str:
    """The long English form of ``date``: 2021-03-03 -> "3 March 2021" (day without a leading
    zero, the month's English name, the four-digit year). Its characters all lie in
    ``date_alphabet()`` (it is the natural case of the "D Month YYYY" source format)."""
    return f"{date.day} {_mon(date.month)} {date.year}"


#: the longest ``long_date``: "30 September 2021" (every year has 4 digits)
LONG_DATE_MAX_LEN = len("30 September 2000")


def date_long_examples(split: str, start: int, count: int, *, seed: int = 0
                       ) -> list[tuple[str, str]]:
    """Examples ``start .. start+count-1`` of ``split`` as ``(source, long_date(date))``:
    the sources (and dates, held out by calendar date) of ``date_examples`` with the same
    arguments, the target written "3 March 2021" instead of ISO."""
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    _check_split(split)
    out = []
    for i in range(start, start + count):
        s = date_sample(seed=seed, split=split, index=i)
        out.append((s.source, long_date(s.date)))
    return out


@functools.cache
def _bounds() -> tuple[str, int]:
    """(alphabet, max source length) over every format, case, weekday and valid month/day.

    Weekday and month/day vary independently here, which covers every real date (each
    (month, day) falls on every weekday in some year of the range). Every year has 4 digits,
    so one year gives the lengths; the year's digits, ASCII or Chinese, are added explicitly.
    """
    days = [(m, d) for m in range(1, 13) for d in range(1, 32)
            if d <= (_dt.date(2000, m % 12 + 1, 1) - _dt.timedelta(days=1)).day]
    texts = []
    for render, cased in _FORMATS.values():
        rendered = "\n".join(render(2000, m, d, w) for m, d in days for w in range(7))
        texts.append(rendered)
        if cased:
            texts += [rendered.lower(), rendered.upper()]
    longest = max(len(t) for block in texts for t in block.split("\n"))
    chars = set("".join(texts)) - {"\n"}
    chars |= set("0123456789-") | set(_CN_DIGITS)  # ISO targets; years of the Chinese formats
    return "".join(sorted(chars)), longest


def date_alphabet() -> str:
    """Every character a source or target of the date task can contain, sorted."""
    return _bounds()[0]


def date_max_source_len() -> int:
    """Length in characters of the longest possible source (targets are always 10)."""
    return _bounds()[1]
