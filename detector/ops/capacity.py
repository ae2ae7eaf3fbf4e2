"""Active-block lists of a bounded capacity, made and used on the device without a host synchronization.

:func:`reduce_mask` returns ``[K, 3]`` with a data-dependent ``K``: on a GPU its size is a host sync, and every
new ``K`` is a new shape (no graph replay). A :class:`BlockList` has a fixed number of rows instead, its
*capacity* (from a few buckets, :func:`capacity_buckets`, so that shapes repeat), and the number of active
blocks as a 0-d tensor on the device:

    blist = reduce_mask_capacity(mask, bp, capacity=64, tol=0.5)
    blist.indices    # int32 [capacity, 3]: the active blocks in reduce_mask's order, then padding rows
    blist.count      # int64 0-d tensor: the active blocks (may exceed the capacity: see overflow)
    blist.valid      # bool [capacity]: row k < count
    blist.overflow   # bool 0-d tensor: count > capacity (the list then misses active blocks)

Padding rows are *distinct inactive blocks* (in ascending order), so every row is a valid, unique block of the
grid: the existing gather and scatter kernels take the list as it is (a gather of a padding row is wasted work,
never a wrong read), and the scatter of :func:`scatter_padded` leaves the map unchanged at padding rows (their
tiles are replaced by the map's own values). The fused GPU kernels (:mod:`detector.ops.fused`) read the count
and skip padding rows altogether. A capacity larger than the grid is cut to the grid's blocks (a static shape).

    act   = block_activity(mask, bp, tol).flatten()           # [T] bool, T = N * bcount_h * bcount_w
    pos   = where(act, cumsum(act) - 1, count + cumsum(!act) - 1)   # active first, then inactive, each sorted
    order = empty(T); order[pos] = arange(T)
    rows  = order[:capacity]  ->  (n, by, bx)

An overflow (more active blocks than the capacity) is never silent: ``overflow`` is set on the device and the
caller reruns with a larger bucket or dense (:mod:`detector.nn.capacity` does, and logs it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .blocks import BlockParams
from .formulas import ScatterInPlace, like_map, memory_format_of
from .functional import _kernels_for, block_activity

__all__ = ["BlockList", "reduce_mask_capacity", "capacity_buckets", "bucket_for", "uses_buckets", "scatter_padded",
           "gather_tiles", "gather_windows", "level_valid", "list_memo"]


@dataclass(frozen=True, eq=False)
class BlockList:
    """A bounded list of active blocks (module docstring): ``indices`` int32 ``[capacity, 3]`` (valid, unique
    rows of ``block``'s grid), ``count`` (int64 0-d, the active blocks, on the device); ``mask``: where on the
    output map the blocks' tiles are written (``[N, 1, H', W']``, set where > 0.5; None: all of each tile)."""

    indices: torch.Tensor
    count: torch.Tensor
    block: BlockParams
    mask: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.indices.shape[0]  # an int; traced (torch.export), a symbol: no int() of it

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[capacity]``: whether row k is an active block (``k < count``)."""
        return torch.arange(self.capacity, device=self.indices.device) < self.count

    def keep(self, tile: tuple[int, int]) -> torch.Tensor:
        """bool ``[capacity, 1, th, tw]``: the tile pixels written - active rows, where :attr:`mask` is set."""
        valid = self.valid.view(-1, 1, 1, 1)
        if self.mask is None:
            return valid
        return valid & (gather_tiles(self.mask, self.indices, tile) > 0.5)

    @property
    def overflow(self) -> torch.Tensor:
        """bool 0-d: more active blocks than rows (the list is then incomplete)."""
        return self.count > self.capacity


def capacity_buckets(total: int, smallest: int = 8) -> tuple[int, ...]:
    """The capacities a grid of ``total`` blocks uses: powers of two from ``smallest`` below ``total``, then
    ``total`` (every block: never overflows). Few buckets, so that a captured graph per bucket is replayed."""
    if total < 1:
        raise ValueError(f"capacity_buckets: total must be >= 1, got {total}")
    out, c = [], max(1, smallest)
    while c < total:
        out.append(c)
        c *= 2
    return (*out, total)


def bucket_for(count: int, total: int, smallest: int = 8) -> int:
    """The smallest bucket of :func:`capacity_buckets` that holds ``count`` blocks."""
    return next(b for b in capacity_buckets(total, smallest) if b >= count)


def uses_buckets(device: torch.device | str) -> bool:
    """Whether block lists on ``device`` take a bucket's rows (:func:`bucket_for`) or exactly the active blocks.
    Buckets repeat shapes, so that a captured CUDA graph is replayed; where nothing is captured (the CPU) a
    bucket's padding rows would only be computed and thrown away, and the host read of the count is free."""
    return torch.device(device).type == "cuda"


def reduce_mask_capacity(mask: torch.Tensor, bp: BlockParams, capacity: int, tol: float = 0.5,
                         avgpool: bool = False) -> BlockList:
    """The active blocks of ``mask [N, 1, H, W]`` (:func:`~detector.ops.reduce_mask`'s rule and order) as a
    :class:`BlockList` of ``min(capacity, N * bcount_h * bcount_w)`` rows; no host sync, static shapes."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"reduce_mask_capacity: capacity must be an int >= 0, got {capacity!r}")
    act = block_activity(mask, bp, tol, avgpool).reshape(-1)
    total = act.numel()
    cap = min(capacity, total)
    a = act.to(torch.int64)
    count = a.sum()
    pos = torch.where(act, torch.cumsum(a, 0) - 1, count + torch.cumsum(1 - a, 0) - 1)
    ar = torch.arange(total, device=act.device)
    order = torch.empty_like(ar).scatter_(0, pos, ar)[:cap]
    per = bp.bcount_h * bp.bcount_w
    rows = torch.stack([order // per, (order // bp.bcount_w) % bp.bcount_h, order % bp.bcount_w], 1)
    return BlockList(indices=rows.to(torch.int32).contiguous(), count=count, block=bp)


def level_valid(indices: torch.Tensor, mul: tuple[int, int], off: tuple[int, int], extent: tuple[int, int],
                size: tuple[int, int]) -> torch.Tensor:
    """bool ``[K, 1, e_h, e_w]``: whether each block pixel lies in a map of ``size``, block ``(by, bx)`` starting
    at ``(by * mul_h - off_h, bx * mul_w - off_w)`` (computed on the device, no sync)."""
    idx = indices.long()
    ys = idx[:, 1:2] * mul[0] - off[0] + torch.arange(extent[0], device=idx.device)
    xs = idx[:, 2:3] * mul[1] - off[1] + torch.arange(extent[1], device=idx.device)
    vy = (ys >= 0) & (ys < size[0])
    vx = (xs >= 0) & (xs < size[1])
    return (vy[:, :, None] & vx[:, None, :]).unsqueeze(1)


def gather_windows(x: torch.Tensor, indices: torch.Tensor, extent: tuple[int, int],
                   origin: tuple[tuple[int, int], tuple[int, int]]) -> torch.Tensor:
    """``[K, C, e_h, e_w]``: the map ``x``'s windows of ``extent`` at ``indices``, block ``(by, bx)``'s first pixel at
    ``(by * mul_h - off_h, bx * mul_w - off_w)`` for ``origin = ((mul_h, mul_w), (off_h, off_w))`` (0 past the map)."""
    (mh, mw), (fh, fw) = origin
    if _kernels_for(x.device):
        return torch.ops.sbnet.sparse_gather(x, indices, list(extent), [mh, mw], [-fh, -fw])
    from dataclasses import replace

    from . import reference
    from .blocks import calc_block_params

    bp = replace(calc_block_params(int(x.shape[2]), int(x.shape[3]), bsize=extent, ksize=1, stride=1, padding=0),
                 bstride_h=mh, bstride_w=mw, boffset_h=-fh, boffset_w=-fw)
    return reference.sparse_gather(x, indices, bp)


def gather_tiles(t: torch.Tensor, indices: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The map ``t``'s values at the output tiles of ``indices`` (``[K, C, th, tw]``, 0 past the map)."""
    return gather_windows(t, indices, tile, (tile, (0, 0)))


# what is derived from a list alone (its kept tile pixels, its pixels inside a level's map), made once per list:
# the units of a stage share their list
_PER_LIST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def list_memo(blist: BlockList, key: tuple, make):  # noqa: ANN001, ANN201
    """``make()`` remembered for ``blist`` (immutable) and ``key`` (made anew while compiling)."""
    if torch.compiler.is_compiling():
        return make()
    made = _PER_LIST.setdefault(blist, {})
    if key not in made:
        made[key] = make()
    return made[key]


def _keep(blist: BlockList, tile: tuple[int, int]) -> torch.Tensor:
    return list_memo(blist, ("keep", tile), lambda: blist.keep(tile))


def _tile_params(bp: BlockParams, tile: tuple[int, int]) -> BlockParams:
    from dataclasses import replace

    return replace(bp, bsize_h=tile[0], bsize_w=tile[1], bstride_h=tile[0], bstride_w=tile[1], obsize_h=tile[0],
                   obsize_w=tile[1], boffset_h=0, boffset_w=0)


def scatter_padded(tiles: torch.Tensor, blist: BlockList, base: torch.Tensor, add: bool, relu: bool,
                   inplace: bool, zeros: bool = False) -> torch.Tensor:
    """``sparse_scatter`` of ``tiles [capacity, C, th, tw]`` at ``blist``'s rows into ``base`` (a copy, or ``base``
    itself with ``inplace``), padding rows and pixels outside the list's mask inert: the map keeps its values there.
    The composition of the existing kernels (no sync), differentiable either way: in place under autograd the write
    is recorded on ``base`` (:class:`~detector.ops.formulas.ScatterInPlace`; its backward reads the tiles only, and a
    tensor saved earlier that aliases ``base`` fails loudly at the backward instead of giving a wrong gradient).
    ``zeros``: ``base`` holds zeros at the list's tiles (a fresh output map), so they need not be read.

        old = base at the tiles                          (zeros: 0)
        new = relu?((old + tiles) if add else tiles)
        base at the tiles = where(keep, new, old)        keep: blist.keep(tile)

    Where the kept pixels' ``old`` need not be read - an add without ReLU (``old + 0`` elsewhere), or zeros - the
    masked tiles go to the kernel with its own add and ReLU: one pass less, and no gather of ``old``.
    """
    tile = (int(tiles.shape[2]), int(tiles.shape[3]))
    idx = blist.indices
    fmt = memory_format_of(base)
    if fmt is None:
        raise ValueError("scatter_padded: base must be NCHW-contiguous or channels-last")
    tiles = like_map(tiles, base)
    keep = _keep(blist, tile)
    relu_flag = False
    if add and not relu:
        new, add_flag = torch.where(keep, tiles, 0).contiguous(memory_format=fmt), True
    elif zeros and not add:  # relu(0) = 0 = base outside the kept pixels
        new, add_flag, relu_flag = torch.where(keep, tiles, 0).contiguous(memory_format=fmt), False, relu
    else:
        old = gather_tiles(base, idx, tile)
        new = old + tiles if add else tiles
        new = torch.relu(new) if relu else new
        new, add_flag = torch.where(keep, new, old).contiguous(memory_format=fmt), False
    if not _kernels_for(base.device):
        from . import reference

        bp = _tile_params(blist.block, tile)
        op = reference.sparse_scatter_ if inplace else reference.sparse_scatter
        return op(new, idx, base, bp, add_flag, relu_flag)
    args = (new, idx, base, list(tile), [0, 0], add_flag, relu_flag)
    if inplace and torch.compiler.is_exporting():  # a program holds no in-place custom op (ONNX has none): copy back
        return base.copy_(torch.ops.sbnet.sparse_scatter(*args))
    if inplace and torch.is_grad_enabled() and (new.requires_grad or base.requires_grad):
        return ScatterInPlace.apply(new, idx, base, tile, add_flag, relu_flag)
    if inplace:
        torch.ops.sbnet.sparse_scatter_(*args)
        return base
    return torch.ops.sbnet.sparse_scatter(*args)
