"""Model kind "clip": a ``qkv.models.CLIP`` trained contrastively on image-caption pairs —
the synthetic shapes task (``--task shapes``: ``qkv.data.shapes_pairs.ShapesPairs``, where a
quarter of the captions are zero-shot prompts) or a folder of images with a captions TSV
(``--data DIR``: ``qkv.data.folder_pairs.FolderPairs``, whole images held out).

Shapes: B batch (pairs image i <-> caption i), W processes, N text length, H = W_img image
side (the model's ``vision.image_size``), E embedding width.

Text: a char tokenizer (or BPE, ``--tokenizer bpe``) fitted to the pairs' ``texts`` (for
shapes every caption and prompt it can write, so that every prompt is encodable); rows bos
+ caption + eos with a mask (``qkv.data.clip_text.encode_texts``). The text tower gets
``vocab_size`` and ``eos_token_id`` from the tokenizer, "eos" pooling, and ``max_len`` =
the longest text + 2 (or ``--max-len``, which must hold them). Images: ``pixel_values`` =
CLIP's normalisation of images in [0, 1] (``qkv.data.image_preprocess.to_pixel_values``);
a checkpoint holds the transform as ``preprocessor_config.json`` (``processor_config``).

Batches (``make_batch``): ``pixel_values`` (B, 3, H, W) float32, ``input_ids`` (B, N),
``attention_mask`` (B, N) bool; step s holds training pairs s·B .. s·B + B - 1.

Loss: the symmetric InfoNCE of ``CLIP.loss`` (``qkv.models.clip_loss``). Under W processes
each rank holds B/W pairs, gathers every rank's features with gradients and takes the mean
loss of its own rows against all B columns, L_r. ``loss`` returns ``(L_r · B/W, B/W)``:
the trainer's logged loss Σ L_r·(B/W) / B is the mean of the L_r — the loss of the global
batch — and it back-propagates L_r·(B/W)·W/B = L_r on each rank, which the gather's
backward and DDP's average over ranks turn into the gradient of the global loss (exactly
one process's on the whole batch). ``label_smoothing`` does not apply (ignored).
After every optimizer step ``logit_scale`` is clamped to [0, log 100].

Evaluation (rank 0, no collectives; ``qkv.models.zero_shot``): ``eval_loss``, the
contrastive loss of held-out pairs in chunks of ``EVAL_BATCH``, averaged by pairs;
``recall_at_1``, text -> image among them; for shapes ``zero_shot_accuracy``, top-1 on the
"test" split (held-out combinations) among the ensembled English prompts of all 30
combinations (``shapes_zero_shot_accuracy``).

Not yet: ``--init-from`` / peft with clip (refused by ``check_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...data.clip_text import encode_texts
from ...data.folder_pairs import FolderPairs, folder_fingerprint
from ...data.image_preprocess import processor_config, to_pixel_values
from ...data.shapes_pairs import ShapesPairs, zero_shot_prompts
from ...models import CLIP, CLIPConfig
from ...models.zero_shot import chunked_contrastive_loss, retrieval_recall, zero_shot_accuracy
from .base import ModelKind

__all__ = ["EVAL_BATCH", "CLIPKind", "shapes_zero_shot_accuracy"]

#: pairs per chunk of the evaluation's contrastive loss (and per encoding batch)
EVAL_BATCH = 256


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a CLIPConfig dict) with ``overrides``: "vision.dim" / "text.num_layers"
    set one field of a tower, a dict for "vision" / "text" updates its fields, anything
    else a top-level field."""
    out = {**base, "vision": dict(base.get("vision", {})), "text": dict(base.get("text", {}))}
    for key, value in overrides.items():
        tower, dot, field = key.partition(".")
        if dot and tower in ("vision", "text"):
            out[tower][field] = value
        elif key in ("vision", "text") and isinstance(value, dict):
            out[key].update(value)
        else:
            out[key] = value
    return out


