"""WordTokenizer: ids per word, greedy longest-match segmentation of unspaced text, decode
spacing, save / read_tokenizer round trip, errors."""

from __future__ import annotations

import pytest
import torch

from qkv.data import DataError, WordTokenizer, read_tokenizer

WORDS = ["the", "cat", "sat", "猫", "坐在", "在", "垫子", "上", "，", "a", "ab"]


def test_ids_follow_the_specials_in_list_order():
    tok = WordTokenizer([*WORDS, "cat"])  # a repeat is kept once
    assert tok.vocab_size == 4 + len(WORDS)
    assert tok.encode("the cat sat") == [4, 5, 6]
    assert tok.encode("cat", add_bos=True, add_eos=True) == [1, 5, 2]
    assert tok.tokens([1, 4, 0]) == ["<bos>", "the", "<pad>"]


def test_unspaced_text_is_cut_by_longest_match():
    tok = WordTokenizer(WORDS)
    # "坐在" wins over "在" at the second character; "上，" splits in two words.
    assert tok.tokens(tok.encode("猫坐在垫子上，")) == ["猫", "坐在", "垫子", "上", "，"]
    assert tok.tokens(tok.encode("猫在垫子上")) == ["猫", "在", "垫子", "上"]
    assert tok.tokens(tok.encode("aab")) == ["a", "ab"]


def test_unknown_characters_become_unk_one_each():
    tok = WordTokenizer(WORDS)
    assert tok.encode("dog") == [tok.unk_id] * 3
    assert tok.encode("猫x") == [tok.encode("猫")[0], tok.unk_id]
    assert tok.encode("<eos>") == [tok.unk_id] * 5  # text spelling a special is not one


def test_decode_spaces_words_except_between_non_ascii():
    tok = WordTokenizer(WORDS)
    for text in ("the cat sat", "猫坐在垫子上，", "the 猫 sat"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(tok.decode(ids)) == ids
    ids = tok.encode("the cat", add_bos=True, add_eos=True)
    assert tok.decode(ids) == "the cat"
    assert tok.decode(ids, skip_special=False) == "<bos> the cat <eos>"
    assert tok.decode(torch.tensor(ids)) == "the cat"


def test_encode_batch_pads_right():
    tok = WordTokenizer(WORDS)
    ids, lengths = tok.encode_batch(["the cat", "猫坐在垫子上"])
    assert lengths.tolist() == [2, 4]
    assert ids.tolist() == [[4, 5, 0, 0], [7, 8, 10, 11]]


def test_save_and_read_tokenizer_round_trip(tmp_path):
    tok = WordTokenizer(WORDS)
    tok.save(tmp_path / "tok.json")
    back = read_tokenizer(tmp_path / "tok.json")
    assert isinstance(back, WordTokenizer)
    assert back.words == tok.words
    assert back.encode("the cat 猫坐在垫子上") == tok.encode("the cat 猫坐在垫子上")


def test_read_tokenizer_names_a_broken_word_file(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text('{"kind": "word", "version": 1, "words": ["a b"]}', encoding="utf-8")
    with pytest.raises(DataError, match="broken word tokenizer"):
        read_tokenizer(path)


@pytest.mark.parametrize(("words", "error", "match"), [
    ("abc", TypeError, "single str"),
    ([], ValueError, "at least one word"),
    (["a", ""], ValueError, "without whitespace"),
    (["a b"], ValueError, "without whitespace"),
    (["<eos>"], ValueError, "special"),
    ([3], ValueError, "non-empty strings"),
])
def test_bad_word_lists_are_refused(words, error, match):
    with pytest.raises(error, match=match):
        WordTokenizer(words)


def test_out_of_range_ids_are_refused():
    tok = WordTokenizer(WORDS)
    with pytest.raises(ValueError, match="ids must be in"):
        tok.decode([tok.vocab_size])
