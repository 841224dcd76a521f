"""The decode step with static shapes: every layer of a plan for one new token per row,
attending over the whole capacity of the caches with a mask computed from a slot tensor, so
that no shape and no Python value in the step changes from one step to the next and the step
can run under ``torch.compile(dynamic=False)`` without recompiling (the static KV cache of
gpt-fast and torchtune).

Shapes: R rows, C width, H heads, Hkv key/value heads, g = H / Hkv, D head dim,
P = (H + 2·Hkv)·D, cap the caches' capacity, L layers, V vocab size.

Per layer: norm1 -> the fused q/k/v projection -> split -> RoPE (cos/sin gathered from a
(cap, D/2) table at the position tensor) -> the new key and value written into cache slot t
by ``index_copy_`` at the slot tensor -> scores over all cap slots + the additive mask
(R·Hkv|1, 1, cap): 0 where key j <= t and j is not a padded prompt position, -inf elsewhere
-> softmax -> values -> out projection + residual -> norm2 -> feed-forward + residual. The
stepper (``qkv.generation.stepper.PlanStepper``) embeds the tokens (learned positions
included) and applies the final norm; ``head`` is the LM head, eager (one ``addmm``).

Slots past t hold whatever the buffers held (uninitialised memory, NaN in the tests): the
mask's -inf keeps their scores out, but a non-finite value times a zero weight is still NaN,
so the first step zeroes every slot from t on once (eagerly; the prefill has written the
slots before t). Later writes are finite; slots a ``rewind`` gave up hold finite stale values
the mask hides (docs/ARCHITECTURE.md: Masks; Checklist 9).

``static_step`` is the pure function of the step; ``compiled_step(mode)`` is it under
``torch.compile(fullgraph=True, dynamic=False)``, one wrapper per mode for the process, so a
second stepper (the next ``generate`` call) with the same shapes reuses the compiled code
(dynamo's cache on the function: its guards check shapes, dtypes and the constants in
``spec`` and torch's thread count, never which tensors are passed). torch keeps at most
``torch._dynamo.config.recompile_limit`` compiled versions per function; past that it runs
the step eagerly (the same values) with a warning.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.activations import ACTIVATION_TABLE
from ..modules.cache import KVCache
from ..modules.positions import rotate_pairs
from .linears import DenseLinears
from .plan import DecodePlan, apply_norm

__all__ = ["COMPILE_MODES", "StaticLayers", "compiled_step", "static_step"]

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
"""The ``torch.compile`` modes ``compiled_step`` accepts."""

_COMPILED: dict[str, object] = {}  # mode -> the compiled static_step (one per process)


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (M, K) times w (K, N) (+ b (N,)) -> (M, N)."""
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