class CLIPKind(ModelKind):
    """The contrastive image-text kind (see the module docstring)."""

    name = "clip"
    default_preset = "clip-shapes"
    model_class = CLIP
    model_types = ("qkv-clip",)
    tasks = ("shapes",)
    data_what = "a folder of images with captions.tsv"
    splits_batches = False  # the negatives of a micro-batch would be fewer than the batch's

    def check_config(self, config: Any) -> None:
        from ..errors import ConfigError

        super().check_config(config)
        for field in ("init_from", "peft"):
            if getattr(config, field) is not None:
                raise ConfigError(field, f"{field} is not supported with --model clip yet: "
                                         f"a CLIP run trains from scratch")

    # --- data ---------------------------------------------------------------------------
    def model_dict(self, config: Any, *, vocab_size: int | None = None,
                   eos_token_id: int | None = None, max_len: int | None = None
                   ) -> dict[str, Any]:
        """The CLIPConfig fields of a run: the preset, the text sizes the data needs (when
        given), then the user's overrides (``_merge``)."""
        presets = CLIPConfig.PRESETS
        if config.model_preset not in presets:
            raise ValueError(f"CLIPConfig: unknown preset {config.model_preset!r}; known: "
                             f"{sorted(presets)}")
        base = _merge(presets[config.model_preset], {})
        derived = {f"text.{k}": v for k, v in (("vocab_size", vocab_size),
                                                ("eos_token_id", eos_token_id),
                                                ("max_len", max_len)) if v is not None}
        if derived:
            derived["text.pooling"] = "eos"
        return _merge(_merge(base, derived), config.overrides)

    def image_size(self, config: Any) -> int:
        """The side of the run's images: the model's ``vision.image_size``."""
        vision = self.model_dict(config)["vision"]
        from ...models.vit import ViTConfig

        return int(ViTConfig.from_dict(vision).image_size)

    def _data(self, config: Any) -> ShapesPairs | FolderPairs:
        size = self.image_size(config)
        if config.task is not None:
            return ShapesPairs(image_size=size, seed=config.seed)
        return FolderPairs(str(config.data), image_size=size, seed=config.seed)

    @staticmethod
    def _need(texts: list[str], tokenizer: Any) -> int:
        return max(len(tokenizer.encode(t)) for t in texts) + 2  # bos + text + eos

    def prepare_data(self, config: Any) -> tuple[Any, Any, int, int]:
        from ...data import BPETokenizer, CharTokenizer

        data = self._data(config)
        texts = data.texts
        tokenizer = (CharTokenizer.from_texts(texts) if config.tokenizer == "char"
                     else BPETokenizer.train(texts, vocab_size=config.bpe_vocab_size))
        need = self._need(texts, tokenizer)
        if config.max_len is not None and config.max_len < need:
            raise ValueError(f"max_len={config.max_len} is shorter than the longest caption "
                             f"or prompt ({need} tokens with bos and eos); raise --max-len "
                             f"or leave it out")
        return data, tokenizer, config.max_len or need, need

    def load_data(self, config: Any, tokenizer: Any, max_len: int) -> Any:
        data = self._data(config)
        need = self._need(data.texts, tokenizer)
        if need > max_len:
            raise ValueError(f"--data {config.data}: its longest caption needs {need} tokens "
                             f"with bos and eos, beyond the model's max_len={max_len} (the "
                             f"captions changed since the run began); restore them or start "
                             f"a new run")
        return data

    def data_fingerprint(self, path: Any) -> dict[str, Any]:
        """Of a folder: its captions.tsv's bytes and every file's name and size."""
        path = Path(path)
        if not path.is_dir():
            raise OSError("not a directory (--model clip reads a folder with captions.tsv)")
        return folder_fingerprint(path)

    # --- model --------------------------------------------------------------------------
    def build_model(self, config: Any, tokenizer: Any, max_len: int) -> nn.Module:
        fields = self.model_dict(config, vocab_size=tokenizer.vocab_size,
                                 eos_token_id=tokenizer.eos_id, max_len=max_len)
        return CLIP(CLIPConfig.from_dict(fields))

    def check_model(self, model_config: Any, tokenizer: Any, max_len: int) -> None:
        text = model_config.text
        if text.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"text.vocab_size={text.vocab_size} is smaller than the "
                             f"tokenizer's {tokenizer.vocab_size} ids: leave --set "
                             f"text.vocab_size out (qkv sets it from the data)")
        if text.max_len < max_len:
            raise ValueError(f"text.max_len={text.max_len} is shorter than the {max_len} "
                             f"tokens of the longest caption: leave --set text.max_len out")
        if text.eos_token_id != tokenizer.eos_id or text.pooling != "eos":
            raise ValueError(f"text.eos_token_id={text.eos_token_id}, text.pooling="
                             f"{text.pooling!r}: the texts end with the tokenizer's eos "
                             f"{tokenizer.eos_id}, where the text is pooled ('eos'); leave "
                             f"--set text.eos_token_id / text.pooling out")

    def max_len_of(self, model: nn.Module) -> int:
        return int(model.config.text.max_len)

    def estimate_memory(self, model: nn.Module, *, batch_size: int, seq_len: int,
                        eval_examples: int) -> Any:
        """Both towers as token stacks — the image tower over T = (H/P)² + 1 tokens, the
        text tower over ``seq_len`` — the B x B similarity logits, the images of a step
        (and of an evaluation: held-out and test images and their embeddings)."""
        from ..memory import estimate_stacks_bytes

        v, t = model.config.vision, model.config.text
        tokens = (v.image_size // v.patch_size) ** 2 + 1
        pixels = v.num_channels * v.image_size ** 2
        stacks = [(v.dim, v.ffn_hidden or 4 * v.dim, v.num_heads, v.num_layers, tokens),
                  (t.dim, t.ffn_hidden or 4 * t.dim, t.num_heads, t.num_layers, seq_len)]
        return estimate_stacks_bytes(model, batch_size=batch_size, stacks=stacks,
                                     output_numbers=2 * batch_size * batch_size,
                                     input_numbers=2 * batch_size * pixels,
                                     eval_bytes=int(eval_examples) * 4 * 2 * (
                                         pixels + model.config.embed_dim))

    # --- one step -----------------------------------------------------------------------
    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        images, captions = items
        input_ids, attention_mask = encode_texts(tokenizer, captions)
        return {"pixel_values": to_pixel_values(images), "input_ids": input_ids,
                "attention_mask": attention_mask}

    def loss(self, model: nn.Module, batch: dict[str, Tensor], *,
             label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        """``(L · b, b)`` for this process's b pairs, L its local contrastive loss against
        the global batch (see the module docstring for why this is exact)."""
        rows = batch["input_ids"].shape[0]
        loss = model.loss(batch["pixel_values"], batch["input_ids"], batch["attention_mask"])
        return loss.float() * rows, torch.tensor(rows, device=loss.device)

    def loss_count(self, batch: dict[str, Tensor]) -> Tensor:
        """The pairs of ``batch`` (what ``loss`` averages over)."""
        return torch.tensor(batch["input_ids"].shape[0], device=batch["input_ids"].device)

    def batch_tokens(self, batch: dict[str, Tensor], tokenizer: Any) -> int:
        """The captions' real tokens (images are not counted)."""
        return int(batch["attention_mask"].sum())

    def after_optimizer_step(self, model: nn.Module) -> None:
        model.clamp_logit_scale_()

    # --- evaluation and checkpoints -----------------------------------------------------
    def evaluate(self, model: nn.Module, tokenizer: Any, data: Any,
                 count: int) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                images, captions = data.heldout(count)
                img, txt = self._embed(model, tokenizer, images, captions)
                scale = model.logit_scale.exp().float()
                result = {"eval_loss": chunked_contrastive_loss(img, txt, scale,
                                                                chunk=EVAL_BATCH),
                          "recall_at_1": retrieval_recall(img, txt, ks=(1,))["text_to_image@1"]}
                if isinstance(data, ShapesPairs):
                    test_images, labels = data.test(count)
                    result["zero_shot_accuracy"] = shapes_zero_shot_accuracy(
                        model, tokenizer, test_images, labels)
        finally:
            model.train(was_training)
        return result

    @staticmethod
    def _embed(model: nn.Module, tokenizer: Any, images: Tensor, captions: list[str]
               ) -> tuple[Tensor, Tensor]:
        """Image and text embeddings (B, E) each, fp32, encoded in chunks."""
        device = next(model.parameters()).device
        img, txt = [], []
        for i in range(0, len(captions), EVAL_BATCH):
            ids, mask = encode_texts(tokenizer, captions[i:i + EVAL_BATCH])
            img.append(model.encode_image(to_pixel_values(images[i:i + EVAL_BATCH]).to(device)))
            txt.append(model.encode_text(ids.to(device), mask.to(device)))
        return torch.cat(img).float(), torch.cat(txt).float()

    def checkpoint_files(self, model: nn.Module) -> dict[str, Any]:
        """preprocessor_config.json: the image transform, in HF CLIPImageProcessor's fields."""
        return {"preprocessor_config.json": processor_config(int(model.config.vision.image_size))}


def shapes_zero_shot_accuracy(model: nn.Module, tokenizer: Any, images: Tensor,
                              labels: Tensor) -> float:
    """Top-1 accuracy of shapes images (B, 3, H, W) in [0, 1] with ``labels`` (B,) indices
    into ``COMBINATIONS``, classified among all K = 30 combinations by the English prompt
    templates, ensembled (``qkv.models.zero_shot.zero_shot_accuracy``: the mean of the M
    normalised prompt embeddings of a class, renormalised)."""
    device = next(model.parameters()).device

    def tokenize(texts: list[str]) -> tuple[Tensor, Tensor]:
        ids, mask = encode_texts(tokenizer, texts)
        return ids.to(device), mask.to(device)

    prompts = [list(row) for row in zip(*zero_shot_prompts("en"), strict=True)]  # K x M
    return zero_shot_accuracy(model, tokenize, prompts, to_pixel_values(images), labels,
                              batch_size=EVAL_BATCH)
