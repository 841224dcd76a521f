"""``qkv.data.clip_text.encode_texts`` against rows framed and padded by hand: bos + the
tokenizer's own ids + eos, right-padded with pad id 0, the mask True on exactly the real
tokens."""

from __future__ import annotations

import pytest
import torch

from qkv.data import BPETokenizer, CharTokenizer
from qkv.data.clip_text import encode_texts


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_rows_are_bos_text_eos_right_padded(kind):
    texts = ["a red circle", "一个蓝色的星", "x", "two green squares at the top"]
    tok = (CharTokenizer.from_texts(texts) if kind == "char"
           else BPETokenizer.train(texts * 5, vocab_size=300))
    ids, mask = encode_texts(tok, texts)
    rows = [[1, *tok.encode(t), 2] for t in texts]  # <bos> = 1, <eos> = 2, typed in again
    width = max(len(r) for r in rows)
    assert ids.shape == mask.shape == (4, width)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    for i, row in enumerate(rows):
        assert ids[i].tolist() == row + [0] * (width - len(row))
        assert mask[i].tolist() == [True] * len(row) + [False] * (width - len(row))
    one_ids, one_mask = encode_texts(tok, ["x"])  # a row alone is not padded
    assert one_ids.tolist() == [rows[2]] and bool(one_mask.all())


@pytest.mark.parametrize("bad", ["a red circle", [], ["ok", 3], None])
def test_refuses_what_is_not_a_list_of_strings(bad):
    with pytest.raises(TypeError, match="encode_texts: texts"):
        encode_texts(CharTokenizer("abc"), bad)
