"""Pronoun resolution sentences (English and Chinese) whose answer the tokens decide.

The seeds' example: in "The cat sat on the mat because it was tired" (猫坐在垫子上，因为它很累)
self-attention lets "it" (它) draw on "cat" (猫). Every sentence here holds two nouns and one
pronoun, and the pronoun's antecedent follows from the words alone:

- ``"property"``: an animal and an object, the pronoun "it" (它); the adjective fits only one
  of them (animals are tired, hungry, scared...; objects are soft, broken, empty...)::

      the cat sat on the mat because it was tired     -> it = cat
      the cat sat on the mat because it was soft      -> it = mat
      猫坐在垫子上，因为它很累                             -> 它 = 猫

- ``"gender"``: a male and a female person; the pronoun (he/she, 他/她) agrees with one::

      the king helped the girl because she was scared -> she = girl

Sentences are word sequences (``CorefExample.tokens``); ``text`` joins them with spaces
(English) or without (Chinese), and ``qkv.data.WordTokenizer(coref_vocabulary())`` encodes
``text`` back to exactly those words.

Generation is counter-based: example ``i`` of ``(seed, split)`` comes from its own
``random.Random`` seeded with a BLAKE2 hash of ``(seed, split, i)``. Held-out splits are
disjoint from "train" by noun pair: of each kind's unordered pairs, 10% (ranked by a BLAKE2
hash, independent of ``seed``) are "test" and the next 10% "valid"; "train" never puts those
two nouns in one sentence, in either order or language. Each noun alone does occur in training
(with other partners). The seeds' pair (cat, mat) is always "test".
"""

from __future__ import annotations

import functools
import random
from typing import NamedTuple

from .order import hash_int

__all__ = ["COREF_KINDS", "COREF_LANGS", "CorefExample", "coref_examples", "coref_lexicon",
           "coref_sentence", "coref_split", "coref_split_pairs", "coref_vocabulary"]

#: Sentence kinds and languages.
COREF_KINDS = ("property", "gender")
COREF_LANGS = ("en", "zh")
_SPLITS = ("train", "valid", "test")
_HELD_OUT = 0.1  # fraction of each kind's noun pairs in "test", and again in "valid"
_PINNED_TEST = ("cat", "mat")  # the seeds' sentence is always held out

# Nouns: English -> (Chinese, class). Classes: animal, object (pronoun it / 它), male (he /
# 他), female (she / 她).
_NOUNS: dict[str, tuple[str, str]] = {
    "cat": ("猫", "animal"), "dog": ("狗", "animal"), "bird": ("鸟", "animal"),
    "horse": ("马", "animal"), "rabbit": ("兔子", "animal"), "mouse": ("老鼠", "animal"),
    "duck": ("鸭子", "animal"), "fox": ("狐狸", "animal"),
    "mat": ("垫子", "object"), "box": ("盒子", "object"), "chair": ("椅子", "object"),
    "table": ("桌子", "object"), "bed": ("床", "object"), "sofa": ("沙发", "object"),
    "rug": ("地毯", "object"), "basket": ("篮子", "object"),
    "boy": ("男孩", "male"), "man": ("男人", "male"), "king": ("国王", "male"),
    "father": ("父亲", "male"), "brother": ("弟弟", "male"), "uncle": ("叔叔", "male"),
    "girl": ("女孩", "female"), "woman": ("女人", "female"), "queen": ("王后", "female"),
    "mother": ("母亲", "female"), "sister": ("妹妹", "female"), "aunt": ("阿姨", "female"),
}
# Adjectives: English -> (Chinese predicate, what it fits: "animate" or "object").
_ADJECTIVES: dict[str, tuple[str, str]] = {
    "tired": ("很累", "animate"), "hungry": ("很饿", "animate"), "sleepy": ("很困", "animate"),
    "scared": ("很害怕", "animate"), "happy": ("很开心", "animate"),
    "sad": ("很难过", "animate"), "angry": ("很生气", "animate"),
    "thirsty": ("很渴", "animate"),
    "soft": ("很软", "object"), "broken": ("坏了", "object"), "empty": ("是空的", "object"),
    "wooden": ("是木头的", "object"), "cracked": ("裂开了", "object"),
    "plastic": ("是塑料的", "object"),
}
# Relations: English -> (Chinese before the second noun, Chinese after it, subject must be
# animate). Chinese: N1 + before + N2 + after.
_RELATIONS: dict[str, tuple[str, str, bool]] = {
    "sat on": ("坐在", "上", True), "slept on": ("睡在", "上", True),
    "looked at": ("看着", "", True), "was next to": ("在", "旁边", False),
    "was behind": ("在", "后面", False), "was under": ("在", "下面", False),
    "met": ("遇见了", "", True), "helped": ("帮助了", "", True),
    "thanked": ("感谢了", "", True), "waited for": ("等着", "", True),
}
_KIND_RELATIONS = {
    "property": ("sat on", "slept on", "looked at", "was next to", "was behind", "was under"),
    "gender": ("met", "helped", "thanked", "waited for", "looked at", "was next to",
               "was behind"),
}
_PRONOUNS = {"animal": ("it", "它"), "object": ("it", "它"), "male": ("he", "他"),
             "female": ("she", "她")}
