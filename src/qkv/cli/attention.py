"""``qkv attention``: draw the attention of a trained run on one input — a PNG grid (layers ×
heads) per attention map, the cross-attention alignment of an encoder-decoder, and one
self-contained interactive HTML page.

Inputs are framed as in training (``qkv.train.data``): an encoder-decoder reads source +
eos and its decoder is fed bos + target (generated greedily when --target is not given); a
GPT trained on pairs reads bos + input + eos (+ target, or its own greedy answer); a BERT
reads bos + input [+ " " + target] + eos; models trained on plain text read the text as is.

A CLIP run (``qkv train --model clip``, ``qkv demo clip``) reads an image instead: ``--image
PATH`` (resized and centre-cropped to the model's size) or, for a shapes run, test image
``--index I`` of the run's seed (default 0). Its image tower's attention is drawn as the
attention rollout over the patches (Abnar & Zuidema 2020; ``qkv.viz.patches``) on the image,
each layer's class-token attention on the image, and the layers × heads grid; ``--input``
adds the text tower's attention on that text.

A HuggingFace encoder-decoder directory (T5 / Flan-T5, BART, Marian opus-mt; config.json,
weights and tokenizer files: ``qkv.cli.seq2seq_directory``) reads the input as its tokenizer
frames it (Marian / T5 ``text </s>``); the decoder is fed its start token
(``decoder_start_token_id``) + the model's own greedy translation (the processors of its
generation_config.json applied, e.g. opus-mt's never-generate-pad), or + ``--target`` (as
transformers feeds labels: the target's ids without their final ``</s>``). Its maps are
drawn as a run's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch import nn

from .checks import int_in

#: the longest generated target of a run (--max-new-tokens)
DEFAULT_MAX_NEW_TOKENS = 64
#: the files ``qkv attention`` writes into its output directory; a rerun may replace these
#: (and only these) in an existing directory
ATTENTION_FILES = ("attention_*.png", "attention.html")

EXAMPLES = """examples:
  qkv attention runs/dates --input "March 5, 2024"
        greedy-translate, then draw encoder, decoder and cross-attention
  qkv attention runs/dates --input "March 5, 2024" --target 2024-03-05 --out viz
        teacher-forced on a given target; files go to viz/
  qkv attention runs/dates --input "2024年3月5日" --layer -1 --head 0
        only the last layer's head 0 in the PNG grids (the HTML keeps every layer and head)
  qkv attention runs/lm --input "the cat sat on the mat"
        a GPT or BERT run: its self-attention
  qkv attention models/opus-mt-en-zh --input "How are you?"
        an HF encoder-decoder directory: its cross-attention on its own translation
  qkv attention runs/clip --index 3
        a CLIP run on shapes: attention rollout over test image 3's patches
  qkv attention runs/clip --image photo.png --input "a photo of a red circle"
        a CLIP run on your image, and the text tower's attention on a caption

