"""The gather and the residual scatter of an identity-shortcut unit, with ``x``'s gradient assembled once.

An identity unit reads its input's blocks once and combines its output tiles back into its input:

    blocks = sparse_gather(x, indices, gather_bp)                   # [K, C, bsize_h, bsize_w], x's layout
    ... the unit's convolutions on the blocks ...  -> tiles [K, C, obsize_h, obsize_w]
    out = sparse_scatter(tiles, indices, x, scatter_bp, add=True, relu=relu)   # relu(x + tile): post-act

:class:`ResidualBlocks` gives exactly these values with the compiled ops, and two things more:

- ``inplace=True`` writes the tiles into ``x`` itself (``sparse_scatter_``), under autograd too (``x`` is
  marked dirty; nothing saves ``x`` for backward: the gather keeps only the indices, the relu keeps the
  output tiles). The forward then costs the blocks, not the map. Only for an ``x`` the caller owns (a
  unit's own intermediate), never a tensor someone else still reads.
- backward assembles ``x``'s gradient in one map-sized pass: the output gradient with the tiles' part
  replaced (``relu``: masked by the output tile > 0) and the block gradients added into it in place
  (``sparse_gather_backward_``), instead of summing two map-sized gradients (the scatter's and the
  gather's). Deterministic: the adjoint adds in a fixed phase order.

Without compiled kernels for the device the pair falls back to the public ops (the reference), whose
gradients autograd sums.
"""

from __future__ import annotations

import torch

from .blocks import BlockParams
from .formulas import memory_format_of, scatter_backward, tiles_of
from .functional import _kernels_for, sparse_gather, sparse_scatter, sparse_scatter_

__all__ = ["ResidualBlocks"]


class _Link:
    """Hands ``x``'s partial gradient from the scatter's backward to the gather's backward."""

    def __init__(self) -> None:
        self.grad_x: torch.Tensor | None = None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, bp, link):  # noqa: ANN001, ANN205 - autograd.Function protocol
        ctx.save_for_backward(indices)
        ctx.bp, ctx.link, ctx.shape = bp, link, tuple(x.shape)
        ctx.format = memory_format_of(x)
        return torch.ops.sbnet.sparse_gather(x, indices, list(bp.bsize), list(bp.bstride), list(bp.boffset))

    @staticmethod
    def backward(ctx, grad_blocks):  # noqa: ANN001, ANN205
        (indices,) = ctx.saved_tensors
        bp, link, fmt = ctx.bp, ctx.link, ctx.format
        gx, link.grad_x = link.grad_x, None
        if gx is None:  # the output's gradient did not reach the scatter (e.g. unused): zeros
            gx = torch.empty(ctx.shape, dtype=grad_blocks.dtype, device=grad_blocks.device, memory_format=fmt).zero_()
        g = grad_blocks.contiguous(memory_format=memory_format_of(gx) or fmt)  # gx: the output gradient's layout
        torch.ops.sbnet.sparse_gather_backward_(g, indices, gx, list(bp.bstride), list(bp.boffset))
        return gx, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tiles, x, indices, tile, relu, add, inplace, link):  # noqa: ANN001, ANN205
        if inplace:
            torch.ops.sbnet.sparse_scatter_(tiles, indices, x, list(tile), [0, 0], add, relu)
            ctx.mark_dirty(x)
            out = x
        else:
            out = torch.ops.sbnet.sparse_scatter(tiles, indices, x, list(tile), [0, 0], add, relu)
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.save_for_backward(indices, tiles_of(out, indices, tile) if relu and need else None)
        ctx.args = (tile, relu, add, memory_format_of(out), link)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        indices, out_tiles = ctx.saved_tensors
        tile, relu, add, fmt, link = ctx.args
        need_x = ctx.needs_input_grad[1]
        gt, gx = scatter_backward(grad, indices, out_tiles, tile, add, relu, ctx.needs_input_grad[0], need_x, fmt)
        if need_x:
            # the gather's backward adds the block gradients into it: it must be a tensor of our own
            link.grad_x = gx.clone(memory_format=fmt) if gx is grad else gx
        return gt, None, None, None, None, None, None, None


class ResidualBlocks:
    """One identity unit's gather of ``x`` and scatter back into ``x`` (module docstring).

    Use :meth:`gather` once, then :meth:`scatter` once. ``gather_bp`` / ``scatter_bp``: the unit's block
    geometry (the same :class:`BlockParams` for a stride-1 chain). ``indices`` must be valid for them
    (e.g. from ``reduce_mask``); ``x`` NCHW-contiguous or channels-last.
    """

    def __init__(self, x: torch.Tensor, indices: torch.Tensor, bp: BlockParams, inplace: bool) -> None:
        if memory_format_of(x) is None:
            raise ValueError("ResidualBlocks: x must be NCHW-contiguous or channels-last")
        self.x, self.indices, self.bp, self.inplace = x, indices, bp, inplace
        self.fused = _kernels_for(x.device)
        self.link = _Link()

    def gather(self) -> torch.Tensor:
        """The blocks ``[K, C, bsize_h, bsize_w]`` of ``x`` (``x``'s layout; 0 outside the map)."""
        if not self.fused or not (torch.is_grad_enabled() and self.x.requires_grad):
            return sparse_gather(self.x, self.indices, self.bp)
        return _Gather.apply(self.x, self.indices, self.bp, self.link)

    def scatter(self, tiles: torch.Tensor, relu: bool, add: bool = True) -> torch.Tensor:
        """``x`` with each tile added (``relu``: ``relu(x + tile)``; ``add=False``: the tile written over ``x``'s
        values there), a copy or ``x`` itself (``inplace``)."""
        x, bp = self.x, self.bp
        if not self.fused or not (torch.is_grad_enabled() and (x.requires_grad or tiles.requires_grad)):
            op = sparse_scatter_ if self.inplace else sparse_scatter
            return op(tiles, self.indices, x, bp, add=add, relu=relu)
        tiles = tiles.contiguous(memory_format=memory_format_of(x))
        return _Scatter.apply(tiles, x, self.indices, tuple(bp.obsize), bool(relu), bool(add), self.inplace,
                              self.link)
