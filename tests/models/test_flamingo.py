"""``qkv.models.Flamingo``: gates at 0 == the frozen GPT bit for bit; frozen bases unchanged
by an optimizer step with no ``.grad``; the gated blocks reached through the LM (logits
against a hand-run of GPT's layers with the blocks in between); cached decoding (``bind_images``
+ ``qkv.generate``) == full forward at every step, an ``<image>`` fed mid-decoding included;
a padded batch row == the row alone with other image counts; errors; save/load.

Shapes: B batch, N text length, V vocab, T image slots, C width.
Tolerances: gates at 0: exact (torch.equal) against GPT's (B, N, C) path; hand-run / cached /
padded vs alone: fp32 atol 1e-5 (other batch sizes and lengths pick other kernels and
summation orders).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import qkv
from qkv.models import CLIP, GPT, CLIPConfig, Flamingo, GPTConfig, ViT, ViTConfig
from qkv.models.flamingo import CONFIG_NAME, WEIGHTS_NAME, FlamingoCache
from qkv.models.hub import CheckpointError

IMG = 5
V = 24


def make_lm(layers: int = 2) -> GPT:
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=V, max_len=64, dim=32, num_heads=4,
                                   num_layers=layers))


def make_vit() -> ViT:
    return ViT(ViTConfig.from_name("vit-tiny", dim=16, image_size=16, patch_size=8))


def make(layers: int = 2, **kw) -> Flamingo:
    return Flamingo(make_lm(layers), make_vit(), image_token_id=IMG, num_latents=3, **kw)


def open_gates(model: Flamingo, value: float = 0.8) -> None:
    with torch.no_grad():
        for block in model.gated.values():
            block.attn_gate.fill_(value)
            block.ff_gate.fill_(-value / 2)


def ids_with_images(b: int, n: int, positions: list[list[int]]) -> torch.Tensor:
    ids = torch.randint(IMG + 1, V, (b, n))
    for r, pos in enumerate(positions):
        ids[r, pos] = IMG
    return ids


def test_gates_at_zero_equal_the_frozen_lm_exactly():
    model = make().eval()
    ids = ids_with_images(3, 12, [[0, 5], [3], []])
    images = torch.randn(3, 2, 3, 16, 16)
    assert torch.equal(model(ids, images), model.lm(ids))
    keep = torch.ones(3, 12, dtype=torch.bool)
    keep[1, :2] = False  # left padding
    got = model(ids, images, keep)
    # GPT in train mode (dropout 0) runs the same (B, N, C) math as the wrapper: exact (in
    # eval GPT may pack a padded batch's real tokens, other kernels: not the same math)
    assert torch.equal(got, model.lm.train()(ids, attention_mask=keep))
    model.lm.eval()
    assert torch.equal(model(ids[2:], None), model.lm(ids[2:]))  # a row without images
    open_gates(model)
    assert not torch.allclose(model(ids, images), model.lm(ids), atol=1e-3)


def test_blocks_run_before_their_layers():
    """An independent hand-run of GPT's modules with the blocks in between (layers 1 and 3 of
    4 for cross_attn_every=2, OpenFlamingo's placement)."""
    model = make(layers=4, cross_attn_every=2).eval()
    assert sorted(model.gated) == ["1", "3"]
    open_gates(model)
    ids = ids_with_images(2, 9, [[1, 6], [4]])
    images = torch.randn(2, 2, 3, 16, 16)
    lm = model.lm
    counts = (ids == IMG).sum(1)
    mask = torch.arange(2)[None] < counts[:, None]
    latents = model.resampler(
        torch.stack([torch.stack([model.vision(images[b, t:t + 1]).last_hidden_state[0, 1:]
                                  for t in range(2)]) for b in range(2)]), media_mask=mask)
    tt = (ids == IMG).long().cumsum(1)
    x = lm.positions(lm.embed(ids), torch.arange(9))
    for i, layer in enumerate(lm.layers):
        if str(i) in model.gated:
            x = model.gated[str(i)](x, latents, text_time=tt, media_mask=mask)
        x = layer(x, causal=True)
    want = lm.lm_head(lm.norm(x))
    torch.testing.assert_close(model(ids, images), want, atol=1e-5, rtol=0)


