"""``qkv.demos.tiny_marian``: the directory it writes without transformers is one that
transformers' ``MarianMTModel`` / ``MarianTokenizer`` load, and they agree with qkv's
``from_pretrained`` / ``load_seq2seq_tokenizer`` on it.

- the files: what the module docstring lists; the tokenizer files are the same for two seeds,
  the weights differ;
- qkv loads it with no warning (no config field unknown or doubtful);
- token ids: ``MarianTokenizer(texts)`` / ``text_target=`` == qkv's ``encode`` /
  ``encode_target``, English and Chinese (each side's pieces), and decoding;
- logits on a right-padded batch: |qkv - HF| <= 1e-5 · max|HF| (fp32 both, the same math);
- HF's ``generation_config`` is the file's (4 beams, bad words [[pad]], forced eos).

Shapes: B = 3 batch, V ~ 300 vocab.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from qkv.data.seq2seq_tokenizer import load_seq2seq_tokenizer
from qkv.demos.tiny_marian import PAIRS, make_tiny_marian, marian_config
from qkv.models import Transformer, from_pretrained

transformers = pytest.importorskip("transformers")

FILES = {"config.json", "model.safetensors", "generation_config.json", "source.spm",
         "target.spm", "vocab.json", "tokenizer_config.json"}
TEXTS = ["Attention lets every token look at every other token.", "Where is the bookshop?",
         "unseen words: zebra quantum!"]
ZH = ["注意力让每个词元都能看到其他所有词元。", "最近的书店在哪里？", "没见过的字：鑫"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_marian(tmp_path_factory.mktemp("tiny") / "tiny-marian")


def _hf_tokenizer(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MarianTokenizer: "Recommended: pip install sacremoses"
        return transformers.MarianTokenizer.from_pretrained(path)


def test_the_files_and_the_seed(tiny, tmp_path):
    assert {p.name for p in tiny.iterdir()} == FILES
    other = make_tiny_marian(tmp_path / "other", seed=1)
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (tiny / name).read_bytes() == (other / name).read_bytes(), name
    assert (tiny / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    vocab = json.loads((tiny / "vocab.json").read_text(encoding="utf-8"))
    assert (vocab["</s>"], vocab["<unk>"], vocab["<pad>"]) == (0, 1, len(vocab) - 1)
    config = json.loads((tiny / "config.json").read_text())
    assert config == marian_config(len(vocab))


def test_qkv_loads_it_without_warnings(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = from_pretrained(tiny)
        tok = load_seq2seq_tokenizer(tiny)
    assert isinstance(model, Transformer)
    c = model.config
    assert (c.pad_id, c.bos_id, c.eos_id) == (tok.pad_id, tok.pad_id, tok.eos_id)
    assert c.src_vocab_size == c.tgt_vocab_size == tok.vocab_size
    assert c.share_embeddings and c.tie_output and c.head_bias


def test_token_ids_and_decoding_equal_marian_tokenizers(tiny):
    hf, ours = _hf_tokenizer(tiny), load_seq2seq_tokenizer(tiny)
    for text in TEXTS + [en for en, _ in PAIRS[:6]]:
        assert ours.encode(text) == hf(text)["input_ids"], text
    for text in ZH + [zh for _, zh in PAIRS[:6]]:
        ids = hf(text_target=text)["input_ids"]
        assert ours.encode_target(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.unk_id in ours.encode_target(ZH[2])  # 鑫 is no piece: the test can fail


def test_logits_equal_marian_mt_model(tiny):
    hf = transformers.MarianMTModel.from_pretrained(tiny, attn_implementation="eager").eval()
    ours = from_pretrained(tiny)
    tok = _hf_tokenizer(tiny)
    batch = tok(TEXTS, text_target=ZH, padding=True, return_tensors="pt")
    start = torch.full((3, 1), hf.config.decoder_start_token_id)
    tgt = torch.cat((start, batch["labels"][:, :-1]), dim=1)  # (B, T) shifted right
    tgt = tgt.masked_fill(tgt == -100, hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 decoder_input_ids=tgt).logits  # (B, T, V)
        got = ours(batch["input_ids"], tgt, src_mask=batch["attention_mask"].bool())
    err = float((got - ref).abs().max())
    assert err <= 1e-5 * float(ref.abs().max()), err


def test_generation_config_is_opus_mts(tiny):
    g = transformers.GenerationConfig.from_pretrained(tiny)
    pad = json.loads((tiny / "config.json").read_text())["pad_token_id"]
    assert (g.num_beams, g.bad_words_ids, g.forced_eos_token_id, g.decoder_start_token_id,
            g.renormalize_logits) == (4, [[pad]], 0, pad, True)
