"""``qkv.viz.attention_maps`` / ``token_labels``: one example's weights from each model kind.

Shapes: L layers, H heads, S source length, T target length, N sequence length.

Oracle: the model's own ``output_attentions=True`` forward in eval mode under no_grad (the
weights themselves are checked against fp64 references in tests/models); here the stacks
must equal it exactly, rows must sum to 1 over allowed keys (fp32: 1e-5), masked keys
(causal, padding) must hold exactly 0, and the training flags must be restored.
"""

from __future__ import annotations

import pytest
import torch

from qkv.models import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
from qkv.viz import MAP_NAMES, attention_maps, token_labels

V = 32


def transformer(**kw) -> Transformer:
    cfg = TransformerConfig.from_name("transformer-tiny", **{"dropout": 0.3,
                                                             "attn_dropout": 0.5, **kw})
    return Transformer(cfg)


def gpt() -> GPT:
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=V, max_len=32, dim=32,
                                   attn_dropout=0.5))


def bert() -> BERT:
    return BERT(BERTConfig.from_name("bert-tiny", vocab_size=V, max_len=32, dim=32))


def stacked(ws) -> torch.Tensor:
    return torch.stack([w[0] for w in ws])  # (L, H, N, S)


def assert_rows_sum_to_one(w: torch.Tensor) -> None:
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5, rtol=0)


def test_transformer_maps_equal_the_model_weights_and_restore_training():
    model = transformer(num_encoder_layers=2, num_decoder_layers=3).train()
    model.encoder_layers[0].eval()  # a mixed flag must survive too
    src, tgt = torch.randint(3, V, (7,)), torch.tensor([1, 4, 5, 6, 9])
    maps = attention_maps(model, src, target_ids=tgt)
    assert model.training and not model.encoder_layers[0].training
    assert model.encoder_layers[1].training
    assert list(maps) == ["encoder", "decoder", "cross"]
    h = model.config.num_heads
    assert maps["encoder"].shape == (2, h, 7, 7)
    assert maps["decoder"].shape == (3, h, 5, 5)
    assert maps["cross"].shape == (3, h, 5, 7)
    model.eval()
    with torch.no_grad():
        out = model(src[None], tgt[None], output_attentions=True)
    for name, ws in (("encoder", out.encoder_attentions),
                     ("decoder", out.decoder_self_attentions), ("cross", out.cross_attentions)):
        torch.testing.assert_close(maps[name], stacked(ws), atol=0, rtol=0)
        assert_rows_sum_to_one(maps[name])
        assert not maps[name].requires_grad and maps[name].device.type == "cpu"
    future = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    assert (maps["decoder"][..., future] == 0).all()


def test_transformer_padding_keys_hold_zero():
    model = transformer()
    src = torch.tensor([[5, 6, 0, 7, 8]])  # pad_id 0 inside: masked as a key
    maps = attention_maps(model, src, target_ids=[1, 3])
    assert (maps["encoder"][..., 2] == 0).all() and (maps["cross"][..., 2] == 0).all()
    assert_rows_sum_to_one(maps["cross"])


def test_gpt_maps_are_causal_and_equal_the_model_weights():
    model = gpt().train()
    ids = torch.randint(0, V, (1, 9))
    maps = attention_maps(model, ids)
    assert model.training and list(maps) == ["decoder"]
    assert maps["decoder"].shape == (2, 4, 9, 9)
    model.eval()
    with torch.no_grad():
        ref = stacked(model(ids, output_attentions=True).attentions)
    torch.testing.assert_close(maps["decoder"], ref, atol=0, rtol=0)
    assert_rows_sum_to_one(maps["decoder"])
    assert (maps["decoder"][..., torch.triu(torch.ones(9, 9, dtype=torch.bool), 1)] == 0).all()


def test_bert_maps_equal_the_model_weights():
    model = bert().train()
    ids = [2, 5, 7, 11, 3, 1]
    maps = attention_maps(model, ids)
    assert model.training and list(maps) == ["encoder"]
    model.eval()
    with torch.no_grad():
        ref = stacked(model(torch.tensor([ids]), output_attentions=True).attentions)
    assert maps["encoder"].shape == (2, 2, 6, 6)
    torch.testing.assert_close(maps["encoder"], ref, atol=0, rtol=0)
    assert_rows_sum_to_one(maps["encoder"])


def test_eval_mode_means_no_dropout_on_the_weights():
    model = transformer().train()
    src, tgt = torch.randint(3, V, (6,)), torch.tensor([1, 7, 8])
    a = attention_maps(model, src, target_ids=tgt)
    b = attention_maps(model, src, target_ids=tgt)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_one_example_only_and_clear_errors():
    model = transformer()
    with pytest.raises(ValueError, match=r"ONE example.*\(2, 4\)"):
        attention_maps(model, torch.randint(3, V, (2, 4)), target_ids=[1])
    with pytest.raises(ValueError, match="target_ids is required"):
        attention_maps(model, [4, 5])
    with pytest.raises(ValueError, match="empty"):
        attention_maps(model, [], target_ids=[1])
    with pytest.raises(ValueError, match="target_ids is only for"):
        attention_maps(gpt(), [4, 5], target_ids=[1])
    with pytest.raises(TypeError, match="model must be"):
        attention_maps(torch.nn.Linear(2, 2), [1])
    with pytest.raises(TypeError, match="ints"):
        attention_maps(model, [1.5, 2], target_ids=[1])
    was = model.training
    with pytest.raises(ValueError):  # an id out of range: the model's error, flags restored
        attention_maps(model, [V + 5], target_ids=[1])
    assert model.training == was


def test_token_labels_pair_each_map_with_its_tokens():
    maps = {"encoder": torch.zeros(1, 1, 3, 3), "decoder": torch.zeros(1, 1, 2, 2),
            "cross": torch.zeros(1, 1, 2, 3)}
    src, tgt = ["a", "b", "c"], ["<bos>", "x"]
    labels = token_labels(maps, input_tokens=src, target_tokens=tgt)
    assert labels == {"encoder": (src, src), "decoder": (tgt, tgt), "cross": (tgt, src)}
    assert token_labels({"decoder": maps["encoder"]}, input_tokens=src) == {
        "decoder": (src, src)}  # a GPT
    assert set(labels) <= set(MAP_NAMES)
    with pytest.raises(ValueError, match="needs target_tokens"):
        token_labels({"cross": maps["cross"]}, input_tokens=src)
    with pytest.raises(ValueError, match=r"\(L, H, 2, 2\)"):
        token_labels({"encoder": maps["encoder"]}, input_tokens=["a", "b"])
