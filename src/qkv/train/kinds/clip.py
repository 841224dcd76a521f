"""Model kind "clip": a ``qkv.models.CLIP`` trained contrastively on image-caption pairs —
the synthetic shapes task (``--task shapes``, ``qkv.data.ShapesDataset``) or a folder of
images with a captions TSV (``--data DIR``, ``qkv.data.ImageFolderDataset``).

Shapes: B batch (pairs image i <-> caption i), W processes, N text length, H = W_img image
side (the model's ``vision.image_size``), E embedding width, K classes (30 colour/shape
combinations), M prompt templates.

Text: a qkv char tokenizer (or BPE, ``--tokenizer bpe``) fitted to the captions — for the
shapes task every caption the task can write, in English and Chinese, and every zero-shot
prompt (``PROMPT_TEMPLATES`` filled with every colour and shape, both languages), so that
every prompt is encodable. A text row is bos + caption + eos, right-padded, with an
attention mask (``encode_texts``); the text tower gets ``vocab_size`` from the tokenizer,
``eos_token_id`` = the tokenizer's eos, "eos" pooling, and ``max_len`` = the longest
caption/prompt + 2 (or ``--max-len``, which must hold them).

Images: ``pixel_values`` = CLIP's per-channel normalisation (``CLIP_MEAN`` / ``CLIP_STD``
of ``qkv.data.image_preprocess``) of images in [0, 1] (``to_pixel_values``). Shapes images
are drawn at the model's image size; a folder's images are resized (shorter side, bicubic)
and centre-cropped to it first (``preprocess_image``). Use the same two functions at
inference; a checkpoint also holds ``preprocessor_config.json`` (HF CLIPImageProcessor's
fields: size, crop, mean, std) so that a loaded run reproduces the transform.

Captions of the shapes task: a quarter of the training examples (``PROMPT_CAPTION_SHARE``,
a coin of (seed, index)) are captioned by a zero-shot prompt of their (colour, shape) in
their language — "a photo of a red circle" / "一张红色圆形的照片" — instead of the data's
"a small red circle on the left". Without it the prompts are a form of text the tower never
reads (no size, position or count; at other character positions), and their embeddings
land off the captions' manifold: a run of 300 steps named the held-out images right 81 %
of the time by prompts in their own caption's form, but 34 % by "a photo of a {colour}
{shape}" (and 30-50 % even on the trained combinations). The held-out combinations still
never appear, in any form.

Batches (``make_batch``): ``pixel_values`` (B, 3, H, W) float32, ``input_ids`` (B, N),
``attention_mask`` (B, N) bool. Step s of the shapes task holds training examples
s·B .. s·B + B - 1 (``ShapesDataset`` is index-addressable: an endless stream); a folder is
shuffled per epoch by a generator seeded with (seed, epoch), its held-out images (5 %, at
least 1, at most 1000, whole images with all their captions) never trained on.

Loss: the symmetric InfoNCE of ``CLIP.loss`` (``qkv.models.clip_loss``). Under W processes
each rank holds B/W pairs, gathers every rank's features with gradients and takes the mean
loss of its own rows against all B columns, L_r. ``loss`` returns ``(L_r · B/W, B/W)``:
the trainer's logged loss Σ L_r·(B/W) / B is the mean of the L_r — the loss of the global
batch — and it back-propagates L_r·(B/W)·W/B = L_r on each rank, which the gather's
backward and DDP's average over ranks turn into the gradient of the global loss (exactly
one process's on the whole batch). ``label_smoothing`` does not apply (ignored).
After every optimizer step ``logit_scale`` is clamped to [0, log 100]
(``CLIP.clamp_logit_scale_``).

Evaluation (rank 0, no collectives): ``eval_loss``, the contrastive loss of held-out pairs
(the "valid" split; a folder's held-out images) in chunks of ``EVAL_BATCH`` pairs,
averaged by pairs; ``recall_at_1``, text -> image recall@1 among the held-out pairs (a
caption written for several images counts only its own); for the shapes task
``zero_shot_accuracy``, top-1 on the "test" split (its held-out (colour, shape)
combinations) classified among the prompts of ALL 30 combinations, the English templates
ensembled by ``qkv.models.zero_shot_weights``.

Not yet: ``--init-from`` / peft with clip (refused by ``check_config``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...data.image_preprocess import CLIP_MEAN, CLIP_STD, preprocess_image, to_pixel_values
from ...models import CLIP, CLIPConfig
from ..data import epoch_indices
from .base import ModelKind

__all__ = [
    "EVAL_BATCH",
    "PROMPT_CAPTION_SHARE",
    "CLIPKind",
    "FolderPairs",
    "ShapesPairs",
    "encode_texts",
    "shapes_texts",
    "to_pixel_values",
    "zero_shot_prompts",
]

#: pairs per chunk of the evaluation's contrastive loss (and per encoding batch)
EVAL_BATCH = 256
#: the examples of an endless ShapesDataset stream (images are drawn on demand)
_ENDLESS = 2**62
#: the shapes task: the share of training captions replaced by a zero-shot prompt of the
#: example's (colour, shape) ("a photo of a red circle"; ``ShapesPairs.prompt_caption``)
PROMPT_CAPTION_SHARE = 0.25
#: a folder's held-out share of its images (at least 1, at most _MAX_HELD)
_HELD_FRACTION, _MAX_HELD = 0.05, 1000


# --- public helpers: text and images as the model reads them ----------------------------
def encode_texts(tokenizer: Any, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """Texts as the CLIP text tower reads them: ``(input_ids (B, N), attention_mask (B,
    N))``, each row bos + text + eos right-padded with the pad id to the longest row N;
    the mask (bool) is True at real tokens.

    Raises:
        TypeError naming ``texts`` when it is not a non-empty list of strings.
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts or not all(
            isinstance(t, str) for t in texts):
        raise TypeError(f"encode_texts: texts must be a non-empty list of strings, got "
                        f"{texts!r:.80}")
    rows = [[tokenizer.bos_id, *tokenizer.encode(t), tokenizer.eos_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)  # (B, N)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, N)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return ids, mask


def zero_shot_prompts(language: str = "en") -> list[list[str]]:
    """The zero-shot prompts of the shapes task: for each of the M templates of
    ``PROMPT_TEMPLATES[language]``, the K = 30 prompts in ``COMBINATIONS`` order (M lists)."""
    from ...data.shapes import PROMPT_TEMPLATES, class_prompts

    return [class_prompts(t, language=language) for t in PROMPT_TEMPLATES[language]]


def shapes_texts() -> list[str]:
    """Every caption the shapes task can write (both languages) and every zero-shot prompt
    (both languages): what the tokenizer of a shapes run is fitted to."""
    from ...data.shapes import COMBINATIONS, POSITIONS, SIZES, caption_for

    labels = [{"colour": c, "shape": s, "count": 1, "size": size, "position": pos}
              for c, s in COMBINATIONS for size in SIZES for pos in POSITIONS]
    labels += [{"colour": c, "shape": s, "count": n, "size": "small", "position": None}
               for c, s in COMBINATIONS for n in (2, 3)]
    texts = [caption_for(lab, lang) for lang in ("en", "zh") for lab in labels]
    texts += [p for lang in ("en", "zh") for ps in zero_shot_prompts(lang) for p in ps]
    return texts


# --- data -------------------------------------------------------------------------------
def _prompt_of(template: str, language: str, colour: str, shape: str) -> str:
    """``template`` filled with (colour, shape) as ``class_prompts`` fills it."""
    from ...data.shapes import COMBINATIONS, class_prompts

    return class_prompts(template, language=language)[COMBINATIONS.index((colour, shape))]


@dataclasses.dataclass
class ShapesPairs:
    """The shapes task as training data (captions in English and Chinese).

    ``train(start, count)``: training examples start .. start + count - 1 of an endless
    stream -> (images (count, 3, H, W) float32 in [0, 1], captions). ``heldout(count)``:
    the first ``count`` of the "valid" split (same combinations, other images).
    ``test(count)``: the first ``count`` of the "test" split (held-out combinations) ->
    (images, labels (count,) int64 indices into ``COMBINATIONS``).
    """

    image_size: int
    seed: int = 0
    prompt_share: float = PROMPT_CAPTION_SHARE

    def __post_init__(self) -> None:
        from ...data import ShapesDataset

        if not (isinstance(self.prompt_share, (int, float)) and not isinstance(
                self.prompt_share, bool) and 0.0 <= self.prompt_share <= 1.0):
            raise ValueError(f"ShapesPairs: prompt_share must be a number in [0, 1], got "
                             f"{self.prompt_share!r}")

        self.splits = {split: ShapesDataset(split, size=_ENDLESS, image_size=self.image_size,
                                            seed=self.seed, language="both")
                       for split in ("train", "valid", "test")}

    def train(self, start: int, count: int) -> tuple[Tensor, list[str]]:
        """Training pairs ``start .. start + count - 1``: the dataset's captions, each
        replaced with probability ``prompt_share`` by a prompt (``prompt_caption``)."""
        batch = self.splits["train"].batch(range(start, start + count))
        captions = [self.prompt_caption(start + k, lab) or caption
                    for k, (caption, lab) in enumerate(zip(batch.captions, batch.labels,
                                                           strict=True))]
        return batch.images, captions

    def prompt_caption(self, index: int, labels: dict[str, Any]) -> str | None:
        """The prompt that replaces the caption of training example ``index`` (labels as
        ``ShapesDataset`` gives), or None when it keeps its own: with probability
        ``prompt_share`` (a coin of ``(seed, index)`` alone, so that a resumed run reads
        the same), one of ``PROMPT_TEMPLATES[language]`` (uniform) filled with the
        example's colour and shape, in its caption's language."""
        from ...data.shapes import PROMPT_TEMPLATES

        if self.prompt_share <= 0.0:
            return None
        key = f"qkv.train.kinds.clip/prompt\x1f{self.seed}\x1f{index}".encode()
        rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(),
                                           "little"))
        if rng.random() >= self.prompt_share:
            return None
        lang = labels["language"]
        return _prompt_of(rng.choice(PROMPT_TEMPLATES[lang]), lang, labels["colour"],
                          labels["shape"])

    def heldout(self, count: int) -> tuple[Tensor, list[str]]:
        """The first ``count`` validation pairs."""
        batch = self.splits["valid"].batch(range(count))
        return batch.images, batch.captions

    def test(self, count: int) -> tuple[Tensor, Tensor]:
        """The first ``count`` test images and their class indices into ``COMBINATIONS``."""
        from ...data.shapes import COMBINATIONS

        batch = self.splits["test"].batch(range(count))
        labels = torch.tensor([COMBINATIONS.index((lab["colour"], lab["shape"]))
                               for lab in batch.labels], dtype=torch.long)  # (count,)
        return batch.images, labels