def test_frozen_parameters_unchanged_and_no_grad_allocated():
    model = make()
    open_gates(model, 0.3)
    frozen = {k: v.clone() for k, v in model.state_dict().items()
              if k.startswith(("lm.", "vision."))}
    assert all(not p.requires_grad for p in model.lm.parameters())
    assert all(not p.requires_grad for p in model.vision.parameters())
    new = model.trainable_parameters()
    assert {id(p) for p in new} == {id(p) for n, p in model.named_parameters()
                                    if n.startswith(("resampler.", "gated."))}
    before = [p.detach().clone() for p in new]
    opt = torch.optim.AdamW(new, lr=1e-2)
    model.train()
    assert not model.lm.training and not model.vision.training and model.resampler.training
    ids = ids_with_images(2, 10, [[0, 4], [2]])
    images = torch.randn(2, 2, 3, 16, 16)
    loss = model.loss(ids, images, ids.roll(-1, 1))
    ref = torch.nn.functional.cross_entropy(model(ids, images).flatten(0, 1),
                                            ids.roll(-1, 1).flatten())
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)  # fused loss == logits' CE
    loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        if name.startswith(("lm.", "vision.")):
            assert p.grad is None, name
    after = model.state_dict()
    for k, v in frozen.items():
        assert torch.equal(after[k], v), k
    assert any(not torch.equal(a, b) for a, b in zip(before, new, strict=True))


def test_padded_row_equals_row_alone_with_other_image_counts():
    model = make().eval()
    open_gates(model)
    ids = ids_with_images(2, 10, [[0, 5], [2]])
    images = torch.randn(2, 2, 3, 16, 16)
    both = model(ids, images)
    alone1 = model(ids[1:], images[1:, :1])  # row 1 has one image: its second slot is padding
    torch.testing.assert_close(both[1:], alone1, atol=1e-5, rtol=0)
    alone0 = model(ids[:1], images[:1])
    torch.testing.assert_close(both[:1], alone0, atol=1e-5, rtol=0)
    junk = images.clone()
    junk[1, 1] = float("nan")  # the padded slot is never encoded nor attended (Checklist 9)
    assert torch.equal(model(ids, junk), both)
    # left padding: a shorter row padded on the left == the row alone
    short = ids_with_images(1, 7, [[1]])
    padded = torch.cat([torch.full((1, 3), 7), short], dim=1)
    keep = torch.ones(1, 10, dtype=torch.bool)
    keep[0, :3] = False
    pair_ids = torch.cat([ids[:1], padded])
    pair_keep = torch.cat([torch.ones(1, 10, dtype=torch.bool), keep])
    out = model(pair_ids, images, pair_keep)
    torch.testing.assert_close(out[1:, 3:], model(short, images[1:, :1]), atol=1e-5, rtol=0)


def test_pad_tokens_equal_to_image_id_are_not_images():
    model = make().eval()
    open_gates(model)
    ids = ids_with_images(1, 6, [[2]])
    padded = torch.cat([torch.full((1, 2), IMG), ids], dim=1)  # pads that spell <image>
    keep = torch.ones(1, 8, dtype=torch.bool)
    keep[0, :2] = False
    images = torch.randn(1, 1, 3, 16, 16)
    torch.testing.assert_close(model(padded, images, keep)[:, 2:], model(ids, images),
                               atol=1e-5, rtol=0)


def test_cached_generation_equals_full_forward_every_step():
    model = make().eval()
    open_gates(model)
    prompt = ids_with_images(2, 6, [[0], [1, 3]])
    images = torch.randn(2, 3, 3, 16, 16)
    dec = model.bind_images(images, image_counts=torch.tensor([2, 3]))
    feed = torch.tensor([[9, IMG, 11, 12, 13], [10, 14, IMG, 8, 7]])  # a 2nd/3rd image later
    seq = prompt
    with torch.no_grad():
        cache = dec.new_cache(2, 11)
        assert isinstance(cache, FlamingoCache)
        step_logits = [dec(prompt, cache=cache)]
        for j in range(feed.shape[1]):
            step_logits.append(dec(feed[:, j:j + 1], cache=cache))
            seq = torch.cat([seq, feed[:, j:j + 1]], dim=1)
        full = model(seq, images)
    got = torch.cat(step_logits, dim=1)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    assert cache.seen.tolist() == [2, 3]
    # qkv.generate: cached == uncached, greedy and beams; it continues the full forward
    out = qkv.generate(dec, prompt, max_new_tokens=6)
    assert torch.equal(out, qkv.generate(dec, prompt, max_new_tokens=6, use_cache=False))
    with torch.no_grad():
        first = model(prompt, images)[:, -1].argmax(-1)
    assert torch.equal(out[:, 6], first)
    beams = qkv.generate(dec, prompt, max_new_tokens=4, num_beams=3)
    assert torch.equal(beams, qkv.generate(dec, prompt, max_new_tokens=4, num_beams=3,
                                           use_cache=False))


