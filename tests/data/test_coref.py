"""qkv.data.coref: deterministic counter-based sentences, held-out noun pairs disjoint from
training, and labels recomputed here from word lists written independently of the module."""

from __future__ import annotations

import itertools
import re

import pytest

from qkv.data import (
    COREF_KINDS,
    WordTokenizer,
    coref_examples,
    coref_sentence,
    coref_split,
    coref_split_pairs,
    coref_vocabulary,
)

# The oracle's own word lists: English and Chinese noun classes and adjective fits.
ANIMALS = {"cat": "猫", "dog": "狗", "bird": "鸟", "horse": "马", "rabbit": "兔子",
           "mouse": "老鼠", "duck": "鸭子", "fox": "狐狸"}
OBJECTS = {"mat": "垫子", "box": "盒子", "chair": "椅子", "table": "桌子", "bed": "床",
           "sofa": "沙发", "rug": "地毯", "basket": "篮子"}
MALE = {"boy": "男孩", "man": "男人", "king": "国王", "father": "父亲", "brother": "弟弟",
        "uncle": "叔叔"}
FEMALE = {"girl": "女孩", "woman": "女人", "queen": "王后", "mother": "母亲", "sister": "妹妹",
          "aunt": "阿姨"}
ANIMATE_ADJ = {"tired", "hungry", "sleepy", "scared", "happy", "sad", "angry", "thirsty",
               "很累", "很饿", "很困", "很害怕", "很开心", "很难过", "很生气", "很渴"}
OBJECT_ADJ = {"soft", "broken", "empty", "wooden", "cracked", "plastic",
              "很软", "坏了", "是空的", "是木头的", "裂开了", "是塑料的"}
CLASS = {w: c for c, table in (("animal", ANIMALS), ("object", OBJECTS), ("male", MALE),
                               ("female", FEMALE))
         for en, zh in table.items() for w in (en, zh)}
ENGLISH = {zh: en for table in (ANIMALS, OBJECTS, MALE, FEMALE) for en, zh in table.items()}
PRONOUN_CLASS = {"he": "male", "他": "male", "she": "female", "她": "female"}
EN_PATTERN = re.compile(r"the (\w+) ([a-z ]+) the (\w+) because (it|he|she) was (\w+)")


def oracle(tokens: tuple[str, ...]) -> tuple[int, tuple[int, int], int]:
    """(pronoun index, noun indices, antecedent index) recomputed from the word lists."""
    nouns = tuple(i for i, t in enumerate(tokens) if t in CLASS)
    pronoun = next(i for i, t in enumerate(tokens) if t in ("it", "它", *PRONOUN_CLASS))
    adjective = tokens[-1]
    assert len(nouns) == 2 and adjective in ANIMATE_ADJ | OBJECT_ADJ
    if tokens[pronoun] in PRONOUN_CLASS:
        want = {PRONOUN_CLASS[tokens[pronoun]]}
    else:
        want = {"object"} if adjective in OBJECT_ADJ else {"animal"}
    matches = [i for i in nouns if CLASS[tokens[i]] in want]
    assert len(matches) == 1, tokens
    return pronoun, nouns, matches[0]


def test_examples_are_deterministic_and_counter_based():
    a = coref_examples("train", 0, 40, seed=3)
    assert a == coref_examples("train", 0, 40, seed=3)
    assert coref_examples("train", 25, 15, seed=3) == a[25:]
    assert coref_examples("train", 0, 40, seed=4) != a
    assert coref_examples("valid", 0, 40, seed=3) != coref_examples("test", 0, 40, seed=3)
    assert coref_examples("test", 7, 0) == []


def test_labels_match_the_oracle():
    examples = [e for split in ("train", "valid", "test")
                for e in coref_examples(split, 0, 700, seed=1)]
    for e in examples:
        pronoun, nouns, antecedent = oracle(e.tokens)
        assert (e.pronoun, e.nouns, e.antecedent) == (pronoun, nouns, antecedent), e
        assert e.answer == e.tokens[antecedent]
        assert e.kind == ("gender" if e.tokens[pronoun] in PRONOUN_CLASS else "property")
        if e.lang == "en":
            assert EN_PATTERN.fullmatch(e.text), e.text
            assert e.text == " ".join(e.tokens)
        else:
            assert e.text == "".join(e.tokens) and "，因为" in e.text
    kinds = {(e.lang, e.kind, e.antecedent == e.nouns[0]) for e in examples}
    assert len(kinds) == 8  # both languages, both kinds, antecedent first and second


