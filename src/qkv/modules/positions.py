"""Absolute position encodings: fixed sinusoidal, learned, and rotary (RoPE).

Shapes: B batch, N length, C model width, H heads, D head dim.

Positions are integer tensors of absolute positions: ``(N,)`` (every row the same) or
``(B, N)`` (a row each: left-padded batches, rows decoding at different offsets). Modules
that add an encoding take ``x`` (B, N, C) and default to ``arange(offset, offset + N)``;
``offset`` is the number of tokens already in a cache when decoding. For a left-padded batch,
``positions_from_mask(keep)`` gives each real token its position counted from the row's first
real token.

Angles are computed from the positions in fp64 (fp32 on devices without fp64, such as MPS), so
no table bounds the length and position 16384 is as exact as position 16; results are cast to
the input dtype at the end (the math of half-precision inputs runs in fp32). None of these
modules stores a floating-point buffer, so ``.half()`` or ``.to(bfloat16)`` cannot round the
angles; ``Learned`` holds its weight as an ordinary parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .rope_scaling import RopeScaling, rope_frequencies

__all__ = ["SINUSOIDAL_LAYOUTS", "Learned", "PositionError", "RoPE", "Sinusoidal",
           "positions_from_mask"]


class PositionError(IndexError, ValueError):
    """A position outside what a module can encode (e.g. ``>= max_len`` of ``Learned``).

    Subclasses both IndexError (what ``nn.Embedding`` users expect) and ValueError (the house
    convention for a bad argument value), so either ``except`` catches it.
    """


def _angle_dtype(device: torch.device) -> torch.dtype:
    """fp64 for the angles, except on devices that have no fp64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half precision (and integer) inputs, the input dtype otherwise."""
    if dtype in (torch.float32, torch.float64):
        return dtype
    return torch.float32


def _check_integer(positions: object, name: str = "positions") -> Tensor:
    if not isinstance(positions, Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex \
            or positions.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor (absolute positions), got dtype {positions.dtype}"
        )
    return positions


def _resolve_positions(
    positions: Tensor | None, offset: int, batch: int, n: int, device: torch.device,
) -> Tensor:
    """Validate ``positions`` against a (batch, n) problem; returns (N,) or (B|1, N) int64."""
    if positions is None:
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise TypeError(f"offset must be an int, got {type(offset).__name__}")
        return torch.arange(offset, offset + n, device=device)  # (N,)
    if offset != 0:
        raise ValueError(
            f"pass either positions or offset, not both (offset={offset}); "
            "add the offset to positions yourself"
        )
    positions = _check_integer(positions)
    if positions.ndim not in (1, 2):
        raise ValueError(
            f"positions must be (N,) or (B, N), got shape {tuple(positions.shape)}"
        )
    if positions.shape[-1] != n:
        raise ValueError(
            f"positions has length {positions.shape[-1]} but the input has N={n} "
            f"(positions shape {tuple(positions.shape)})"
        )
    if positions.ndim == 2 and positions.shape[0] not in (1, batch):
        raise ValueError(
            f"positions has batch {positions.shape[0]} but the input has B={batch} "
            f"(positions shape {tuple(positions.shape)})"
        )
    return positions.to(device=device, dtype=torch.long)


def _inv_freq(half: int, dim: int, base: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """base^(-2i/dim) for i in [0, half), shape (half,)."""
    exponent = torch.arange(0, half, device=device, dtype=dtype) * (2.0 / dim)
    return torch.pow(torch.tensor(float(base), device=device, dtype=dtype), -exponent)


def _check_dim(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value % 2:
        raise ValueError(f"{name} must be even (the encoding pairs dimensions), got {value}")
    return value


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)) \
            or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    return float(base)


def _check_x(x: object, ndim: int, last: int, shape_name: str, last_name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor {shape_name}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"x must be {shape_name}, got shape {tuple(x.shape)}")
    if x.shape[-1] != last:
        raise ValueError(
            f"x has last dim {x.shape[-1]} but the module has {last_name}={last} "
            f"(x shape {tuple(x.shape)})"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    return x


def positions_from_mask(keep: Tensor) -> Tensor:
    """Positions (B, N) int64 of a left- (or right-) padded batch from its padding mask.

    ``keep`` (B, N) bool, True at real tokens (the house convention: True = may attend).
    Each real token gets its index among the row's real tokens (0, 1, 2, ...); padding
    columns get 0 (any in-range value would do: their outputs are masked away). For decoding
    with a cache, pass the mask over the whole sequence so far and take the last columns.
    """
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
        raise TypeError(f"keep must be a bool tensor (True = real token), got {got}")
    if keep.ndim != 2:
        raise ValueError(f"keep must be (B, N), got shape {tuple(keep.shape)}")
    pos = keep.long().cumsum(dim=-1) - 1  # (B, N)
    return pos.clamp_min(0).masked_fill(~keep, 0)


#: ``Sinusoidal`` layouts: sin/cos interleaved (the paper) or concatenated halves [sin | cos]
SINUSOIDAL_LAYOUTS = ("interleaved", "halves")


class Sinusoidal(nn.Module):
    """Fixed sinusoidal encoding of Vaswani et al. 2017, added to the input.

    ``PE[pos, 2i] = sin(pos / base^(2i/dim))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i/dim))``:
    sin and cos interleaved as in the paper (``layout="interleaved"``). ``layout="halves"``
    concatenates them instead, ``PE[pos, i] = sin(...)`` and ``PE[pos, C/2 + i] = cos(...)``
    for i < C/2 (tensor2tensor, fairseq and Marian / opus-mt, whose HF checkpoints do not
    store the table). The input is not scaled by sqrt(dim); that belongs to the token
    embedding.

    Args:
        dim: model width C; must be even.
        max_len: optional size of a table precomputed (lazily, fp32, on the input's device) for
            positions ``< max_len``. It is a cache, not a limit: other positions are computed
            from the formula. Nothing is stored in the state dict.
        base: the wavelength base (10000 in the paper).
        layout: "interleaved" (the paper) or "halves" ([sin | cos]).

    ``forward(x, positions=None, *, offset=0)``: x (B, N, C) -> x + PE[positions] (B, N, C)
    in x's dtype.
    """

    def __init__(self, dim: int, *, max_len: int | None = None, base: float = 10000.0,
                 layout: str = "interleaved") -> None:
        super().__init__()
        self.dim = _check_dim(dim, "dim")
        if layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(f"Sinusoidal: layout must be one of {SINUSOIDAL_LAYOUTS}, "
                             f"got {layout!r}")
        self.layout = layout
        if max_len is not None and (
            not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 0
        ):
            raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
        self.max_len = max_len
        self.base = _check_base(base)
        self._table: Tensor | None = None  # (max_len, C) fp32; a cache, not a buffer

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, max_len={self.max_len}, base={self.base:g}, "
                f"layout={self.layout!r}")

    def _formula(self, positions: Tensor) -> Tensor:
        """(...) int -> (..., C) fp32, from the formula."""
        adt = _angle_dtype(positions.device)
        inv = _inv_freq(self.dim // 2, self.dim, self.base, positions.device, adt)  # (C/2,)
        angles = positions.to(adt).unsqueeze(-1) * inv  # (..., C/2)
        if self.layout == "halves":
            return torch.cat((angles.sin(), angles.cos()), dim=-1).to(torch.float32)  # (..., C)
        pe = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (..., C/2, 2)
        return pe.flatten(-2).to(torch.float32)  # (..., C)

    def encoding(self, positions: Tensor) -> Tensor:
        """Rows of the encoding table: positions (...) int -> (..., C) fp32."""
        positions = _check_integer(positions)
        if self.max_len is None or positions.numel() == 0:
            return self._formula(positions)
        table = self._table
        if table is None or table.device != positions.device:
            table = self._formula(torch.arange(self.max_len, device=positions.device))
            self._table = table  # (max_len, C)
        in_table = bool(((positions >= 0) & (positions < self.max_len)).all())
        if in_table:
            return table[positions]  # (..., C)
        return self._formula(positions)

    def forward(self, x: Tensor, positions: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """x (B, N, C) + PE; positions (N,) or (B, N) int, default arange(offset, offset + N)."""
        x = _check_x(x, 3, self.dim, "(B, N, C)", "dim")
        pos = _resolve_positions(positions, offset, x.shape[0], x.shape[1], x.device)
        pe = self.encoding(pos)  # (N, C) or (B|1, N, C)
        cdt = _compute_dtype(x.dtype)
        return (x.to(cdt) + pe.to(cdt)).to(x.dtype)


class Learned(nn.Module):
    """Learned absolute position embedding (GPT-2, BERT), added to the input.

    Args:
        max_len: number of positions with an embedding; positions must lie in [0, max_len).
        dim: model width C.
        init_std: standard deviation of the normal initialisation (0.02, as GPT-2 and BERT).

    ``weight`` (max_len, C) is a parameter. ``forward(x, positions=None, *, offset=0)``:
    x (B, N, C) -> x + weight[positions] (B, N, C) in x's dtype. A position outside
    [0, max_len) raises ``PositionError`` (an IndexError and a ValueError) naming it.
    """

    def __init__(
        self, max_len: int, dim: int, *, init_std: float = 0.02,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("max_len", max_len), ("dim", dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_len = max_len
        self.dim = dim
        self.init_std = float(init_std)
        self.weight = nn.Parameter(torch.empty(max_len, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw ``weight`` from N(0, init_std²)."""
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"

    def encoding(self, positions: Tensor) -> Tensor:
        """Rows of the table: positions (...) int -> weight[positions] (..., C)."""
        positions = _check_integer(positions).to(self.weight.device)
        bad = (positions < 0) | (positions >= self.max_len)
        if positions.numel() and bool(bad.any()):
            value = int(positions[bad][0])
            raise PositionError(
                f"position {value} is out of range for Learned(max_len={self.max_len}); "
                f"positions must lie in [0, {self.max_len})"
            )
        return self.weight[positions]  # (..., C)

    def forward(self, x: Tensor, positions: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """x (B, N, C) + weight[positions]; positions (N,) or (B, N) int, default
        arange(offset, offset + N)."""
        x = _check_x(x, 3, self.dim, "(B, N, C)", "dim")
        pos = _resolve_positions(positions, offset, x.shape[0], x.shape[1], x.device)
        return x + self.encoding(pos).to(x.dtype)  # (B, N, C)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """RoPE's rotation of x (..., D) by cos/sin broadcastable to (..., D/2): the pairs
    (x[i], x[i + D/2]) (half-split), or (x[2i], x[2i+1]) when ``interleaved``; -> (..., D)."""
    if interleaved:
        pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))  # (..., D/2, 2)
        a, b = pairs[..., 0], pairs[..., 1]  # (..., D/2)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., D)


class RoPE(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer) for queries and keys.

    Each pair of dimensions ``(a, b)`` of a head is rotated by angle ``pos * θ_i`` with
    ``θ_i = base^(-2i/D)``, i in [0, D/2); then ``<rot(q, m), rot(k, n)>`` depends on the
    positions only through ``m - n``. Which dimensions form pair i:

    - ``interleaved=False`` (default): half-split, ``(x[i], x[i + D/2])`` — GPT-NeoX and
      HF Llama/Mistral/Qwen (``rotate_half``); checkpoints from those load as they are.
    - ``interleaved=True``: adjacent pairs ``(x[2i], x[2i+1])`` — the RoFormer paper, GPT-J,
      Meta's original Llama code (``view_as_complex``).

    The two conventions differ only by a fixed permutation of the head dims (of the q/k
    projection weights). Angles come from the positions in fp64, so there is no length limit
    and no table; the rotation runs in fp32 for fp16/bf16 inputs and returns the input dtype.

    ``scaling`` extends the context as transformers does for Llama-family checkpoints
    ("linear", "dynamic", "llama3", "yarn"; ``qkv.modules.rope_scaling``): θ_i become the
    scaled frequencies and cos and sin are multiplied by the attention factor (yarn's; 1
    otherwise), as transformers' rotary embeddings do. "dynamic" rescales the base from the
    largest position of each call (``position_dependent``): ``rotate(x, positions)`` at a
    decoding step is what transformers computes there, but ``cos_sin(arange(cap))`` precomputed
    as a table is not (it scales every position for the length ``cap``).

    Args:
        head_dim: D, the dims rotated; must be even.
        base: θ base (10000 in the paper; Llama 3 uses 500000).
        interleaved: the pair convention, above.
        scaling: None (plain RoPE, the default), a ``RopeScaling``, or its ``to_dict()`` form
            (``{"rope_type": "llama3", "factor": 8.0, ...}``); kept as ``self.scaling``
            (a ``RopeScaling`` or None).
    """

    def __init__(
        self, head_dim: int, *, base: float = 10000.0, interleaved: bool = False,
        scaling: RopeScaling | Mapping | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = _check_dim(head_dim, "head_dim")
        self.base = _check_base(base)
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
        self.interleaved = interleaved
        if isinstance(scaling, Mapping):
            scaling = RopeScaling.from_dict(scaling)
        elif scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"scaling must be a RopeScaling, its dict or None, "
                            f"got {type(scaling).__name__}")
        if scaling is not None:
            rope_frequencies(self.head_dim, self.base, scaling)  # a ValueError for a bad pair
        self.scaling: RopeScaling | None = scaling

    @property
    def position_dependent(self) -> bool:
        """True when the angles of a position depend on the call's largest position
        ("dynamic" scaling): cos/sin precomputed for ``arange(cap)`` then differ from
        ``cos_sin`` of each call's positions, so compute them per call."""
        return self.scaling is not None and self.scaling.position_dependent

    def extra_repr(self) -> str:
        text = f"head_dim={self.head_dim}, base={self.base:g}, interleaved={self.interleaved}"
        if self.scaling is not None:
            text += f", scaling={self.scaling.to_dict()}"
        return text

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype = torch.float32,
    ) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles ``pos * θ_i``: positions (...) int -> two (..., D/2).

        Computed in fp64 (fp32 on MPS) and cast to ``dtype``. Column i belongs to pair i
        (see the class docstring for which dims that is). With ``scaling``, θ_i are the
        scaled frequencies and both are multiplied by the attention factor; "dynamic" takes
        its length from these positions, ``max(positions) + 1`` over all of them (as
        transformers takes ``max(position_ids) + 1`` over the batch).
        """
        positions = _check_integer(positions)
        adt = _angle_dtype(positions.device)
        if self.scaling is None:
            inv = _inv_freq(self.head_dim // 2, self.head_dim, self.base, positions.device, adt)
            angles = positions.to(adt).unsqueeze(-1) * inv  # (..., D/2)
            return angles.cos().to(dtype), angles.sin().to(dtype)
        seq_len = positions.max() + 1 \
            if self.scaling.position_dependent and positions.numel() else None
        inv, factor = rope_frequencies(self.head_dim, self.base, self.scaling, seq_len=seq_len,
                                       device=positions.device, dtype=adt)  # (D/2,)
        angles = positions.to(adt).unsqueeze(-1) * inv  # (..., D/2)
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, H, N, D) with cos/sin (N, D/2) or (B|1, N, D/2) in the compute dtype."""
        if cos.ndim == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B|1, 1, N, D/2)
        return rotate_pairs(x.to(cos.dtype), cos, sin, self.interleaved).to(x.dtype)

    def _prepare(
        self, x: Tensor, name: str, positions: Tensor | None, offset: int,
    ) -> tuple[Tensor, Tensor]:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, H, N, D), got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be (B, H, N, D), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} has head dim {x.shape[-1]} but RoPE has head_dim={self.head_dim} "
                f"({name} shape {tuple(x.shape)})"
            )
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        pos = _resolve_positions(positions, offset, x.shape[0], x.shape[2], x.device)
        return self.cos_sin(pos, _compute_dtype(x.dtype))

    def rotate(self, x: Tensor, positions: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """Rotate x (B, H, N, D) by its positions; returns (B, H, N, D) in x's dtype.

        positions: (N,) or (B, N) integer absolute positions (a decoding step passes the
        cache length onwards, per row); default ``arange(offset, offset + N)``.
        """
        cos, sin = self._prepare(x, "x", positions, offset)
        return self._rotate(x, cos, sin)

    def forward(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None, *, offset: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """Rotate q (B, H, N, D) and k (B, Hkv, N, D) at the same positions -> (q_rot, k_rot).

        For queries and keys at different positions, call ``rotate`` on each.
        """
        cos, sin = self._prepare(q, "q", positions, offset)
        if not isinstance(k, Tensor) or k.ndim != 4 or k.shape[0] != q.shape[0] \
                or k.shape[2:] != q.shape[2:]:
            got = tuple(k.shape) if isinstance(k, Tensor) else type(k).__name__
            raise ValueError(
                f"k must be (B, Hkv, N, D) matching q {tuple(q.shape)} in B, N and D, got {got}; "
                "for keys at other positions call rotate() on each"
            )
        if not k.dtype.is_floating_point:
            raise TypeError(f"k must be a floating-point tensor, got dtype {k.dtype}")
        kcdt = _compute_dtype(k.dtype)
        if kcdt == cos.dtype:
            kcos, ksin = cos, sin
        else:
            pos = _resolve_positions(positions, offset, q.shape[0], q.shape[2], q.device)
            kcos, ksin = self.cos_sin(pos.to(k.device), kcdt)
        return self._rotate(q, cos, sin), self._rotate(k, kcos.to(k.device), ksin.to(k.device))
