"""``qkv export SRC --format hf --out DIR``: a HuggingFace directory transformers loads with the
source's logits, from an HF model directory (its tokenizer files and token ids kept, its
family kept unless ``--hf-type`` says otherwise) or a ``qkv train`` run (its BPE tokenizer
as HF's tokenizer.json); encoder-decoders too: an HF Marian directory with its SentencePiece
tokenizer, a qkv-saved Transformer (the paper's: as Marian); refusals end with one line and
leave nothing behind.

Oracles: transformers' AutoModelForCausalLM / AutoModelForSeq2SeqLM / AutoTokenizer /
MarianTokenizer loading the written directory, against the source HF model or the run's own
model and tokenizer. Tolerance: logits within 1e-5 of the logits' largest magnitude (1e-6
where the source is an HF model: the same weights through the same code); tokenizer ids and
copied files exactly equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models._hf_decoders import VOCAB, hf_logits, hf_model, left_padded, save_hf, transformers
from qkv.cli import main
from qkv.models import GPT, GPTConfig
from qkv.train import load_run

#: the HF tokenizer files the export copies, with contents of this test's making
TOKENIZER_FILES = {
    "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                         "bos_token": "<s>", "eos_token": "</s>"}),
    "special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>"}),
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                          "max_new_tokens": 7}),
}


def _close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> None:
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x logits scale {scale:.3g}"


def _word_tokenizer(path: Path) -> None:
    """An HF tokenizer.json (a word-level vocabulary of VOCAB ids), built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    hf = hf_model("llama")
    src = save_hf(hf, tmp_path_factory.mktemp("llama") / "src")
    _word_tokenizer(src / "tokenizer.json")
    for name, text in TOKENIZER_FILES.items():
        (src / name).write_text(text)
    return hf, src


def test_hf_directory_exports_with_its_tokenizer(hf_llama, tmp_path, capsys):
    hf, src = hf_llama
    out = tmp_path / "out"
    assert main(["export", str(src), "--format", "hf", "--out", str(out)]) == 0
    assert "HuggingFace 'llama'" in capsys.readouterr().out
    for name in ("tokenizer.json", *TOKENIZER_FILES):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["bos_token_id"], config["eos_token_id"]) == (
        "llama", 1, 2)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager").eval()
    ids, mask = left_padded()
    keep = mask.bool()
    _close(hf_logits(back, ids, mask)[keep], hf_logits(hf, ids, mask)[keep])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w5 w7 w3")["input_ids"] == [5, 7, 3]


def test_hf_type_keeps_the_source_family_unless_asked(tmp_path, capsys):
    src = save_hf(hf_model("phi3"), tmp_path / "phi3")
    assert main(["export", str(src), "--format", "hf", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "phi3"
    assert main(["export", str(src), "--format", "hf", "--hf-type", "mistral",
                 "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model_type"] == "mistral"
    capsys.readouterr()
    assert main(["export", str(src), "--hf-type", "mistral", "--out", str(tmp_path / "c")]) == 2
    assert "--hf-type is for --format hf" in capsys.readouterr().err


def test_run_with_bpe_exports_as_llama_with_its_tokenizer(tmp_path, capsys):
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and",
             "runs", "far", "away"]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g))
             for _ in range(120)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines))
    run = tmp_path / "run"
    train = ["train", "--model", "gpt", "--data", str(tmp_path / "corpus.txt"),
             "--tokenizer", "bpe", "--bpe-vocab-size", "300", "--max-len", "32",
             "--set", "dim=32", "--set", "num_layers=2", "--set", "num_heads=4",
             "--set", "num_kv_heads=2", "--set", "positions=rope", "--set", "norm=rmsnorm",
             "--set", "activation=swiglu", "--set", "bias=false",
             "--set", "tie_embeddings=false", "--steps", "2", "--batch-size", "4",
             "--eval-every", "2", "--eval-examples", "4", "--warmup", "1", "--no-progress",
             "--device", "cpu", "--out", str(run)]
    assert main(train) == 0
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert "HuggingFace 'llama'" in capsys.readouterr().out
    model, tokenizer = load_run(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the lazy fox runs away"
    ids = tokenizer.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1, 2)
    config = json.loads((out / "config.json").read_text())
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    x = torch.tensor([ids])
    with torch.no_grad():
        _close(theirs(x).logits, model(x))


