"""``qkv.data.ShapesQADataset``: rows deterministic per index, answers true of the images'
labels (``ShapesDataset.describe``, an independent path) and never spelled by the question,
answer spans, held-out images for test, the text-only variant, the ``<image>`` character and
``collate`` (ids, masks, images) for a ``CharTokenizer``.

Shapes: B batch, N text length, T image slots, H = W image side.
"""

from __future__ import annotations

import pytest
import torch

from qkv.data import (
    COLOURS,
    IMAGE_CHAR,
    SHAPES,
    BPETokenizer,
    CharTokenizer,
    ShapesQADataset,
    image_token_id,
    qa_alphabet,
)


def test_rows_are_deterministic_per_index():
    a, b = ShapesQADataset("train", size=50), ShapesQADataset("train", size=50)
    assert a[7] == b[7] and a[-1] == b[49]
    assert a[3] != a[4]
    assert ShapesQADataset("train", size=50, seed=1)[7] != a[7]
    with pytest.raises(IndexError):
        a[50]


def test_answers_are_true_of_the_images_and_spans_mark_them():
    qa = ShapesQADataset("train", size=200, max_images=3, questions_per_image=2)
    kinds, counts = set(), set()
    for i in range(200):
        row = qa[i]
        assert row.text.count(IMAGE_CHAR) == len(row.image_indices) == len(row.labels)
        counts.add(len(row.image_indices))
        assert len(row.pairs) == 2 * len(row.image_indices) == len(row.answer_spans)
        for pair, (start, end) in zip(row.pairs, row.answer_spans, strict=True):
            assert row.text[start:end] == pair.answer
            assert row.text[end] == "."
            _, lab = qa.images.describe(row.image_indices[pair.image])
            want = {"colour": lab["colour"], "shape": lab["shape"], "count": str(lab["count"])}
            assert pair.answer == want[pair.kind]
            assert pair.answer not in pair.question  # the text alone does not answer it
            kinds.add(pair.kind)
            # the question follows its own image: the nearest IMAGE_CHAR before it
            assert row.text[:start].count(IMAGE_CHAR) == pair.image + 1
    assert kinds == {"colour", "shape", "count"} and counts == {1, 2, 3}
    assert set(COLOURS) >= {p.answer for i in range(200) for p in qa[i].pairs
                            if p.kind == "colour"}
    assert set(SHAPES) >= {p.answer for i in range(200) for p in qa[i].pairs
                           if p.kind == "shape"}


def test_example_text_format():
    row = ShapesQADataset("train", size=10)[1]
    shown = row.display()
    assert IMAGE_CHAR not in shown and shown.startswith("<image> Q: ")
    assert shown.count("<image>") == len(row.image_indices)


def test_test_split_holds_out_images():
    train = ShapesQADataset("train", size=100)
    test = ShapesQADataset("test", size=100)
    assert train.images.split == "train" and test.images.split == "valid"
    # the image streams differ: the same index gives other pixels
    assert not torch.equal(train.images[0][0], test.images[0][0])
    combos = ShapesQADataset("test", size=50, image_split="test")
    assert all(lab["heldout"] for i in range(50) for lab in combos[i].labels)
    assert not any(lab["heldout"] for i in range(50) for lab in train[i].labels)


def test_text_only_variant():
    qa = ShapesQADataset("test", size=30, questions_per_image=2)
    for i in range(30):
        row, plain = qa[i], qa[i].text_only()
        assert IMAGE_CHAR not in plain.text and plain.image_indices == ()
        assert plain.text.startswith("Q: ")
        assert [plain.text[a:b] for a, b in plain.answer_spans] == [p.answer for p in row.pairs]


def test_image_token_and_collate():
    tok = CharTokenizer(qa_alphabet())
    img = image_token_id(tok)
    qa = ShapesQADataset("train", size=20, image_size=16)
    rows = [qa[i] for i in range(6)]
    batch = qa.collate(rows, tok)
    assert batch.input_ids.shape[0] == 6
    assert batch.images.shape == (6, 3, 3, 16, 16)
    for r, row in enumerate(rows):
        ids = batch.input_ids[r][batch.attention_mask[r]]
        assert tok.decode(ids) == row.text
        assert int((ids == img).sum()) == int(batch.image_counts[r]) == len(row.image_indices)
        answers = tok.decode(batch.input_ids[r][batch.answer_mask[r]])
        assert answers == "".join(p.answer for p in row.pairs)
        k = len(row.image_indices)
        assert torch.equal(batch.images[r, :k], qa.images_of(row))
        assert not batch.images[r, k:].any()
    with pytest.raises(ValueError, match="more than max_images=1"):
        qa.collate([r for r in rows if len(r.image_indices) > 1], tok, max_images=1)


def test_tokenizers_without_a_single_image_id_are_refused():
    with pytest.raises(ValueError, match="one id"):
        image_token_id(CharTokenizer("abc"))  # IMAGE_CHAR -> <unk>
    bpe = BPETokenizer.train(["hello world"] * 5, vocab_size=262)
    with pytest.raises(ValueError, match="one id"):
        image_token_id(bpe)  # three bytes, never merged
    qa = ShapesQADataset("train", size=4)
    with pytest.raises(ValueError, match="one token per character"):
        qa.collate([qa[0]], bpe)


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        ShapesQADataset("valid")
    with pytest.raises(ValueError, match="questions_per_image=4"):
        ShapesQADataset(questions_per_image=4)
    with pytest.raises(ValueError, match="kinds"):
        ShapesQADataset(kinds=("colour", "size"))
    with pytest.raises(ValueError, match="image_split"):
        ShapesQADataset("test", image_split="train")
