"""CharTokenizer and BPETokenizer: specials, round trips (Chinese and emoji included),
batching, and save/read through one JSON file."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.data import BPETokenizer, CharTokenizer, DataError, get_task, read_tokenizer

TEXTS = [
    "Wednesday, March 3rd 2021",
    "二〇二一年三月三日星期三",
    "the quick brown fox jumps over the lazy dog\n\tindented  twice",
    "emoji 🙂 and é, ß, 日本語",
]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [t for t in TEXTS for _ in range(5)] + [e[0] for e in get_task("dates").examples(
        "train", 0, 200)]
    return BPETokenizer.train(corpus, vocab_size=300)


def test_char_specials_and_ids() -> None:
    tok = CharTokenizer("abc")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 7 == len(tok)
    assert tok.encode("cab") == [6, 4, 5]
    assert tok.encode("cab", add_bos=True, add_eos=True) == [1, 6, 4, 5, 2]
    assert tok.encode("axb") == [4, 3, 5]  # unknown -> unk
    assert tok.encode("<pad>") == [3, 3, 4, 3, 3]  # text spelling a special is text
    assert CharTokenizer("abca").alphabet == "abc"
    assert tok.tokens([1, 4, 3, 2, 0]) == ["<bos>", "a", "<unk>", "<eos>", "<pad>"]


def test_char_round_trip_incl_chinese() -> None:
    tok = CharTokenizer.from_texts(TEXTS)
    assert tok.alphabet == "".join(sorted(set("".join(TEXTS))))
    for text in TEXTS:
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert tok.unk_id not in ids
        assert tok.decode(ids) == text
        assert tok.decode(torch.tensor(ids)) == text
        assert len(tok.tokens(ids)) == len(ids)
    dates = get_task("dates")
    tok = CharTokenizer(dates.alphabet())
    for source, target in dates.examples("train", 0, 300):
        assert tok.decode(tok.encode(source)) == source
        assert tok.decode(tok.encode(target)) == target


def test_decode_drops_specials_and_never_stops() -> None:
    tok = CharTokenizer("ab")
    ids = [1, 4, 2, 5, 0, 0]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special=False) == "<bos>a<eos>b<pad><pad>"
    with pytest.raises(ValueError, match="ids must be in"):
        tok.decode([6])
    with pytest.raises(ValueError, match="ids must be 1-D"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))


def test_tokens_show_whitespace() -> None:
    tok = CharTokenizer(" \nx\t")
    assert tok.tokens(tok.encode(" x\n\t")) == ["␣", "x", "↵", "⇥"]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_encode_batch_pads_right(kind: str, bpe: BPETokenizer) -> None:
    tok = CharTokenizer.from_texts(TEXTS) if kind == "char" else bpe
    texts = [TEXTS[1], "", TEXTS[0]]
    ids, lengths = tok.encode_batch(texts, add_bos=True, add_eos=True)
    assert ids.dtype == lengths.dtype == torch.long
    rows = [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert ids.shape == (3, max(map(len, rows)))
    assert lengths.tolist() == [len(r) for r in rows]
    for b, row in enumerate(rows):
        assert ids[b, : len(row)].tolist() == row
        assert (ids[b, len(row):] == tok.pad_id).all()
    empty_ids, empty_lengths = tok.encode_batch([])
    assert empty_ids.shape == (0, 0) and empty_lengths.shape == (0,)
    ids, lengths = tok.encode_batch([""])
    assert ids.shape == (1, 0) and lengths.tolist() == [0]
    with pytest.raises(TypeError, match="single str"):
        tok.encode_batch("abc")


def test_bpe_round_trip_incl_unseen_characters(bpe: BPETokenizer) -> None:
    assert [bpe.hf.id_to_token(i) for i in range(4)] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert 260 <= bpe.vocab_size <= 300
    unseen = ["龍年 🐉 Ω≈ç√", "  leading and trailing  ", "", "a<eos>b<pad>", "\r\n"]
    for text in TEXTS + unseen:
        ids = bpe.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id
        assert not set(ids[1:-1]) & {0, 1, 2, 3}  # no specials, no unk, from any text
        assert bpe.decode(ids) == text
    ids = bpe.encode("日本語 fox")
    assert bpe.decode([1, *ids, 2, 0], skip_special=False) == "<bos>日本語 fox<eos><pad>"
    assert bpe.decode([*ids[:1], 2, *ids[1:]]) == "日本語 fox"  # does not stop at <eos>


def test_bpe_merges_and_tokens(bpe: BPETokenizer) -> None:
    text = "Wednesday, March 3rd 2021"
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode())  # merges were learnt
    pieces = bpe.tokens(ids)
    assert "".join(pieces) == text.replace(" ", "␣")
    assert bpe.tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
    # a character cut between tokens shows its bytes instead of failing
    assert all(isinstance(p, str) and p for p in bpe.tokens(bpe.encode("🐉")))


def test_bpe_rejects_small_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size must be"):
        BPETokenizer.train(["abc"], vocab_size=100)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_and_read_round_trip(kind: str, bpe: BPETokenizer, tmp_path) -> None:
    tok = CharTokenizer.from_texts(TEXTS) if kind == "char" else bpe
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["kind"] == kind
    back = read_tokenizer(path)
    assert type(back) is type(tok) and back.vocab_size == tok.vocab_size
    for text in [*TEXTS, "龍 <pad>"]:
        assert back.encode(text, add_eos=True) == tok.encode(text, add_eos=True)
        assert back.decode(back.encode(text)) == tok.decode(tok.encode(text))
    tok.save(path)  # overwriting is fine
    assert read_tokenizer(path).vocab_size == tok.vocab_size


@pytest.mark.parametrize(("content", "match"), [
    (None, "cannot read tokenizer"),
    ("not json", "not JSON"),
    ("[1, 2]", "no \"kind\""),
    ('{"kind": "wordpiece", "version": 1}', "unknown tokenizer kind 'wordpiece'"),
    ('{"kind": "char", "version": 99, "alphabet": "ab"}', "unsupported tokenizer version"),
    ('{"kind": "char", "version": 1}', "broken char tokenizer"),
    ('{"kind": "char", "version": 1, "alphabet": ""}', "broken char tokenizer"),
    ('{"kind": "bpe", "version": 1, "tokenizer": "{}"}', "broken bpe tokenizer"),
])
def test_read_tokenizer_bad_files(content: str | None, match: str, tmp_path) -> None:
    path = tmp_path / "tok.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=match) as info:
        read_tokenizer(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_bpe_needs_specials_at_fixed_ids() -> None:
    from tokenizers import Tokenizer, models

    hf = Tokenizer(models.BPE())
    with pytest.raises(ValueError, match="must map <pad> to id 0"):
        BPETokenizer(hf)
