"""The decode layer in torch ops, written once: n new tokens per row against a KV cache, for
every weight form (``qkv.generation.linears``).

Shapes: R rows, n new tokens per row, t tokens already cached, s = t + n keys, C width,
H heads, Hkv key/value heads, g = H / Hkv, D head dim, P = (H + 2·Hkv)·D, cap the caches'
capacity, V vocab size.

Per layer: norm1 -> the fused q/k/v projection -> split (views) -> RoPE -> the new keys and
values into cache slots [t, s) -> attention -> out projection + residual -> norm2 ->
feed-forward in + activation (gated: act(gate)·up) -> out + residual. Attention for one new
token per row (a step) is ``baddbmm`` (scores·scale + the padding bias, one op) -> softmax ->
``bmm`` over (R·Hkv, g, ·) batches of the cache, GQA without expanding keys; or, fp32 on one
thread where it builds, one call of the C kernel ``attention_kernel`` per layer, which skips
the padded keys (its buffers checked once against the kernel's declaration when the runner is
built, ``kernel_registry.check``; the per-token calls pass the checked pointers, and q's,
which is a view of the projection or the rotated copy this runner just made). int8 plans
attend one query through ``scaled_dot_product_attention`` as the modules do (their layers
re-quantize every activation: another rounding order could move a value across a rounding
boundary). Several new tokens per row (``run(n)``: prompt lookup and speculative
verification) go through ``scaled_dot_product_attention`` with the padding and causal
(bottom-right) mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..modules.cache import KVCache
from . import kernel_registry
from .plan import DecodePlan

__all__ = ["TorchLayers"]


class TorchLayers:
    """Every layer of a plan in torch ops over ``linears`` (one of ``qkv.generation.linears``'
    kinds), on the caches ``cache`` (R rows, contiguous ``KVCache``s) and the additive key
    padding bias ``bias`` (R·Hkv, 1, cap): 0 = may attend, -inf = a padded prompt position,
    or None when nothing is padded. ``attention_kernel``: the loaded C attention function, or
    None for the torch ops.

    ``layers(x, t, n, pos)`` runs x (R·n, C) (the embedded new tokens, row-major by row) and
    returns the residual stream after the last layer (R·n, C); ``head(h)`` -> logits (M, V).
    """

    one_token_only = False

    def __init__(self, plan: DecodePlan, linears, cache: list[KVCache], bias: Tensor | None,
                 attention_kernel=None) -> None:
        self.plan, self.lin, self.cache, self.bias = plan, linears, cache, bias
        rows, hkv, cap, d = cache[0].keys.shape
        self.rows, self.cap = rows, cap
        self.scale = 1.0 / plan.head_dim ** 0.5
        self.split = (plan.heads * d, (plan.heads + hkv) * d)  # where k starts, v starts
        self.keys_t = [kc.keys.view(rows * hkv, cap, d).transpose(1, 2) for kc in cache]
        self.values = [kc.values.view(rows * hkv, cap, d) for kc in cache]  # (R·Hkv, cap, D)
        self.zero_bias = torch.zeros(1, 1, 1, dtype=plan.dtype, device=plan.device)
        self.kernel = attention_kernel
        if attention_kernel is not None:
            self.attn_out = torch.empty(rows, plan.heads * d, dtype=plan.dtype)  # (R, H·D)
            self.scratch = torch.empty(plan.group * cap, dtype=plan.dtype)
            q = torch.empty(rows, (plan.heads + 2 * hkv) * d, dtype=plan.dtype)  # (R, P)
            for kc in cache:  # every buffer the per-token calls pass, checked once
                kernel_registry.check(
                    "attention", q=q, qr=q.stride(0), k=kc.keys, v=kc.values, kb=cap * d,
                    nbh=rows * hkv, hkv=hkv, g=plan.group, s=cap, d=d, bias=bias, bb=cap,
                    scale=self.scale, out=self.attn_out, scratch=self.scratch)
        self.norms = [(lp.norm1, lp.norm2) for lp in plan.layers]
        self.qk_norms = ([(lp.q_norm, lp.k_norm) for lp in plan.layers] if plan.qk_norm
                         else None)
        # int8 plans attend one query through SDPA, as the modules do: int8 layers re-quantize
        # every activation, so another fp32 rounding order of attention can move a value
        # across a rounding boundary and the tokens away from the quantized model's own
        self.sdpa_one = plan.int8 and attention_kernel is None

    def head(self, h: Tensor) -> Tensor:
        """Logits (M, V) of final-normed rows h (M, C)."""
        return self.lin.linear(h.contiguous(), len(self.plan.layers) * 4)

    def _mask(self, t: int, n: int) -> Tensor | None:
        """The additive mask (R|1, 1, n, s) of n new tokens per row after t cached ones: the
        padding bias and no key after its query; for ``scaled_dot_product_attention``."""
        s = t + n
        causal = torch.ones(n, s, dtype=torch.bool, device=self.plan.device).tril(t)
        mask = torch.zeros(n, s, dtype=self.plan.dtype, device=self.plan.device).masked_fill(
            ~causal, float("-inf"))[None, None]  # (1, 1, n, s)
        if self.bias is not None:
            pad = self.bias.view(self.rows, -1, 1, self.cap)[:, :1, :, :s]  # (R, 1, 1, s)
            mask = mask + pad
        return mask

    def _attend_one(self, q: Tensor, i: int, s: int, proj: Tensor) -> Tensor:
        """One query per row: q (R, H, 1, D) (a view of proj, or rotated) over the first s
        slots of layer i's cache -> (R, H·D)."""
        plan, rows = self.plan, self.rows
        hkv, g, d = plan.kv_heads, plan.group, plan.head_dim
        if self.kernel is not None:
            rotated = plan.rope is not None or plan.qk_norm  # q is then a contiguous copy
            src = q if rotated else proj  # rotated q is contiguous; else q's rows are in proj
            bias = self.bias
            self.kernel(src.data_ptr(), plan.heads * d if rotated else proj.stride(0),
                        self.keys_t[i].data_ptr(), self.values[i].data_ptr(), self.cap * d,
                        rows * hkv, hkv, g, s, d, None if bias is None else bias.data_ptr(),
                        self.cap, self.scale, self.attn_out.data_ptr(), self.scratch.data_ptr())
            return self.attn_out
        if self.bias is None:
            bias, beta = self.zero_bias, 0.0
        else:
            bias, beta = self.bias[:, :, :s], 1.0  # (R·Hkv, 1, s)
        scores = torch.baddbmm(bias, q.reshape(rows * hkv, g, d), self.keys_t[i][:, :, :s],
                               beta=beta, alpha=self.scale)  # (R·Hkv, g, s)
        a = torch.bmm(torch._softmax(scores, -1, False), self.values[i][:, :s])
        return a.view(rows, plan.heads * d)  # (R·Hkv, g, D) -> (R, H·D)

    def layers(self, x: Tensor, t: int, n: int, pos: Tensor | None) -> Tensor:
        """The layers on x (R·n, C) at cache slots [t, t + n); ``pos``: RoPE positions,
        (n,) for every row or (R, n), None without RoPE. Returns (R·n, C)."""
        plan, lin, rows = self.plan, self.lin, self.rows
        h_all, hkv, d = plan.heads, plan.kv_heads, plan.head_dim
        qs, vs = self.split
        s = t + n
        mask = self._mask(t, n) if n > 1 else None
        if n == 1 and self.sdpa_one and self.bias is not None:  # (R, 1, 1, s), True = attend
            mask = self.bias.view(rows, -1, 1, self.cap)[:, :1, :, :s] == 0
        for i, (kc, (norm1, norm2)) in enumerate(zip(self.cache, self.norms, strict=True)):
            proj = lin.linear(norm1(x), 4 * i)  # (R·n, P)
            p = proj.view(rows, n, -1)
            q = p[..., :qs].view(rows, n, h_all, d).transpose(1, 2)  # (R, H, n, D)
            k = p[..., qs:vs].view(rows, n, hkv, d).transpose(1, 2)  # (R, Hkv, n, D)
            v = p[..., vs:].view(rows, n, hkv, d).transpose(1, 2)  # (R, Hkv, n, D)
            if self.qk_norms is not None:  # Qwen3: per head, before RoPE
                q, k = self.qk_norms[i][0](q), self.qk_norms[i][1](k)
                if n == 1 and plan.rope is None:
                    q = q.contiguous()
            if plan.rope is not None:
                q, k = plan.rope.rotate(q, pos), plan.rope.rotate(k, pos)
                if n == 1:
                    q = q.contiguous()
            kc.keys[:, :, t:s] = k
            kc.values[:, :, t:s] = v
            if n == 1 and not self.sdpa_one:
                a = self._attend_one(q, i, s, proj)  # (R, H·D)
            else:
                a = F.scaled_dot_product_attention(
                    q, kc.keys[:, :, :s], kc.values[:, :, :s], attn_mask=mask,
                    enable_gqa=hkv != h_all)  # (R, H, n, D)
                a = a.transpose(1, 2).reshape(rows * n, h_all * d)
            x = lin.add(a, 4 * i + 1, x)  # (R·n, C)
            x = lin.add(lin.act(norm2(x), 4 * i + 2), 4 * i + 3, x)
        return x
