"""load_seq2seq_tokenizer against transformers' own tokenizers (test-only oracles), on
directories built here from SentencePiece / BPE models trained in the test on a small
English / German / Chinese text: Marian (source.spm + target.spm + vocab.json, also with
separate vocabularies), T5 (spiece.model + sentinels, also byte fallback and user-defined
pieces), tokenizer.json (T5's as transformers 5 writes it; a BART byte-level BPE). Ids,
framing and decoded text are compared exactly (no tolerance: they are ids and strings).
Then saving, and the one-line errors of bad directories."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from qkv.data.seq2seq_tokenizer import (
    Seq2SeqTokenizer,
    check_embedding_rows,
    load_seq2seq_tokenizer,
)
from qkv.files import CheckpointError

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

EN = ("The quick brown fox jumps over the lazy dog. I have 3 apples and 12 oranges! Where is "
      "the train station? It is near 42nd street. Machine translation turns English into "
      "German. Please call me at 555-0199, thanks. We are learning to read, write and speak "
      "new languages every day. My friend bought seven books, two maps and one umbrella "
      "yesterday. Numbers like 2024, 3.14 and 100% appear in the news.")
DE = ("Der schnelle braune Fuchs springt über den faulen Hund. Ich habe 3 Äpfel und 12 "
      "Orangen! Wo ist der Bahnhof? Er ist in der Nähe der Straße 42. Maschinelle Übersetzung "
      "macht aus Englisch Deutsch. Bitte rufen Sie mich unter 555-0199 an, danke. Wir lernen "
      "jeden Tag neue Sprachen zu lesen, schreiben und sprechen. Mein Freund kaufte gestern "
      "sieben Bücher, zwei Karten und einen Regenschirm. Zahlen wie 2024, 3,14 und 100 % "
      "stehen in der Zeitung.")
ZH = ("我喜欢学习中文。今天天气很好，我们去公园吧！机器翻译把英文变成德文。"
      "我有三个苹果和十二个橙子。火车站在哪里？我们每天学习阅读、写作和说新的语言。"
      "我的朋友昨天买了七本书、两张地图和一把雨伞。新闻里有二零二四年和百分之百这样的数字。")

#: Test texts: unknown characters (龍, ★€, ':' ';' are in no training text), special tokens and
#: sentinels spelled in a text, a Marian language code, whitespace runs, the empty text.
TEXTS = [
    "The quick brown fox jumps over 3 lazy dogs!",
    "Der schnelle braune Fuchs springt über 12 Äpfel.",
    "我喜欢机器翻译，也喜欢龍。",
    "Mixed: Hello 世界, 42 Straßen; ★€ ok? 100%",
    "  spaces   and\ttabs\nnewline ",
    "",
    ">>de<< Guten Tag",
    "special </s> in <pad> text<unk>here",
    "sentinel <extra_id_0> and <extra_id_10>x <extra_id_1>",
    "a<sep>b <cls> c<s>d",
]


def _corpus() -> str:
    words = (EN + " " + DE).split()
    lines = [EN, DE, ZH]
    for k in range(1, 40):
        lines.append(" ".join(words[(k * 7 + i * k) % len(words)] for i in range(12)))
        lines.append(ZH[(k * 3) % len(ZH):] + ZH[:(k * 3) % len(ZH)])
    return "\n".join(lines * 3)


def _train(corpus: Path, prefix: Path, vocab: int, **options) -> Path:
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix),
                                   vocab_size=vocab, minloglevel=2, num_threads=1, **options)
    return prefix.with_suffix(".model")


def _write_json(path: Path, content) -> None:
    path.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")


def _marian_vocab(*models: Path, drop: int = 0) -> dict[str, int]:
    """Marian's vocab.json: </s> 0, <unk> 1, the models' normal pieces, <pad> last; ``drop``
    pieces left out (as a vocab.json built from training data may lack some)."""
    vocab = {"</s>": 0, "<unk>": 1}
    for path in models:
        proc = spm.SentencePieceProcessor(model_file=str(path))
        for i in range(proc.get_piece_size()):
            if not (proc.is_control(i) or proc.is_unknown(i)):
                vocab.setdefault(proc.id_to_piece(i), len(vocab))
    pieces = list(vocab)[2:]
    dropped = set(pieces[len(pieces) // 3: len(pieces) // 3 + drop])
    kept = [p for p in pieces if p not in dropped]
    return {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(kept)},
            "<pad>": len(kept) + 2}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Model directories built from models trained here, by name."""
    root = tmp_path_factory.mktemp("seq2seq_tok")
    corpus = root / "corpus.txt"
    corpus.write_text(_corpus(), encoding="utf-8")
    t5_ids = {"pad_id": 0, "eos_id": 1, "unk_id": 2, "bos_id": -1}
    t5 = _train(corpus, root / "t5", 300, character_coverage=0.999, **t5_ids)
    t5_bytes = _train(corpus, root / "t5b", 400, character_coverage=0.99, byte_fallback=True,
                      **t5_ids)
    t5_user = _train(corpus, root / "t5u", 300, character_coverage=0.999,
                     user_defined_symbols=["<sep>"], control_symbols=["<cls>"],
                     **{**t5_ids, "bos_id": 3})
    source = _train(corpus, root / "src", 280, character_coverage=1.0)
    target = _train(corpus, root / "tgt", 220, character_coverage=0.999, model_type="bpe")
    out = {}

    def make(name: str, files: dict[str, Path], config: dict | None = None) -> Path:
        d = root / name
        d.mkdir()
        for dest, src in files.items():
            shutil.copyfile(src, d / dest)
        if config is not None:
            _write_json(d / "tokenizer_config.json", config)
        out[name] = d
        return d

    make("t5", {"spiece.model": t5})
    make("t5_bytes", {"spiece.model": t5_bytes})
    make("t5_user", {"spiece.model": t5_user}, {"extra_ids": 10})
    make("t5_listed", {"spiece.model": t5},
         {"extra_ids": 5, "additional_special_tokens": [f"<extra_id_{k}>" for k in range(5)]})
    marian_config = {"source_lang": "en", "target_lang": "de", "separate_vocabs": False,
                     "tokenizer_class": "MarianTokenizer"}
    d = make("marian", {"source.spm": source, "target.spm": target}, marian_config)
    _write_json(d / "vocab.json", _marian_vocab(source, target, drop=3))
    _write_json(d / "special_tokens_map.json",
                {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    d = make("marian_separate", {"source.spm": source, "target.spm": target},
             {**marian_config, "separate_vocabs": True})
    _write_json(d / "vocab.json", _marian_vocab(source))
    _write_json(d / "target_vocab.json", _marian_vocab(target))
    out["bart"] = _bart_directory(root / "bart", corpus)
    # <unk> and <mask> only in the vocabulary: transformers adds the named ones as specials
    out["bart_bare"] = root / "bart_bare"
    shutil.copytree(out["bart"], out["bart_bare"])
    content = json.loads((out["bart"] / "tokenizer.json").read_text(encoding="utf-8"))
    content["added_tokens"] = [t for t in content["added_tokens"]
                               if t["content"] not in ("<unk>", "<mask>")]
    _write_json(out["bart_bare"] / "tokenizer.json", content)
    # tokenizer.json as transformers 5 writes T5's (from the spiece.model above)
    if _has_protobuf():
        out["t5_json"] = root / "t5_json"
        _hf("t5", out["t5"]).save_pretrained(out["t5_json"])
    return out


def _bart_directory(d: Path, corpus: Path) -> Path:
    """A BART-style byte-level BPE tokenizer.json (<s> 0, <pad> 1, </s> 2, <unk> 3, <mask>
    lstrip'd as BART's) built with the tokenizers library, and BART's tokenizer_config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.read_text(encoding="utf-8").split("\n"), trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    content = json.loads(tok.to_str())
    for added in content["added_tokens"]:
        added["lstrip"] = added["content"] == "<mask>"
    d.mkdir()
    _write_json(d / "tokenizer.json", content)
    _write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "BartTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "mask_token": "<mask>", "add_prefix_space": False, "errors": "replace"})
    return d


_HF_CLASSES = {"t5": "T5Tokenizer", "t5_bytes": "T5Tokenizer", "t5_user": "T5Tokenizer",
               "t5_listed": "T5Tokenizer", "t5_json": "T5Tokenizer", "bart": "BartTokenizer",
               "bart_bare": "BartTokenizer",
               "marian": "MarianTokenizer", "marian_separate": "MarianTokenizer"}


def _has_protobuf() -> bool:
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return False
    return True


def _hf(name: str, directory: Path):
    """transformers' tokenizer of ``directory`` (the class the checkpoint ``name`` names)."""
    if name.startswith("t5") and not _has_protobuf():
        pytest.skip("transformers 5 reads a T5 spiece.model through protobuf (test-only)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MarianTokenizer: "Recommended: pip install sacremoses"
        return getattr(transformers, _HF_CLASSES[name]).from_pretrained(str(directory))


def _pair(dirs: dict[str, Path], name: str) -> tuple[Seq2SeqTokenizer, object]:
    if name not in dirs:
        pytest.skip(f"no {name} directory (it needs protobuf to build)")
    return load_seq2seq_tokenizer(dirs[name]), _hf(name, dirs[name])


def _assert_same(ours: Seq2SeqTokenizer, hf, texts=TEXTS) -> list[list[int]]:
    """encode / encode_target / decode (both ways) equal to transformers' on ``texts``, and
    decode on their encodings and on 40 random id sequences (decoding is of the target side:
    with separate vocabularies, source ids are not decoded); returns the source encodings."""
    encodings, targets = [], []
    for text in texts:
        ids = hf(text)["input_ids"]
        target = hf(text_target=text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.encode_target(text) == target, text
        encodings.append(ids)
        targets.append(target)
    rng = random.Random(0)
    sequences = [*targets, *(encodings if ours.target_vocab_size == ours.vocab_size else ()),
                 *([rng.randrange(ours.target_vocab_size) for _ in range(12)]
                   for _ in range(40))]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), (ids, skip)
    return encodings


def _assert_specials(ours: Seq2SeqTokenizer, hf) -> None:
    assert (ours.eos_id, ours.pad_id, ours.unk_id, ours.bos_id) == (
        hf.eos_token_id, hf.pad_token_id, hf.unk_token_id, hf.bos_token_id)
    assert ours.vocab_size == len(hf) == len(ours)


# --------------------------------------------------------------------------- against HF

def test_marian_matches_transformers(dirs) -> None:
    ours, hf = _pair(dirs, "marian")
    assert ours.kind == "marian" and ours.bos_id is None
    _assert_specials(ours, hf)
    encodings = _assert_same(ours, hf)
    # the cases are exercised: source and target models differ, unknown pieces and
    # characters give unk, the language code and the spelled </s> are single tokens
    assert any(ours.encode(t) != ours.encode_target(t) for t in TEXTS)
    assert any(ours.unk_id in e[:-1] for e in encodings)
    assert ours.encode(">>de<< Guten Tag")[0] == ours.unk_id  # no >>de<< in vocab.json
    assert ours.eos_id in ours.encode("special </s> in")[:-1]
    assert ours.decode(torch.tensor(encodings[2])) == ours.decode(encodings[2])


def test_marian_separate_vocabs_matches_transformers(dirs) -> None:
    ours, hf = _pair(dirs, "marian_separate")
    assert ours.target_vocab_size != ours.vocab_size
    _assert_specials(ours, hf)
    _assert_same(ours, hf)


def test_t5_spiece_matches_transformers(dirs) -> None:
    ours, hf = _pair(dirs, "t5")
    assert ours.kind == "t5" and ours.vocab_size == 300 + 100
    _assert_specials(ours, hf)
    encodings = _assert_same(ours, hf)
    sentinel = ours.encode("sentinel <extra_id_0> and <extra_id_10>x <extra_id_1>")
    assert {399, 389, 398} <= set(sentinel)  # <extra_id_k> = 300 + 100 - 1 - k
    assert any(ours.unk_id in e for e in encodings)
    assert ours.decode([5, 399, ours.vocab_size + 27]) == hf.decode([5, 399, 427],
                                                                     skip_special_tokens=True)


@pytest.mark.parametrize("name", ["t5_bytes", "t5_user", "t5_listed"])
def test_t5_variants_match_transformers(dirs, name: str) -> None:
    """Byte fallback (transformers' T5 has none: a run of unknown characters is one unk),
    user-defined and control pieces with extra_ids 10, sentinels listed in the config."""
    ours, hf = _pair(dirs, name)
    _assert_specials(ours, hf)
    encodings = _assert_same(ours, hf)
    if name == "t5_bytes":
        assert any(ours.unk_id in e for e in encodings)
    if name == "t5_user":  # <sep> (user-defined) is kept, <cls> and <s> (control) dropped
        ids = ours.encode("a<sep>b <cls> c<s>d")
        assert ours.decode(ids) == "a<sep>b c d" and ours.vocab_size == 310


#: Texts with the t5_user model's user-defined piece <sep> at a word's start, middle and end,
#: alone, twice, and beside whitespace runs (no added token of the model in them).
USER_PIECE_TEXTS = ["a<sep>b", "x <sep>y", "x<sep> y", "<sep>", "<sep><sep>", " <sep>  der ",
                    "The fox<sep>jumps over<sep> the dog", "我喜欢<sep>中文"]


def test_t5_user_defined_pieces_are_sentencepieces_own(dirs) -> None:
    """A user-defined piece is matched by SentencePiece inside the text, with no "▁" after it
    (``a<sep>b`` is ``▁a <sep> b``): the oracle is sentencepiece itself on spiece.model, the
    model's own definition. transformers >= 5.25 (the pinned version, whose Unigram model
    converted from spiece.model keeps <sep> as a piece) gives the same ids; transformers 5.24
    and before split <sep> out as an added token and began the rest with "▁" (``a<sep>b``:
    ``▁a <sep> ▁ b``), unlike sentencepiece: qkv follows sentencepiece."""
    ours, hf = _pair(dirs, "t5_user")
    proc = spm.SentencePieceProcessor(model_file=str(dirs["t5_user"] / "spiece.model"))
    sep = proc.piece_to_id("<sep>")
    for text in USER_PIECE_TEXTS:
        want = [*proc.encode(text), ours.eos_id]  # (no byte fallback: an unknown is unk)
        assert ours.encode(text) == want, text
        assert sep in want, text
    assert ours.encode("a<sep>b")[:3] == [proc.piece_to_id("▁a"), sep, proc.piece_to_id("b")]
    assert [ours.encode(t) for t in USER_PIECE_TEXTS] == [hf(t)["input_ids"]
                                                         for t in USER_PIECE_TEXTS]


@pytest.mark.parametrize("name", ["t5_json", "bart", "bart_bare"])
def test_tokenizer_json_matches_transformers(dirs, name: str) -> None:
    ours, hf = _pair(dirs, name)
    assert ours.kind == "tokenizers"
    _assert_specials(ours, hf)
    encodings = _assert_same(ours, hf)
    if name.startswith("bart"):
        assert ours.bos_id == 0 and all(e[0] == 0 and e[-1] == 2 for e in encodings)
        assert 4 in ours.encode("a <mask>b")  # the spelled <mask>


# ------------------------------------------------------------------------------- saving

@pytest.mark.parametrize("name", ["marian", "marian_separate", "t5_user", "bart"])
def test_save_reads_back_the_same_tokenizer(dirs, tmp_path, name: str) -> None:
    ours = load_seq2seq_tokenizer(dirs[name])
    ours.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(ours.files)
    again = load_seq2seq_tokenizer(tmp_path / "out")
    assert (again.kind, again.vocab_size, again.eos_id, again.pad_id) == (
        ours.kind, ours.vocab_size, ours.eos_id, ours.pad_id)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
        assert again.encode_target(text) == ours.encode_target(text)
    hf = _hf(name, tmp_path / "out")  # transformers reads the saved directory too
    assert hf(TEXTS[3])["input_ids"] == ours.encode(TEXTS[3])


# ------------------------------------------------------------------------- bad directories

def _copy(dirs, name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    shutil.copytree(dirs[name], d)
    return d


def _one_line_error(directory: Path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as err:
        load_seq2seq_tokenizer(directory)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_missing_or_broken_files_are_named(dirs, tmp_path) -> None:
    d = _copy(dirs, "marian", tmp_path)
    (d / "target.spm").unlink()
    assert str(d / "target.spm") in _one_line_error(d, "target.spm is missing")
    for name in ("source.spm", "target.spm"):
        (d / name).unlink(missing_ok=True)
    _one_line_error(d, "source.spm is missing")  # tokenizer_class names MarianTokenizer
    (d / "source.spm").write_bytes(b"not a model")
    (d / "target.spm").write_bytes(b"not a model")
    _one_line_error(d, "source.spm: not a SentencePiece model")
    d = _copy(dirs, "marian_separate", tmp_path)
    (d / "target_vocab.json").unlink()
    _one_line_error(d, "target_vocab.json is missing")
    d = tmp_path / "empty"
    d.mkdir()
    _one_line_error(d, "no tokenizer files")
    d = _copy(dirs, "t5", tmp_path)
    (d / "spiece.model").write_bytes(b"\x00garbage")
    _one_line_error(d, "spiece.model: not a SentencePiece model")


def test_bad_vocab_json_is_refused(dirs, tmp_path) -> None:
    d = _copy(dirs, "marian", tmp_path)
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    other = {"</s>": 0, "<unk>": 1, **{f"word{i}": i + 2 for i in range(300)}, "<pad>": 302}
    _write_json(d / "vocab.json", other)
    _one_line_error(d, r"vocab.json covers 0 of the \d+ pieces of .*source.spm")
    _write_json(d / "vocab.json", {k: v for k, v in vocab.items() if k != "<pad>"})
    _one_line_error(d, "the special token '<pad>' is not in it")
    _write_json(d / "vocab.json", {**vocab, "<pad>": len(vocab) + 5})
    _one_line_error(d, r"the ids must be 0 \.\. \d+, each once")


def test_bad_t5_configs_are_refused(dirs, tmp_path) -> None:
    d = _copy(dirs, "t5", tmp_path)
    for extra_ids in (-1, "100", True):
        _write_json(d / "tokenizer_config.json", {"extra_ids": extra_ids})
        _one_line_error(d, "extra_ids must be an int >= 0")
    _write_json(d / "tokenizer_config.json",
                {"extra_ids": 100, "additional_special_tokens": ["<extra_id_0>"]})
    _one_line_error(d, "lists 1 <extra_id_N> tokens but extra_ids is 100")
    _write_json(d / "tokenizer_config.json", {"eos_token": "<end>"})
    _one_line_error(d, "the special token '<end>' is not a piece")
    d = _copy(dirs, "bart", tmp_path)
    _write_json(d / "tokenizer_config.json", {"eos_token": "<end>"})
    _one_line_error(d, "eos_token '<end>' is not a token")


def test_check_embedding_rows(dirs) -> None:
    marian = load_seq2seq_tokenizer(dirs["marian"])
    check_embedding_rows(marian, marian.vocab_size, "config.json vocab_size")
    with pytest.raises(CheckpointError, match=rf"config.json vocab_size: the embedding has "
                       rf"{marian.vocab_size + 1} rows but .*vocab.json has "
                       rf"{marian.vocab_size} tokens") as err:
        check_embedding_rows(marian, marian.vocab_size + 1, "config.json vocab_size")
    assert "\n" not in str(err.value)
    separate = load_seq2seq_tokenizer(dirs["marian_separate"])
    check_embedding_rows(separate, separate.target_vocab_size, "decoder_vocab_size",
                         target=True)
    with pytest.raises(CheckpointError, match=rf"has {separate.vocab_size} rows but "
                       rf".*target_vocab.json has {separate.target_vocab_size} tokens"):
        check_embedding_rows(separate, separate.vocab_size, "decoder_vocab_size", target=True)
    t5 = load_seq2seq_tokenizer(dirs["t5"])
    check_embedding_rows(t5, 512, "t5")  # T5 pads its embedding: more rows are fine
    with pytest.raises(CheckpointError, match="ids >= 399 would index past it"):
        check_embedding_rows(t5, 399, "t5")
    for rows in (0, True, 3.0):
        with pytest.raises(ValueError, match="rows must be an int >= 1"):
            check_embedding_rows(t5, rows, "t5")
    with pytest.raises(TypeError, match="must be a Seq2SeqTokenizer"):
        check_embedding_rows("t5", 512, "t5")


def test_bad_arguments(dirs) -> None:
    marian = load_seq2seq_tokenizer(dirs["marian"])
    with pytest.raises(TypeError, match="text must be a str"):
        marian.encode(None)
    with pytest.raises(TypeError, match="text must be a str"):
        marian.encode_target(["a"])
    with pytest.raises(ValueError, match="ids must be 1-D"):
        marian.decode(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must be >= 0, got -1"):
        marian.decode([3, -1])
    with pytest.raises(TypeError, match="ids must be ints"):
        marian.decode([3, 1.5])
    with pytest.raises(TypeError, match="sequence of ints"):
        marian.decode("3 4")
    with pytest.raises(ValueError, match=f"id {marian.vocab_size} is beyond the vocabulary"):
        marian.decode([3, marian.vocab_size])
