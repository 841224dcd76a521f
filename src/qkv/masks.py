"""Public mask namespace (True = may attend): ``Causal``, ``Padding``, and the sparse
patterns ``SlidingWindow``, ``Longformer``, ``BigBird``, ``BlockSparse``; combine with ``&``."""

from .ops.masks import And, Causal, DenseMask, Mask, Padding, as_mask
from .ops.sparse_masks import BigBird, BlockSparse, Longformer, SlidingWindow

__all__ = ["And", "BigBird", "BlockSparse", "Causal", "DenseMask", "Longformer", "Mask",
           "Padding", "SlidingWindow", "as_mask"]