writes DIR/attention_<map>.png for each map (encoder, decoder, cross), DIR/attention_
alignment.png (encoder-decoder: cross-attention averaged over heads) and DIR/attention.html
(open it in a browser; it needs no network). A CLIP run: DIR/attention_rollout.png,
DIR/attention_patches.png, DIR/attention_vision.png (+ attention_text.png with --input),
DIR/attention.html. DIR (--out, default RUN/attention) must be new,
empty, or hold only these files of an earlier run (they are replaced); never inside a
training checkpoint directory (given RUN/checkpoint, the default is RUN/attention).
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv attention`` to the command parsers."""
    p = sub.add_parser("attention", help="draw a trained run's attention on one input "
                       "(PNG grids + an interactive HTML page)", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="a run directory of `qkv train` (or a "
                   "checkpoint directory with config.json, model.safetensors, tokenizer.json), "
                   "or an HF encoder-decoder directory (T5, BART, Marian)")
    p.add_argument("--input", default=None, metavar="TEXT",
                   help="the input (source) text (required, except for a CLIP run: there, a "
                        "caption whose text-tower attention is drawn too)")
    p.add_argument("--image", default=None, metavar="PATH",
                   help="CLIP runs: the image (PNG, JPEG, ...; resized and centre-cropped to "
                        "the model's size)")
    p.add_argument("--index", type=int_in(0), default=None, metavar="I",
                   help="CLIP runs on the shapes task: test image I of the run's seed "
                        "(default 0 when --image is not given)")
    p.add_argument("--target", default=None, metavar="TEXT",
                   help="the target text, teacher-forced (default for an encoder-decoder or "
                        "a GPT trained on pairs: the model's own greedy output)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory: new, empty or holding only attention_*.png / "
                        "attention.html (default: RUN/attention)")
    p.add_argument("--layer", type=int_in(), default=None, metavar="L",
                   help="draw only layer L in the PNGs (negative: from the end); the HTML "
                        "opens on it")
    p.add_argument("--head", type=int_in(), default=None, metavar="H",
                   help="draw only head H in the PNGs (negative: from the end); the HTML "
                        "opens on it (default: the mean over heads)")
    p.add_argument("--max-new-tokens", type=int_in(1), default=None, metavar="N",
                   help="longest generated target when --target is not given (default 64; "
                        "an HF directory: its generation_config.json's max_length, else 64)")
    p.set_defaults(func=_run)


def _max_len(model: nn.Module) -> int | None:
    """The longest sequence the model's positions allow, or None (relative positions)."""
    from ..models import Transformer

    c = model.config
    if isinstance(model, Transformer) and not c.absolute_positions:
        return None
    return getattr(c, "max_len", None)


def _generate(model: nn.Module, ids: list[int], tok: Any, budget: int, *,
              encoder_decoder: bool) -> list[int]:
    """Greedy decoding, cut before the first eos: bos + output (encoder-decoder, ``ids`` the
    framed source) or ``ids`` + continuation (GPT)."""
    from ..generation import complete_ids, translate_ids

    if encoder_decoder:
        return [tok.bos_id, *translate_ids(model, [ids], pad_id=tok.pad_id, bos_id=tok.bos_id,
                                           eos_id=tok.eos_id, max_new_tokens=budget)[0]]
    return ids + complete_ids(model, [ids], pad_id=tok.pad_id, eos_id=tok.eos_id,
                              max_new_tokens=budget)[0]


def _frame(model: nn.Module, tok: Any, info: dict[str, Any], text: str, target: str | None,
           budget: int) -> tuple[list[int], list[int] | None, str | None]:
    """(input ids, target ids or None, the generated target text or None), framed as in
    training."""
    from ..models import BERT, Transformer
    from ..train.checkpoint import trained_on_pairs

    bos, eos = tok.bos_id, tok.eos_id
    pairs = trained_on_pairs(info)
    limit = _max_len(model)
    if isinstance(model, Transformer):
        src = [*tok.encode(text), eos]
        if target is not None:
            return src, [bos, *tok.encode(target)], None
        room = budget if limit is None else min(budget, limit - 1)
        tgt = _generate(model, src, tok, room, encoder_decoder=True)
        return src, tgt, tok.decode(tgt[1:])
    if isinstance(model, BERT):
        full = text if target is None else f"{text} {target}"
        return ([bos, *tok.encode(full), eos] if pairs else tok.encode(full)), None, None
    if not pairs:  # a GPT language model on plain text
        return tok.encode(text if target is None else text + target), None, None
    prompt = [bos, *tok.encode(text), eos]
    if target is not None:
        return [*prompt, *tok.encode(target)], None, None
    room = budget if limit is None else min(budget, limit - len(prompt))
    ids = _generate(model, prompt, tok, room, encoder_decoder=False) if room > 0 else prompt
    return ids, None, tok.decode(ids[len(prompt):])


def _stack_sizes(model: nn.Module) -> tuple[int, int]:
    """(layers of the shallowest attention stack, heads) of a qkv model."""
    c = model.config
    layers = [getattr(c, k) for k in ("num_layers", "num_encoder_layers", "num_decoder_layers")
              if isinstance(getattr(c, k, None), int)]
    return min(layers), c.num_heads