@dataclasses.dataclass
class FolderPairs:
    """A folder of images + captions TSV as training data: whole images (with all their
    captions) held out, the rest shuffled per epoch. Items as ``ShapesPairs``: (images
    (count, 3, S, S) float32 in [0, 1], resized and centre-cropped to S, captions)."""

    folder: str
    image_size: int
    seed: int = 0

    @staticmethod
    def to_unit(image: Tensor, size: int) -> Tensor:
        """A decoded image (3, h, w) uint8 (``qkv.data.load_image``) -> (3, S, S) float32
        in [0, 1]: shorter side resized to S = ``size`` (bicubic), centre-cropped — what a
        folder's images are trained on (``qkv attention --image`` reads its image so)."""
        return preprocess_image(image, size, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))

    def __post_init__(self) -> None:
        from ...data import ImageFolderDataset

        size = self.image_size

        def to_unit(image: Tensor) -> Tensor:  # (3, h, w) uint8 -> (3, S, S) in [0, 1]
            return FolderPairs.to_unit(image, size)

        # every image checked now (header, size, mode, a PNG's checksums, a truncated
        # JPEG): a bad file stops the run before it starts, not when first drawn
        self.dataset = ImageFolderDataset(self.folder, transform=to_unit, verify="quick")
        files = sorted({str(f) for f in self.dataset.files})
        if len(files) < 2:
            raise ValueError(f"--data {self.folder}: needs at least 2 different images (one to "
                             f"train on, one to hold out), got {len(files)}")
        random.Random(self.seed).shuffle(files)
        n_held = min(max(1, int(len(files) * _HELD_FRACTION)), _MAX_HELD, len(files) - 1)
        held = set(files[:n_held])
        rows = range(len(self.dataset))  # one per TSV line (an image may have several)
        self.held_rows = [i for i in rows if str(self.dataset.files[i]) in held]
        self.train_rows = [i for i in rows if str(self.dataset.files[i]) not in held]

    @property
    def captions(self) -> list[str]:
        """Every caption of the TSV."""
        return self.dataset.captions

    def train(self, start: int, count: int) -> tuple[Tensor, list[str]]:
        """Training pairs ``start .. start + count - 1`` (epochs shuffled by (seed, epoch))."""
        idx = epoch_indices(len(self.train_rows), start, count, self.seed)
        return self.dataset.batch([self.train_rows[i] for i in idx])

    def heldout(self, count: int) -> tuple[Tensor, list[str]]:
        """The first ``count`` held-out pairs (fewer if the folder holds fewer)."""
        return self.dataset.batch(self.held_rows[:count])