def static_step(x: Tensor, slot: Tensor, pos: Tensor | None, cos: Tensor | None,
                sin: Tensor | None, bias: Tensor | None, keys: list[Tensor],
                values: list[Tensor], ws: list[Tensor], bs: list[Tensor | None],
                norms: list[Tensor | None], spec: tuple) -> Tensor:
    """One decode step of every layer, for one new token per row, with the same shapes at
    every step.

    Args:
        x: (R, C) the embedded new tokens (learned positions added).
        slot: (1,) int64, the cache slot t the new keys/values go to; key j is attended to
            iff j <= t (and ``bias`` allows it).
        pos: RoPE positions, (1,) for every row or (R, 1) per row; None without RoPE.
        cos, sin: (cap, D/2) RoPE tables for positions 0..cap-1, or None without RoPE.
        bias: (R·Hkv, 1, cap) additive key padding bias (0 or -inf), or None.
        keys, values: per layer the (R, Hkv, cap, D) cache buffers, written at ``slot``.
        ws, bs: the 4·L projections (qkv, out, ffn_in, ffn_out per layer) as (K, N) weights
            and (N,) biases or None (``DenseLinears``' copies; the head is not used here).
        norms: per layer norm1 weight, norm1 bias, norm2 weight, norm2 bias (4·L; None
            where absent).
        spec: (H, Hkv, D, scale, norm kind, eps, activation name, gated, interleaved):
            constants. (torch.compile's guards include torch's thread count, which
            inductor's C++ kernels are written for: another count compiles anew.)

    Returns:
        (R, C) the residual stream after the last layer (before the final norm).
    """
    heads, hkv, d, scale, kind, eps, act_name, gated, interleaved = spec
    act = ACTIVATION_TABLE[act_name].fn
    rows, cap = x.shape[0], keys[0].shape[2]
    g = heads // hkv
    qs, vs = heads * d, (heads + hkv) * d
    # key j may be read iff j <= t: one additive mask for every layer, (R·Hkv|1, 1, cap)
    allowed = torch.arange(cap, device=x.device) <= slot  # (cap,)
    mask = torch.zeros((), dtype=x.dtype, device=x.device).masked_fill(
        ~allowed, float("-inf"))[None, None]  # (1, 1, cap)
    if bias is not None:
        mask = mask + bias  # (R·Hkv, 1, cap)
    if pos is not None:
        c, s = cos[pos], sin[pos]  # (1, D/2) or (R, 1, D/2)
        c, s = c.view(-1, 1, d // 2), s.view(-1, 1, d // 2)  # (1|R, 1, D/2)
    for i in range(len(keys)):
        w0, w1, w2, w3 = ws[4 * i:4 * i + 4]
        b0, b1, b2, b3 = bs[4 * i:4 * i + 4]
        proj = _linear(apply_norm(x, norms[4 * i], norms[4 * i + 1], kind, eps), w0, b0)  # (R, P)
        q = proj[:, :qs].view(rows, heads, d)  # (R, H, D)
        k = proj[:, qs:vs].view(rows, hkv, d)  # (R, Hkv, D)
        v = proj[:, vs:].reshape(rows, hkv, 1, d)  # (R, Hkv, 1, D)
        if pos is not None:
            q, k = rotate_pairs(q, c, s, interleaved), rotate_pairs(k, c, s, interleaved)
        keys[i].index_copy_(2, slot, k.reshape(rows, hkv, 1, d))
        values[i].index_copy_(2, slot, v)
        kt = keys[i].view(rows * hkv, cap, d).transpose(1, 2)  # (R·Hkv, D, cap)
        scores = torch.baddbmm(mask, q.reshape(rows * hkv, g, d), kt,
                               alpha=scale)  # (R·Hkv, g, cap)
        a = torch.bmm(torch.softmax(scores, dim=-1),
                      values[i].view(rows * hkv, cap, d))  # (R·Hkv, g, D)
        x = _linear(a.reshape(rows, heads * d), w1, b1) + x  # (R, C)
        y = _linear(apply_norm(x, norms[4 * i + 2], norms[4 * i + 3], kind, eps), w2, b2)
        if gated:
            gate, up = y.chunk(2, dim=-1)  # (R, F) each
            y = act(gate) * up
        else:
            y = act(y)  # (R, F)
        x = _linear(y, w3, b3) + x  # (R, C)
    return x


def compiled_step(mode: str = "default"):
    """``static_step`` under ``torch.compile(fullgraph=True, dynamic=False, mode=mode)``, made
    once per process and mode (``COMPILE_MODES``); compilation happens at its first call
    for each set of shapes and constants."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compiled_step: mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(static_step, fullgraph=True, dynamic=False,
                                        mode=None if mode == "default" else mode)
    return _COMPILED[mode]


class StaticLayers:
    """A layer runner (``TorchLayers``' interface) whose step has the same shapes every call:
    ``static_step`` eagerly, or its compiled form when ``compile`` is a mode of
    ``COMPILE_MODES``. For fp32/fp64 plans (not int8) over ``DenseLinears``' copies.

    Args:
        plan: the model's ``DecodePlan``.
        cache: the stepper's caches (``KVCache``s of R rows and cap slots, contiguous).
        bias: the additive key padding bias (R·Hkv, 1, cap) (0 = may attend, -inf = a padded
            prompt position), or None when nothing is padded.
        compile: None (eager) or a ``torch.compile`` mode.

    ``layers(x, t, n, pos)``: x (R, C) with n = 1 -> (R, C); ``head(h)``: (M, C) -> (M, V).
    ``one_token_only``: the stepper feeds a multi-token ``run`` one token at a time.
    """

    one_token_only = True

    def __init__(self, plan: DecodePlan, cache: list[KVCache], bias: Tensor | None, *,
                 compile: str | None = None) -> None:
        if plan.int8 or plan.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"StaticLayers: plans of fp32/fp64 weights only, got "
                             f"{'int8' if plan.int8 else plan.dtype}")
        if compile is not None and compile not in COMPILE_MODES:
            raise ValueError(f"StaticLayers: compile must be None or one of {COMPILE_MODES}, "
                             f"got {compile!r}")
        self.plan, self.cache, self.bias = plan, cache, bias
        eps = {n.eps for lp in plan.layers for n in (lp.norm1, lp.norm2)}
        if len(eps) != 1:
            raise ValueError(f"StaticLayers: the layers' norms must share one eps, got "
                             f"{sorted(eps)}")
        self.eps = eps.pop()
        self.lin = DenseLinears(plan)
        rows, _, cap, _ = cache[0].keys.shape
        self.rows, self.cap = rows, cap
        self.keys = [kc.keys for kc in cache]  # (R, Hkv, cap, D) each
        self.values = [kc.values for kc in cache]
        self.norms = [t for lp in plan.layers
                      for t in (lp.norm1.weight, lp.norm1.bias, lp.norm2.weight, lp.norm2.bias)]
        self.cos = self.sin = None
        rope = plan.rope
        if rope is not None:  # (cap, D/2) tables: positions never exceed the slot
            self.cos, self.sin = rope.cos_sin(torch.arange(cap, device=plan.device),
                                              plan.dtype)
        self.interleaved = bool(rope is not None and rope.interleaved)
        self.slot = torch.zeros(1, dtype=torch.long, device=plan.device)  # (1,)
        self.mode = compile
        self.fn = static_step if compile is None else compiled_step(compile)
        self.clean = False  # slots from the first step's t on zeroed yet

    def head(self, h: Tensor) -> Tensor:
        """Logits (M, V) of final-normed rows h (M, C)."""
        return self.lin.linear(h.contiguous(), len(self.plan.layers) * 4)

    def layers(self, x: Tensor, t: int, n: int, pos: Tensor | None) -> Tensor:
        """The layers on x (R, C), one new token per row (n = 1) at cache slot t; ``pos``:
        RoPE positions (1,) or (R, 1), None without RoPE. Returns (R, C)."""
        if n != 1:
            raise ValueError(f"StaticLayers.layers: one token per row, got n={n}")
        if not 0 <= t < self.cap:
            raise IndexError(f"StaticLayers.layers: slot {t} outside the caches' {self.cap}")
        if not self.clean:  # never-written slots may hold NaN: zero them once
            for buf in (*self.keys, *self.values):
                buf[:, :, t:].zero_()
            self.clean = True
        plan = self.plan
        self.slot.fill_(t)
        if pos is not None:
            pos = pos.reshape(-1, 1) if pos.dim() == 2 else pos.reshape(1)
        spec = (plan.heads, plan.kv_heads, plan.head_dim, 1.0 / plan.head_dim ** 0.5,
                plan.norm_kind, self.eps, plan.activation, plan.gated,
                self.interleaved)
        return self.fn(x, self.slot, pos, self.cos, self.sin, self.bias, self.keys,
                       self.values, self.lin.w[:-1], self.lin.b[:-1], self.norms, spec)
