"""The date task: determinism, held-out dates, and every source parsed back by an oracle
written here independently (``datetime.strptime`` for English/numeric formats, hand tables
for Chinese numerals, ordinal words and weekdays)."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from qkv.data.dates import (
    DATE_FORMATS,
    DATE_MAX,
    DATE_MIN,
    chinese_number,
    date_alphabet,
    date_examples,
    date_max_source_len,
    date_sample,
    date_split,
    render_date,
)

# ------------------------------------------------------------------ hand-written oracles

CN_NUMBERS = {
    1: "一", 2: "二", 3: "三", 4: "四", 5: "五", 6: "六", 7: "七", 8: "八", 9: "九", 10: "十",
    11: "十一", 12: "十二", 13: "十三", 14: "十四", 15: "十五", 16: "十六", 17: "十七",
    18: "十八", 19: "十九", 20: "二十", 21: "二十一", 22: "二十二", 23: "二十三", 24: "二十四",
    25: "二十五", 26: "二十六", 27: "二十七", 28: "二十八", 29: "二十九", 30: "三十",
    31: "三十一",
}
CN_YEAR_DIGITS = dict(zip("〇一二三四五六七八九", "0123456789", strict=True))
CN_WEEKDAYS = {"一": 0, "二": 1, "三": 2, "四": 3, "五": 4, "六": 5, "日": 6}
ORDINALS = [
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
    "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
    "seventeenth", "eighteenth", "nineteenth", "twentieth", "twenty-first", "twenty-second",
    "twenty-third", "twenty-fourth", "twenty-fifth", "twenty-sixth", "twenty-seventh",
    "twenty-eighth", "twenty-ninth", "thirtieth", "thirty-first",
]
SUFFIX = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}  # others: "th"
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december"]


def _two_digit_year(yy: str) -> int:
    return 1900 + int(yy) if int(yy) >= 50 else 2000 + int(yy)


def _strip_suffix(text: str) -> str:
    """'3rd' -> '3', checking the suffix against the hand table."""
    def repl(m: re.Match) -> str:
        day = int(m.group(1))
        assert m.group(2).lower() == SUFFIX.get(day, "th"), text
        return m.group(1)
    return re.sub(r"\b(\d{1,2})(st|nd|rd|th)\b", repl, text, flags=re.IGNORECASE)


def _check_weekday(word: str, date: dt.date) -> None:
    full = date.strftime("%A").lower()  # C locale: English
    assert word.lower() in (full, full[:3]), (word, date)


def _cn_int(text: str) -> int:
    if text.isascii():
        return int(text)
    return {v: k for k, v in CN_NUMBERS.items()}[text]


def parse(source: str, fmt: str) -> dt.date:
    """Independent parser: the date a source of format ``fmt`` denotes."""
    strp = {
        "Www, D Month YYYY": "%a, %d %B %Y", "D Month YYYY": "%d %B %Y",
        "Month D, YYYY": "%B %d, %Y", "mon D YYYY": "%b %d %Y", "Mon Dth, YYYY": "%b %d, %Y",
        "Dth of Month, YYYY": "%d of %B, %Y", "Weekday, Month Dth YYYY": "%A, %B %d %Y",
        "Weekday D Month YYYY": "%A %d %B %Y", "YYYY, Month D": "%Y, %B %d",
        "M/D/YYYY": "%m/%d/%Y", "DD-MM-YYYY": "%d-%m-%Y", "YYYY.MM.DD": "%Y.%m.%d",
        "YYYY/M/D": "%Y/%m/%d", "YYYYMMDD": "%Y%m%d",
    }
    if fmt in strp:
        date = dt.datetime.strptime(_strip_suffix(source), strp[fmt]).date()
        if fmt.startswith("W"):
            _check_weekday(re.split(r"[ ,]", source)[0], date)
        return date
    if fmt == "D Mon 'YY":
        d, mon, yy = re.fullmatch(r"(\d+) (\w{3}) '(\d\d)", source).groups()
        return dt.date(_two_digit_year(yy), [m[:3] for m in MONTHS].index(mon.lower()) + 1,
                       int(d))
    if fmt == "MM/DD/YY":
        mm, dd, yy = re.fullmatch(r"(\d\d)/(\d\d)/(\d\d)", source).groups()
        return dt.date(_two_digit_year(yy), int(mm), int(dd))
    if fmt == "the ordinal of month YYYY":
        word, month, y = re.fullmatch(r"the (\S+) of (\w+) (\d{4})", source.lower()).groups()
        return dt.date(int(y), MONTHS.index(month) + 1, ORDINALS.index(word) + 1)
    if fmt == "month the ordinal, YYYY":
        month, word, y = re.fullmatch(r"(\w+) the (\S+), (\d{4})", source.lower()).groups()
        return dt.date(int(y), MONTHS.index(month) + 1, ORDINALS.index(word) + 1)
    m = re.fullmatch(r"(.{4})年(.+?)月(.+?)日(?:星期(.)| 周(.))?", source)
    assert m, (source, fmt)
    y, mo, d, wd1, wd2 = m.groups()
    year = int("".join(CN_YEAR_DIGITS.get(c, c) for c in y))
    date = dt.date(year, _cn_int(mo), _cn_int(d))
    wd = wd1 or wd2
    assert ("星期" in fmt or "周" in fmt) == (wd is not None), (source, fmt)
    if wd is not None:
        assert CN_WEEKDAYS[wd] == date.weekday(), (source, date)
    assert ("中文" in fmt) == (not y.isascii()), (source, fmt)
    return date


# ------------------------------------------------------------------------------- tests


def test_golden_strings_for_one_date() -> None:
    d = dt.date(2021, 3, 3)  # a Wednesday
    expected = {
        "Www, D Month YYYY": "Wed, 3 March 2021", "March 3, 2021": None,
        "mon D YYYY": "mar 3 2021", "MM/DD/YY": "03/03/21", "YYYY.MM.DD": "2021.03.03",
        "Dth of Month, YYYY": "3rd of March, 2021",
        "the ordinal of month YYYY": "the third of march 2021",
        "Weekday, Month Dth YYYY": "Wednesday, March 3rd 2021",
        "YYYY年M月D日": "2021年3月3日", "中文 年月日": "二〇二一年三月三日",
        "YYYY年M月D日星期W": "2021年3月3日星期三", "DD-MM-YYYY": "03-03-2021",
    }
    for fmt, text in expected.items():
        if text is not None:
            assert render_date(d, fmt) == text
    assert render_date(d, "Month D, YYYY") == "March 3, 2021"
    assert render_date(d, "Www, D Month YYYY", case="upper") == "WED, 3 MARCH 2021"
    assert render_date(d, "YYYY年M月D日", case="upper") == "2021年3月3日"
    assert render_date(dt.date(1999, 12, 21), "中文 年月日") == "一九九九年十二月二十一日"
    assert render_date(dt.date(2010, 10, 31), "中文 年月日星期W") == "二〇一〇年十月三十一日星期日"
    assert render_date(dt.date(1950, 1, 2), "MM/DD/YY") == "01/02/50"  # US order
    assert render_date(dt.date(1950, 1, 2), "DD-MM-YYYY") == "02-01-1950"  # day first


def test_chinese_numbers_hand_table() -> None:
    for n, text in CN_NUMBERS.items():
        assert chinese_number(n) == text
    with pytest.raises(ValueError, match="n must be"):
        chinese_number(0)


def test_ordinal_words_and_suffixes_for_every_day() -> None:
    for day in range(1, 32):
        d = dt.date(2020, 1, day)
        assert render_date(d, "the ordinal of month YYYY") == (
            f"the {ORDINALS[day - 1]} of january 2020")
        assert render_date(d, "Dth of Month, YYYY") == (
            f"{day}{SUFFIX.get(day, 'th')} of January, 2020")


def test_every_format_parses_back_to_the_target() -> None:
    seen_formats, seen_cases = set(), set()
    for split, n in (("train", 3000), ("valid", 300), ("test", 300)):
        for i in range(n):
            s = date_sample(seed=3, split=split, index=i)
            assert s.target == s.date.isoformat()
            assert parse(s.source, s.format).isoformat() == s.target, s
            assert DATE_MIN <= s.date <= DATE_MAX
            if s.case == "lower":
                assert s.source == s.source.lower()
            elif s.case == "upper":
                assert s.source == s.source.upper()
            seen_formats.add(s.format)
            seen_cases.add(s.case)
    assert seen_formats == set(DATE_FORMATS)
    assert len(DATE_FORMATS) >= 20
    assert seen_cases == {"natural", "lower", "upper"}


def test_every_format_of_extreme_dates() -> None:
    for d in (DATE_MIN, DATE_MAX, dt.date(2000, 2, 29), dt.date(1968, 9, 27)):
        for fmt in DATE_FORMATS:
            for case in ("natural", "lower", "upper"):
                assert parse(render_date(d, fmt, case=case), fmt) == d, (d, fmt, case)


def test_deterministic_and_counter_based() -> None:
    run = date_examples("train", 0, 60, seed=7)
    assert run == date_examples("train", 0, 60, seed=7)
    for i in (0, 17, 59):
        assert date_examples("train", i, 1, seed=7) == [run[i]]
        s = date_sample(seed=7, split="train", index=i)
        assert (s.source, s.target) == run[i]
    assert date_examples("train", 20, 40, seed=7) == run[20:]
    assert date_examples("train", 0, 60, seed=8) != run
    assert date_examples("valid", 5, 3) == date_examples("valid", 0, 8)[5:]


def test_held_out_dates_never_in_train() -> None:
    train = {date_sample(seed=0, split="train", index=i).date for i in range(20_000)}
    valid = {date_sample(seed=s, split="valid", index=i).date for s in (0, 1)
             for i in range(500)}
    test = {date_sample(seed=s, split="test", index=i).date for s in (0, 1) for i in range(500)}
    assert not train & valid and not train & test and not valid & test
    assert all(date_split(d) == "train" for d in train)
    assert all(date_split(d) == "valid" for d in valid)
    assert all(date_split(d) == "test" for d in test)
    days = [DATE_MIN + dt.timedelta(days=k) for k in range((DATE_MAX - DATE_MIN).days + 1)]
    held = sum(date_split(d) != "train" for d in days) / len(days)
    assert 0.04 < held < 0.06  # ~5% of dates held out


def test_bounds_alphabet_and_lengths() -> None:
    alphabet = set(date_alphabet())
    longest = date_max_source_len()
    assert longest < 40
    for i in range(2000):
        source, target = date_examples("train", i, 1, seed=1)[0]
        assert set(source + target) <= alphabet
        assert len(source) <= longest and len(target) == 10
    # the bound is attained: a long weekday, month and ordinal in one source
    long_date = dt.date(2020, 9, 23)  # "the twenty-third of september 2020"
    assert max(len(render_date(long_date, f)) for f in DATE_FORMATS) <= longest


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        date_examples("dev", 0, 1)
    with pytest.raises(ValueError, match="start must be"):
        date_examples("train", -1, 1)
    with pytest.raises(ValueError, match="index must be"):
        date_sample(seed=0, split="train", index=-3)
    with pytest.raises(ValueError, match="fmt must be"):
        render_date(dt.date(2020, 1, 1), "nope")
    with pytest.raises(ValueError, match="case must be"):
        render_date(dt.date(2020, 1, 1), "YYYYMMDD", case="title")