def test_generation_with_left_padded_prompts():
    model = make().eval()
    open_gates(model)
    a = ids_with_images(1, 7, [[0, 4]])
    b = ids_with_images(1, 4, [[1]])
    images = torch.randn(2, 2, 3, 16, 16)
    prompts = torch.cat([a, torch.cat([torch.full((1, 3), 7), b], dim=1)])
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[1, :3] = 0
    dec = model.bind_images(images, image_counts=torch.tensor([2, 1]))
    out = qkv.generate(dec, prompts, attention_mask=keep, max_new_tokens=5)
    alone = qkv.generate(model.bind_images(images[1:, :1]), b, max_new_tokens=5)
    assert torch.equal(out[1, 7:], alone[0, 4:])


def test_clip_image_tower_and_all_tokens():
    clip = CLIP(CLIPConfig.from_name("clip-tiny", vision={"image_size": 16, "patch_size": 8,
                                                          "dim": 16, "num_layers": 1,
                                                          "num_heads": 2, "pre_norm": True,
                                                          "patch_bias": False}))
    model = Flamingo(make_lm(), clip, image_token_id=IMG, num_latents=2,
                     vision_features="all").eval()
    assert model.vision is clip.vision
    open_gates(model)
    ids = ids_with_images(1, 5, [[0]])
    assert model(ids, torch.randn(1, 1, 3, 16, 16)).shape == (1, 5, V)


def test_errors_are_clear():
    model = make().eval()
    ids = ids_with_images(2, 6, [[0, 3], [1]])
    images = torch.randn(2, 2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"row 0 has 2 <image> tokens but images holds 1"):
        model(ids, images[:, :1])
    with pytest.raises(ValueError, match="row 0 has 2 <image> tokens but images holds 0"):
        model(ids, None)
    with pytest.raises(ValueError, match=r"images must have shape \(B, T, Cin, H, W\)"):
        model(ids, images[:, 0])  # (B, 3, H, W): the T axis missing
    with pytest.raises(ValueError, match=r"images must have shape"):
        model(ids, images[:1])  # batch mismatch
    with pytest.raises(ValueError, match=r"images must have shape"):
        model(ids, torch.randn(2, 2, 1, 16, 16))  # channels
    with pytest.raises(TypeError, match="floating-point"):
        model(ids, images.to(torch.uint8))
    with pytest.raises(ValueError, match="multiples of patch_size"):
        model(ids, torch.randn(2, 2, 3, 12, 12))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, images, torch.ones(2, 5))
    with pytest.raises(ValueError, match="image_token_id"):
        Flamingo(make_lm(), make_vit(), image_token_id=V)
    with pytest.raises(TypeError, match=r"lm must be a qkv\.models\.GPT"):
        Flamingo(make_vit(), make_vit(), image_token_id=1)
    with pytest.raises(TypeError, match="vision must be"):
        Flamingo(make_lm(), make_lm(), image_token_id=1)
    with pytest.raises(ValueError, match="cross_attn_every=3 places no gated block"):
        make(cross_attn_every=3)
    with pytest.raises(ValueError, match="cross_attn_heads=3 does not divide"):
        make(cross_attn_heads=3)
    dec = model.bind_images(images, image_counts=torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="row 1 has 2 <image> tokens but bind_images bound 1"):
        dec(ids_with_images(2, 4, [[0], [0, 2]]), cache=dec.new_cache(2, 8))
    with pytest.raises(ValueError, match="rows must be B or B·K"):
        dec(ids[:1])
    with pytest.raises(ValueError, match="image_counts must be in"):
        model.bind_images(images, image_counts=torch.tensor([3, 1]))


