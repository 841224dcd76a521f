"""The "dates-long" task (the target ``qkv demo lora`` adapts a dates model to): the very
sources of "dates", the target "3 March 2021" checked against an oracle written here
(``strftime``-free: a hand table of month names and the ISO target of "dates" parsed back),
determinism, held-out dates never in training, and every character inside the dates
alphabet (so the dates model's character tokenizer encodes it)."""

from __future__ import annotations

import datetime as dt

import pytest

from qkv.data.dates import date_alphabet, date_examples, date_long_examples, long_date
from qkv.data.tasks import DatesLongTask, DatesTask, get_task

SPLITS = ("train", "valid", "test")
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]


def oracle(iso: str) -> str:
    """ISO "2021-03-03" -> "3 March 2021", by hand."""
    year, month, day = (int(x) for x in iso.split("-"))
    return f"{day} {MONTHS[month - 1]} {year:04d}"


def test_known_values() -> None:
    assert long_date(dt.date(2021, 3, 3)) == "3 March 2021"
    assert long_date(dt.date(1950, 1, 1)) == "1 January 1950"
    assert long_date(dt.date(2049, 12, 31)) == "31 December 2049"
    assert long_date(dt.date(2000, 9, 30)) == "30 September 2000"


@pytest.mark.parametrize("split", SPLITS)
def test_same_sources_as_dates_long_targets(split: str) -> None:
    """Example i of dates-long is example i of dates (same source, same seed and split) with
    the ISO target rewritten; day has no leading zero, the month is its English name."""
    for seed in (0, 3):
        iso = date_examples(split, 5, 400, seed=seed)
        long = get_task("dates-long", seed=seed).examples(split, 5, 400)
        assert [s for s, _ in long] == [s for s, _ in iso]
        assert [t for _, t in long] == [oracle(t) for _, t in iso]
        assert long == date_long_examples(split, 5, 400, seed=seed)
    days = {t.split(" ")[0] for _, t in get_task("dates-long").examples("train", 0, 2000)}
    assert days == {str(d) for d in range(1, 32)}  # 1..31, never "03"


def test_deterministic_and_counter_based() -> None:
    task = get_task("dates-long", seed=7)
    run = task.examples("test", 0, 60)
    assert run == DatesLongTask(seed=7).examples("test", 0, 60)
    assert task.examples("test", 20, 40) == run[20:]
    assert task.examples("test", 9, 1) == [run[9]]
    assert get_task("dates-long", seed=8).examples("train", 0, 40) != \
        task.examples("train", 0, 40)


def test_held_out_dates_never_in_train() -> None:
    """Disjoint by calendar date (the target names the date): no test or valid date appears
    in 20,000 training examples."""
    task = get_task("dates-long")
    train = {t for _, t in task.examples("train", 0, 20_000)}
    valid = {t for _, t in task.examples("valid", 0, 500)}
    test = {t for _, t in task.examples("test", 0, 1000)}
    assert not train & valid and not train & test and not valid & test
    assert len(test) > 500 and len(valid) > 300


def test_alphabet_is_the_dates_alphabet_and_bounds() -> None:
    task, dates = get_task("dates-long"), DatesTask()
    assert task.alphabet() == dates.alphabet() == date_alphabet()
    assert task.max_source_len == dates.max_source_len
    chars, longest = set(), 0
    for split in SPLITS:
        for source, target in task.examples(split, 0, 3000 if split == "train" else 300):
            chars |= set(target)
            longest = max(longest, len(target))
            assert len(source) <= task.max_source_len
    assert chars <= set(dates.alphabet())
    # every possible target, whatever the date: within the alphabet and the bound
    every = [oracle(f"2000-{m:02d}-{d:02d}") for m in range(1, 13) for d in range(1, 32)]
    assert set("".join(every)) <= set(dates.alphabet())
    assert max(len(t) for t in every) == task.max_target_len == 17
    assert longest <= task.max_target_len


def test_validation() -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("dates-long").examples("dev", 0, 1)
    with pytest.raises(ValueError, match="count must be"):
        get_task("dates-long").examples("train", 0, -1)
    with pytest.raises(ValueError, match="start must be"):
        date_long_examples("train", -1, 1)
