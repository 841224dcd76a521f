"""Speculative decoding on / off: ``qkv.generate(target, ..., draft_model=d,
num_draft_tokens=k)`` vs plain greedy ``qkv.generate(target, ...)``, side by side; the
outputs are checked to be identical (greedy: they must be).

Shapes: B batch (1 and 8), N prompt length (2 + L), T new tokens (L), L copied tokens, C
width, V vocab, k draft tokens.

The task: copy. A prompt is ``BOS x SEP`` with x = L random tokens; the answer is x again.
Training a 12-layer GPT here takes minutes, so the target is built: a 2-layer GPT A (C=256,
H=4, V=256, learned positions) is trained on the copy task for ``--steps`` steps (AdamW, on
fresh random batches), and the 12-layer target is A's embeddings, positions, 2 layers, final
norm and head with 10 more layers (random weights, default init) after its two, their
residual branches (attention and feed-forward output projections) scaled by ``--eps``: a
12-layer GPT's compute whose answers stay A's, nudged by the 10 layers (eps = 0 would make
it A exactly). The drafts (2 layers, C=256):

- own: A itself, the target's first 2 layers + its head (agrees as far as the 10 layers
  leave the argmax alone);
- twin: a second 2-layer GPT trained the same way from another seed (agrees where both copy
  correctly: two models that learnt the same task);
- untrained: random weights (almost never agrees: the cost of drafts that fail).

Per draft and batch size: the median seconds of ``qkv.generate`` over ``--examples``
prompts (alternating on / off, the order flipping each repeat) and the speed-up; the same for
the decode loops alone ("loop": ``search.greedy_or_sample`` on the engine's stepper vs
``speculative.speculative_decode`` on ``speculative.verifier_stepper``'s two, the steppers'
weight copies and caches built outside the timed part: a ``generate`` call builds one
stepper for plain greedy and, for speculative decoding, one that ``_generate_decoder`` builds
before its draft branch and does not use, the target's (twice when the engine's first choice
feeds one token per call) and the draft's); the acceptance rate (draft tokens the target
kept / proposed, rows still running); target forward passes per new-token position (plain
greedy: 1). A batch advances by the fewest tokens any of its rows kept, so the speed-up
shrinks with the batch when rows disagree. Timings vary with the machine's load: read the
ratios.

Usage: python -m benchmarks.bench_speculative [--quick] [--steps 80 --copy 24 --examples 8
       --k 5 --eps 0.1 --batches 1,8 --repeats 3 --threads 1 --clock wall]
(``--quick``: tiny models, 2 training steps, 2 examples, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks._harness import CLOCKS, load_average, print_cpu, print_table, side_by_side
from qkv.generation import api, speculative
from qkv.generation.engine import decoder_stepper
from qkv.generation.search import greedy_or_sample
from qkv.models import GPT, GPTConfig

BOS, SEP = 1, 2  # token ids below 3 are never copied


class StatsSpy:
    """Sums the speculative loop's stats over the calls made inside the ``with``."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self._real = speculative.speculative_decode

    def __enter__(self) -> StatsSpy:
        def spy(*args, stats=None, **kw):
            box: dict = {}
            out = self._real(*args, stats=box, **kw)
            for key, value in box.items():
                self.totals[key] = self.totals.get(key, 0) + value
            self.totals["positions"] = self.totals.get("positions", 0) + out.shape[1]
            return out

        speculative.speculative_decode = spy
        return self

    def __exit__(self, *exc) -> None:
        speculative.speculative_decode = self._real


def copy_batch(batch: int, length: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, 2 + 2·length) sequences ``BOS x SEP x``, x uniform over [3, vocab)."""
    x = torch.randint(3, vocab, (batch, length), generator=gen)
    return torch.cat((torch.full((batch, 1), BOS), x, torch.full((batch, 1), SEP), x), dim=1)


def train_copy(model: GPT, steps: int, length: int, seed: int) -> GPT:
    """``steps`` AdamW steps (lr 2e-3, batch 16) of the copy loss (the answer tokens only)."""
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        seq = copy_batch(16, length, vocab, gen)
        logits = model(seq[:, :-1])[:, length + 1:]  # (16, L, V): predicting x after SEP
        loss = F.cross_entropy(logits.reshape(-1, vocab), seq[:, length + 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def build(args) -> tuple[GPT, dict[str, GPT], float]:
    """The target, the drafts by name, and the training seconds."""
    size = dict(vocab_size=256, max_len=2 * args.copy + 8, dim=256, num_heads=4)
    if args.quick:
        size.update(vocab_size=32, dim=32, num_heads=2)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    own = train_copy(GPT(GPTConfig(num_layers=2, **size)), args.steps, args.copy, seed=0)
    torch.manual_seed(1)
    twin = train_copy(GPT(GPTConfig(num_layers=2, **size)), args.steps, args.copy, seed=1)
    trained = time.perf_counter() - t0
    torch.manual_seed(2)
    untrained = GPT(GPTConfig(num_layers=2, **size)).eval()
    torch.manual_seed(3)
    target = GPT(GPTConfig(num_layers=12, **size)).eval()
    with torch.no_grad():
        state = target.state_dict()
        for key, value in own.state_dict().items():  # A's parts; layers 0 and 1 among them
            state[key].copy_(value)
        for layer in target.layers[2:]:
            for lin in (layer.attn.out_proj, layer.ffn.fc_out):
                lin.weight.mul_(args.eps)
                if lin.bias is not None:
                    lin.bias.mul_(args.eps)
    return target, {"own": own, "twin": twin, "untrained": untrained}, trained


def decode_only(target: GPT, draft: GPT | None, prompts: torch.Tensor, bs: int, new: int,
                k: int, clock: str) -> float:
    """Seconds of the decode loops alone over ``prompts`` in batches of ``bs``: the steppers
    (weight copies, caches) are built outside the timed part; plain greedy on the engine's
    stepper, speculative on ``speculative.verifier_stepper``'s two (what ``generate`` uses)."""
    now, total = CLOCKS[clock], 0.0
    with torch.inference_mode():
        for i in range(0, len(prompts), bs):
            ids = prompts[i:i + bs]
            cap = ids.shape[1] + new
            if draft is None:
                stepper = decoder_stepper(target, ids, None, cap)
                t0 = now()
                greedy_or_sample(stepper, len(ids), new, do_sample=False, temperature=1.0,
                                 top_k=None, top_p=None, eos=None, pad=0, generator=None,
                                 device=ids.device)
            else:
                verify = speculative.verifier_stepper(target, ids, None, cap,
                                                      tokens_per_pass=k + 1)
                propose = speculative.verifier_stepper(draft, ids, None, cap)
                t0 = now()
                speculative.speculative_decode(
                    verify, propose, new, num_tokens=k, do_sample=False, temperature=1.0,
                    top_k=None, top_p=None, eos=None, pad=0, generator=None,
                    device=ids.device)
            total += now() - t0
    return total