_KIND_CLASSES = {"property": ("animal", "object"), "gender": ("male", "female")}


class CorefExample(NamedTuple):
    """One sentence. ``tokens`` are its words; ``pronoun``, ``nouns`` and ``antecedent`` are
    indices into ``tokens`` (``antecedent`` is one of ``nouns``, which are in sentence
    order); ``answer`` is the antecedent word, ``kind`` "property" or "gender", ``lang``
    "en" or "zh"."""

    text: str
    tokens: tuple[str, ...]
    lang: str
    kind: str
    pronoun: int
    nouns: tuple[int, int]
    antecedent: int

    @property
    def answer(self) -> str:
        """The antecedent noun, e.g. "cat" / "猫"."""
        return self.tokens[self.antecedent]


def coref_lexicon() -> dict[str, dict[str, tuple]]:
    """The word lists, keyed by English word: ``{"nouns": {en: (zh, class)}, "adjectives":
    {en: (zh, "animate" | "object")}, "relations": {en: (zh_before, zh_after,
    animate_subject)}, "pronouns": {class: (en, zh)}}`` (copies)."""
    return {"nouns": dict(_NOUNS), "adjectives": dict(_ADJECTIVES),
            "relations": dict(_RELATIONS), "pronouns": dict(_PRONOUNS)}


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def coref_sentence(first: str, second: str, *, relation: str, adjective: str,
                   antecedent: int, lang: str = "en") -> CorefExample:
    """Build one sentence from English lexicon words: "the {first} {relation} the {second}
    because {pronoun} was {adjective}" (or its Chinese form), the pronoun referring to
    ``first`` (``antecedent=0``) or ``second`` (1).

    Raises:
        ValueError: a word outside the lexicon, two nouns that are not one animal + one
        object or one male + one female, a relation that needs an animate subject after an
        object, or an adjective that does not fit the antecedent (or is not animate in a
        "gender" sentence).
    """
    for name, value, table in (("first", first, _NOUNS), ("second", second, _NOUNS),
                               ("relation", relation, _RELATIONS),
                               ("adjective", adjective, _ADJECTIVES)):
        if value not in table:
            raise ValueError(f"{name} must be a word of the coref lexicon, got {value!r}")
    _check_choice("lang", lang, COREF_LANGS)
    if antecedent not in (0, 1) or isinstance(antecedent, bool):
        raise ValueError(f"antecedent must be 0 (first) or 1 (second), got {antecedent!r}")
    classes = (_NOUNS[first][1], _NOUNS[second][1])
    kind = next((k for k, c in _KIND_CLASSES.items() if set(classes) == set(c)), None)
    if kind is None:
        raise ValueError(f"first and second must be an animal and an object, or a male and a "
                         f"female person; got {first!r} ({classes[0]}), {second!r} "
                         f"({classes[1]})")
    zh_before, zh_after, animate_subject = _RELATIONS[relation]
    if relation not in _KIND_RELATIONS[kind] or (animate_subject and classes[0] == "object"):
        raise ValueError(f"relation {relation!r} does not fit {first!r} ... {second!r}")
    target = classes[antecedent]
    fits = _ADJECTIVES[adjective][1]
    if fits != ("object" if target == "object" else "animate"):
        raise ValueError(f"adjective {adjective!r} ({fits}) does not fit the antecedent "
                         f"{(first, second)[antecedent]!r} ({target})")
    pron_en, pron_zh = _PRONOUNS[target]
    if lang == "en":
        words = ["the", first, *relation.split(), "the", second, "because", pron_en, "was",
                 adjective]
        nouns = (1, 3 + len(relation.split()))
    else:
        words = [_NOUNS[first][0], zh_before, _NOUNS[second][0], *([zh_after] if zh_after
                                                                  else []),
                 "，", "因为", pron_zh, _ADJECTIVES[adjective][0]]
        nouns = (0, 2)
    text = (" " if lang == "en" else "").join(words)
    return CorefExample(text, tuple(words), lang, kind, len(words) - 3 + (lang == "zh"),
                        nouns, nouns[antecedent])


