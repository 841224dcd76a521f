"""Bias producers: additive attention-logit biases computed one block at a time.

Shapes: B batch, H query heads, N query length, S key length, D head dim, Dv value dim.

A relative position scheme (ALiBi, T5 buckets, Shaw et al.) is a function of the query and
key *positions*; materialising it for a long sequence costs N×S memory. A ``BiasProducer``
instead computes the bias of any block of (query, key) positions on demand, so the chunked
backend never holds more than one block.

Positions: with N queries and S keys, query ``i`` sits at absolute position ``i + S - N``
(bottom-right alignment, what cached decoding needs) and key ``j`` at ``j``.

Optional structure lets the chunked backend hand most of the work to torch's fused kernel:
``far_field`` says that beyond a distance the bias no longer depends on the key (so, within
that region, it cancels in softmax up to a per-row term), and ``key_linear_slopes`` says that
on the causal side the bias is ``slope[h] * (j - pos_i)`` (ALiBi), which folds into one extra
query/key dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["BiasProducer", "FarField", "query_positions"]


def query_positions(i0: int, i1: int, n: int, s: int, device: torch.device) -> Tensor:
    """Absolute positions of queries ``i0:i1`` in a problem of N=n queries and S=s keys."""
    return torch.arange(i0 + s - n, i1 + s - n, device=device)


@dataclass(frozen=True)
class FarField:
    """How a producer behaves beyond ``distance`` positions.

    For ``key_pos - query_pos <= -distance`` (left) and ``>= distance`` (right) the bias
    does not depend on the key: it equals ``row_term(q, side)`` for every such key, and the
    producer's value term there adds ``value_vector(side)`` to each key's value.
    """

    distance: int


class BiasProducer(nn.Module):
    """Base class of bias producers usable as ``bias=`` in ``qkv.attention``.

    Subclasses implement ``score_bias`` and, when the scheme also changes the values
    (Shaw et al. 2018), set ``has_value_term = True`` and implement ``value_term``.
    ``needs_query = True`` when the bias depends on the query vectors (Shaw's key term).
    """

    needs_query: bool = False
    has_value_term: bool = False

    @property
    def num_heads(self) -> int | None:
        """H this producer is built for (None: any)."""
        return None

    def score_bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None,
                   scale: float = 1.0) -> Tensor:
        """Additive logit bias for queries at ``q_pos`` (n,) and keys at ``k_pos`` (s,).

        ``q`` (B, H, n, D) is given when ``needs_query``; ``scale`` is the attention's
        logit scale (Shaw's key term is scaled like q·k). Returns a float tensor
        broadcastable to (B, H, n, s).
        """
        raise NotImplementedError

    def value_term(self, p: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Extra output from attention weights ``p`` (B, H, n, s): returns (B, H, n, Dv).

        Linear in ``p``: the output of query i gains sum_j p[i, j] * a(j - pos_i).
        """
        raise NotImplementedError

    # --- optional structure used by the fast path ---------------------------------------
    def far_field(self) -> FarField | None:
        """Distance beyond which the bias no longer depends on the key (None: never)."""
        return None

    def far_row_term(self, q: Tensor | None, side: int, scale: float) -> Tensor:
        """Bias of every far key, per query row: broadcastable to (B, H, n). ``side`` is -1
        for keys on the left (earlier) and +1 for keys on the right."""
        raise NotImplementedError

    def far_value_vector(self, side: int) -> Tensor | None:
        """Vector added to each far key's value on ``side`` (Dv,) or (H, Dv); None: none."""
        return None

    def key_linear_slopes(self) -> Tensor | None:
        """Per-head slopes (H,) if the bias on the causal side is ``slope[h] * (k - q)``."""
        return None

    def dense(self, n: int, s: int, *, q: Tensor | None = None, scale: float = 1.0,
              device: torch.device | str = "cpu") -> Tensor:
        """The whole (B|1, H, N, S) bias, for tests and the reference backend."""
        dev = torch.device(device)
        return self.score_bias(query_positions(0, n, n, s, dev),
                               torch.arange(s, device=dev), q=q, scale=scale)