def _folder_fingerprint(folder: Path) -> dict[str, Any]:
    """Size and SHA-256 over the captions TSV's bytes and each image's name and size."""
    from ...data.files import regular_file

    tsv = regular_file(folder / "captions.tsv")  # a FIFO would block, a device never end
    digest = hashlib.sha256(tsv.read_bytes())
    total = tsv.stat().st_size
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p != tsv):
        size = path.stat().st_size
        digest.update(f"\0{path.relative_to(folder).as_posix()}\0{size}".encode())
        total += size
    return {"size": total, "sha256": digest.hexdigest()}


# --- the kind ---------------------------------------------------------------------------
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


def _contrastive(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    """One process's symmetric InfoNCE of normalised (B, E) rows (evaluation: no gather)."""
    logits = scale * (F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).t())  # (B, B)
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


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
        from ..config import ConfigError

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
    def _texts(data: ShapesPairs | FolderPairs) -> list[str]:
        return shapes_texts() if isinstance(data, ShapesPairs) else list(data.captions)

    @staticmethod
    def _need(texts: list[str], tokenizer: Any) -> int:
        return max(len(tokenizer.encode(t)) for t in texts) + 2  # bos + text + eos

    def prepare_data(self, config: Any) -> tuple[Any, Any, int, int]:
        from ...data import BPETokenizer, CharTokenizer

        data = self._data(config)
        texts = self._texts(data)
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
        need = self._need(self._texts(data), tokenizer)
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
        return _folder_fingerprint(path)

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
        from ...models.zero_shot import retrieval_recall

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                images, captions = data.heldout(count)
                img, txt = self._embed(model, tokenizer, images, captions)
                scale = model.logit_scale.exp().float()
                loss = sum(float(_contrastive(img[i:i + EVAL_BATCH], txt[i:i + EVAL_BATCH],
                                              scale)) * len(img[i:i + EVAL_BATCH])
                           for i in range(0, len(img), EVAL_BATCH))
                result = {"eval_loss": loss / len(img),
                          "recall_at_1": retrieval_recall(img, txt, ks=(1,))["text_to_image@1"]}
                if isinstance(data, ShapesPairs):
                    test_images, labels = data.test(count)
                    result["zero_shot_accuracy"] = zero_shot_accuracy(
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
        size = int(model.config.vision.image_size)
        return {"preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor", "do_resize": True,
            "size": {"shortest_edge": size}, "resample": 3, "do_center_crop": True,
            "crop_size": {"height": size, "width": size}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(CLIP_MEAN),
            "image_std": list(CLIP_STD), "do_convert_rgb": True}}