@functools.cache
def coref_split_pairs() -> dict[str, dict[str, tuple[tuple[str, str], ...]]]:
    """``{split: {kind: pairs}}``: the unordered noun pairs (each sorted) of every split.
    Independent of the seed; ("cat", "mat") is in "test"."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {s: {} for s in _SPLITS}
    for kind, (a_class, b_class) in _KIND_CLASSES.items():
        pairs = [tuple(sorted((a, b))) for a, (_, ca) in _NOUNS.items() if ca == a_class
                 for b, (_, cb) in _NOUNS.items() if cb == b_class]
        pairs.sort(key=lambda p: (p != _PINNED_TEST, hash_int("qkv.data.coref/heldout", *p)))
        n = max(1, round(_HELD_OUT * len(pairs)))
        out["test"][kind] = pairs[:n]
        out["valid"][kind] = pairs[n:2 * n]
        out["train"][kind] = pairs[2 * n:]
    return {s: {k: tuple(v) for k, v in d.items()} for s, d in out.items()}


def coref_split(first: str, second: str) -> str:
    """The split ("train", "valid" or "test") of sentences holding nouns ``first`` and
    ``second`` (English lexicon words, either order)."""
    pair = tuple(sorted((first, second)))
    for split, kinds in coref_split_pairs().items():
        if any(pair in pairs for pairs in kinds.values()):
            return split
    raise ValueError(f"first, second must be an animal and an object or a male and a female "
                     f"of the coref lexicon, got {first!r}, {second!r}")


def _draw(rng: random.Random, split: str, langs: tuple[str, ...]) -> CorefExample:
    kind = rng.choice(COREF_KINDS)
    lang = rng.choice(langs)
    pair = list(rng.choice(coref_split_pairs()[split][kind]))
    rng.shuffle(pair)
    first, second = pair
    subject_object = _NOUNS[first][1] == "object"
    relation = rng.choice([r for r in _KIND_RELATIONS[kind]
                           if not (subject_object and _RELATIONS[r][2])])
    antecedent = rng.randrange(2)
    fits = "object" if _NOUNS[pair[antecedent]][1] == "object" else "animate"
    adjective = rng.choice([a for a, (_, f) in _ADJECTIVES.items() if f == fits])
    return coref_sentence(first, second, relation=relation, adjective=adjective,
                          antecedent=antecedent, lang=lang)


def coref_examples(split: str, start: int, count: int, *, seed: int = 0,
                   langs: tuple[str, ...] = COREF_LANGS) -> list[CorefExample]:
    """Examples ``start .. start+count-1`` of ``split`` ("train", "valid", "test"): kind,
    language (one of ``langs``), noun pair of the split, order, relation, antecedent and a
    fitting adjective, each drawn uniformly."""
    _check_choice("split", split, _SPLITS)
    for name, value in (("start", start), ("count", count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    langs = tuple(langs)
    if not langs or any(lang not in COREF_LANGS for lang in langs):
        raise ValueError(f"langs must be a non-empty subset of {COREF_LANGS}, got {langs!r}")
    return [_draw(random.Random(hash_int("qkv.data.coref", seed, split, i, *langs)), split,
                  langs)
            for i in range(start, start + count)]


@functools.cache
def _vocabulary() -> tuple[str, ...]:
    words = ["the", "because", "was", "，", "因为"]
    words += [w for en, (zh, _) in _NOUNS.items() for w in (en, zh)]
    words += [w for en, (zh, _) in _ADJECTIVES.items() for w in (en, zh)]
    for en, (before, after, _) in _RELATIONS.items():
        words += [*en.split(), before, *([after] if after else [])]
    words += [w for pair in _PRONOUNS.values() for w in pair]
    return tuple(dict.fromkeys(words))


def coref_vocabulary() -> list[str]:
    """Every word a sentence can contain (English and Chinese), each once, in a fixed
    order: ``WordTokenizer(coref_vocabulary())`` encodes every ``CorefExample.text``."""
    return list(_vocabulary())
