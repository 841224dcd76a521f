"""The encoder-decoder's decoder layer in torch ops, written once: n new tokens per row
against a self-attention cache and the memory's keys and values, for every weight form of
``qkv.generation.linears`` (dense, oneDNN-packed, int8 torch ops, int8 C).

Shapes: B sources, K beams (rows R = B·K, the K rows of a source consecutive), n new tokens
per row, t tokens already cached, s = t + n keys, S source length, C width, H heads, D head
dim, cap the caches' capacity, V vocab size.

Per layer (``Seq2SeqLayerPlan``): the fused q/k/v projection -> the new keys and values into
cache slots [t, s) -> self-attention (causal, with the relative bias of T5 / ALiBi if any)
-> out projection + residual -> the cross-attention query -> attention over the memory ->
out projection + residual -> feed-forward in + activation (gated: act(gate)·up) -> out +
residual; each norm before its sublayer (pre-norm) or after its residual add (post-norm).

The memory's keys and values are projected once per source (``cross_kv``), one copy per
source and head, shared by the source's K beams: the cross-attention computes the K·n
queries of a source as one (K·n, D) x (D, S) product per head (the beams act as a group of
queries on one key/value head), so nothing is repeated per beam and beam reordering never
touches the memory. Attention is ``baddbmm`` (scores·scale + bias in one op) -> softmax ->
``bmm``; or, one new token per row on one CPU thread where it builds, one call of the C
kernel ``attention_kernel`` per attention (its buffers checked once against the kernel's
declaration when the runner is built, ``kernel_registry.check``; the per-token calls pass
the checked pointers, and the query's, a projection this runner just made): the self-
attention's R·H single queries against the cache, the cross-attention's K beams of a source
as the kernel's query group of one memory head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.cache import KVCache
from . import kernel_registry
from .seq2seq_plan import Seq2SeqPlan

__all__ = ["Seq2SeqLayers"]


class Seq2SeqLayers:
    """Every decoder layer of ``plan`` in torch ops over ``linears`` (one of
    ``qkv.generation.linears``' kinds built on the plan), on the self-attention caches
    ``cache`` (R rows, contiguous ``KVCache``s).

    Args:
        plan: the model's ``Seq2SeqPlan``.
        linears: the weight form (``DenseLinears(plan)``, ``PackedLinears(plan)``, ...).
        cache: one ``KVCache`` (R, H, cap, D) per layer; this runner writes its buffers.
        memory: (B, S, C) the encoder's output; ``keep`` (B, S) bool, True = a real source
            token.
        beams: K.
        attention_kernel: the loaded C attention function (fp32 activations on one CPU
            thread), or None for the torch ops.

    ``layers(x, t, n)`` runs x (R·n, C) (the embedded new tokens, row-major by row) and
    returns the residual stream after the last layer (and the final norm) (R·n, C);
    ``head(h)`` -> logits (M, V).
    """

    def __init__(self, plan: Seq2SeqPlan, linears, cache: list[KVCache], memory: Tensor,
                 keep: Tensor, beams: int, attention_kernel=None) -> None:
        self.plan, self.lin, self.cache = plan, linears, cache
        rows, h, cap, d = cache[0].keys.shape
        batch, src_len, width = memory.shape
        if rows != batch * beams:
            raise ValueError(f"Seq2SeqLayers: caches of {rows} rows for {batch} sources x "
                             f"{beams} beams")
        self.rows, self.batch, self.beams, self.cap = rows, batch, beams, cap
        self.scale = plan.attention_scale
        self.hd = h * d
        # beam search: a second buffer per cache tensor, which a reorder gathers into (one
        # pass over the filled slots) before the two swap
        self.spare = ([(torch.empty_like(kc.keys), torch.empty_like(kc.values)) for kc in cache]
                      if beams > 1 else None)
        self._views()
        self.zero = torch.zeros(1, 1, 1, dtype=plan.dtype, device=plan.device)
        # the memory's keys and values (B·H, S, D), once per source
        flat = memory.reshape(batch * src_len, width)
        self.mem_k, self.mem_v = [], []
        empty = ~keep.any(dim=1)  # (B,) a source of padding only: its rows attend nothing
        for i in range(len(plan.layers)):
            kv = linears.linear(flat, plan.kv_index(i)).view(batch, src_len, 2, h, d)
            k = kv[:, :, 0].transpose(1, 2)  # (B, H, S, D)
            v = kv[:, :, 1].transpose(1, 2)
            if bool(empty.any()):  # zero values: such a row's cross-attention gives zeros
                v = v.masked_fill(empty[:, None, None, None], 0.0)
            self.mem_k.append(k.contiguous().view(batch * h, src_len, d))
            self.mem_v.append(v.contiguous().view(batch * h, src_len, d))
        self.mem_bias = None  # (B·H, 1, S): -inf at padded source positions, 0 elsewhere
        if not bool(keep.all()):
            attend = keep | empty[:, None]  # nothing to attend to: uniform over zero values
            bias = torch.zeros(batch, h, 1, src_len, dtype=plan.dtype, device=plan.device)
            bias.masked_fill_(~attend[:, None, None, :], float("-inf"))
            self.mem_bias = bias.view(batch * h, 1, src_len)
        self.norms = [(lp.self_norm, lp.cross_norm, lp.ffn_norm) for lp in plan.layers]
        self.pre = plan.norm_first
        self.kernel = attention_kernel
        if attention_kernel is not None:
            self._check_kernel(src_len)

    def _check_kernel(self, src_len: int) -> None:
        """The C attention's buffers, each checked once against the kernel's declaration."""
        plan, rows, b, k, cap = self.plan, self.rows, self.batch, self.beams, self.cap
        h, d, hd = plan.heads, plan.head_dim, self.hd
        dt = plan.dtype
        self.self_out = torch.empty(rows, hd, dtype=dt)  # (R, H·D)
        self.cross_out = torch.empty(b, h, k, d, dtype=dt)  # (B, H, K, D)
        self.cross_q = torch.empty(b, h, k, d, dtype=dt)  # the queries, per memory head
        self.scratch = torch.empty(k * max(cap, src_len), dtype=dt)
        self.self_bias_buf = (None if plan.self_bias is None else
                              torch.zeros(rows * h, cap, dtype=dt))  # (R·H, cap)
        q = torch.empty(rows, 3 * hd, dtype=dt)  # (R, 3·H·D) a self-attention projection
        pairs = [(kc.keys, kc.values) for kc in self.cache] + (self.spare or [])
        for keys, values in pairs:
            kernel_registry.check(
                "attention", q=q, qr=3 * hd, k=keys, v=values, kb=cap * d,
                nbh=rows * h, hkv=h, g=1, s=cap, d=d, bias=self.self_bias_buf, bb=cap,
                scale=self.scale, out=self.self_out, scratch=self.scratch)
        mem_bias = None if self.mem_bias is None else self.mem_bias.view(b * h, src_len)
        for mk, mv in zip(self.mem_k, self.mem_v, strict=True):
            kernel_registry.check(
                "attention", q=self.cross_q, qr=h * k * d, k=mk, v=mv, kb=src_len * d,
                nbh=b * h, hkv=h, g=k, s=src_len, d=d, bias=mem_bias, bb=src_len,
                scale=self.scale, out=self.cross_out, scratch=self.scratch)
        self.src_len = src_len

    def _views(self) -> None:
        """The bmm path's views of the caches: keys (R·H, D, cap), values (R·H, cap, D)."""
        rows, h, cap, d = self.cache[0].keys.shape
        self.keys_t = [kc.keys.view(rows * h, cap, d).transpose(1, 2) for kc in self.cache]
        self.values = [kc.values.view(rows * h, cap, d) for kc in self.cache]

    def reorder(self, idx: Tensor, n: int) -> None:
        """Row r of every cache continues from row ``idx[r]`` (R,), over the n filled slots:
        gathered into the spare buffers, which then become the caches (``KVCache.keys`` /
        ``values`` are set to them)."""
        if self.spare is None:
            raise ValueError("Seq2SeqLayers: reorder is for beam search (beams > 1)")
        for i, kc in enumerate(self.cache):
            keys, values = self.spare[i]
            torch.index_select(kc.keys[:, :, :n], 0, idx, out=keys[:, :, :n])
            torch.index_select(kc.values[:, :, :n], 0, idx, out=values[:, :, :n])
            self.spare[i] = (kc.keys, kc.values)
            kc.keys, kc.values = keys, values
        self._views()

    def head(self, h: Tensor) -> Tensor:
        """Logits (M, V) of final rows h (M, C) (after ``layers``' final norm): the head of
        ``head_scale``·h."""
        if self.plan.head_scale != 1.0:
            h = h * self.plan.head_scale
        return self.lin.linear(h.contiguous(), self.plan.head_index)

    def _self_bias(self, t: int, n: int) -> tuple[Tensor, float]:
        """The additive bias (R·H | 1, n, s) of the self-attention of n new tokens per row
        after t cached ones (the relative bias, no key after its query) and baddbmm's beta."""
        plan, s = self.plan, t + n
        producer = plan.self_bias
        if producer is None and n == 1:
            return self.zero, 0.0
        dev = plan.device
        bias = torch.zeros(1, 1, n, s, dtype=plan.dtype, device=dev)
        if producer is not None:  # (1, H, n, s), query i at position t + i
            bias = bias + producer.score_bias(torch.arange(t, s, device=dev),
                                              torch.arange(s, device=dev)).to(plan.dtype)
        if n > 1:
            future = torch.ones(n, s, dtype=torch.bool, device=dev).tril(t).logical_not_()
            bias = bias.masked_fill(future, float("-inf"))
        h = plan.heads
        return bias.expand(self.rows, h, n, s).reshape(self.rows * h, n, s), 1.0

    def _self_attend(self, proj: Tensor, i: int, t: int, n: int, bias: Tensor, beta: float
                     ) -> Tensor:
        """Self-attention of layer i: proj (R·n, 3·H·D) -> (R·n, H·D)."""
        plan, rows, hd = self.plan, self.rows, self.hd
        h, d, s = plan.heads, plan.head_dim, t + n
        p = proj.view(rows, n, 3, h, d)
        kc = self.cache[i]
        kc.keys[:, :, t:s] = p[:, :, 1].transpose(1, 2)
        kc.values[:, :, t:s] = p[:, :, 2].transpose(1, 2)
        if self.kernel is not None and n == 1:  # q's rows are in proj, H·D each, at 3·H·D
            buf = self.self_bias_buf
            self.kernel(proj.data_ptr(), 3 * hd, kc.keys.data_ptr(), kc.values.data_ptr(),
                        self.cap * d, rows * h, h, 1, s, d,
                        None if buf is None else buf.data_ptr(), self.cap, self.scale,
                        self.self_out.data_ptr(), self.scratch.data_ptr())
            return self.self_out
        q = p[:, :, 0].transpose(1, 2).reshape(rows * h, n, d)  # (R·H, n, D)
        scores = torch.baddbmm(bias, q, self.keys_t[i][:, :, :s], beta=beta,
                               alpha=self.scale)  # (R·H, n, s)
        a = torch.bmm(torch._softmax(scores, -1, False), self.values[i][:, :s])
        if n == 1:
            return a.view(rows, hd)  # (R·H, 1, D) -> (R, H·D)
        return a.view(rows, h, n, d).transpose(1, 2).reshape(rows * n, hd)

    def _cross_attend(self, q: Tensor, i: int, n: int) -> Tensor:
        """Cross-attention of layer i: q (R·n, H·D) -> (R·n, H·D); a source's K·n queries
        against its one copy of the memory."""
        plan, b, hd = self.plan, self.batch, self.hd
        h, d, g = plan.heads, plan.head_dim, self.beams * n
        if self.kernel is not None and n == 1:
            src = q.contiguous() if g == 1 else self.cross_q.copy_(
                q.view(b, g, h, d).transpose(1, 2))  # (B, H, K, D)
            s, bias = self.src_len, self.mem_bias
            self.kernel(src.data_ptr(), h * g * d, self.mem_k[i].data_ptr(),
                        self.mem_v[i].data_ptr(), s * d, b * h, h, g, s, d,
                        None if bias is None else bias.data_ptr(), s, self.scale,
                        self.cross_out.data_ptr(), self.scratch.data_ptr())
            out = self.cross_out  # (B, H, K, D)
            return out.view(b, hd) if g == 1 else out.transpose(1, 2).reshape(b * g, hd)
        q = q.view(b, g, h, d).transpose(1, 2).reshape(b * h, g, d)  # (B·H, K·n, D)
        bias, beta = (self.zero, 0.0) if self.mem_bias is None else (self.mem_bias, 1.0)
        scores = torch.baddbmm(bias, q, self.mem_k[i].transpose(1, 2), beta=beta,
                               alpha=self.scale)  # (B·H, K·n, S)
        a = torch.bmm(torch._softmax(scores, -1, False), self.mem_v[i])  # (B·H, K·n, D)
        if g == 1:
            return a.view(b, hd)
        return a.view(b, h, g, d).transpose(1, 2).reshape(b * g, hd)

    def layers(self, x: Tensor, t: int, n: int) -> Tensor:
        """The decoder on x (R·n, C) at cache slots [t, t + n); returns (R·n, C) after the
        final norm (if any)."""
        lin, pre = self.lin, self.pre
        bias, beta = self._self_bias(t, n)
        if self.kernel is not None and n == 1 and self.self_bias_buf is not None:
            self.self_bias_buf.view(self.rows * self.plan.heads, self.cap)[:, :t + 1] = \
                bias.view(-1, t + 1)
        for i, (norm1, norm2, norm3) in enumerate(self.norms):
            j = 6 * i
            a = self._self_attend(lin.linear(norm1(x) if pre else x, j), i, t, n, bias, beta)
            x = lin.add(a, j + 1, x) if pre else norm1(lin.add(a, j + 1, x))
            c = self._cross_attend(lin.linear(norm2(x) if pre else x, j + 2), i, n)
            x = lin.add(c, j + 3, x) if pre else norm2(lin.add(c, j + 3, x))
            f = lin.act(norm3(x) if pre else x, j + 4)
            x = lin.add(f, j + 5, x) if pre else norm3(lin.add(f, j + 5, x))
        return x if self.plan.norm is None else self.plan.norm(x)
