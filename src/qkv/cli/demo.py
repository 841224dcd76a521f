"""``qkv demo``: the default demo trains the seeds' encoder-decoder Transformer on the
embedded date-normalisation task; ``qkv demo lora`` adapts that model with LoRA to an output
format it never produced; ``qkv demo coref`` shows self-attention resolving pronouns;
``qkv demo clip`` trains a small CLIP on synthetic shapes and classifies held-out
colour/shape combinations zero-shot; ``qkv demo flamingo`` teaches a frozen GPT to answer
questions about shapes images (Perceiver resampler + tanh-gated cross-attention);
``qkv demo tour`` is a quick tour of the attention
core."""

from __future__ import annotations

import argparse

from .checks import int_in, seed

#: ``qkv demo tour``'s default --length
TOUR_LENGTH = 8192
#: ... with --quick
TOUR_QUICK_LENGTH = 1024

EXAMPLES = """examples:
  qkv demo                       train on dates (~1.5 min on 2 CPU cores), print exact match
  qkv demo --quick               a few-second run (smoke test; low accuracy)
  qkv demo --out runs/my-demo    choose the run directory
  qkv demo lora                  train the dates model, then adapt it with LoRA to
                                 "3 March 2021" outputs (<= 4 min on 2 CPU cores)
  qkv demo lora --base runs/my-demo   adapt a finished `qkv demo` run instead
  qkv demo coref                 attention links pronouns to their nouns
  qkv demo clip                  train a small CLIP on coloured shapes (800 steps), print
                                 zero-shot accuracy on held-out colour/shape combinations
  qkv demo clip --steps 400      a shorter run (the budget is in steps)
  qkv demo flamingo              a frozen GPT learns to answer questions about shapes images
                                 (resampler + gated cross-attention; ~4 min of CPU time)
  qkv demo flamingo --vision runs/my-clip   reuse a `qkv demo clip` run as the image tower
  qkv demo tour --length 4096    masks, backends, relative positions at long length
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv demo`` to the command parsers."""
    p = sub.add_parser("demo", help="train the seeds' Transformer on dates and show it works",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", default="dates",
                   choices=("dates", "lora", "coref", "clip", "flamingo", "tour"),
                   help="which demo (default: dates)")
    p.add_argument("--quick", action="store_true",
                   help="a short run for smoke tests (accuracy will be low)")
    p.add_argument("--out", default=None,
                   help="run directory, new or empty (default: runs/demo-<which>-<timestamp>)")
    p.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    p.add_argument("--base", default=None, metavar="RUN",
                   help="lora only: a finished `qkv demo` / `qkv train --task dates` run to "
                        "adapt (default: train one first, into OUT/base)")
    p.add_argument("--steps", type=int_in(1), default=None, metavar="N",
                   help="clip / flamingo only: training steps (clip: default 800; flamingo: "
                        "its Flamingo steps, default 300; fewer with --quick)")
    p.add_argument("--vision", default=None, metavar="RUN",
                   help="flamingo only: a finished `qkv demo clip` run to use as the image "
                        "tower (default: train one first, 300 steps, into OUT/vision)")
    p.add_argument("--length", type=int_in(1), default=None,
                   help=f"tour only: sequence length of the relative-position part (default "
                        f"{TOUR_LENGTH}, {TOUR_QUICK_LENGTH} with --quick; the time grows as N², "
                        f"the memory as N)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from . import UserError

    if args.which != "tour" and args.length is not None:
        raise UserError(f"--length {args.length}: only `qkv demo tour` takes --length")
    if args.which != "lora" and args.base is not None:
        raise UserError(f"--base {args.base}: only `qkv demo lora` takes --base")
    if args.which not in ("clip", "flamingo") and args.steps is not None:
        raise UserError(f"--steps {args.steps}: only `qkv demo clip` and `qkv demo flamingo` "
                        f"take --steps")
    if args.which != "flamingo" and args.vision is not None:
        raise UserError(f"--vision {args.vision}: only `qkv demo flamingo` takes --vision")
    if args.which == "flamingo":
        from ..demos.flamingo import run_flamingo_demo

        return run_flamingo_demo(args.out, steps=args.steps, seed=args.seed,
                                 vision=args.vision, quick=args.quick)
    if args.which == "clip":
        from ..demos.clip import run_clip_demo

        return run_clip_demo(out=args.out, steps=args.steps, quick=args.quick, seed=args.seed)
    if args.which == "lora":
        from ..demos.lora import run_lora_demo

        return run_lora_demo(out=args.out, base=args.base, quick=args.quick, seed=args.seed)
    if args.which == "tour":
        from .tour import run_tour

        if args.out is not None:
            raise UserError(f"--out {args.out}: `qkv demo tour` writes no files")
        if args.length is None:
            args.length = TOUR_QUICK_LENGTH if args.quick else TOUR_LENGTH
        return run_tour(args)
    if args.which == "coref":
        from ..demos.coref import run_coref_demo

        return run_coref_demo(out=args.out, quick=args.quick, seed=args.seed)
    from ..demos.dates import run_dates_demo

    return run_dates_demo(out=args.out, quick=args.quick, seed=args.seed)
