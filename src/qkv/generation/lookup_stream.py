"""Streaming prompt-lookup decoding (``qkv.generate(prompt_lookup_num_tokens=...,
streamer=...)``): the tokens each row's lookup text gains, assembled into the output columns
a streamer receives (``qkv.generation.api`` hands them to prompt lookup).

Shapes: R rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .prompt_lookup import NgramIndex

__all__ = ["StreamColumns", "StreamedText"]


class StreamColumns:
    """Assembles the tokens prompt lookup appends to each row's lookup text (in order, the
    rows' own tokens only) into output columns (R,) for a streamer: a column is complete
    when every row has its token there or had ended (its stop token) before it; columns
    where every row has ended are never produced (prompt lookup's output ends there too)."""

    def __init__(self, rows: int, stops: tuple[int, ...] | None, pad: int,
                 device: torch.device, streamer: Callable[[Tensor], object]) -> None:
        self.got: list[list[int]] = [[] for _ in range(rows)]
        self.end: list[int | None] = [None] * rows  # tokens up to and with its stop token
        self.stops = frozenset(stops or ())
        self.pad, self.device, self.streamer = pad, device, streamer
        self.sent = 0  # columns streamed

    def add(self, row: int, tok: int) -> None:
        got = self.got[row]
        got.append(tok)
        if tok in self.stops and self.end[row] is None:
            self.end[row] = len(got)
        c = self.sent
        while (any(len(g) > c for g in self.got)
               and all(len(g) > c or (e is not None and e <= c)
                       for g, e in zip(self.got, self.end, strict=True))):
            column = [g[c] if len(g) > c else self.pad for g in self.got]
            self.streamer(torch.tensor(column, dtype=torch.long, device=self.device))
            c = self.sent = c + 1


class StreamedText(NgramIndex):
    """A row's lookup text that also hands every token appended after its initial segments
    (the tokens prompt lookup emits for the row, in order) to ``columns``."""

    def __init__(self, ngram: int, segments: list[list[int]], columns: StreamColumns,
                 row: int) -> None:
        self.columns: StreamColumns | None = None  # the initial segments are not streamed
        super().__init__(ngram, segments)
        self.columns, self.row = columns, row

    def append(self, tok: int) -> None:
        super().append(tok)
        if self.columns is not None:
            self.columns.add(self.row, tok)
