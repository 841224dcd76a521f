"""Zero-shot classification and image-text retrieval with a CLIP-style model.

Shapes: K classes, M prompts (templates) per class, B images, Bt texts, E embedding width.

``zero_shot_weights(model, tokenize, class_names, templates)`` encodes every
"template.format(name)" prompt, L2-normalises each embedding, averages the M prompts of a
class and renormalises (OpenAI's prompt ensembling) -> (K, E); ``prompt_weights(model,
tokenize, prompts)`` does the same for prompts already written out (K lists of M).
``zero_shot_classify`` scores images against them (cosine similarity), ``topk_accuracy``
reads top-1 / top-5, and ``zero_shot_accuracy`` does all three for a batch of images.
``retrieval_recall`` gives image->text and text->image recall@K of paired embeddings, and
``chunked_contrastive_loss`` their symmetric InfoNCE in chunks (one process, no gather: an
evaluation's loss).

The model is any module with ``encode_text(input_ids, attention_mask)`` -> (n, E) and
``encode_image(pixel_values)`` -> (B, E) (``qkv.models.CLIP``); turning text into ids is the
caller's ``tokenize`` (e.g. ``qkv.data.clip_text.encode_texts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunked_contrastive_loss", "prompt_weights", "retrieval_recall", "topk_accuracy",
           "zero_shot_accuracy", "zero_shot_classify", "zero_shot_weights"]

Tokenize = Callable[[list[str]], "tuple[Tensor, Tensor | None] | Tensor"]


def _check_embeds(owner: str, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor) or not t.dtype.is_floating_point or t.dim() != 2:
        got = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__)
        raise ValueError(f"{owner}: {name} must be a floating-point tensor (rows, E), got {got}")
    return t


@torch.no_grad()
def zero_shot_weights(model, tokenize: Tokenize, class_names: Sequence[str],
                      templates: Sequence[str], *, batch_size: int = 256) -> Tensor:
    """Class embeddings (K, E), unit rows, from prompts.

    Args:
        model: has ``encode_text(input_ids, attention_mask)`` -> (n, E) (``qkv.models.CLIP``).
        tokenize: list of n strings -> ``(input_ids (n, N), attention_mask (n, N) or None)``
            or just ``input_ids``, on the model's device.
        class_names: K names, each put into every template.
        templates: M format strings with one "{}" (e.g. "a photo of a {}.").
        batch_size: prompts encoded per call.

    Returns:
        (K, E): for each class, the mean of its M normalised prompt embeddings, renormalised.

    Raises:
        ValueError naming ``class_names`` / ``templates`` when empty or a template has no
        "{}".
    """
    names, temps = list(class_names), list(templates)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"zero_shot_weights: class_names must be a non-empty list of "
                         f"strings, got {class_names!r}")
    if not temps or not all(isinstance(t, str) and "{}" in t for t in temps):
        raise ValueError(f"zero_shot_weights: templates must be a non-empty list of strings "
                         f"each with one '{{}}', got {templates!r}")
    return prompt_weights(model, tokenize, [[t.format(n) for t in temps] for n in names],
                          batch_size=batch_size)


@torch.no_grad()
def prompt_weights(model, tokenize: Tokenize, prompts: Sequence[Sequence[str]], *,
                   batch_size: int = 256) -> Tensor:
    """Class embeddings (K, E), unit rows, from prompts written out: ``prompts[k]`` the M
    prompts of class k (the same M for every class).

    Args:
        model, tokenize, batch_size: as ``zero_shot_weights``.
        prompts: K lists of M strings.

    Returns:
        (K, E): for each class, the mean of its M normalised prompt embeddings, renormalised.

    Raises:
        ValueError naming ``prompts`` when it is empty, holds a non-string, or its classes
        have different numbers of prompts.
    """
    rows_in = [list(p) for p in prompts] if not isinstance(prompts, str) else []
    m = len(rows_in[0]) if rows_in else 0
    if (not rows_in or m == 0 or any(len(r) != m for r in rows_in)
            or not all(isinstance(t, str) for r in rows_in for t in r)):
        raise ValueError(f"prompt_weights: prompts must be K non-empty lists of M strings "
                         f"each (the same M), got {prompts!r:.120}")
    flat = [t for r in rows_in for t in r]  # K·M, class-major
    rows = []
    for i in range(0, len(flat), batch_size):
        enc = tokenize(flat[i:i + batch_size])
        ids, mask = enc if isinstance(enc, tuple) else (enc, None)
        rows.append(F.normalize(model.encode_text(ids, mask).float(), dim=-1))  # (n, E)
    emb = torch.cat(rows).view(len(rows_in), m, -1)  # (K, M, E)
    return F.normalize(emb.mean(dim=1), dim=-1)  # (K, E)


@torch.no_grad()
def zero_shot_accuracy(model, tokenize: Tokenize, prompts: Sequence[Sequence[str]],
                       pixel_values: Tensor, labels: Tensor, *, batch_size: int = 256
                       ) -> float:
    """Top-1 accuracy of images classified among K classes by their prompt ensembles.

    Args:
        model, tokenize: as ``zero_shot_weights``.
        prompts: K lists of M strings, ``prompts[k]`` the prompts of class k
            (``prompt_weights``).
        pixel_values: (B, 3, H, W), what ``model.encode_image`` reads (already normalised),
            moved to the model's device ``batch_size`` images at a time.
        labels: (B,) class indices in [0, K).
        batch_size: prompts and images encoded per call.

    Returns:
        the fraction of images whose highest-scoring class (``zero_shot_classify``) is
        their label.

    Raises:
        ValueError naming ``pixel_values`` / ``labels`` / ``prompts`` for bad shapes.
    """
    if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4 or not len(pixel_values):
        got = (tuple(pixel_values.shape) if isinstance(pixel_values, Tensor)
               else type(pixel_values).__name__)
        raise ValueError(f"zero_shot_accuracy: pixel_values must be a tensor (B, 3, H, W) "
                         f"with B >= 1, got {got}")
    weights = prompt_weights(model, tokenize, prompts, batch_size=batch_size)  # (K, E)
    images = torch.cat([model.encode_image(pixel_values[i:i + batch_size].to(weights.device))
                        for i in range(0, len(pixel_values), batch_size)])  # (B, E)
    scores = zero_shot_classify(images, weights)  # (B, K)
    return topk_accuracy(scores, labels, ks=(1,))[1]


def chunked_contrastive_loss(image_embeds: Tensor, text_embeds: Tensor,
                             logit_scale: Tensor | float, *, chunk: int = 256) -> float:
    """The symmetric InfoNCE of pairs (image i, text i), in chunks of ``chunk`` pairs (each
    chunk's negatives are its own rows), averaged over the pairs: an evaluation's loss, in
    one process (no gather, unlike ``qkv.models.clip_loss`` under torch.distributed).

    Args:
        image_embeds: (B, E). text_embeds: (B, E), row i the text of image i.
        logit_scale: the multiplier s (already exponentiated).
        chunk: pairs per chunk; the last chunk may be shorter.

    Returns:
        ``Σ_c |c| · (CE(s · Î_c T̂_cᵀ) + CE(s · T̂_c Î_cᵀ)) / 2 / B`` over the chunks c, in fp32.

    Raises:
        ValueError naming the argument: not (B, E) with B >= 1, different shapes, a bad
        ``chunk``.
    """
    img = _check_embeds("chunked_contrastive_loss", "image_embeds", image_embeds)
    txt = _check_embeds("chunked_contrastive_loss", "text_embeds", text_embeds)
    if img.shape != txt.shape or img.shape[0] == 0:
        raise ValueError(f"chunked_contrastive_loss: image_embeds {tuple(img.shape)} and "
                         f"text_embeds {tuple(txt.shape)} must be the same (B, E), B >= 1")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunked_contrastive_loss: chunk must be a positive int, got "
                         f"{chunk!r}")
    total = 0.0
    for i in range(0, len(img), chunk):
        a = F.normalize(img[i:i + chunk].float(), dim=-1)  # (b, E)
        t = F.normalize(txt[i:i + chunk].float(), dim=-1)  # (b, E)
        logits = logit_scale * (a @ t.t())  # (b, b)
        target = torch.arange(len(a), device=logits.device)
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
        total += float(loss) * len(a)
    return total / len(img)


def zero_shot_classify(image_embeds: Tensor, class_weights: Tensor) -> Tensor:
    """Cosine similarities (B, K) of images (B, E) (normalised here) with class embeddings
    (K, E) (``zero_shot_weights``); ``argmax(-1)`` is the predicted class."""
    img = _check_embeds("zero_shot_classify", "image_embeds", image_embeds)
    cls = _check_embeds("zero_shot_classify", "class_weights", class_weights)
    if img.shape[1] != cls.shape[1]:
        raise ValueError(f"zero_shot_classify: image_embeds {tuple(img.shape)} and "
                         f"class_weights {tuple(cls.shape)} differ in E")
    return F.normalize(img.float(), dim=-1) @ F.normalize(cls.float(), dim=-1).t()  # (B, K)


def topk_accuracy(scores: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)
                  ) -> dict[int, float]:
    """Fraction of rows whose label is among the k highest scores, for each k in ``ks``
    (k larger than K counts every row right). scores (B, K), labels (B,) ints in [0, K)."""
    _check_embeds("topk_accuracy", "scores", scores)
    if (not isinstance(labels, Tensor) or labels.dtype.is_floating_point
            or tuple(labels.shape) != (scores.shape[0],)):
        got = f"{tuple(labels.shape)} {labels.dtype}" if isinstance(labels, Tensor) else \
            type(labels).__name__
        raise ValueError(f"topk_accuracy: labels must be integers of shape (B,) = "
                         f"({scores.shape[0]},), got {got}")
    kmax = min(max(ks), scores.shape[1])
    top = scores.topk(kmax, dim=-1).indices  # (B, kmax)
    hit = top == labels.to(top.device)[:, None]  # (B, kmax)
    return {k: float(hit[:, :min(k, kmax)].any(dim=-1).float().mean()) for k in ks}


def retrieval_recall(image_embeds: Tensor, text_embeds: Tensor,
                     text_to_image: Tensor | None = None, ks: Sequence[int] = (1, 5, 10)
                     ) -> dict[str, float]:
    """Recall@K of image->text and text->image retrieval by cosine similarity.

    Args:
        image_embeds: (B, E). text_embeds: (Bt, E).
        text_to_image: (Bt,) the image index of each text (several captions per image);
            default ``arange(B)`` (Bt == B, text i describes image i).
        ks: the K values.

    Returns:
        {"image_to_text@K": fraction of images with one of their texts among their K
        nearest texts, "text_to_image@K": fraction of texts whose image is among their K
        nearest images} for each K.
    """
    img = F.normalize(_check_embeds("retrieval_recall", "image_embeds", image_embeds).float(),
                      dim=-1)
    txt = F.normalize(_check_embeds("retrieval_recall", "text_embeds", text_embeds).float(),
                      dim=-1)
    if img.shape[1] != txt.shape[1]:
        raise ValueError(f"retrieval_recall: image_embeds {tuple(img.shape)} and text_embeds "
                         f"{tuple(txt.shape)} differ in E")
    if text_to_image is None:
        if txt.shape[0] != img.shape[0]:
            raise ValueError(f"retrieval_recall: {txt.shape[0]} texts for {img.shape[0]} "
                             f"images: pass text_to_image (Bt,) naming each text's image")
        text_to_image = torch.arange(img.shape[0])
    t2i = text_to_image.to(img.device).long()
    if tuple(t2i.shape) != (txt.shape[0],) or bool(((t2i < 0) | (t2i >= img.shape[0])).any()):
        raise ValueError(f"retrieval_recall: text_to_image must be (Bt,) = ({txt.shape[0]},) "
                         f"image indices in [0, {img.shape[0]}), got {tuple(t2i.shape)}")
    sim = img @ txt.t()  # (B, Bt)
    out: dict[str, float] = {}
    for k in ks:
        kt, ki = min(k, txt.shape[0]), min(k, img.shape[0])
        top_txt = sim.topk(kt, dim=1).indices  # (B, kt) texts per image
        i2t = (t2i[top_txt] == torch.arange(img.shape[0], device=img.device)[:, None])
        out[f"image_to_text@{k}"] = float(i2t.any(dim=1).float().mean())
        top_img = sim.t().topk(ki, dim=1).indices  # (Bt, ki) images per text
        out[f"text_to_image@{k}"] = float((top_img == t2i[:, None]).any(dim=1).float().mean())
    return out