def decode_only_medians(target, draft, prompts, bs, new, k, args) -> tuple[float, float]:
    """Median ``decode_only`` seconds (plain, speculative), alternating, the order flipping
    every repeat, after ``args.warmup`` untimed rounds."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.warmup + args.repeats):
        for spec in ((False, True) if r % 2 == 0 else (True, False)):
            t = decode_only(target, draft if spec else None, prompts, bs, new, k, args.clock)
            if r >= args.warmup:
                runs[spec].append(t)
    return statistics.median(runs[False]), statistics.median(runs[True])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models, 2 steps, 2 examples")
    p.add_argument("--steps", type=int, default=80, help="copy-task training steps per draft")
    p.add_argument("--copy", type=int, default=24, help="L: tokens copied (= new tokens)")
    p.add_argument("--examples", type=int, default=8, help="prompts decoded per timed run")
    p.add_argument("--k", type=int, default=5, help="num_draft_tokens")
    p.add_argument("--eps", type=float, default=0.1,
                   help="scale of the target's 10 extra layers' residual branches")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.copy, args.examples, args.repeats, args.warmup = 2, 6, 2, 1, 0
        args.batches = "1,2"
    print("command: python -m benchmarks.bench_speculative "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    target, drafts, trained = build(args)  # trains on torch's default threads
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    vocab = target.config.vocab_size
    prompts = copy_batch(args.examples, args.copy, vocab,
                         torch.Generator().manual_seed(7))[:, :args.copy + 2]  # (E, N)
    answers = prompts[:, 1:-1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, greedy; "
          f"target 12 layers (2 trained + 10 at eps={args.eps}), drafts 2 layers, C="
          f"{target.config.dim} V={vocab}; k={args.k}; {args.examples} prompts of "
          f"{args.copy + 2} tokens, {args.copy} new tokens each; drafts trained "
          f"{args.steps} steps ({trained:.0f} s); {args.clock} clock; load average at start "
          f"{load_average()}")

    def decode(bs: int, **kw) -> list[torch.Tensor]:
        return [api.generate(target, prompts[i:i + bs], max_new_tokens=args.copy, **kw)
                for i in range(0, args.examples, bs)]

    plain = torch.cat(decode(1))[:, args.copy + 2:]
    copied = (plain == answers).float().mean().item()
    rows, speedups = [], {}
    for name, draft in drafts.items():
        for bs in batches:
            def off(bs=bs):
                return decode(bs)

            def on(bs=bs, draft=draft):
                return decode(bs, draft_model=draft, num_draft_tokens=args.k)

            with StatsSpy() as spy:
                spec = on()
            same = torch.equal(torch.cat(spec), torch.cat(off()))
            times = side_by_side({"off": off, "on": on}, args.warmup, args.repeats, args.clock)
            ratio = times["off"] / times["on"]
            loop_off, loop_on = decode_only_medians(target, draft, prompts, bs, args.copy,
                                                    args.k, args)
            speedups[(name, bs)] = ratio
            s = spy.totals
            rows.append([name, str(bs), f"{times['off'] * 1e3:.0f}", f"{times['on'] * 1e3:.0f}",
                         f"{ratio:.2f}x", f"{loop_off * 1e3:.0f}", f"{loop_on * 1e3:.0f}",
                         f"{loop_off / loop_on:.2f}x",
                         f"{s['accepted'] / max(1, s['drafted']):.2f}",
                         f"{(s['rounds'] + len(spec)) / max(1, s['positions']):.2f}",
                         str(same)])
    print(f"\ntarget's greedy answers: {copied:.0%} of the copied tokens right")
    print_table(f"Speculative decoding (k={args.k}) vs plain greedy, median of {args.repeats}",
                ["draft", "batch", "greedy ms", "speculative ms", "speed-up",
                 "greedy loop ms", "speculative loop ms", "loop speed-up", "acceptance",
                 "target passes per position", "same output"], rows)
    print("\nspeed-ups: " + ", ".join(f"{d} B={b}: {r:.2f}x" for (d, b), r in speedups.items()))


if __name__ == "__main__":
    main()
