"""The task registry: determinism, counter-based access, disjoint splits, correct targets
(checked by independent Python: slicing, sorted(), int addition), bounds and alphabets."""

from __future__ import annotations

import pytest

from qkv.data import TASKS, AdditionTask, StringTask, date_examples, get_task

SPLITS = ("train", "valid", "test")


def test_registry_names_and_errors() -> None:
    assert TASKS == ("dates", "copy", "reverse", "sort", "addition", "dates-long")
    for name in TASKS:
        task = get_task(name, seed=2)
        assert task.name == name and task.seed == 2
    with pytest.raises(ValueError,
                       match="dates, copy, reverse, sort, addition, dates-long; got 'nope'"):
        get_task("nope")
    with pytest.raises(TypeError, match="seed must be an int"):
        get_task("copy", seed=1.5)


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_and_counter_based(name: str) -> None:
    task = get_task(name, seed=5)
    for split in SPLITS:
        run = task.examples(split, 0, 40)
        assert run == get_task(name, seed=5).examples(split, 0, 40)
        assert task.examples(split, 13, 1) == [run[13]]
        assert task.examples(split, 25, 15) == run[25:]
        assert task.examples(split, 3, 0) == []
    assert get_task(name, seed=6).examples("train", 0, 40) != task.examples("train", 0, 40)


@pytest.mark.parametrize("name", TASKS)
def test_bounds_and_alphabet(name: str) -> None:
    task = get_task(name)
    alphabet = set(task.alphabet())
    lengths = set()
    for split in SPLITS:
        for source, target in task.examples(split, 0, 1000 if split == "train" else 100):
            assert source and target
            assert set(source) | set(target) <= alphabet
            assert len(source) <= task.max_source_len
            assert len(target) <= task.max_target_len
            lengths.add(len(source))
    if name in ("copy", "reverse", "sort"):
        assert lengths == set(range(1, 25))  # every length 1..24 occurs, none beyond


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "addition"])
def test_held_out_sources_never_in_train(name: str) -> None:
    task = get_task(name)
    train = {s for s, _ in task.examples("train", 0, 20_000)}
    valid = {s for s, _ in task.examples("valid", 0, 500)}
    test = {s for s, _ in task.examples("test", 0, 500)}
    assert not train & valid and not train & test and not valid & test
    assert len(valid) > 100 and len(test) > 100


def test_dates_task_is_the_date_module() -> None:
    task = get_task("dates", seed=4)
    assert task.examples("valid", 10, 5) == date_examples("valid", 10, 5, seed=4)
    assert task.max_target_len == 10 and task.max_source_len < 40


def test_targets_are_correct() -> None:
    for source, target in get_task("copy").examples("train", 0, 300):
        assert target == source
    for source, target in get_task("reverse").examples("train", 0, 300):
        assert target == "".join(reversed(source))
    for source, target in get_task("sort").examples("train", 0, 300):
        assert list(target) == sorted(source)
    digits = set()
    for source, target in get_task("addition").examples("train", 0, 2000):
        a, b = source.split("+")
        assert int(target) == int(a) + int(b)
        assert str(int(a)) == a and str(int(b)) == b  # no leading zeros
        digits.update((len(a), len(b)))
    assert digits == {1, 2, 3, 4}


def test_options_and_validation() -> None:
    task = StringTask("reverse", max_len=3, chars="xy")
    assert task.alphabet() == "xy" and task.max_source_len == 3
    assert all(len(s) <= 3 and set(s) <= {"x", "y"} for s, _ in task.examples("train", 0, 100))
    add = AdditionTask(max_digits=2)
    assert (add.max_source_len, add.max_target_len) == (5, 3)
    tiny = StringTask("copy", max_len=1, chars="ab")  # 2 sources: some split holds none
    empty = [split for split in SPLITS
             if not any(tiny.source_split(c) == split for c in "ab")]
    with pytest.raises(ValueError, match=f"split '{empty[0]}' of .* got no source"):
        tiny.examples(empty[0], 0, 1)
    with pytest.raises(ValueError, match="kind must be one of"):
        StringTask("shuffle")
    with pytest.raises(ValueError, match="max_len must be"):
        StringTask("copy", max_len=0)
    with pytest.raises(ValueError, match="max_digits must be"):
        AdditionTask(max_digits=0)
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("copy").examples("dev", 0, 1)
    with pytest.raises(ValueError, match="count must be"):
        get_task("copy").examples("train", 0, -1)
