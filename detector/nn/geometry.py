"""Block geometry of a chain of convolutions run on sparse blocks (one gather, one scatter).

A sparse unit runs a chain of convolutions ``conv_0 ... conv_{L-1}`` (kernel ``k_i``, stride ``s_i``,
the dense twin's zero padding ``p_i``) on each gathered block with VALID padding. The chain's output
tile is ``T`` pixels (rows and columns handled alike); walking back from the output (level ``L``) to
the input (level ``0``) gives, for every *level* ``i`` (the tensor that enters ``conv_i``):

    extent   e_L = T,  e_i = (e_{i+1} - 1) * s_i + k_i        block pixels at level i (halo included)
    offset   P_L = 0,  P_i = P_{i+1} * s_i + p_i              how far the block starts before its tile
    region   R_i = T * S / r_i                                 the tile's own pixels at level i
             (r_i = s_0 ... s_{i-1} the level's stride, S = r_L the chain's stride)

Block ``(by, bx)`` covers level-i rows ``by * R_i - P_i ... + e_i``; its *tile region* is level-i rows
``by * R_i ... + R_i`` (block rows ``P_i ... P_i + R_i``). Tile regions partition a level's map, so
statistics over them count every pixel once. The whole chain is one sparse-block convolution with
``calc_block_params(H, W, bsize=e_0, ksize=e_0 - (T - 1) * S, stride=S, padding=P_0)``, whose output
tile is ``T`` and whose block stride is ``T * S``.

Level map sizes follow the dense twin: ``H_{i+1} = (H_i + 2 p_i - k_i) // s_i + 1``. Pixels of a
block outside its level's map are the dense twin's zero padding; a unit must zero them after every
layer whose output feeds a ``k > 1`` convolution (BN and activation of a padded zero are not zero).

The tiles only carry the computation; what is computed is defined by the unit's mask (:mod:`detector.nn.chain`):
``M`` at the input resolution, max-pooled by ``r_i`` (ceil mode, :func:`mask_at_stride`) at level ``i``. The
active tiles are those whose output tile holds a pixel of the output level's mask (``ChainGeometry.select``:
one window per tile, no halo), so they cover ``M`` whatever the tile size; batch statistics count the mask's
pixels of each level (inside the tile regions, which the tiles' regions then cover).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from detector.ops.blocks import BlockParams, calc_block_params, pair

__all__ = [
    "ConvSpec", "Level", "ChainGeometry", "chain_geometry", "LevelMasks", "BlockSpan", "level_masks", "zero_pixels",
    "mask_at_stride", "binary_mask", "pool_max",
]


def pool_max(x: torch.Tensor, r: int, ceil_mode: bool = True) -> torch.Tensor:
    """``F.max_pool2d(x, r, r, ceil_mode=ceil_mode)`` of a floating ``[N, C, H, W]`` map (NCHW or channels-last; the
    result in the same layout), as two reductions over adjacent memory - on a CPU several times faster than the
    library's pooling (a one-channel mask: ~7x; the channels-last BEV by 4: ~2x). The same values; a gradient through
    it splits between tied maxima (the masks and the BEV it pools carry none)."""
    if r == 1:
        return x
    N, C, H, W = x.shape  # N stays symbolic under torch.export (its batch dimension is dynamic)
    C, H, W = int(C), int(H), int(W)
    Ho, Wo = (-(-H // r), -(-W // r)) if ceil_mode else (H // r, W // r)
    nhwc = C > 1 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    if not ceil_mode:
        x = x[:, :, : Ho * r, : Wo * r]
    elif Ho * r != H or Wo * r != W:  # ceil mode's partial windows: padded with -inf, which no maximum takes
        x = torch.nn.functional.pad(x, (0, Wo * r - W, 0, Ho * r - H), value=float("-inf"))
    if nhwc:
        h = x.permute(0, 2, 3, 1).reshape(-1, Ho, r, Wo * r * C).amax(2)
        return h.view(-1, Ho, Wo, r, C).amax(3).permute(0, 3, 1, 2)
    h = x.reshape(-1, Ho, r, Wo * r).amax(2)
    return h.view(-1, Ho, Wo, r).amax(3).view(N, C, Ho, Wo)


class _PerTensor:
    """Values remembered per tensor, by identity (a tensor's ``==`` is elementwise: no WeakKeyDictionary), and
    dropped with it."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t: torch.Tensor) -> object:
        hit = self._d.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def set(self, t: torch.Tensor, value: object) -> None:
        key = id(t)
        self._d[key] = (weakref.ref(t, lambda _, d=self._d, k=key: d.pop(k, None)), value)


# masks derived from a mask tensor (its binary form, its strided copies), made once per tensor and version
_DERIVED = _PerTensor()
_BINARY = _PerTensor()  # masks known to hold 0 and 1 only: their version then


def _untracked(t: torch.Tensor) -> bool:
    """Whether nothing may be remembered about ``t``: it has a gradient, it tracks no version counter (made under
    ``torch.inference_mode``: a change in place would go unseen), or the code is traced, compiled, exported, or
    captured into a CUDA graph (a remembered tensor would be a constant of the graph)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # first: nothing below is traced then
        return True
    return (t.requires_grad or t.is_inference() or torch.jit.is_tracing()
            or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def _memo(mask: torch.Tensor, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, remembered for ``mask`` and ``key`` while neither changes (their version counters): the plan, the
    stages, the neck and the head derive the same masks from one mask (:func:`_untracked`: made anew)."""
    if _untracked(mask):
        return make()
    entry = _DERIVED.get(mask)
    if entry is None or entry[0] != mask._version:
        entry = (mask._version, {})
        _DERIVED.set(mask, entry)
    made = entry[1].get(key)
    if made is None or made[0]._version != made[1]:
        made = entry[1][key] = (v := make(), v._version)
    return made[0]


def _known_binary(mask: torch.Tensor) -> bool:
    return not _untracked(mask) and _BINARY.get(mask) == mask._version


def _mark_binary(mask: torch.Tensor) -> torch.Tensor:
    if not _untracked(mask):
        _BINARY.set(mask, mask._version)
    return mask


def binary_mask(mask: torch.Tensor, tol: float) -> torch.Tensor:
    """``mask`` made binary: 1 where it exceeds ``tol`` (in ``[0, 1)``), else 0, in its floating dtype (float32 for
    another). A mask already made so (by this function or :func:`mask_at_stride` of one) is returned as it is: the
    same values at any such ``tol``."""
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    if mask.dtype == dtype and _known_binary(mask):
        return mask
    return _mark_binary(_memo(mask, ("binary", float(tol), dtype), lambda: (mask > tol).to(dtype)))


def mask_at_stride(mask: torch.Tensor, r: int) -> torch.Tensor:
    """A unit's mask ``[N, 1, H, W]`` at a level ``r`` times coarser: max-pooled by ``r`` (ceil mode), the map size of a
    ``k = 2p + 1`` convolution of stride ``r`` (``ceil(H / r)``). The identity for ``r = 1``. Made once per mask
    tensor and stride (:func:`_memo`)."""
    if r == 1:
        return mask
    out = _memo(mask, ("stride", r), lambda: pool_max(mask, r))
    return _mark_binary(out) if _known_binary(mask) else out


@dataclass(frozen=True)
class ConvSpec:
    """One square convolution of a chain: kernel, stride and the dense twin's zero padding."""

    ksize: int
    stride: int
    padding: int


@dataclass(frozen=True)
class Level:
    """One level of a chain in block space (see the module docstring); pairs are (rows, columns)."""

    extent: tuple[int, int]  # e_i: block size at this level
    offset: tuple[int, int]  # P_i: block start before the tile region
    region: tuple[int, int]  # R_i: tile region size
    map_size: tuple[int, int]  # H_i, W_i: the dense twin's map at this level
    stride: int = 1  # r_i: the level's stride from the chain's input (its mask: mask_at_stride(M, r_i))


@dataclass(frozen=True)
class ChainGeometry:
    """Geometry of a conv chain on an input map: the gather/scatter BlockParams and each level."""

    block: BlockParams
    levels: tuple[Level, ...]  # L + 1 levels: input, after conv_0, ..., output
    select: BlockParams  # the tiles on the output map (window = tile, no halo): which tiles the mask activates

    @property
    def tile(self) -> tuple[int, int]:
        return self.block.obsize


def chain_geometry(H: int, W: int, convs: tuple[ConvSpec, ...], tile: int | tuple[int, int]) -> ChainGeometry:
    """Geometry of ``convs`` run on ``tile``-pixel output tiles of an ``H x W`` input map."""
    th, tw = pair(tile, "tile")
    if th < 1 or tw < 1:
        raise ValueError(f"tile (block size) must be >= 1, got {(th, tw)}")
    if not convs:
        raise ValueError("a chain needs at least one convolution")
    # Walk back from the output: extents and offsets.
    ext = [(th, tw)]
    off = [(0, 0)]
    for c in reversed(convs):
        eh, ew = ext[0]
        ph, pw = off[0]
        ext.insert(0, ((eh - 1) * c.stride + c.ksize, (ew - 1) * c.stride + c.ksize))
        off.insert(0, (ph * c.stride + c.padding, pw * c.stride + c.padding))
    # Walk forward: level strides and dense map sizes.
    strides = [1]
    sizes = [(H, W)]
    for c in convs:
        strides.append(strides[-1] * c.stride)
        h, w = sizes[-1]
        sizes.append(
            ((h + 2 * c.padding - c.ksize) // c.stride + 1, (w + 2 * c.padding - c.ksize) // c.stride + 1)
        )
        if sizes[-1][0] < 1 or sizes[-1][1] < 1:
            raise ValueError(f"input map {H}x{W} is too small for this unit (a level's map would be empty)")
    S = strides[-1]
    levels = tuple(
        Level(
            extent=ext[i],
            offset=off[i],
            region=(th * S // strides[i], tw * S // strides[i]),
            map_size=sizes[i],
            stride=strides[i],
        )
        for i in range(len(convs) + 1)
    )
    ksize = (ext[0][0] - (th - 1) * S, ext[0][1] - (tw - 1) * S)
    block = calc_block_params(H, W, bsize=ext[0], ksize=ksize, stride=S, padding=off[0])
    if block.out_size != sizes[-1]:  # cannot happen for k >= 2p + 1 convs; guards odd paddings
        raise ValueError(
            f"unit geometry mismatch: sparse output map {block.out_size} != dense output map {sizes[-1]} "
            "(each convolution's padding must be at most (ksize - 1) // 2)"
        )
    select = calc_block_params(*sizes[-1], bsize=(th, tw), ksize=1, stride=1, padding=0)
    return ChainGeometry(block=block, levels=levels, select=select)


def _axis_valid(start: torch.Tensor, length: int, limit: int) -> torch.Tensor:
    pos = start[:, None] + torch.arange(length, device=start.device)
    return (pos >= 0) & (pos < limit)


@dataclass(frozen=True)
class BlockSpan:
    """The range of block rows/columns of a set of active blocks: ``(by_min, by_max, bx_min, bx_max)``."""

    by_min: int
    by_max: int
    bx_min: int
    bx_max: int

    @staticmethod
    def of(indices: torch.Tensor) -> BlockSpan:
        """One host sync for the whole set (``indices`` must be non-empty)."""
        lo = indices[:, 1:].amin(0)
        hi = indices[:, 1:].amax(0)
        a, b, c, d = torch.stack([lo[0], hi[0], lo[1], hi[1]]).tolist()
        return BlockSpan(a, b, c, d)


class LevelMasks:
    """Per-block validity at one level for a set of active blocks.

    ``outside``: the block pixels outside the level's map, as indices into the ``[K * e_h * e_w]`` block
    pixels in (block, row, column) order, or None when every pixel of every block is inside it.
    ``region``: the tile-region pixels that batch statistics count - those of the level's mask (in the map) - as
    indices into the ``[K * R_h * R_w]`` region pixels in (block, row, column) order, or None when all are counted.
    ``count``: their number. Given as values, or (:func:`level_masks`) built from the blocks on first use:
    ``outside`` is read only before a ``k > 1`` convolution, ``region`` and ``count`` only by batch statistics, and
    building one costs a few small kernels and a host sync or two.
    """

    def __init__(self, outside: torch.Tensor | None = None, region: torch.Tensor | None = None, count: int = 0,
                 *, blocks: tuple[torch.Tensor, Level, BlockSpan | None, torch.Tensor] | None = None) -> None:
        self._blocks = blocks
        self._outside = None if blocks is not None else (outside,)
        self._region = None if blocks is not None else (region, count)

    @property
    def outside(self) -> torch.Tensor | None:
        if self._outside is None:
            self._outside = (_outside_pixels(*self._blocks[:3]),)
        return self._outside[0]

    @property
    def region(self) -> torch.Tensor | None:
        if self._region is None:
            self._region = _region_pixels(*self._blocks)
        return self._region[0]

    @property
    def count(self) -> int:
        if self._region is None:
            self._region = _region_pixels(*self._blocks)
        return self._region[1]


def _outside_pixels(indices: torch.Tensor, level: Level, span: BlockSpan | None) -> torch.Tensor | None:
    (eh, ew), (ph, pw), (rh, rw), (H, W) = level.extent, level.offset, level.region, level.map_size
    if span is not None and (span.by_min * rh - ph >= 0 and span.by_max * rh - ph + eh <= H
                             and span.bx_min * rw - pw >= 0 and span.bx_max * rw - pw + ew <= W):
        return None  # every block's halo lies inside the map
    vy = _axis_valid(indices[:, 1].long() * rh - ph, eh, H)
    vx = _axis_valid(indices[:, 2].long() * rw - pw, ew, W)
    return (~(vy[:, :, None] & vx[:, None, :])).reshape(-1).nonzero().flatten()


def region_mask(indices: torch.Tensor, level: Level, mask: torch.Tensor) -> torch.Tensor:
    """``[K, 1, R_h, R_w]``: the level's mask ``mask [N, 1, H_l, W_l]`` at each block's tile region (0 past the map):
    the pixels batch statistics count."""
    from detector.ops import sparse_gather

    bp = calc_block_params(*level.map_size, bsize=level.region, ksize=1, stride=1, padding=0)
    return sparse_gather(mask, indices, bp)


def _region_pixels(indices: torch.Tensor, level: Level, span: BlockSpan | None, mask: torch.Tensor
                   ) -> tuple[torch.Tensor | None, int]:
    on = region_mask(indices, level, mask).reshape(-1) > 0.5
    region = on.nonzero().flatten()
    if torch.compiler.is_compiling():
        return region, region.shape[0]
    count = int(region.shape[0])
    return (None if count == on.numel() else region), count


def level_masks(indices: torch.Tensor, level: Level, mask: torch.Tensor, span: BlockSpan | None = None
                ) -> LevelMasks:
    """Validity masks of the blocks at ``indices`` ([K, 3] rows n, by, bx) at ``level``, each built on first use;
    ``mask``: the unit's mask at the level's resolution (what batch statistics count).

    ``span`` (from :meth:`BlockSpan.of`) lets the common case - no block near the map border - skip
    building the outside pixels. Traced (torch.compile / torch.export) there is no span (it costs a host sync): both
    masks are built at once from the indices, whatever K, and ``count`` is the region's (symbolic) length.
    """
    if torch.compiler.is_compiling():
        return LevelMasks(_outside_pixels(indices, level, None), *_region_pixels(indices, level, None, mask))
    if int(indices.shape[0]) == 0:
        return LevelMasks(outside=None, region=None, count=0)
    return LevelMasks(blocks=(indices, level, BlockSpan.of(indices) if span is None else span, mask))


def zero_pixels(t: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the block pixels ``pixels`` (indices into ``K * h * w``, (k, row, column) order, as
    :attr:`LevelMasks.outside`) of every channel of ``t [K, C, h, w]``; returns ``t``."""
    k, c, h, w = t.shape
    if t.is_contiguous(memory_format=torch.channels_last):
        t.permute(0, 2, 3, 1).view(k * h * w, c).index_fill_(0, pixels, 0)
    else:
        hit = torch.zeros(k * h * w, dtype=torch.bool, device=t.device).index_fill_(0, pixels, True)
        t.masked_fill_(hit.view(k, 1, h, w), 0)
    return t
