"""The streamed output of ``qkv generate`` (one output, no beams): ``TokenStream``, the
``qkv.generate`` streamer that prints each new token's stable text as it arrives and the
speed at the end.

Shapes: one row; its tokens arrive one (1,) tensor at a time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TokenStream"]


class TokenStream:
    """``qkv.generate``'s streamer for one output: writes ``lead`` (the prompt as typed, or
    nothing) and the text the new tokens add after ``head`` (the ids it continues; their text
    is not printed again) as the tokens arrive, until a token of ``ends``. Only stable text is
    written: the decoding of every new token so far less what was written, without its
    trailing U+FFFD (the bytes of a character not all generated yet), and only where it
    extends what was written. ``finish`` writes the rest of the final output and the speed."""

    def __init__(self, decode: Callable[[list[int]], str], *, head: list[int],
                 ends: set[int], lead: str) -> None:
        self.decode, self.head, self.ends, self.lead = decode, head, ends, lead
        self.base = decode(head) if head else ""
        self.ids: list[int] = []
        self.shown = ""  # written so far
        self.ended = False
        self.count = 0  # tokens generated (the stop token included)
        self.start = time.perf_counter()
        self.first: float | None = None

    def text(self) -> str:
        """The text of the new tokens so far (as ``qkv.generation.text._continuation``)."""
        if not self.head:
            return self.decode(self.ids)
        whole = self.decode(self.head + self.ids)
        return whole[len(self.base):] if whole.startswith(self.base) else self.decode(self.ids)

    def __call__(self, tokens: Any) -> None:  # tokens (1,): the one row's new token
        if self.first is None:
            self.first = time.perf_counter()
        self.count += 1
        tok = int(tokens[0])
        if self.ended or tok in self.ends:
            self.ended = True
            return
        self.ids.append(tok)
        self._write((self.lead + self.text()).rstrip("\ufffd"))

    def _write(self, text: str) -> None:
        if len(text) > len(self.shown) and text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text

    def finish(self, final: str) -> None:
        """Write what ``final`` (the output as printed without streaming) has beyond what
        was written, a newline, and the tokens/s on stderr."""
        seconds = time.perf_counter() - self.start
        if final.startswith(self.shown):
            sys.stdout.write(final[len(self.shown):] + "\n")
        else:  # a tokenizer whose decoding changed text already written: print it whole
            print("qkv: warning: the streamed text changed as more tokens came; the output "
                  "follows whole", file=sys.stderr)
            sys.stdout.write("\n" + final + "\n")
        sys.stdout.flush()
        first = "" if self.first is None else (
            f", the first after {self.first - self.start:.2f} s")
        print(f"qkv: {self.count} tokens in {seconds:.2f} s "
              f"({self.count / max(seconds, 1e-9):.1f} tokens/s{first})", file=sys.stderr)
