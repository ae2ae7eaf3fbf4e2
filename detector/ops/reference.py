"""Pure-PyTorch reference of the sparse-block ops: the test oracle and the fallback without kernels.

Written to read like the pseudo-code in :mod:`detector.ops.functional` (one Python loop over blocks,
slices clipped to the map), not to be fast. Differentiable through autograd (the slice copies are
ordinary in-place ops on fresh tensors). Arguments are assumed checked by the functional layer.

Results keep the memory layout of their map (NCHW or channels-last), as the kernels do.

Conventions shared with the kernels:
- a block's window is clipped to the map; pixels outside it read as 0 (gather) or are skipped (scatter);
- ``reduce_mask`` looks only at the in-map part of a block's window: max or mean over those pixels
  (the mean divides by their count, so a border block is not diluted by the padding); a block whose
  window lies wholly outside the map is never active. The mean is accumulated in float64.
"""

from __future__ import annotations

import torch

from .blocks import BlockParams

__all__ = ["reduce_mask", "block_activity", "sparse_gather", "sparse_scatter", "sparse_scatter_", "region_sums",
           "region_norm_grad", "region_rows"]


def _clip(start: int, length: int, limit: int) -> tuple[int, int]:
    """``[start, start + length)`` clipped to ``[0, limit)`` as (lo, hi); lo >= hi means empty."""
    return max(start, 0), min(start + length, limit)


def block_activity(mask: torch.Tensor, bp: BlockParams, tol: float, avgpool: bool = False) -> torch.Tensor:
    """Whether each block of ``mask [N, 1, H, W]`` is active: bool ``[N, bcount_h, bcount_w]``.

    for n, by, bx in grid:
        window = mask[n, 0, boffset_h + by*bstride_h : ... + bsize_h,
                            boffset_w + bx*bstride_w : ... + bsize_w]   # in-map part only
        active[n, by, bx] = window not empty and (mean if avgpool else max)(window) > tol
    """
    N, _, H, W = mask.shape
    active = torch.zeros((N, bp.bcount_h, bp.bcount_w), dtype=torch.bool)
    for n in range(N):
        for by in range(bp.bcount_h):
            y0, y1 = _clip(bp.boffset_h + by * bp.bstride_h, bp.bsize_h, H)
            for bx in range(bp.bcount_w):
                x0, x1 = _clip(bp.boffset_w + bx * bp.bstride_w, bp.bsize_w, W)
                if y0 >= y1 or x0 >= x1:
                    continue
                window = mask[n, 0, y0:y1, x0:x1].double()
                value = window.mean() if avgpool else window.max()
                active[n, by, bx] = value.item() > tol
    return active.to(mask.device)


def reduce_mask(mask: torch.Tensor, bp: BlockParams, tol: float, avgpool: bool = False) -> torch.Tensor:
    """Active blocks of ``mask [N, 1, H, W]`` as int32 ``[K, 3]`` rows (n, by, bx), sorted: the true
    entries of :func:`block_activity` in row-major order."""
    return block_activity(mask, bp, tol, avgpool).nonzero().to(torch.int32).contiguous()