def default_out(run: Path) -> Path:
    """``qkv attention``'s default output directory: RUN/attention for a run directory, and
    for a training checkpoint directory (RUN/checkpoint) its run's RUN/attention — never a
    folder inside the checkpoint, which every save replaces. A model directory outside any
    run (``save_pretrained``, ``qkv demo coref``) gets DIR/attention."""
    from ..outputs import inside_checkpoint

    ckpt = inside_checkpoint(run)
    return (run if ckpt is None else ckpt.parent) / "attention"


def _index(name: str, value: int | None, total: int) -> int | None:
    from . import UserError

    if value is not None and not -total <= value < total:
        raise UserError(f"--{name} {value} is out of range: the model has {total} {name}s "
                        f"(0..{total - 1}, or negative from the end)")
    return value


def _run(args: argparse.Namespace) -> int:
    from ..outputs import new_output_dir
    from ..train.checkpoint import load_run, read_run_info
    from ..viz import (
        attention_maps,
        token_labels,
    )
    from . import UserError
    from .checks import check_fits
    from .generate import warn_unknown

    if args.input is not None and not args.input.strip():
        raise UserError("--input is empty")
    if args.target is not None and not args.target.strip():
        raise UserError("--target is empty (leave it out to generate the target)")
    run = Path(args.run)
    from .seq2seq_directory import is_seq2seq_directory

    if is_seq2seq_directory(run):
        return _run_seq2seq_directory(args, run)
    if args.max_new_tokens is None:
        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    model, tok = load_run(run)
    model.eval()
    from ..models import CLIP

    if isinstance(model, CLIP):
        return _run_clip(args, run, model, tok)
    if args.image is not None or args.index is not None:
        what = "--image" if args.image is not None else "--index"
        raise UserError(f"{what}: {run} is a {type(model).__name__} run, which reads text; "
                        f"--image / --index are for CLIP runs")
    if args.input is None:
        raise UserError(f"--input is required: {run} is a {type(model).__name__} run, which "
                        f"reads text")
    from ..peft import PrefixAttention

    if any(isinstance(m, PrefixAttention) and m.active is not None for m in model.modules()):
        raise UserError(f"{run} trained a prefix (learned key/value positions before every "
                        f"token); its attention maps have key columns no token labels, which "
                        f"qkv attention does not draw yet (qkv.viz.attention_maps returns "
                        f"them, prefix columns first)")
    from ..models import Transformer

    if isinstance(model, Transformer) and callable(getattr(tok, "encode_target", None)):
        # fine-tuned from an HF encoder-decoder directory: its tokenizer frames the input
        from ..models.generation_settings import GenerationSettings
        from .seq2seq_directory import Seq2SeqDirectory

        return _run_seq2seq_directory(args, run, Seq2SeqDirectory(run, model, tok,
                                                                  GenerationSettings()))
    n_layers, n_heads = _stack_sizes(model)
    layer = _index("layer", args.layer, n_layers)
    head = _index("head", args.head, n_heads)
    if _max_len(model) is None:  # relative positions: nothing else bounds the output length
        longest = len(tok.encode(args.input)) + 2 + (
            args.max_new_tokens if args.target is None else len(tok.encode(args.target)))
        check_fits(f"--max-new-tokens {args.max_new_tokens} (attention maps of up to "
                   f"{longest} tokens, {n_layers}×{n_heads}×{longest}² fp32)",
                   4 * n_layers * n_heads * longest**2)
    out = new_output_dir(Path(args.out) if args.out is not None else default_out(run),
                         replaceable=ATTENTION_FILES)
    info = read_run_info(run)
    warn_unknown(tok, [args.input, args.target or ""])
    src, tgt, generated = _frame(model, tok, info, args.input, args.target,
                                 args.max_new_tokens)
    maps = attention_maps(model, src, target_ids=tgt)
    src_tokens = tok.tokens(src)
    tgt_tokens = None if tgt is None else tok.tokens(tgt)
    labels = token_labels(maps, input_tokens=src_tokens, target_tokens=tgt_tokens)
    if generated is not None:
        print(f"generated target: {generated}")
    return _draw(maps, labels, src_tokens, tgt_tokens, out, args.input, layer, head)