def zero_shot_accuracy(model: nn.Module, tokenizer: Any, images: Tensor, labels: Tensor
                       ) -> float:
    """Top-1 accuracy of ``images`` (B, 3, H, W) in [0, 1] with ``labels`` (B,) indices into
    ``COMBINATIONS``, classified among all K = 30 combinations by the English prompt
    templates, ensembled (``zero_shot_weights``: mean of the M normalised prompt embeddings
    of a class, renormalised)."""
    from ...data.shapes import COMBINATIONS
    from ...models.zero_shot import topk_accuracy, zero_shot_classify, zero_shot_weights

    device = next(model.parameters()).device
    table = zero_shot_prompts("en")  # M lists of K prompts
    # zero_shot_weights formats "{}" templates; the prompts need "a"/"an" and the
    # template's own wording, so each (class, template) key is looked up in the table
    names = [f"{k}" for k in range(len(COMBINATIONS))]
    templates = [f"{{}}/{m}" for m in range(len(table))]

    def tokenize(keys: list[str]) -> tuple[Tensor, Tensor]:
        texts = [table[int(m)][int(k)] for k, m in (key.split("/") for key in keys)]
        ids, mask = encode_texts(tokenizer, texts)
        return ids.to(device), mask.to(device)

    weights = zero_shot_weights(model, tokenize, names, templates)  # (K, E)
    image_embeds = torch.cat([model.encode_image(to_pixel_values(images[i:i + EVAL_BATCH])
                                                 .to(device))
                              for i in range(0, len(images), EVAL_BATCH)])  # (B, E)
    scores = zero_shot_classify(image_embeds, weights)  # (B, K)
    return topk_accuracy(scores, labels, ks=(1,))[1]
