"""The TransformerConfig fields of pretrained encoder-decoders (T5, BART, Marian): each
checked against math written here (fp64 where it is a formula) and its validation.

Tolerances: fp64 formulas exact to 1e-12; fp32 model outputs to 1e-6 relative."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.models import Transformer, TransformerConfig
from qkv.modules.positions import Sinusoidal

BASE = dict(src_vocab_size=23, tgt_vocab_size=23, dim=16, num_encoder_layers=1,
            num_decoder_layers=1, num_heads=2, ffn_hidden=24, dropout=0.0, max_len=20)


def _model(**fields) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(**{**BASE, **fields})).eval()


def test_sinusoidal_halves_is_sin_then_cos():
    dim, base = 8, 10000.0
    pos = torch.arange(7)
    got = Sinusoidal(dim, layout="halves").encoding(pos).double()
    want = torch.empty(7, dim, dtype=torch.float64)
    for p in range(7):
        for i in range(dim // 2):
            angle = p / base ** (2 * i / dim)
            want[p, i], want[p, dim // 2 + i] = math.sin(angle), math.cos(angle)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # the table is fp32
    inter = Sinusoidal(dim).encoding(pos)
    torch.testing.assert_close(inter[:, 0::2], got[:, :dim // 2].float())
    with pytest.raises(ValueError, match="layout"):
        Sinusoidal(dim, layout="pairs")


def test_position_offset_reads_shifted_rows():
    m = _model(positions="learned", position_offset=2, scale_embeddings=False)
    assert m.src_positions.weight.shape == (BASE["max_len"] + 2, BASE["dim"])
    src = torch.tensor([[3, 4, 5]])
    want = m.src_embed(src) + m.src_positions.weight[2:5]
    got = m._embed(src, m.src_embed, m.src_positions, torch.arange(3), "src", None)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="max_len"):  # the limit is on positions, not rows
        m.encode(torch.randint(3, 23, (1, BASE["max_len"] + 1)))


def test_head_bias_and_scale_and_embed_norm():
    m = _model(head_bias=True, head_scale=0.25, embed_norm=True)
    assert m.lm_head.bias is not None and m.src_embed_norm is not None
    with torch.no_grad():
        m.lm_head.bias.normal_()
    src, tgt = torch.tensor([[3, 4, 5, 2]]), torch.tensor([[1, 6, 7]])
    out = m(src, tgt, output_attentions=True)
    memory, keep = m.encode(src)
    hidden = m._decode_hidden(tgt, memory, memory_mask=keep, memory_kv=None,
                              tgt_lengths=None, tgt_mask=None, cache=None,
                              need_weights=False)[0]
    want = hidden * 0.25 @ m.lm_head.weight.T + m.lm_head.bias
    torch.testing.assert_close(out.logits, want, rtol=1e-6, atol=1e-6)
    # the embedding norm is applied: its bias shows in the encoder input
    x = m._embed(src, m.src_embed, m.src_positions, torch.arange(4), "src", m.src_embed_norm)
    torch.testing.assert_close(x.mean(-1), torch.zeros(1, 4), atol=1e-5, rtol=0)


def test_attention_head_dim_and_scale_and_gated_ffn():
    m = _model(num_heads=3, attention_head_dim=8, attention_scale=1.0, activation="geglu_tanh")
    attn = m.encoder_layers[0].attn
    assert attn.in_proj.weight.shape == (3 * 3 * 8, BASE["dim"])
    assert m.decoder_layers[0].ffn.fc_in.weight.shape == (2 * BASE["ffn_hidden"], BASE["dim"])
    src = torch.tensor([[3, 4, 5, 2]])
    out = m(src, torch.tensor([[1, 6]]), output_attentions=True)
    # unscaled scores: the encoder's weights are softmax(q·k) (no 1/sqrt(D)), fp64 here
    x = m._embed(src, m.src_embed, m.src_positions, torch.arange(4), "src", None).double()
    q, k, _ = (x @ attn.in_proj.weight.double().T + attn.in_proj.bias.double()).split(24, -1)
    q, k = (t.view(1, 4, 3, 8).transpose(1, 2) for t in (q, k))
    want = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    torch.testing.assert_close(out.encoder_attentions[0].double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, match", [
    (dict(position_offset=2), "learned"),
    (dict(positions="learned", position_offset=-1), "position_offset"),
    (dict(head_scale=0.0), "head_scale"),
    (dict(attention_scale=float("nan")), "attention_scale"),
    (dict(attention_head_dim=0), "attention_head_dim"),
    (dict(num_heads=3), "attention_head_dim"),
    (dict(sinusoidal_layout="pairs"), "sinusoidal_layout"),
    (dict(embed_norm=1), "embed_norm"),
    (dict(activation="reglu"), "activation"),
])
def test_bad_fields_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**BASE, **fields})


@pytest.mark.parametrize("frozen", [True, False])
def test_freeze_pad_row_decides_whether_the_pad_row_learns(frozen):
    """T5 starts its decoder from the pad token, and HF trains that row (no padding_idx);
    untied here: a tied head would give the row a gradient through the logits anyway;
    BART/Marian (and the paper's model) keep it frozen at zero."""
    m = _model(freeze_pad_row=frozen, share_embeddings=True, bos_id=0, tie_output=False)
    m.train()
    assert bool((m.src_embed.weight[0] == 0).all()) == frozen
    src, tgt = torch.tensor([[3, 4, 5, 2]]), torch.tensor([[0, 6, 7]])
    m(src, tgt).sum().backward()
    grad = m.src_embed.weight.grad[0]
    assert bool((grad == 0).all()) == frozen


def test_loaded_t5_trains_its_pad_row(tmp_path):
    from _hf_t5 import hf_t5, save_hf

    from qkv.models import from_pretrained

    model = from_pretrained(save_hf(hf_t5("flan-t5"), tmp_path / "t5"))
    assert model.config.freeze_pad_row is False and model.src_embed.padding_idx is None
