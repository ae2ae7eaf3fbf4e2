"""Public sparse-block ops (SBNet semantics; NCHW and channels-last maps): argument checks, semantics, dispatch.

Geometry comes from a :class:`~detector.ops.blocks.BlockParams` (see :func:`calc_block_params`).
Each function checks its arguments and raises one clear ``TypeError``/``ValueError`` naming the op and
the argument, then runs the compiled kernels (``torch.ops.sbnet.*``, built on first use by
:mod:`detector.ops._library`) or, where they are not available for the tensor's device, the pure-PyTorch
:mod:`detector.ops.reference` (with a one-time warning). Both paths give the same results and are
differentiable:

- gather's gradient is a scatter-add of the block gradients into zeros like ``x`` (blocks overlap by
  the halo, so overlapping gradients add up);
- scatter's gradient w.r.t. ``blocks`` is a gather of the output gradient at the tiles (output
  geometry, no halo; zeros where a tile sticks out of the map); w.r.t. ``base`` it is the output
  gradient, with the written tiles zeroed when ``add=False``.

Indices are an int32 ``[K, 3]`` tensor of unique rows ``(n, by, bx)`` (what :func:`reduce_mask`
returns; int64 is accepted and converted). ``K`` may be 0.
Supported dtypes: float16, bfloat16, float32, float64.

Layouts: maps may be NCHW-contiguous or channels-last (NHWC); the kernels read and write both natively
(a block row of a channels-last map is one contiguous run of ``bw * C`` values). Blocks take their
map's layout: :func:`sparse_gather` returns channels-last blocks for a channels-last ``x``, and
:func:`sparse_scatter` converts ``blocks`` to ``base``'s layout if they differ. A map in another stride
pattern (a slice, a permutation) is copied to NCHW first by the out-of-place ops; the in-place scatter
raises for it (it could not write into ``base`` itself).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import reference
from .blocks import BlockParams
from .formulas import ScatterInPlace, memory_format_of

__all__ = ["reduce_mask", "block_activity", "sparse_gather", "sparse_scatter", "sparse_scatter_"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_warned_devices: set[str] = set()


# ----------------------------------------------------------------------------------------- checks
def _check_tensor(op: str, name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    return t


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _native(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its layout is one the kernels read, else an NCHW-contiguous copy."""
    return x if memory_format_of(x) is not None else x.contiguous()


def _check_bp(op: str, bp: object) -> BlockParams:
    if not isinstance(bp, BlockParams):
        raise TypeError(f"{op}: bp must be a BlockParams (from calc_block_params), got {type(bp).__name__}")
    return bp