# --- HF encoder-decoder directories ----------------------------------------------------
def _directory_target(d: Any, src: list[int], target: str | None, budget: int
                      ) -> tuple[list[int], str | None]:
    """(the decoder input: start + target ids, the generated text or None): ``target``'s
    ids without their final eos, or the greedy output (the directory's processors on)."""
    from ..generation import translate_ids

    tok, start = d.tokenizer, d.start_id()
    if target is not None:
        ids = tok.encode_target(target)
        return [start, *(ids[:-1] if ids and ids[-1] == tok.eos_id else ids)], None
    kw = d.decoding()
    for name in ("num_beams", "length_penalty", "early_stopping", "do_sample", "temperature",
                 "top_k", "top_p", "max_new_tokens", "decoder_start_token_id"):
        kw.pop(name, None)  # greedy, for --max-new-tokens
    ends = kw.pop("eos_token_id", [tok.eos_id])
    new = translate_ids(d.model, [src], pad_id=tok.pad_id, bos_id=start, eos_id=ends,
                        max_new_tokens=budget, settings=None, **kw)[0]  # kw: the settings
    return [start, *new], tok.decode(new)


def _run_seq2seq_directory(args: argparse.Namespace, path: Path, d: Any = None) -> int:
    """``qkv attention DIR`` on an HF encoder-decoder directory (the module docstring); ``d``:
    its ``Seq2SeqDirectory`` when already loaded (a run fine-tuned from one)."""
    from ..outputs import new_output_dir
    from ..viz import (
        attention_maps,
        token_labels,
    )
    from . import UserError
    from .checks import check_fits
    from .seq2seq_directory import load_seq2seq_directory, token_strings, warn_unknown_pieces

    if args.image is not None or args.index is not None:
        what = "--image" if args.image is not None else "--index"
        raise UserError(f"{what}: {path} is an encoder-decoder, which reads text; --image / "
                        f"--index are for CLIP runs")
    if args.input is None:
        raise UserError(f"--input is required: {path} is an encoder-decoder, which reads text")
    d = load_seq2seq_directory(path) if d is None else d
    model, tok = d.model, d.tokenizer
    n_layers, n_heads = _stack_sizes(model)
    layer = _index("layer", args.layer, n_layers)
    head = _index("head", args.head, n_heads)
    warn_unknown_pieces(tok, [args.input])
    src = tok.encode(args.input)
    limit = _max_len(model)
    if limit is not None and len(src) > limit:
        raise UserError(f"--input is {len(src)} tokens (with eos), beyond the model's "
                        f"max_len={limit}")
    budget = args.max_new_tokens or d.decoding().get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    budget = budget if limit is None else min(budget, limit - 1)
    if limit is None:  # relative positions (T5): nothing else bounds the output length
        longest = len(src) + 1 + (budget if args.target is None else
                                  len(tok.encode_target(args.target)))
        check_fits(f"--max-new-tokens {budget} (attention maps of up to {longest} tokens, "
                   f"{n_layers}×{n_heads}×{longest}² fp32)", 4 * n_layers * n_heads * longest**2)
    out = new_output_dir(Path(args.out) if args.out is not None else default_out(path),
                         replaceable=ATTENTION_FILES)
    tgt, generated = _directory_target(d, src, args.target, budget)
    if limit is not None and len(tgt) > limit:
        raise UserError(f"--target is {len(tgt)} tokens with the start token, beyond the "
                        f"model's max_len={limit}")
    maps = attention_maps(model, src, target_ids=tgt)
    src_tokens, tgt_tokens = token_strings(tok, src), token_strings(tok, tgt)
    labels = token_labels(maps, input_tokens=src_tokens, target_tokens=tgt_tokens)
    if generated is not None:
        print(f"generated target: {generated}")
    return _draw(maps, labels, src_tokens, tgt_tokens, out, args.input, layer, head)


