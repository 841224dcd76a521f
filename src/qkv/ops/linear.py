"""Kernelised linear attention: parallel (non-causal, causal chunkwise) and recurrent step.

Shapes: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), N query length,
S key length, D head dim, Dv value dim, D' feature dim (D for "elu", m for "favor"),
C chunk length, K = ceil(N / C) chunks.

With a positive feature map φ (D -> D'):

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)

summed over all j (non-causal) or j <= i (causal). The sums KV = Σ φ(k) vᵀ (B, H, D', Dv)
and z = Σ φ(k) (B, H, D') are the whole state: non-causal costs O(N·D'·Dv); causal runs
chunkwise (a masked C×C quadratic form inside each chunk, the running state across chunks,
O(N·C + K·D'·Dv) memory) and decoding carries the constant-size ``LinearState``.

Feature maps:
- "elu": φ(x) = elu(x) + 1 (Katharopoulos et al. 2020), D' = D.
- "favor": FAVOR+ positive orthogonal random features (Choromanski et al. 2021),
  φ(x) = exp(wᵀx' - |x'|²/2) / sqrt(m) with x' = x / D^{1/4}, so that φ(q)·φ(k) is an
  unbiased estimate of exp(q·k / sqrt(D)); the projection w (m, D) lives in a
  ``FavorFeatures``. For range, the exponent is shifted by a per-row max for queries and by
  a per-(batch, head) max for keys (carried in the state as ``log_scale``); the shifts are
  undone exactly in the denominator's eps, so the result is the formula above.

All sums and the state are kept in fp32 for fp16/bf16/fp32 inputs (fp64 for fp64 inputs);
the output is cast back to q's dtype. Gradients come from autograd.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_qkv, shape_of
from .reference import compute_dtype, expand_kv

__all__ = [
    "FEATURE_MAPS",
    "FavorFeatures",
    "LinearState",
    "linear_attention",
    "linear_attention_step",
]

FEATURE_MAPS = ("elu", "favor")


class LinearState(NamedTuple):
    """Running sums of causal linear attention, constant size whatever the length.

    kv: Σ_j φ(k_j) v_jᵀ, (B, H, D', Dv); z: Σ_j φ(k_j), (B, H, D'); both fp32 (fp64 for
    fp64 inputs). log_scale: (B, H) or None. For "favor" the sums are stored multiplied by
    exp(-log_scale) (a running max of the key exponents, for range); None means unscaled
    (always the case for "elu").
    """

    kv: Tensor
    z: Tensor
    log_scale: Tensor | None = None


class FavorFeatures:
    """The random projection of FAVOR+ features: ``projection`` w (m, D), fp32.

    Rows come in blocks of D orthogonal Gaussian directions (QR of a Gaussian matrix), the
    last block truncated to m rows; each row's norm is resampled from the chi distribution
    with D degrees of freedom (the norm of a D-dim standard Gaussian), so rows are marginally
    Gaussian. ``redraw`` draws new rows in place (so a module that registered
    ``projection`` as a buffer sees them). A plain object, not an nn.Module (ops/ holds
    none): a module owning one registers ``features.projection`` as a buffer.

    Args:
        head_dim: D, the query/key head dim.
        num_features: m, the feature dim D'.
        seed: seeds the first draw (same seed -> same projection); None draws from torch's
            global RNG.
    """

    def __init__(self, head_dim: int, num_features: int, *, seed: int | None = None) -> None:
        for name, val in (("head_dim", head_dim), ("num_features", num_features)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"FavorFeatures: {name} must be a positive int, got {val!r}")
        self.head_dim = head_dim
        self.num_features = num_features
        self.projection = torch.empty(num_features, head_dim)  # (m, D)
        gen = None
        if seed is not None:
            gen = torch.Generator()
            gen.manual_seed(seed)
        self.redraw(gen)

    def redraw(self, generator: torch.Generator | None = None) -> FavorFeatures:
        """Draw a new projection in place (from ``generator``, else torch's global RNG)."""
        m, d = self.num_features, self.head_dim
        g = torch.randn(-(-m // d), d, d, generator=generator, dtype=torch.float64)
        qmat, _ = torch.linalg.qr(g)  # (m/D blocks, D, D), orthonormal columns
        rows = qmat.transpose(1, 2).reshape(-1, d)[:m]  # (m, D), rows orthonormal per block
        norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1)  # (m,)
        w = rows * norms[:, None]  # (m, D)
        with torch.no_grad():
            self.projection.copy_(w.to(self.projection.dtype))
        return self

    def to(self, *args, **kwargs) -> FavorFeatures:
        """Move the projection (``Tensor.to`` arguments); returns self."""
        self.projection = self.projection.to(*args, **kwargs)
        return self

    def log_features(self, x: Tensor) -> Tensor:
        """Exponents of the features: wᵀx' - |x'|²/2 - log(m)/2, x' = x / D^{1/4}.

        x (..., D) -> (..., m) in x's dtype (use fp32 or fp64)."""
        xs = x * self.head_dim ** -0.25  # (..., D)
        w = self.projection.to(device=x.device, dtype=x.dtype)  # (m, D)
        return (xs @ w.T - 0.5 * (xs * xs).sum(-1, keepdim=True)
                - 0.5 * math.log(self.num_features))  # (..., m)

    def __call__(self, x: Tensor) -> Tensor:
        """φ(x) = exp(wᵀx' - |x'|²/2) / sqrt(m), unstabilised: (..., D) -> (..., m)."""
        return torch.exp(self.log_features(x))

    def __repr__(self) -> str:
        return f"FavorFeatures(head_dim={self.head_dim}, num_features={self.num_features})"


# --------------------------------------------------------------------------- validation


def _validate(fn: str, q, k, v, feature_map, features, eps, state, keep=None) -> None:
    check_qkv(fn, q, k, v)
    b, h, _, d = q.shape
    if keep is not None and (not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool
                             or shape_of(keep) != (b, k.shape[2])):
        got = (f"shape {shape_of(keep)} dtype {keep.dtype}" if isinstance(keep, torch.Tensor)
               else type(keep).__name__)
        raise ValueError(f"{fn}: keep must be a (B, S) = {(b, k.shape[2])} bool tensor "
                         f"(True = a real key), got {got}")
    if d == 0 or v.shape[3] == 0:
        raise ValueError(f"{fn}: empty head dim: q {shape_of(q)}, v {shape_of(v)}")
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"{fn}: feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
    if feature_map == "favor":
        if not isinstance(features, FavorFeatures):
            raise TypeError(f"{fn}: feature_map='favor' needs features=FavorFeatures(D, m), "
                            f"got {type(features).__name__}")
        if features.head_dim != d:
            raise ValueError(f"{fn}: features are for head_dim={features.head_dim}, "
                             f"q has D={d}")
    elif features is not None:
        raise ValueError(f"{fn}: features= is only used with feature_map='favor', "
                         f"got feature_map={feature_map!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{fn}: eps must be a non-negative float, got {eps!r}")
    if state is not None:
        if not isinstance(state, LinearState):
            raise TypeError(f"{fn}: state must be a LinearState, got {type(state).__name__}")
        fdim = d if feature_map == "elu" else features.num_features
        want_kv, want_z = (b, h, fdim, v.shape[3]), (b, h, fdim)
        if shape_of(state.kv) != want_kv or shape_of(state.z) != want_z:
            raise ValueError(f"{fn}: state shapes kv {shape_of(state.kv)}, "
                             f"z {shape_of(state.z)} "
                             f"do not match (B, H, D', Dv) = {want_kv}, (B, H, D') = {want_z}")
        if state.log_scale is not None and feature_map == "elu":
            raise ValueError(f"{fn}: state has a log_scale (a FAVOR+ state) but "
                             f"feature_map='elu'; continue with the feature map it was built with")
        if state.log_scale is not None and shape_of(state.log_scale) != (b, h):
            raise ValueError(f"{fn}: state.log_scale must be (B, H) = {(b, h)}, got "
                             f"{shape_of(state.log_scale)}")


# ----------------------------------------------------------------------------- features


def _query_features(q: Tensor, feature_map: str, features, cdt: torch.dtype
                    ) -> tuple[Tensor, Tensor | None]:
    """φ(q) (B, H, N, D') in ``cdt`` and the per-row shift (B, H, N, 1) it was divided by
    (exp of it), None for "elu"."""
    qc = q.to(cdt)
    if feature_map == "elu":
        return F.elu(qc).add_(1.0), None  # elu's backward keeps its input, not its output
    logits = features.log_features(qc)  # (B, H, N, m)
    shift = logits.detach().amax(dim=-1, keepdim=True)  # (B, H, N, 1); cancels in the ratio
    return torch.exp(logits - shift), shift


def _key_features(k: Tensor, heads: int, feature_map: str, features, cdt: torch.dtype,
                  prior: Tensor | None, keep: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """φ(k) expanded to H heads, (B, H, S, D') in ``cdt``, and the key shift (B, H): the
    max of the exponents over keys and features (and ``prior``, a state's log_scale), None
    for "elu". Keys where ``keep`` (B, S) is False get zero features."""
    kc = k.to(cdt)
    if feature_map == "elu":
        fk = F.elu(kc).add_(1.0)  # (B, Hkv, S, D)
        if keep is not None:
            fk = fk.masked_fill(~keep[:, None, :, None].to(fk.device), 0.0)
        return expand_kv(fk, heads), None
    logits = expand_kv(features.log_features(kc), heads)  # (B, H, S, m)
    fallback = None
    if keep is not None and logits.shape[2] > 0:
        # a row whose keys are all masked keeps the state's scale, else its raw max
        fallback = (logits.detach().amax(dim=(2, 3)).nan_to_num(0.0, 0.0, 0.0)
                    if prior is None else prior.to(cdt))
        # exp(-inf) = 0, with zero gradient
        logits = logits.masked_fill(~keep[:, None, :, None].to(logits.device), float("-inf"))
    if logits.shape[2] == 0:  # no keys: keep the state's scale
        shift = logits.new_zeros(logits.shape[:2]) if prior is None else prior.to(cdt)
    else:
        shift = logits.detach().amax(dim=(2, 3))  # (B, H)
        if fallback is not None:
            shift = torch.where(torch.isfinite(shift), shift, fallback)
    if prior is not None:
        shift = torch.maximum(shift, prior.to(cdt))
    return torch.exp(logits - shift[:, :, None, None]), shift


def _clear(v: Tensor, keep: Tensor | None) -> Tensor:
    """Values of masked keys set to zero (B, Hkv, S, Dv), so that whatever they hold (NaN,
    inf) cannot reach the sums: 0 · NaN is NaN."""
    return v if keep is None else v.masked_fill(~keep[:, None, :, None].to(v.device), 0.0)


def _rescale(state: LinearState | None, shift: Tensor | None, like: Tensor, fdim: int,
             dv: int, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """A state's (kv, z) in ``cdt`` re-expressed at the key ``shift``; zeros when None."""
    b, h = like.shape[0], like.shape[1]
    if state is None:
        return (torch.zeros(b, h, fdim, dv, dtype=cdt, device=like.device),
                torch.zeros(b, h, fdim, dtype=cdt, device=like.device))
    kv, z = state.kv.to(cdt), state.z.to(cdt)
    if shift is not None:
        old = torch.zeros_like(shift) if state.log_scale is None else state.log_scale.to(cdt)
        r = torch.exp(old - shift)  # (B, H), <= 1
        kv, z = kv * r[:, :, None, None], z * r[:, :, None]
    return kv, z


def _eps(eps: float, q_shift: Tensor | None, k_shift: Tensor | None) -> Tensor | float:
    """eps in the shifted units: eps · exp(-(q_shift + k_shift)), (B, H, N, 1)."""
    if q_shift is None:
        return eps
    if eps == 0:
        return 0.0
    return torch.exp(math.log(eps) - q_shift - k_shift[:, :, None, None])  # (B, H, N, 1)


# ---------------------------------------------------------------------------- the forms


def _causal_chunked(fq: Tensor, fk: Tensor, va: Tensor, kv0: Tensor, chunk: int
                    ) -> tuple[Tensor, Tensor]:
    """Chunkwise causal sums: (num (B, H, N, Dv+1), final state (B, H, D', Dv+1)).

    fq, fk (B, H, N, D'), va (B, H, N, Dv+1) the values with a column of ones appended (its
    sums are z and the denominator), kv0 (B, H, D', Dv+1) the initial state. Vectorised
    across chunks: per-chunk sums by one batched matmul, the state before each chunk by a
    cumsum over chunks, the intra-chunk part a masked (C, C) form batched over (B, H, K)."""
    b, h, n, fdim = fq.shape
    dv1 = va.shape[-1]
    c = min(chunk, n)
    kc = -(-n // c)
    pad = kc * c - n
    if pad:  # zero keys add nothing; padded query rows are dropped below
        fq, fk, va = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, va))
    fq = fq.reshape(b * h * kc, c, fdim)  # (B·H·K, C, D')
    fk = fk.reshape(b * h * kc, c, fdim)  # (B·H·K, C, D')
    va = va.reshape(b * h * kc, c, dv1)  # (B·H·K, C, Dv+1)
    chunk_kv = torch.bmm(fk.transpose(1, 2), va).view(b, h, kc, fdim, dv1)  # (B, H, K, D', Dv+1)
    before = torch.cat([kv0[:, :, None], chunk_kv[:, :, :-1]], dim=2).cumsum(dim=2)
    final = before[:, :, -1] + chunk_kv[:, :, -1]  # (B, H, D', Dv+1)
    num = torch.bmm(fq, before.view(b * h * kc, fdim, dv1))  # (B·H·K, C, Dv+1)
    # in place: bmm keeps its inputs for backward, not its output
    scores = torch.bmm(fq, fk.transpose(1, 2)).tril_()  # (B·H·K, C, C), j <= i
    num = num.baddbmm_(scores, va)  # (B·H·K, C, Dv+1)
    num = num.view(b, h, kc * c, dv1)[:, :, :n]  # (B, H, N, Dv+1)
    return num, final


def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *,
    feature_map: str = "elu",
    causal: bool = False,
    chunk_size: int = 64,
    eps: float = 1e-6,
    features: FavorFeatures | None = None,
    return_state: bool = False,
    state: LinearState | None = None,
    keep: Tensor | None = None,
) -> Tensor | tuple[Tensor, LinearState]:
    """Kernelised linear attention, out_i = φ(q_i)ᵀ KV / (φ(q_i)ᵀ z + eps).

    Args:
        q: queries (B, H, N, D).
        k: keys (B, Hkv, S, D); H % Hkv == 0 (grouped-/multi-query attention).
        v: values (B, Hkv, S, Dv).
        feature_map: "elu" (φ(x) = elu(x) + 1, D' = D) or "favor" (FAVOR+ random features,
            D' = m, needs ``features``).
        causal: position i attends to keys j <= i (requires N == S; the keys and queries are
            the same positions, following those summed in ``state``). Computed chunkwise.
        chunk_size: C, positions per chunk of the causal form (any C >= 1; the result does
            not depend on it beyond rounding).
        eps: added to the denominator.
        features: the ``FavorFeatures`` (projection (m, D)) for feature_map="favor".
        return_state: also return the ``LinearState`` after the last key, to continue with
            ``linear_attention_step`` or another call.
        state: a ``LinearState`` (kv (B, H, D', Dv), z (B, H, D')) of earlier keys, added to
            the sums (every query sees it, causal or not).
        keep: (B, S) bool, True = a real key; False keys (padding) get zero features, so
            they add nothing to the sums or the state. A query that sees no real key
            returns zeros.

    Returns:
        out (B, H, N, Dv) in q's dtype, or ``(out, state)`` with the state in fp32 (fp64 for
        fp64 inputs).

    Raises:
        TypeError / ValueError naming the offending argument (ranks, shapes, dtypes,
        feature map, causal with N != S, chunk_size).
    """
    fn = "linear_attention"
    _validate(fn, q, k, v, feature_map, features, eps, state, keep)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    n, s = q.shape[2], k.shape[2]
    if causal and n != s:
        raise ValueError(f"{fn}: causal=True needs as many queries as keys (N == S: query i "
                         f"sees keys <= i and the state); got N={n}, S={s}")
    heads, dv = q.shape[1], v.shape[3]
    cdt = compute_dtype(q.dtype)
    prior = None if state is None else state.log_scale
    fq, q_shift = _query_features(q, feature_map, features, cdt)  # (B, H, N, D')
    fk, k_shift = _key_features(k, heads, feature_map, features, cdt, prior, keep)
    vc = expand_kv(_clear(v.to(cdt), keep), heads)  # (B, H, S, Dv)
    ones = vc.new_ones(*vc.shape[:3], 1)  # (B, H, S, 1)
    va = torch.cat([vc, ones], dim=-1)  # (B, H, S, Dv+1): the ones column sums to z
    kv0, z0 = _rescale(state, k_shift, q, fq.shape[-1], dv, cdt)
    kv0 = torch.cat([kv0, z0[..., None]], dim=-1)  # (B, H, D', Dv+1)
    if causal and n > 0:
        num, kv = _causal_chunked(fq, fk, va, kv0, chunk_size)  # (B, H, N, Dv+1)
    else:  # non-causal (or nothing to compute)
        kv = kv0 + torch.matmul(fk.transpose(-1, -2), va)  # (B, H, D', Dv+1)
        num = torch.matmul(fq, kv)  # (B, H, N, Dv+1)
    den = num[..., dv:]  # (B, H, N, 1)
    out = num[..., :dv] / (den + _eps(eps, q_shift, k_shift))  # (B, H, N, Dv)
    out = out.to(q.dtype)
    if return_state:
        state = LinearState(kv[..., :dv].contiguous(), kv[..., dv].contiguous(), k_shift)
        return out, state
    return out


def linear_attention_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: LinearState | None, *,
    feature_map: str = "elu",
    features: FavorFeatures | None = None,
    eps: float = 1e-6,
    keep: Tensor | None = None,
) -> tuple[Tensor, LinearState]:
    """One decoding step of causal linear attention, the recurrent form.

    state' = (kv + φ(k_t) v_tᵀ, z + φ(k_t)); out_t = φ(q_t)ᵀ kv' / (φ(q_t)ᵀ z' + eps).

    Args:
        q_t: the new query (B, H, 1, D).
        k_t: the new key (B, Hkv, 1, D).
        v_t: the new value (B, Hkv, 1, Dv).
        state: ``LinearState`` of the earlier keys (kv (B, H, D', Dv), z (B, H, D')), e.g.
            from ``linear_attention(..., causal=True, return_state=True)``; None = empty.
        feature_map, features, eps: as for ``linear_attention`` (use the same ones).
        keep: (B, 1) bool, False = the new key is padding: it leaves the sums unchanged.

    Returns:
        ``(out_t, new_state)``: out_t (B, H, 1, Dv) in q_t's dtype; the state in fp32 (fp64
        for fp64 inputs).
    """
    fn = "linear_attention_step"
    _validate(fn, q_t, k_t, v_t, feature_map, features, eps, state, keep)
    if q_t.shape[2] != 1 or k_t.shape[2] != 1:
        raise ValueError(f"{fn}: q_t and k_t must hold one position (B, H, 1, D), got "
                         f"q_t {shape_of(q_t)}, k_t {shape_of(k_t)}")
    heads, dv = q_t.shape[1], v_t.shape[3]
    cdt = compute_dtype(q_t.dtype)
    prior = None if state is None else state.log_scale
    fq, q_shift = _query_features(q_t, feature_map, features, cdt)  # (B, H, 1, D')
    fk, k_shift = _key_features(k_t, heads, feature_map, features, cdt, prior, keep)
    vc = expand_kv(_clear(v_t.to(cdt), keep), heads)  # (B, H, 1, Dv)
    kv, z = _rescale(state, k_shift, q_t, fq.shape[-1], dv, cdt)
    kv = kv + fk[:, :, 0, :, None] * vc[:, :, 0, None, :]  # (B, H, D', Dv)
    z = z + fk[:, :, 0]  # (B, H, D')
    num = torch.matmul(fq, kv)  # (B, H, 1, Dv)
    den = torch.einsum("bhnf,bhf->bhn", fq, z)  # (B, H, 1)
    out = num / (den[..., None] + _eps(eps, q_shift, k_shift))  # (B, H, 1, Dv)
    return out.to(q_t.dtype), LinearState(kv, z, k_shift)
