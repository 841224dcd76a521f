"""read_pairs / read_text: UTF-8 TSV and text files; every error names file and line."""

from __future__ import annotations

import pytest

from qkv.data import DataError, read_pairs, read_text


def test_read_pairs(tmp_path) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_bytes("\ufeff3 March 2021\t2021-03-03\r\n\n  \n二〇二一年三月三日\t2021-03-03\n"
                     " padded \t x y \n".encode())
    assert read_pairs(path) == [("3 March 2021", "2021-03-03"),
                                ("二〇二一年三月三日", "2021-03-03"), (" padded ", " x y ")]
    assert read_pairs(str(path)) == read_pairs(path)


@pytest.mark.parametrize(("content", "match"), [
    (b"a\tb\nno tab here\n", r"pairs.tsv:2: expected source<TAB>target, found no tab"),
    (b"a\tb\tc\n", r"pairs.tsv:1: expected source<TAB>target, found 2 tabs"),
    (b"a\tb\n\n\tb\n", r"pairs.tsv:3: empty source"),
    (b"a\t  \n", r"pairs.tsv:1: empty target"),
    (b"a\tb\nc\td\xff\n", r"pairs.tsv:2: not UTF-8 \(byte 0xff at offset 7\)"),
    (b"\n \n", r"pairs.tsv: no source<TAB>target pairs"),
])
def test_read_pairs_errors(content: bytes, match: str, tmp_path) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        read_pairs(path)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_missing_file(tmp_path) -> None:
    for reader in (read_pairs, read_text):
        with pytest.raises(DataError, match=r"cannot read .*missing\.tsv: No such file") as info:
            reader(tmp_path / "missing.tsv")
        assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="cannot read"):
        read_text(tmp_path)  # a directory


def test_read_text(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    text = "第一行\nsecond line\r\n\n"
    path.write_bytes(text.encode())
    assert read_text(path) == text
    path.write_text(" \n\n")
    with pytest.raises(DataError, match=r"corpus\.txt: the file holds no text"):
        read_text(path)
    path.write_bytes(b"ok\nok\n\xe4\xb8\n")  # a character cut in half on line 3
    with pytest.raises(DataError, match=r"corpus.txt:3: not UTF-8"):
        read_text(path)