# --- CLIP runs: attention over image patches --------------------------------------------
def _clip_image(args: argparse.Namespace, run: Path, model: nn.Module) -> tuple[Any, str]:
    """The image of ``--image`` / ``--index``: (3, S, S) float in [0, 1] at the model's
    image size S, and a description of where it came from."""
    from ..data.images_folder import load_image
    from ..train.checkpoint import read_run_info
    from . import UserError

    size = int(model.config.vision.image_size)
    if args.image is not None:
        if args.index is not None:
            raise UserError(f"--image {args.image} and --index {args.index}: give one of them")
        from ..data.files import DataError
        from ..data.folder_pairs import FolderPairs

        try:  # training's loader: the same checks, modes and alpha compositing
            pixels = load_image(args.image)  # (3, H, W) uint8
        except DataError as exc:
            raise UserError(f"--image: {exc}") from None
        return FolderPairs.to_unit(pixels, size), str(args.image)
    info = read_run_info(run)
    if info.get("task") != "shapes":
        raise UserError(f"{run} was not trained on the shapes task (task "
                        f"{info.get('task')!r}): give an image with --image PATH")
    from ..data import ShapesDataset

    index = 0 if args.index is None else args.index
    seed = int(info.get("seed", 0))
    image, caption, _ = ShapesDataset("test", size=index + 1, image_size=size, seed=seed,
                                      language="en")[index]
    return image, f"shapes test image {index} (seed {seed}): {caption!r}"


def _zero_shot_line(model: nn.Module, tok: Any, pixel_values: Any) -> str:
    """"zero-shot: <prompt> (cosine c)" for a shapes run's image: the nearest of the 30
    combinations' English prompt ensembles."""
    import torch.nn.functional as F

    from ..data.shapes import class_prompts
    from ..demos.clip import zero_shot_class_weights

    weights = zero_shot_class_weights(model, tok, "en")  # (K, E)
    image = F.normalize(model.encode_image(pixel_values).float(), dim=-1)  # (1, E)
    scores = (image @ weights.t())[0]  # (K,)
    best = int(scores.argmax())
    return f"zero-shot: {class_prompts(language='en')[best]} (cosine {float(scores[best]):.3f})"