def noun_pair(e) -> tuple[str, str]:
    words = [e.tokens[i] for i in e.nouns]
    return tuple(sorted(ENGLISH.get(w, w) for w in words))


def test_held_out_noun_pairs_never_meet_in_training():
    pairs = {split: {noun_pair(e) for s in (0, 1)
                     for e in coref_examples(split, 0, 3000, seed=s)}
             for split in ("train", "valid", "test")}
    assert not pairs["train"] & (pairs["valid"] | pairs["test"])
    assert not pairs["valid"] & pairs["test"]
    assert ("cat", "mat") in pairs["test"]
    # every noun still occurs in training, with other partners
    assert {w for p in pairs["train"] for w in p} == set(ANIMALS) | set(OBJECTS) | set(MALE) \
        | set(FEMALE)


def test_split_pairs_partition_every_pair_independently_of_the_seed():
    splits = coref_split_pairs()
    expected = {"property": {tuple(sorted(p)) for p in itertools.product(ANIMALS, OBJECTS)},
                "gender": {tuple(sorted(p)) for p in itertools.product(MALE, FEMALE)}}
    for kind in COREF_KINDS:
        parts = [set(splits[s][kind]) for s in ("train", "valid", "test")]
        assert set().union(*parts) == expected[kind]
        assert sum(len(p) for p in parts) == len(expected[kind])
        assert len(parts[1]) == len(parts[2]) == round(0.1 * len(expected[kind]))
    for split, kinds in splits.items():
        for pair in itertools.chain(*kinds.values()):
            assert coref_split(*pair) == coref_split(*reversed(pair)) == split
    with pytest.raises(ValueError, match="first, second"):
        coref_split("cat", "dog")


def test_the_seed_sentence():
    e = coref_sentence("cat", "mat", relation="sat on", adjective="tired", antecedent=0)
    assert e.text == "the cat sat on the mat because it was tired"
    assert (e.tokens[e.pronoun], e.answer) == ("it", "cat")
    soft = coref_sentence("cat", "mat", relation="sat on", adjective="soft", antecedent=1)
    assert soft.answer == "mat" and soft.text.endswith("because it was soft")
    zh = coref_sentence("cat", "mat", relation="sat on", adjective="tired", antecedent=0,
                        lang="zh")
    assert zh.text == "猫坐在垫子上，因为它很累"
    assert (zh.tokens[zh.pronoun], zh.answer) == ("它", "猫")
    she = coref_sentence("king", "girl", relation="helped", adjective="scared", antecedent=1)
    assert she.text == "the king helped the girl because she was scared"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"adjective": "soft", "antecedent": 0}, "does not fit"),
    ({"adjective": "tired", "antecedent": 1}, "does not fit"),
    ({"second": "dog"}, "animal and an object"),
    ({"first": "mat", "second": "cat"}, "relation 'sat on' does not fit"),
    ({"relation": "flew over"}, "relation must be"),
    ({"lang": "fr"}, "lang must be"),
    ({"antecedent": 2}, "antecedent must be"),
])
def test_coref_sentence_refuses_what_does_not_fit(kwargs, match):
    args = {"first": "cat", "second": "mat", "relation": "sat on", "adjective": "tired",
            "antecedent": 0, **kwargs}
    first, second = args.pop("first"), args.pop("second")
    with pytest.raises(ValueError, match=match):
        coref_sentence(first, second, **args)


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="split must be"):
        coref_examples("dev", 0, 1)
    with pytest.raises(ValueError, match="start must be"):
        coref_examples("train", -1, 1)
    with pytest.raises(ValueError, match="langs must be"):
        coref_examples("train", 0, 1, langs=("de",))
    with pytest.raises(TypeError, match="seed must be an int"):
        coref_examples("train", 0, 1, seed=1.5)


def test_word_tokenizer_encodes_every_sentence_to_its_words():
    tok = WordTokenizer(coref_vocabulary())
    assert len(set(coref_vocabulary())) == len(coref_vocabulary())
    examples = coref_examples("train", 0, 3000) + coref_examples("test", 0, 500)
    for e in examples:
        ids = tok.encode(e.text)
        assert tok.tokens(ids) == list(e.tokens)
        assert tok.decode(ids) == e.text
    english = coref_examples("train", 0, 200, langs=("en",))
    assert {e.lang for e in english} == {"en"}
