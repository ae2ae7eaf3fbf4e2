"""SBNet sparse-block ops: block geometry, mask reduction, block gather and scatter (NCHW and channels-last).

    bp = calc_block_params(H, W, bsize=(16, 16), ksize=3, stride=1, padding=1)
    idx = reduce_mask(mask, bp, tol=0.5, avgpool=False)      # int32 [K, 3] (n, by, bx), sorted
    active = block_activity(mask, bp, tol=0.5)                # bool [N, bcount_h, bcount_w]: the same rule
    blocks = sparse_gather(x, idx, bp)                        # [K, C, bp.bsize_h, bp.bsize_w]
    y = sparse_scatter(out_blocks, idx, base, bp, add=True)   # like base (differentiable); relu=True: relu(base + tile)
    sparse_scatter_(out_blocks, idx, base, bp, add=True)      # in place into base (differentiable too)
    s = region_sums(z, None, offset, size, pixels)            # float64 [2, C]: sums of z, z^2 over blocks' tile regions
    dz = region_norm_grad(g, z, scale, c0, c1, offset, size)  # batch-norm's input gradient over tile regions

Semantics in :mod:`detector.ops.functional` and ``kernels/README.md``; compiled kernels are built on
first use by :mod:`detector.ops._library`, with the pure-PyTorch :mod:`detector.ops.reference` as
fallback.
"""

from .blocks import BlockParams, calc_block_params
from .functional import (
    block_activity,
    reduce_mask,
    region_norm_grad,
    region_sums,
    sparse_gather,
    sparse_scatter,
    sparse_scatter_,
)

__all__ = [
    "BlockParams",
    "calc_block_params",
    "reduce_mask",
    "block_activity",
    "sparse_gather",
    "sparse_scatter",
    "sparse_scatter_",
    "region_sums",
    "region_norm_grad",
]