def test_save_load_only_new_parts_and_refuse_changed_base(tmp_path):
    model = make().eval()
    open_gates(model)
    ids = ids_with_images(2, 8, [[0, 4], [2]])
    images = torch.randn(2, 2, 3, 16, 16)
    want = model(ids, images)
    lm_dir, vit_dir = tmp_path / "lm", tmp_path / "vit"
    model.lm.save_pretrained(lm_dir)
    model.vision.save_pretrained(vit_dir)
    out = model.save_pretrained(tmp_path / "fl", lm_path=lm_dir, vision_path=vit_dir)
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    keys = load_file(out / WEIGHTS_NAME)
    assert keys and all(k.startswith(("resampler.", "gated.")) for k in keys)
    assert "gated.0.attn_gate" in keys and "gated.1.ff_gate" in keys
    info = json.loads((out / CONFIG_NAME).read_text())
    assert info["bases"]["lm"]["path"] == str(lm_dir.resolve())
    assert len(info["bases"]["vision"]["sha256"]) == 64
    # from the recorded paths, and from objects handed in
    for loaded in (Flamingo.from_pretrained(out),
                   Flamingo.from_pretrained(out, lm=make_lm_copy(model), vision=model.vision)):
        assert loaded.config == model.config
        torch.testing.assert_close(loaded(ids, images), want, atol=0, rtol=0)
    # a changed base is refused, naming it
    other = make_lm_copy(model)
    with torch.no_grad():
        other.layers[0].ffn.fc_in.weight[0, 0] += 1e-3
    with pytest.raises(CheckpointError, match=r"the lm base .* is not the one"):
        Flamingo.from_pretrained(out, lm=other)
    other.save_pretrained(lm_dir)  # the base on disk changed
    with pytest.raises(CheckpointError, match="the lm base"):
        Flamingo.from_pretrained(out)
    # everything on request: loads with no base around
    full = model.save_pretrained(tmp_path / "full", include_bases=True)
    assert (full / "lm" / "model.safetensors").is_file()
    torch.testing.assert_close(Flamingo.from_pretrained(full)(ids, images), want, atol=0,
                               rtol=0)
    # no path recorded and no base given
    bare = model.save_pretrained(tmp_path / "bare")
    with pytest.raises(CheckpointError, match="pass lm="):
        Flamingo.from_pretrained(bare)


def make_lm_copy(model: Flamingo) -> GPT:
    lm = make_lm()
    lm.load_state_dict(model.lm.state_dict())
    return lm


def test_generated_image_token_past_the_bound_images_reads_nothing():
    """Row 0 has 1 bound image; an <image> fed during decoding has none: the text from it on
    attends no latent. Cached steps == the uncached decoder on the whole sequence == the LM
    conditioned by hand with text_time 0 from the extra <image> on."""
    model = make().eval()
    open_gates(model)
    images = torch.randn(1, 1, 3, 16, 16)
    dec = model.bind_images(images)
    prompt = ids_with_images(1, 4, [[0]])
    feed = torch.tensor([[9, IMG, 11]])
    seq = torch.cat([prompt, feed], dim=1)
    real = torch.ones(1, 1, dtype=torch.bool)
    with torch.no_grad():
        cache = dec.new_cache(1, 7)
        steps = [dec(prompt, cache=cache)] + [dec(feed[:, j:j + 1], cache=cache)
                                              for j in range(3)]
        whole = dec(seq)
        kvs = model.media_kv(model.encode_images(images, real))
        want = model.lm.lm_head(model.hidden_states(
            seq, media_kv=kvs, text_time=torch.tensor([[1, 1, 1, 1, 1, 0, 0]]),
            media_mask=real))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=0)


def test_new_parts_fit_a_tiny_qa_batch():
    """Checklist 22: only the resampler and gated blocks train, on answer tokens of 4 shapes
    QA rows; the loss falls below a quarter of its start in 40 steps. (The LM's embeddings
    are scaled to N(0, 1): GPT-2's N(0, 0.02) init bounds a random LM's logits to about
    ±0.6, which no conditioning can make confident.)"""
    from qkv.data import CharTokenizer, ShapesQADataset, image_token_id, qa_alphabet

    tok = CharTokenizer(qa_alphabet())
    qa = ShapesQADataset("train", size=10, image_size=16, max_images=2)
    batch = qa.collate([qa[i] for i in range(4)], tok)
    lm = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=tok.vocab_size, max_len=128, dim=32,
                                 num_heads=4))
    torch.nn.init.normal_(lm.embed.weight, std=1.0)
    model = Flamingo(lm, make_vit(), image_token_id=image_token_id(tok), num_latents=4)
    targets = batch.input_ids.roll(-1, 1).masked_fill(~batch.answer_mask.roll(-1, 1), -100)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=2e-2)
    losses = []
    for _ in range(40):
        loss = model.loss(batch.input_ids, batch.images, targets,
                          attention_mask=batch.attention_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] / 4, losses


def test_loss_of_a_soft_capped_lm_is_the_cross_entropy_of_its_capped_logits():
    """A Gemma 2-style LM (``logit_softcap``): the loss scores the capped logits ``forward``
    returns, not the raw head's (fp32, 1e-6)."""
    lm = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=V, max_len=64, dim=32, num_heads=4,
                                 logit_softcap=0.5))
    model = Flamingo(lm, make_vit(), image_token_id=IMG, num_latents=3).eval()
    open_gates(model)
    ids = ids_with_images(2, 9, [[0], [4]])
    images = torch.randn(2, 1, 3, 16, 16)
    targets = ids.roll(-1, 1)
    with torch.no_grad():
        logits = model(ids, images)
        assert logits.abs().max() <= 0.5  # capped
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        got = model.loss(ids, images, targets)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
