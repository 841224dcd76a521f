"""Embedded sequence-to-sequence tasks, generated on the fly (no files, no downloads).

==========  ==========================================  ==========================
task        source                                      target
==========  ==========================================  ==========================
dates       "Sat, 6 March 2021", "二〇二一年三月六日", ...     "2021-03-06"
dates-long  the same sources as dates                   "6 March 2021"
copy        "k3x9a"                                     "k3x9a"
reverse     "k3x9a"                                     "a9x3k"
sort        "k3x9a"                                     "39akx" (code-point order)
addition    "123+4567"                                  "4690"
==========  ==========================================  ==========================

Every task is counter-based: example ``i`` of ``(seed, split)`` is drawn from its own
``random.Random`` seeded with a BLAKE2 hash of ``(task, seed, split, i)``, so
``task.examples(split, start, count)`` never generates the examples before ``start`` and gives
the same strings on every machine. Held-out splits ("valid", "test") are disjoint from
"train": for ``dates`` and ``dates-long`` by calendar date (see ``qkv.data.dates``), for the
others by a BLAKE2 hash of the source string (~2.5% of sources are "valid", ~2.5% "test";
each split rejects and redraws sources that belong to another split). The held-out sets do
not depend on ``seed``.
"""

from __future__ import annotations

import random
import string

from .dates import (
    LONG_DATE_MAX_LEN,
    SPLITS,
    date_alphabet,
    date_examples,
    date_long_examples,
    date_max_source_len,
)
from .order import hash_int

__all__ = ["TASKS", "AdditionTask", "DatesLongTask", "DatesTask", "StringTask", "Task",
           "get_task"]

#: Names accepted by ``get_task``.
TASKS = ("dates", "copy", "reverse", "sort", "addition", "dates-long")
#: Draws before giving up on a split that holds (almost) no sources of a tiny task.
_MAX_DRAWS = 10_000


def _check_range(split: str, start: int, count: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for name, value in (("start", start), ("count", count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


class Task:
    """A sequence-to-sequence task: ``examples(split, start, count)`` gives ``(source,
    target)`` string pairs; ``alphabet()`` every character any example can hold;
    ``max_source_len`` / ``max_target_len`` bound their lengths in characters."""

    name: str = ""
    max_source_len: int = 0
    max_target_len: int = 0

    def __init__(self, *, seed: int = 0) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed

    def alphabet(self) -> str:  # pragma: no cover - overridden
        """Every character a source or target can contain."""
        raise NotImplementedError

    def examples(self, split: str, start: int, count: int) -> list[tuple[str, str]]:
        """Examples ``start .. start+count-1`` of ``split`` ("train", "valid", "test")."""
        _check_range(split, start, count)
        return [self._example(split, i) for i in range(start, start + count)]

    def _example(self, split: str, index: int) -> tuple[str, str]:
        rng = random.Random(hash_int("qkv.data.tasks", self.name, self.seed, split, index))
        for _ in range(_MAX_DRAWS):
            source, target = self._draw(rng)
            if self.source_split(source) == split:
                return source, target
        raise ValueError(f"split {split!r} of {self!r} got no source in {_MAX_DRAWS} draws: "
                         f"too few distinct sources (raise max_len / max_digits)")

    def source_split(self, source: str) -> str:
        """The split a source string belongs to (a BLAKE2 hash, independent of the seed)."""
        bucket = hash_int("qkv.data.tasks/heldout", self.name, source) % 40
        return "valid" if bucket == 0 else "test" if bucket == 1 else "train"

    def _draw(self, rng: random.Random) -> tuple[str, str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, seed={self.seed})"


class DatesTask(Task):
    """Human-readable dates (24 English, numeric and Chinese formats) -> ISO "YYYY-MM-DD";
    see ``qkv.data.dates``. Held out by calendar date."""

    name = "dates"
    max_target_len = 10

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.max_source_len = date_max_source_len()

    def alphabet(self) -> str:
        return date_alphabet()

    def examples(self, split: str, start: int, count: int) -> list[tuple[str, str]]:
        _check_range(split, start, count)
        return date_examples(split, start, count, seed=self.seed)


class DatesLongTask(DatesTask):
    """The sources of ``dates`` (example i of a seed and split is the same string) -> the
    long English date "3 March 2021" (day without a leading zero, month name, year); see
    ``qkv.data.dates.long_date``. Held out by calendar date, as ``dates``.

    ``alphabet()`` is the dates alphabet (the targets use none beyond it), so a character
    tokenizer of a model trained on ``dates`` encodes this task with the same ids: the task
    a dates model is adapted to (``qkv demo lora``)."""

    name = "dates-long"
    max_target_len = LONG_DATE_MAX_LEN

    def examples(self, split: str, start: int, count: int) -> list[tuple[str, str]]:
        _check_range(split, start, count)
        return date_long_examples(split, start, count, seed=self.seed)


class StringTask(Task):
    """Random strings of ``chars`` with a length uniform in 1..``max_len``, mapped by
    ``kind``: "copy" (unchanged), "reverse", or "sort" (characters in code-point order)."""

    KINDS = ("copy", "reverse", "sort")

    def __init__(self, kind: str, *, seed: int = 0, max_len: int = 24,
                 chars: str = string.ascii_lowercase + string.digits) -> None:
        super().__init__(seed=seed)
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        if len(set(chars)) < 2:
            raise ValueError(f"chars must hold at least 2 distinct characters, got {chars!r}")
        self.name = kind
        self.chars = "".join(dict.fromkeys(chars))
        self.max_source_len = self.max_target_len = max_len

    def alphabet(self) -> str:
        return "".join(sorted(self.chars))

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        n = rng.randint(1, self.max_source_len)
        source = "".join(rng.choice(self.chars) for _ in range(n))
        if self.name == "reverse":
            return source, source[::-1]
        if self.name == "sort":
            return source, "".join(sorted(source))
        return source, source


class AdditionTask(Task):
    """``"a+b"`` -> decimal ``a + b``. Each operand has a digit count uniform in
    1..``max_digits`` and a value uniform among numbers of that many digits (0..9 for one)."""

    name = "addition"

    def __init__(self, *, seed: int = 0, max_digits: int = 4) -> None:
        super().__init__(seed=seed)
        if not isinstance(max_digits, int) or not 1 <= max_digits <= 18:
            raise ValueError(f"max_digits must be an int in 1..18, got {max_digits!r}")
        self.max_digits = max_digits
        self.max_source_len = 2 * max_digits + 1
        self.max_target_len = max_digits + 1

    def alphabet(self) -> str:
        return "+0123456789"

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = self._operand(rng), self._operand(rng)
        return f"{a}+{b}", str(a + b)


def get_task(name: str, *, seed: int = 0) -> Task:
    """The task called ``name`` (one of ``TASKS``) with default settings and ``seed``."""
    if name == "dates":
        return DatesTask(seed=seed)
    if name == "dates-long":
        return DatesLongTask(seed=seed)
    if name in StringTask.KINDS:
        return StringTask(name, seed=seed)
    if name == "addition":
        return AdditionTask(seed=seed)
    raise ValueError(f"task must be one of {', '.join(TASKS)}; got {name!r}")
