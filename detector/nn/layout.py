"""Gather and scatter of sparse blocks for maps in either memory layout, returning channels-last blocks.

:mod:`detector.ops` implements the SBNet ops for NCHW-contiguous maps. A block gather from an NCHW map
reads one short row per (block, channel, row) - scattered over the whole map, so it is bound by cache
and TLB misses - and the blocks then need a copy to channels-last, the layout in which oneDNN runs
the block convolutions fastest. When the map itself is channels-last (NHWC) a block row is one
contiguous run of ``bw * C`` values, so this module gathers and scatters NHWC maps directly with
``index_select`` / ``index_copy`` / ``index_add`` on the ``[N*H*W, C]`` view of the map (same
semantics and geometry as :func:`detector.ops.sparse_gather` / :func:`detector.ops.sparse_scatter`;
differentiable through those ops' autograd formulas, deterministic on CPU). NCHW maps go through
:mod:`detector.ops`, and the blocks are made channels-last afterwards.

    gather:  blocks[k] = x[n, :, boffset_h + by*bstride_h : ... + bsize_h, ...]   (0 outside the map)
    scatter: out = copy(base); out[n, :, by*obsize_h : ..., bx*obsize_w : ...] (+)= blocks[k] (clipped)
"""

from __future__ import annotations

import torch

from detector.ops.blocks import BlockParams
from detector.ops.functional import sparse_gather, sparse_scatter, sparse_scatter_

__all__ = ["is_nhwc", "gather_blocks", "scatter_blocks", "zeros_like_layout"]


def is_nhwc(x: torch.Tensor) -> bool:
    """Whether ``x [N, C, H, W]`` is stored channels-last (and not also NCHW-contiguous)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def zeros_like_layout(x: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Zeros of ``shape`` in ``x``'s memory layout (channels-last if ``x`` is)."""
    if is_nhwc(x):
        n, c, h, w = shape
        return x.new_zeros((n, h, w, c)).permute(0, 3, 1, 2)
    return x.new_zeros(shape)


def _positions(start: torch.Tensor, length: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``start + arange(length)`` per block ([K, length]), clamped to the map, and validity."""
    pos = start[:, None] + torch.arange(length, device=start.device)
    valid = (pos >= 0) & (pos < limit)
    return pos.clamp(0, limit - 1), valid


def _gather_nhwc(x: torch.Tensor, idx: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    N, C, H, W = x.shape
    n = idx[:, 0].long()
    rows, vr = _positions(idx[:, 1].long() * bp.bstride_h + bp.boffset_h, bp.bsize_h, H)
    cols, vc = _positions(idx[:, 2].long() * bp.bstride_w + bp.boffset_w, bp.bsize_w, W)
    flat = ((n[:, None, None] * H + rows[:, :, None]) * W + cols[:, None, :]).reshape(-1)
    rows_c = x.permute(0, 2, 3, 1).reshape(N * H * W, C).index_select(0, flat)
    blocks = rows_c.view(-1, bp.bsize_h, bp.bsize_w, C)
    if not (bool(vr.all()) and bool(vc.all())):  # clamped reads outside the map must read as 0
        blocks = blocks * (vr[:, :, None, None] & vc[:, None, :, None]).to(blocks.dtype)
    return blocks.permute(0, 3, 1, 2)


def gather_blocks(x: torch.Tensor, indices: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    """``sparse_gather`` returning channels-last blocks ``[K, C, bsize_h, bsize_w]`` for either layout."""
    if is_nhwc(x):
        if x.shape[2:] != bp.in_size:  # the same check as the op's
            raise ValueError(f"sparse_gather: x must be [N, C, {bp.in_h}, {bp.in_w}], got {tuple(x.shape)}")
        return _gather_nhwc(x, indices, bp)
    return sparse_gather(x, indices, bp).contiguous(memory_format=torch.channels_last)


def _tile_rows(idx: torch.Tensor, bp: BlockParams, n_batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flat NHWC row of every tile pixel ([K * th * tw]) and which lie in the map (None: all)."""
    th, tw, Ho, Wo = bp.obsize_h, bp.obsize_w, bp.out_h, bp.out_w
    n = idx[:, 0].long()
    rows = idx[:, 1].long()[:, None] * th + torch.arange(th, device=idx.device)
    cols = idx[:, 2].long()[:, None] * tw + torch.arange(tw, device=idx.device)
    flat = ((n[:, None, None] * Ho + rows[:, :, None]) * Wo + cols[:, None, :]).reshape(-1)
    if bool((rows[:, -1] < Ho).all()) and bool((cols[:, -1] < Wo).all()):
        return flat, None
    return flat, ((rows < Ho)[:, :, None] & (cols < Wo)[:, None, :]).reshape(-1)


def scatter_blocks(
    blocks: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, bp: BlockParams, add: bool, inplace: bool
) -> torch.Tensor:
    """``sparse_scatter`` (or, with ``inplace``, ``sparse_scatter_`` into ``base``) for either layout.

    The result has ``base``'s layout. ``inplace`` is for inference (no autograd through it).
    """
    if not is_nhwc(base):
        if inplace:
            return sparse_scatter_(blocks, indices, base, bp, add=add)
        return sparse_scatter(blocks, indices, base, bp, add=add)
    N, C, Ho, Wo = base.shape
    if blocks.shape[1:] != (C, bp.obsize_h, bp.obsize_w) or blocks.shape[0] != indices.shape[0]:
        raise ValueError(
            f"sparse_scatter: blocks must be [{indices.shape[0]}, {C}, {bp.obsize_h}, {bp.obsize_w}], "
            f"got {tuple(blocks.shape)}"
        )
    flat, valid = _tile_rows(indices, bp, N)
    src = blocks.permute(0, 2, 3, 1).reshape(-1, C)
    if valid is not None:
        flat, src = flat[valid], src[valid]
    view = base.permute(0, 2, 3, 1).view(N * Ho * Wo, C)
    if inplace:
        (view.index_add_ if add else view.index_copy_)(0, flat, src)
        return base
    out = view.index_add(0, flat, src) if add else view.index_copy(0, flat, src)
    return out.view(N, Ho, Wo, C).permute(0, 3, 1, 2)