def test_refusal_is_one_line_and_leaves_nothing(tmp_path, capsys):
    src = GPT(GPTConfig(vocab_size=50, max_len=16, dim=16, num_layers=1, num_heads=2,
                        attention="linear")).save_pretrained(tmp_path / "linear")
    out = tmp_path / "out"
    assert main(["export", str(src), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv export: error: hf_config_for: this GPTConfig cannot be "
                          "exported as HF GPT-2") and "attention='linear'" in err, err
    assert err.count("\n") == 1
    assert not out.exists()
    assert main(["export", str(tmp_path / "nope"), "--format", "hf", "--out", str(out)]) == 2
    assert "no such run directory" in capsys.readouterr().err


# --- encoder-decoders (qkv.models.hf_export_seq2seq) ---------------------------------------
_LINES = ("the quick brown fox jumps over the lazy dog", "attention lets every token look",
          "the encoder reads the source sentence", "the decoder writes one token at a time",
          "queries keys and values are projections", "beam search keeps the best hypotheses")


def _seq2seq_batch(bos: int, pad: int) -> tuple[torch.Tensor, ...]:
    """(src (2, 9) right-padded, mask, tgt (2, 5) from bos), real ids in [3, 30)."""
    g = torch.Generator().manual_seed(4)
    src = torch.randint(3, 30, (2, 9), generator=g)
    mask = torch.ones_like(src)
    mask[1, 5:] = 0
    tgt = torch.randint(3, 30, (2, 5), generator=g)
    tgt[:, 0] = bos
    return src.masked_fill(mask == 0, pad), mask, tgt


def _hf_seq2seq_logits(model, src, mask, tgt) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits


@pytest.fixture(scope="module")
def hf_marian(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """An HF Marian directory with its tokenizer: source.spm / target.spm trained here,
    vocab.json (</s> 0, <unk> 1, the pieces, <pad> last: opus-mt's order) of V ids, the
    model's vocabulary."""
    spm = pytest.importorskip("sentencepiece")
    from models._hf_bart_marian import hf_model as hf_seq2seq
    from models._hf_bart_marian import save_hf as save_seq2seq

    root = tmp_path_factory.mktemp("marian")
    (root / "text.txt").write_text("\n".join(_LINES * 4))
    vocab = {"</s>": 0, "<unk>": 1}
    for side in ("source", "target"):
        spm.SentencePieceTrainer.train(input=str(root / "text.txt"),
                                       model_prefix=str(root / side), vocab_size=40,
                                       hard_vocab_limit=False, minloglevel=2, num_threads=1)
        proc = spm.SentencePieceProcessor(model_file=str(root / f"{side}.model"))
        for i in range(proc.get_piece_size()):
            if not (proc.is_control(i) or proc.is_unknown(i)):
                vocab.setdefault(proc.id_to_piece(i), len(vocab))
    vocab["<pad>"] = pad = len(vocab)
    hf = hf_seq2seq("marian", vocab_size=pad + 1, pad_token_id=pad,
                    decoder_start_token_id=pad)
    src = save_seq2seq(hf, root / "src")
    for side in ("source", "target"):
        (src / f"{side}.spm").write_bytes((root / f"{side}.model").read_bytes())
    (src / "vocab.json").write_text(json.dumps(vocab))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MarianTokenizer", "model_max_length": 40}))
    return hf, src


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_hf_marian_directory_exports_with_its_tokenizer(hf_marian, tmp_path, capsys):
    from qkv.data import load_seq2seq_tokenizer

    hf, src = hf_marian
    out = tmp_path / "out"
    assert main(["export", str(src), "--format", "hf", "--out", str(out)]) == 0
    assert "HuggingFace 'marian'" in capsys.readouterr().out
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    pad = hf.config.pad_token_id
    assert (config["pad_token_id"], config["decoder_start_token_id"], config["eos_token_id"]) \
        == (pad, pad, 0)
    back = transformers.MarianMTModel.from_pretrained(out, attn_implementation="eager").eval()
    batch = _seq2seq_batch(pad, pad)
    _close(_hf_seq2seq_logits(back, *batch), _hf_seq2seq_logits(hf, *batch), 1e-6)
    text = "the lazy fox reads one sentence"
    ids = transformers.MarianTokenizer.from_pretrained(out)(text)["input_ids"]
    assert ids == load_seq2seq_tokenizer(src).encode(text) == load_seq2seq_tokenizer(
        out).encode(text)


def test_qkv_transformer_directory_exports_as_marian(tmp_path, capsys):
    from qkv.models import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_name("transformer-tiny")).eval()  # the paper's
    src = model.save_pretrained(tmp_path / "qkv")
    out = tmp_path / "hf"
    assert main(["export", str(src), "--format", "hf", "--out", str(out)]) == 0
    assert "HuggingFace 'marian'" in capsys.readouterr().out
    c = model.config
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"decoder_start_token_id": c.bos_id, "eos_token_id": c.eos_id,
                   "pad_token_id": c.pad_id, "forced_eos_token_id": c.eos_id,
                   "bad_words_ids": [[c.pad_id]]}
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    batch = _seq2seq_batch(c.bos_id, c.pad_id)
    src_ids, mask, tgt = batch
    with torch.no_grad():
        ours = model(src_ids, tgt, src_mask=mask.bool())
    _close(_hf_seq2seq_logits(theirs, *batch), ours, 1e-5)


def test_seq2seq_refusals_are_one_line(hf_marian, tmp_path, capsys):
    from qkv.models import Transformer, TransformerConfig

    src = Transformer(TransformerConfig.from_name("transformer-tiny", positions="alibi")
                      ).save_pretrained(tmp_path / "alibi")
    out = tmp_path / "out"
    assert main(["export", str(src), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv export: error: hf_config_for: this TransformerConfig cannot be "
                          "exported to HF: positions='alibi'"), err
    assert err.count("\n") == 1 and not out.exists()
    assert main(["export", str(hf_marian[1]), "--format", "hf", "--hf-type", "t5",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cannot be exported as HF T5 (model_type 't5', asked for)" in err, err
    assert err.count("\n") == 1 and not out.exists()