def _run_clip(args: argparse.Namespace, run: Path, model: nn.Module, tok: Any) -> int:
    """``qkv attention`` on a CLIP run (see the module docstring)."""
    import torch

    from ..data.clip_text import encode_texts
    from ..data.image_preprocess import to_pixel_values
    from ..outputs import new_output_dir
    from ..train.checkpoint import read_run_info
    from ..viz import attention_html, plot_attention_grid
    from ..viz.patches import attention_rollout, draw_image_grid, draw_patch_attention
    from . import UserError

    if args.target is not None:
        raise UserError(f"--target {args.target!r}: a CLIP run has no target; give a caption "
                        f"with --input")
    vision, text = model.config.vision, model.config.text
    n_layers = vision.num_layers if args.input is None else min(vision.num_layers,
                                                                 text.num_layers)
    n_heads = vision.num_heads if args.input is None else min(vision.num_heads, text.num_heads)
    layer = _index("layer", args.layer, n_layers)
    head = _index("head", args.head, n_heads)
    image, source = _clip_image(args, run, model)
    out = new_output_dir(Path(args.out) if args.out is not None else default_out(run),
                         replaceable=ATTENTION_FILES)
    pixel_values = to_pixel_values(image[None])  # (1, 3, S, S)
    with torch.no_grad():
        vis = model.vision(pixel_values, output_attentions=True)
        weights = torch.stack(vis.attentions)[:, 0].float()  # (L, H, T, T)
        rollout = attention_rollout(vis.attentions)[0]  # (gh, gw)
        print(f"image: {source}")
        if read_run_info(run).get("task") == "shapes":
            print(_zero_shot_line(model, tok, pixel_values))
    gh, gw = rollout.shape
    grid_name = f"{gh}×{gw} patches of {vision.patch_size} px"
    written = [draw_patch_attention(image, rollout, out / "attention_rollout.png",
                                    title=f"attention rollout over {grid_name}")]
    # each layer's class-token row over the patches (mean of heads, or --head), then rollout
    layers = range(vision.num_layers) if layer is None else [layer % vision.num_layers]
    rows = [weights[lay, :, 0, 1:].mean(dim=0) if head is None else weights[lay, head, 0, 1:]
            for lay in layers]  # (gh·gw,) each
    who = "mean of heads" if head is None else f"head {head % vision.num_heads}"
    maps = [r.reshape(gh, gw) for r in rows] + [rollout]
    captions = [f"layer {lay}, class token ({who})" for lay in layers] + ["rollout"]
    written.append(draw_image_grid([image] * len(maps), out / "attention_patches.png",
                                   captions=captions, maps=maps, title="image tower"))
    tokens = ["[cls]"] + [f"r{i}c{j}" for i in range(gh) for j in range(gw)]
    written.append(plot_attention_grid(
        weights, query_tokens=tokens, key_tokens=tokens, path=out / "attention_vision.png",
        title=f"image tower attention: {source}", layers=None if layer is None else [layer],
        heads=None if head is None else [head]))
    maps_html = {"vision": weights}
    labels = {"vision": (tokens, tokens)}
    if args.input is not None:
        from .generate import warn_unknown

        warn_unknown(tok, [args.input])
        ids, mask = encode_texts(tok, [args.input])
        if ids.shape[1] > text.max_len:
            raise UserError(f"--input is {ids.shape[1]} tokens with bos and eos, beyond the "
                            f"text tower's max_len={text.max_len}")
        with torch.no_grad():
            txt = model.text(ids, mask, output_attentions=True)
            similarity = float(torch.nn.functional.cosine_similarity(
                model.encode_image(pixel_values), model.encode_text(ids, mask)))
        print(f"cosine similarity of the image and {args.input!r}: {similarity:.3f}")
        text_weights = torch.stack(txt.attentions)[:, 0].float()  # (L, H, N, N)
        text_tokens = tok.tokens(ids[0].tolist())
        written.append(plot_attention_grid(
            text_weights, query_tokens=text_tokens, key_tokens=text_tokens,
            path=out / "attention_text.png", title=f"text tower attention: {args.input}",
            layers=None if layer is None else [layer], heads=None if head is None else [head]))
        maps_html["text"] = text_weights
        labels["text"] = (text_tokens, text_tokens)
    else:  # an earlier run's text map would be taken for this one's
        (out / "attention_text.png").unlink(missing_ok=True)
    written.append(attention_html(maps_html, tokens=labels, path=out / "attention.html",
                                  title=f"qkv attention: {source}", layer=layer, head=head))
    for path in written:
        print(path)
    return 0


def _draw(maps: dict, labels: dict, src_tokens: list[str], tgt_tokens: list[str] | None,
          out: Path, text: str, layer: int | None, head: int | None) -> int:
    """Write (and print the paths of) one heatmap grid per map of ``maps`` (name -> (L, H,
    N, M) weights), the cross-attention's alignment plot when there is one (layer ``layer``
    or the last, head ``head`` or the mean of heads) and the HTML page; exit status 0."""
    from ..viz import attention_html, plot_alignment, plot_attention_grid

    written = []
    for name, weights in maps.items():
        q, k = labels[name]
        written.append(plot_attention_grid(
            weights, query_tokens=q, key_tokens=k, path=out / f"attention_{name}.png",
            title=f"{name} attention: {text}", layers=None if layer is None else [layer],
            heads=None if head is None else [head]))
    if "cross" in maps:
        n_layers, n_heads = maps["cross"].shape[:2]
        at = (-1 if layer is None else layer) % n_layers
        cross = maps["cross"][at]  # (H, T, S)
        which = "mean of heads" if head is None else f"head {head % n_heads}"
        written.append(plot_alignment(
            cross if head is None else cross[head], source_tokens=src_tokens,
            target_tokens=tgt_tokens, path=out / "attention_alignment.png",
            title=f"cross-attention, layer {at}, {which}: {text}"))
    written.append(attention_html(maps, tokens=labels, path=out / "attention.html",
                                  title=f"qkv attention: {text}", layer=layer, head=head))
    for path in written:
        print(path)
    return 0
