"""``qkv attention DIR`` on an HF encoder-decoder directory (``qkv.demos.tiny_marian``:
random weights), against transformers: the maps the command writes into attention.html are
``MarianMTModel(..., output_attentions=True)``'s ``encoder_attentions`` /
``decoder_attentions`` / ``cross_attentions`` for the same source and decoder input.

- without --target the decoder input is the start token + HF's greedy ``generate``
  (the directory's generation_config.json with ``num_beams=1``), cut before eos, and the
  printed "generated target" is its ``decode(skip_special_tokens=True)``;
- with --target it is what HF feeds for ``labels=`` (the target shifted right);
- the PNGs are written; the labels are one per token; --layer out of range and --image are
  one-line errors.

Tolerance: the page keeps 4 decimals (rounding: 5e-5) and the fp32 weights of two
implementations differ by at most 5e-5 (PyTorch's SDPA bar): atol 1e-4 on weights in [0, 1].
Shapes: L = 2 layers, H = 4 heads, S source tokens, T decoder tokens.
"""

from __future__ import annotations

import json
import re
import warnings

import matplotlib.image
import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.demos.tiny_marian import make_tiny_marian

transformers = pytest.importorskip("transformers")

TEXT = "Where is the bookshop?"
TARGET = "最近的书店在哪里？"
PNGS = ("attention_encoder.png", "attention_decoder.png", "attention_cross.png",
        "attention_alignment.png")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_marian(tmp_path_factory.mktemp("tiny") / "tiny-marian")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MarianTokenizer: "Recommended: pip install sacremoses"
        tok = transformers.MarianTokenizer.from_pretrained(path)
    model = transformers.MarianMTModel.from_pretrained(path, attn_implementation="eager")
    return path, model.eval(), tok


def page_maps(path) -> dict:
    text = path.read_text(encoding="utf-8")
    payload = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text,
                        re.S).group(1)
    return {m["name"]: m for m in json.loads(payload)["maps"]}


def hf_maps(model, src: torch.Tensor, **decoder) -> dict[str, np.ndarray]:
    """HF's attention weights (L, H, N, S) for one source (1, S)."""
    with torch.no_grad():
        out = model(input_ids=src, output_attentions=True, **decoder)
    return {name: torch.stack(getattr(out, f"{name}_attentions"))[:, 0].double().numpy()
            for name in ("encoder", "decoder", "cross")}


def _check(page: dict, ref: dict, n_src: int, n_tgt: int) -> None:
    for name, want in ref.items():
        got = np.array(page[name]["w"], dtype=np.float64)
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
    assert len(page["cross"]["queries"]) == n_tgt and len(page["cross"]["keys"]) == n_src
    assert page["cross"]["keys"][-1] == "</s>"


def test_greedy_target_cross_attention_is_hfs(tiny, tmp_path, capsys):
    path, model, tok = tiny
    out = tmp_path / "viz"
    capsys.readouterr()
    assert main(["attention", str(path), "--input", TEXT, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    src = tok(TEXT, return_tensors="pt")["input_ids"]  # (1, S)
    with torch.no_grad():
        ids = model.generate(src, num_beams=1)[0].tolist()  # start, new tokens, eos
    eos = model.config.eos_token_id
    tgt = ids[:ids.index(eos, 1)] if eos in ids[1:] else ids
    assert printed[0] == f"generated target: {tok.decode(tgt[1:], skip_special_tokens=True)}"
    assert printed[1:] == [str(out / n) for n in (*PNGS, "attention.html")]
    for name in PNGS:
        assert matplotlib.image.imread(out / name).shape[2] == 4
    ref = hf_maps(model, src, decoder_input_ids=torch.tensor([tgt]))
    _check(page_maps(out / "attention.html"), ref, src.shape[1], len(tgt))
    assert ref["cross"].shape[:2] == (2, 4)


def test_given_target_is_fed_as_hf_feeds_labels(tiny, tmp_path, capsys):
    path, model, tok = tiny
    out = tmp_path / "viz"
    assert main(["attention", str(path), "--input", TEXT, "--target", TARGET, "--out",
                 str(out), "--layer", "-1", "--head", "2"]) == 0
    assert "generated target" not in capsys.readouterr().out
    batch = tok(TEXT, text_target=TARGET, return_tensors="pt")
    labels = batch["labels"]  # (1, T): target + eos
    ref = hf_maps(model, batch["input_ids"], labels=labels)  # HF shifts the labels right
    _check(page_maps(out / "attention.html"), ref, batch["input_ids"].shape[1],
           labels.shape[1])


@pytest.mark.parametrize("extra, want", [
    (["--layer", "2"], "--layer 2 is out of range: the model has 2 layers"),
    (["--image", "x.png"], "--image: "),
])
def test_one_line_errors(tiny, tmp_path, capsys, extra, want):
    path = tiny[0]
    capsys.readouterr()
    rc = main(["attention", str(path), "--input", TEXT, "--out", str(tmp_path / "v"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and want in err, err