def sparse_gather(x: torch.Tensor, indices: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    """Blocks of ``x [N, C, H, W]`` at ``indices``: ``[K, C, bsize_h, bsize_w]``, zeros outside the map.

    for k, (n, by, bx) in enumerate(indices):
        y, x0 = boffset_h + by*bstride_h, boffset_w + bx*bstride_w
        blocks[k] = x[n, :, y : y + bsize_h, x0 : x0 + bsize_w]      # out-of-map pixels = 0
    """
    N, C, H, W = x.shape
    blocks = torch.empty((indices.shape[0], C, bp.bsize_h, bp.bsize_w), dtype=x.dtype, device=x.device,
                         memory_format=_format(x)).zero_()
    for k, (n, by, bx) in enumerate(indices.tolist()):
        top, left = bp.boffset_h + by * bp.bstride_h, bp.boffset_w + bx * bp.bstride_w
        y0, y1 = _clip(top, bp.bsize_h, H)
        x0, x1 = _clip(left, bp.bsize_w, W)
        if y0 < y1 and x0 < x1:
            blocks[k, :, y0 - top : y1 - top, x0 - left : x1 - left] = x[n, :, y0:y1, x0:x1]
    return blocks


def _format(x: torch.Tensor) -> torch.memory_format:
    """The memory format of a map: channels-last if it is stored so (and not also NCHW-contiguous)."""
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if nhwc else torch.contiguous_format


def _write_tiles(
    blocks: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, bp: BlockParams, add: bool, relu: bool
) -> None:
    """Combine each block's output tile into ``out`` in place, clipped to the output map:
    ``relu?(out (+ if add) tile)``."""
    _, _, Ho, Wo = out.shape
    for k, (n, by, bx) in enumerate(indices.tolist()):
        top, left = by * bp.obsize_h, bx * bp.obsize_w
        y0, y1 = _clip(top, bp.obsize_h, Ho)
        x0, x1 = _clip(left, bp.obsize_w, Wo)
        tile = blocks[k, :, y0 - top : y1 - top, x0 - left : x1 - left]
        value = out[n, :, y0:y1, x0:x1] + tile if add else tile
        out[n, :, y0:y1, x0:x1] = torch.relu(value) if relu else value


def sparse_scatter(
    blocks: torch.Tensor,
    indices: torch.Tensor,
    base: torch.Tensor,
    bp: BlockParams,
    add: bool = True,
    relu: bool = False,
) -> torch.Tensor:
    """A copy of ``base [N, C, H', W']`` with each block's output tile combined in.

    out = copy(base)
    for k, (n, by, bx) in enumerate(indices):
        y, x0 = by*obsize_h, bx*obsize_w                              # tiles do not overlap
        t = out[n, :, y : y + obsize_h, x0 : x0 + obsize_w]            # clipped to the map
        t = (t + blocks[k]) if add else blocks[k]
        out[n, :, y : y + obsize_h, x0 : x0 + obsize_w] = relu(t) if relu else t
    """
    out = base.clone(memory_format=_format(base))
    _write_tiles(blocks, indices, out, bp, add, relu)
    return out


def sparse_scatter_(
    blocks: torch.Tensor,
    indices: torch.Tensor,
    base: torch.Tensor,
    bp: BlockParams,
    add: bool = True,
    relu: bool = False,
) -> torch.Tensor:
    """:func:`sparse_scatter` writing into ``base`` itself; returns ``base``."""
    _write_tiles(blocks, indices, base, bp, add, relu)
    return base


def region_rows(t: torch.Tensor, offset: tuple[int, int], size: tuple[int, int],
                pixels: torch.Tensor | None) -> torch.Tensor:
    """The counted region pixels of blocks ``t [K, C, e_h, e_w]`` as ``[pixels, C]`` rows, in (block, row,
    column) order (a view, not a copy, when ``pixels`` is None and the region is the whole block of a
    channels-last ``t``; differentiable)."""
    (oh, ow), (rh, rw) = offset, size
    rows = t[:, :, oh : oh + rh, ow : ow + rw].permute(0, 2, 3, 1).reshape(-1, t.shape[1])
    return rows if pixels is None else rows.index_select(0, pixels)


def region_sums(a: torch.Tensor, b: torch.Tensor | None, center: torch.Tensor | None, offset: tuple[int, int],
                size: tuple[int, int], pixels: torch.Tensor | None) -> torch.Tensor:
    """Float64 ``[2, C]``: with ``u = a - center`` (``a`` without ``center``), the sums of ``u`` and of ``u * b``
    (``u * u`` without ``b``) over the counted region pixels of blocks ``[K, C, e_h, e_w]``.

        for k, i, j in region pixels (counted ones):       # block rows offset_h + i, columns offset_w + j
            u = a[k, :, offset_h + i, offset_w + j] - center
            out[0] += u
            out[1] += u * (b[k, :, offset_h + i, offset_w + j] if b is not None else u)
    """
    u = region_rows(a, offset, size, pixels).double()
    if center is not None:
        u = u - center.double()
    v = u if b is None else region_rows(b, offset, size, pixels).double()
    return torch.stack([u.sum(0), (u * v).sum(0)])


def region_norm_grad(g: torch.Tensor, z: torch.Tensor, scale: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor,
                     offset: tuple[int, int], size: tuple[int, int], pixels: torch.Tensor | None) -> torch.Tensor:
    """``dz = g * scale`` at every pixel of the blocks, plus ``z * c1 + c0`` at the counted region pixels
    (per channel), in ``g``'s layout."""
    K, C = z.shape[:2]
    (oh, ow), (rh, rw) = offset, size
    dt = torch.promote_types(torch.float32, z.dtype)  # the opmath type
    dz = g.to(dt) * scale.to(dt).view(1, C, 1, 1)
    corr = torch.addcmul(c0.to(dt), region_rows(z, offset, size, pixels).to(dt), c1.to(dt))
    if pixels is not None:  # uncounted region pixels get no correction
        corr = corr.new_zeros(K * rh * rw, C).index_copy_(0, pixels, corr)
    dz[:, :, oh : oh + rh, ow : ow + rw] += corr.view(K, rh, rw, C).permute(0, 3, 1, 2)
    return dz.to(z.dtype)