def _check_indices(
    op: str, indices: object, batch: int, bp: BlockParams, device: torch.device
) -> torch.Tensor:
    """``indices`` as a contiguous int32 [K, 3] tensor after checking shape, device, range, uniqueness."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{op}: indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dim() != 2 or indices.shape[1] != 3:
        raise ValueError(f"{op}: indices must have shape [K, 3] (n, by, bx), got {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: indices must be int32 (or int64), got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"{op}: indices are on {indices.device} but the data is on {device}")
    if torch.compiler.is_compiling():  # traced (torch.compile / torch.export): the values are unknown there
        return indices.to(torch.int32).contiguous()
    key = (batch, bp.bcount_h, bp.bcount_w)
    if _known_valid(indices, key):
        return indices
    if indices.shape[0] > 0:
        idx = indices.long()
        # One device sync for all checks: per-column min and max, and whether a row repeats.
        lin = (idx[:, 0] * bp.bcount_h + idx[:, 1]) * bp.bcount_w + idx[:, 2]
        srt = lin.sort().values
        dup = (srt[1:] == srt[:-1]).any().long().reshape(1)
        lo0, lo1, lo2, hi0, hi1, hi2, has_dup = torch.cat([idx.amin(0), idx.amax(0), dup]).tolist()
        for name, lo, hi, limit in (("n", lo0, hi0, batch), ("by", lo1, hi1, bp.bcount_h),
                                    ("bx", lo2, hi2, bp.bcount_w)):
            if lo < 0 or hi >= limit:
                raise ValueError(
                    f"{op}: indices column {name} out of range: values in [{lo}, {hi}], "
                    f"must lie in [0, {limit})"
                )
        if has_dup:
            raise ValueError(f"{op}: indices contain repeated rows; each (n, by, bx) must appear once")
    out = indices.to(torch.int32).contiguous()
    _remember_valid(out, key)
    return out


# Index tensors already checked (or made by reduce_mask) for a (batch, bcount_h, bcount_w), at their
# current version: the checks cost a device sync, and a model passes the same indices to many ops.
# An in-place change bumps the tensor's version and so forgets it. Inference tensors have no version
# counter and are checked on every call.
_valid_indices: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _known_valid(indices: torch.Tensor, key: tuple[int, int, int]) -> bool:
    if indices.is_inference() or indices.dtype != torch.int32 or not indices.is_contiguous():
        return False
    entry = _valid_indices.get(indices)
    return entry is not None and entry[0] == indices._version and key in entry[1]


def _remember_valid(indices: torch.Tensor, key: tuple[int, int, int]) -> None:
    if torch.compiler.is_compiling() or indices.is_inference():
        return
    entry = _valid_indices.get(indices)
    if entry is None or entry[0] != indices._version:
        entry = (indices._version, set())
        _valid_indices[indices] = entry
    entry[1].add(key)


# --------------------------------------------------------------------------------------- dispatch
def _kernels_for(device: torch.device) -> bool:
    """Whether the compiled kernels serve ``device``; warns once per device type when they do not."""
    from . import _library  # imported lazily: building the extension happens on first use

    if _library.has_kernels(device.type):
        return True
    if device.type not in _warned_devices:
        _warned_devices.add(device.type)
        warnings.warn(
            f"detector.ops: compiled sbnet kernels are not available for {device.type} "
            f"({_library.unavailable_reason(device.type)}); using the slow pure-PyTorch reference",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


# ------------------------------------------------------------------------------------------- ops
def _mask_args(op: str, mask: object, bp: object, tol: object) -> tuple[torch.Tensor, BlockParams]:
    """The checked (mask as float, block params) of reduce_mask / block_activity."""
    bp = _check_bp(op, bp)
    mask = _check_tensor(op, "mask", mask, 4)
    if mask.shape[1] != 1 or tuple(mask.shape[2:]) != bp.in_size:
        raise ValueError(
            f"{op}: mask must have shape [N, 1, {bp.in_h}, {bp.in_w}] (the block params' input map), "
            f"got {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        mask = mask.to(torch.float32)
    _check_float(op, "mask", mask)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"{op}: tol must be a float, got {type(tol).__name__}")
    return mask, bp


def reduce_mask(mask: torch.Tensor, bp: BlockParams, tol: float = 0.5, avgpool: bool = False) -> torch.Tensor:
    """Indices of the active blocks of ``mask``: int32 ``[K, 3]`` rows (n, by, bx), sorted, unique.

    ``mask`` is ``[N, 1, H, W]`` at the *input* resolution (``H, W = bp.in_h, bp.in_w``), float or bool.
    A block is active if the max (``avgpool=False``) or mean (``avgpool=True``) of the mask over its
    input window is strictly greater than ``tol``. Only the part of the window inside the map counts:
    the mean divides by the number of in-map pixels; a window wholly outside the map is never active.
    The mean is accumulated in float64. Rows come in ascending (n, by, bx) order; deterministic.

        for n, by, bx in grid (bp.bcount_h x bp.bcount_w per sample):
            window = mask[n, 0, boffset_h + by*bstride_h : ... + bsize_h,
                                boffset_w + bx*bstride_w : ... + bsize_w]   # in-map part
            if window not empty and (mean if avgpool else max)(window) > tol: emit (n, by, bx)

    The rows are the true entries of :func:`block_activity` (K is data-dependent: on a GPU, a host sync).
    """
    mask, bp = _mask_args("reduce_mask", mask, bp, tol)
    if _kernels_for(mask.device):
        indices = torch.ops.sbnet.reduce_mask(
            mask.contiguous(), list(bp.bsize), list(bp.bstride), list(bp.boffset), list(bp.bcount),
            float(tol), bool(avgpool),
        )
    else:
        indices = reference.reduce_mask(mask, bp, float(tol), bool(avgpool))
    _remember_valid(indices, (mask.shape[0], bp.bcount_h, bp.bcount_w))  # valid by construction
    return indices


def block_activity(mask: torch.Tensor, bp: BlockParams, tol: float = 0.5, avgpool: bool = False) -> torch.Tensor:
    """Whether each block is active, by :func:`reduce_mask`'s rule: bool ``[N, bcount_h, bcount_w]``.
    Its ``sum()`` counts the active blocks on the device, without the host sync a count of reduce_mask's
    rows costs on a GPU (the execution plan counts many grids and reads them all at once)."""
    mask, bp = _mask_args("block_activity", mask, bp, tol)
    if _kernels_for(mask.device):
        return torch.ops.sbnet.block_activity(
            mask.contiguous(), list(bp.bsize), list(bp.bstride), list(bp.boffset), list(bp.bcount),
            float(tol), bool(avgpool),
        )
    return reference.block_activity(mask, bp, float(tol), bool(avgpool))


def sparse_gather(x: torch.Tensor, indices: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    """Gather the blocks at ``indices`` from ``x [N, C, H, W]`` into ``[K, C, bsize_h, bsize_w]``.

    Pixels outside the map read as 0 (this is the convolution's zero padding; the whole tensor is
    never padded).

        for k, (n, by, bx) in enumerate(indices):
            y, x0 = boffset_h + by*bstride_h, boffset_w + bx*bstride_w
            blocks[k] = x[n, :, y : y + bsize_h, x0 : x0 + bsize_w]    # out-of-map pixels = 0

    Backward: ``grad_x = zeros_like(x)``; each block's gradient is added at its window (halos add up).
    """
    op = "sparse_gather"
    bp = _check_bp(op, bp)
    x = _check_tensor(op, "x", x, 4)
    _check_float(op, "x", x)
    if tuple(x.shape[2:]) != bp.in_size:
        raise ValueError(
            f"{op}: x must be [N, C, {bp.in_h}, {bp.in_w}] (the block params' input map), "
            f"got {tuple(x.shape)}"
        )
    indices = _check_indices(op, indices, x.shape[0], bp, x.device)
    x = _native(x)
    if _kernels_for(x.device):
        return torch.ops.sbnet.sparse_gather(x, indices, list(bp.bsize), list(bp.bstride), list(bp.boffset))
    return reference.sparse_gather(x, indices, bp)


def _check_scatter(
    op: str, blocks: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, bp: BlockParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BlockParams]:
    bp = _check_bp(op, bp)
    blocks = _check_tensor(op, "blocks", blocks, 4)
    base = _check_tensor(op, "base", base, 4)
    _check_float(op, "blocks", blocks)
    if base.dtype != blocks.dtype:
        raise TypeError(f"{op}: base ({base.dtype}) and blocks ({blocks.dtype}) must have the same dtype")
    if base.device != blocks.device:
        raise ValueError(f"{op}: base is on {base.device} but blocks are on {blocks.device}")
    if tuple(base.shape[2:]) != bp.out_size:
        raise ValueError(
            f"{op}: base must be [N, C, {bp.out_h}, {bp.out_w}] (the block params' output map), "
            f"got {tuple(base.shape)}"
        )
    if tuple(blocks.shape[2:]) != bp.obsize or blocks.shape[1] != base.shape[1]:
        raise ValueError(
            f"{op}: blocks must be [K, {base.shape[1]}, {bp.obsize_h}, {bp.obsize_w}] (base's channels, "
            f"the output block size), got {tuple(blocks.shape)}"
        )
    if isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.shape[0] != blocks.shape[0]:
        raise ValueError(
            f"{op}: blocks has {blocks.shape[0]} blocks but indices has {indices.shape[0]} rows"
        )
    indices = _check_indices(op, indices, base.shape[0], bp, base.device)
    fmt = memory_format_of(base)
    if fmt is None and op.endswith("_"):
        raise ValueError(
            f"{op}: base must be NCHW-contiguous or channels-last to be written in place, got strides {base.stride()}"
        )
    base = _native(base)
    blocks = blocks.contiguous(memory_format=memory_format_of(base))
    return blocks, indices, base, bp


def sparse_scatter(
    blocks: torch.Tensor,
    indices: torch.Tensor,
    base: torch.Tensor,
    bp: BlockParams,
    add: bool = True,
    relu: bool = False,
) -> torch.Tensor:
    """A copy of ``base [N, C, out_h, out_w]`` with each block's output tile combined in.

    ``blocks`` is ``[K, C, obsize_h, obsize_w]``; tile rows/columns outside the output map are dropped.
    Tiles do not overlap (the grid's output tiles partition the output map). ``add`` adds the tile to
    ``base`` instead of writing it; ``relu`` applies ReLU to the combined value (``relu(x + tile)`` is the
    post-activation residual shortcut).

        out = copy(base)
        for k, (n, by, bx) in enumerate(indices):
            y, x0 = by*obsize_h, bx*obsize_w
            t = (out[n, :, y : y + obsize_h, x0 : x0 + obsize_w] + blocks[k]) if add else blocks[k]
            out[n, :, y : y + obsize_h, x0 : x0 + obsize_w] = relu(t) if relu else t   # clipped to the map

    Backward (``on`` = the output tile > 0 with ``relu``, else 1): ``grad_blocks`` = ``grad_out`` at the
    tiles times ``on`` (zeros outside the map); ``grad_base`` = ``grad_out`` with each tile pixel replaced
    by ``grad_out * on`` (``add``) or 0 (written tiles).
    """
    op = "sparse_scatter"
    blocks, indices, base, bp = _check_scatter(op, blocks, indices, base, bp)
    if _kernels_for(base.device):
        return torch.ops.sbnet.sparse_scatter(
            blocks, indices, base, list(bp.obsize), [0, 0], bool(add), bool(relu)
        )
    return reference.sparse_scatter(blocks, indices, base, bp, bool(add), bool(relu))


def sparse_scatter_(
    blocks: torch.Tensor,
    indices: torch.Tensor,
    base: torch.Tensor,
    bp: BlockParams,
    add: bool = True,
    relu: bool = False,
) -> torch.Tensor:
    """:func:`sparse_scatter` into ``base`` itself; returns ``base`` (modified).

    Differentiable: under autograd the write is recorded as an in-place op on ``base`` (its version
    counter moves, so a tensor saved for backward that aliases ``base`` fails loudly at backward instead
    of giving a wrong gradient). ``base`` must not be a leaf that requires grad. Only the tiles are
    touched: the cost is the blocks', not the map's.
    """
    op = "sparse_scatter_"
    blocks, indices, base, bp = _check_scatter(op, blocks, indices, base, bp)
    grad = torch.is_grad_enabled() and (blocks.requires_grad or base.requires_grad)
    if grad and base.is_leaf and base.requires_grad:
        raise RuntimeError(f"{op}: base is a leaf that requires grad and cannot be written in place")
    if _kernels_for(base.device):
        if grad:
            return ScatterInPlace.apply(blocks, indices, base, tuple(bp.obsize), bool(add), bool(relu))
        args = (blocks, indices, base, list(bp.obsize), [0, 0], bool(add), bool(relu))
        if torch.compiler.is_exporting():  # a program holds no in-place custom op (ONNX has none): copy back
            return base.copy_(torch.ops.sbnet.sparse_scatter(*args))
        torch.ops.sbnet.sparse_scatter_(*args)
        return base
    return reference.sparse_scatter_(blocks, indices, base, bp, bool(add), bool(relu))


def _check_region(op: str, t: torch.Tensor, offset: tuple[int, int], size: tuple[int, int],
                  pixels: torch.Tensor | None) -> tuple[list[int], list[int]]:
    _check_tensor(op, "blocks", t, 4)
    _check_float(op, "blocks", t)
    (oh, ow), (rh, rw) = (int(v) for v in offset), (int(v) for v in size)
    eh, ew = t.shape[2:]
    if min(oh, ow, rh, rw) < 0 or oh + rh > eh or ow + rw > ew:
        raise ValueError(f"{op}: region at {(oh, ow)} of size {(rh, rw)} does not fit blocks of {eh} x {ew}")
    if pixels is not None and (pixels.dim() != 1 or pixels.dtype != torch.int64 or pixels.device != t.device):
        raise ValueError(f"{op}: pixels must be an int64 vector on {t.device}")
    return [oh, ow], [rh, rw]


def _region_kernels(t: torch.Tensor) -> bool:
    """The region ops have a CPU kernel only; elsewhere the reference's torch composition is their implementation
    (batched reductions, already the device's fast path), so no warning is due there."""
    return t.device.type == "cpu" and _kernels_for(t.device)


def region_sums(a: torch.Tensor, b: torch.Tensor | None, offset: tuple[int, int], size: tuple[int, int],
                pixels: torch.Tensor | None = None, center: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 ``[2, C]``: with ``u = a - center`` (``a`` when ``center`` is None), the per-channel sums of ``u``
    and of ``u * b`` (``u * u`` when ``b`` is None) over the tile regions of blocks ``[K, C, e_h, e_w]`` - rows
    ``offset_h .. offset_h + size_h`` and columns ``offset_w .. offset_w + size_w`` of each block; ``pixels``
    (int64) lists the region pixels that count, as indices into the ``[K * size_h * size_w]`` region pixels in
    (block, row, column) order (all when None). Batch-norm statistics over the tile regions
    (:mod:`detector.nn.norm`: shifted sums, ``center`` a region pixel's values, so that the variance
    ``E[u^2] - E[u]^2`` keeps its precision); not differentiable.

        for k, i, j in region pixels (counted ones):
            u = a[k, :, offset_h + i, offset_w + j] - center
            out[0] += u
            out[1] += u * (b[k, :, offset_h + i, offset_w + j] if b is not None else u)

    The CPU kernel sums each region row in float (the dtype's opmath type) and the rows in float64, in a fixed
    order (independent of the thread count); elsewhere the sums are float64 reductions.
    """
    op = "region_sums"
    offset, size = _check_region(op, a, offset, size, pixels)
    a = _native(a)
    if b is not None:
        if b.shape != a.shape or b.dtype != a.dtype or b.device != a.device:
            raise ValueError(f"{op}: b must match a in shape, dtype and device, got {tuple(b.shape)} {b.dtype}")
        b = b.contiguous(memory_format=memory_format_of(a))
    if center is not None and (center.shape != (a.shape[1],) or center.device != a.device):
        raise ValueError(f"{op}: center must be a [{a.shape[1]}] vector on {a.device}, got {tuple(center.shape)}")
    if _region_kernels(a):
        return torch.ops.sbnet.region_sums(a, b, center, offset, size, pixels)
    return reference.region_sums(a, b, center, offset, size, pixels)


def region_norm_grad(g: torch.Tensor, z: torch.Tensor, scale: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor,
                     offset: tuple[int, int], size: tuple[int, int], pixels: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The input gradient of batch-norm over tile regions: ``dz = g * scale`` at every pixel of the blocks
    ``z [K, C, e_h, e_w]``, plus ``z * c1 + c0`` at the counted region pixels (:func:`region_sums`' region and
    ``pixels``); ``scale``, ``c0``, ``c1``: ``[C]`` of any floating dtype (float32 ones keep their precision for
    half-precision blocks: the arithmetic is in the blocks' opmath type). One pass on the CPU; ``dz`` in ``z``'s
    layout and dtype."""
    op = "region_norm_grad"
    offset, size = _check_region(op, z, offset, size, pixels)
    z = _native(z)
    if g.shape != z.shape or g.dtype != z.dtype or g.device != z.device:
        raise ValueError(f"{op}: g must match z in shape, dtype and device, got {tuple(g.shape)} {g.dtype}")
    g = g.contiguous(memory_format=memory_format_of(z))
    for name, v in (("scale", scale), ("c0", c0), ("c1", c1)):
        if v.shape != (z.shape[1],) or not v.dtype.is_floating_point or v.device != z.device:
            raise ValueError(f"{op}: {name} must be a floating-point [{z.shape[1]}] vector on {z.device}, "
                             f"got {tuple(v.shape)} {v.dtype}")
    if _region_kernels(z):
        return torch.ops.sbnet.region_norm_grad(g, z, scale, c0, c1, offset, size, pixels)
    return reference.region_norm_grad(g, z, scale, c0, c1, offset, size, pixels)
