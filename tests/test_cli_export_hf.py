"""``qkv export SRC --format hf --out DIR``: a HuggingFace directory transformers loads with the
source's logits, from an HF model directory (its tokenizer files and token ids kept, its
family kept unless ``--hf-type`` says otherwise) or a ``qkv train`` run (its BPE tokenizer
as HF's tokenizer.json); refusals end with one line and leave nothing behind.

Oracles: transformers' AutoModelForCausalLM / AutoTokenizer loading the written directory,
against the source HF model or the run's own model and tokenizer. Tolerance: logits within
1e-5 of the logits' largest magnitude; tokenizer ids and copied files exactly equal.
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
