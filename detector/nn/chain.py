"""A chain of conv-BN-ReLU layers (optionally residual) that runs dense, or sparse on a list of active blocks.

:class:`SparseConvChain` is the engine behind every sparse unit (:mod:`detector.nn.resnet`, the neck, the head).
The same parameters (same ``state_dict``) run either way.

**The mask defines the function.** Given a binary mask ``M`` at the input resolution (``mask > tol``) and
``M_out`` at the output's (max-pooled by the chain's stride, ceil mode), the chain computes, per pixel,

- identity shortcut (stride 1, same channels): ``where(M_out, unit(x), x)``;
- projection shortcut (stride 2 or a channel change) or no shortcut: ``where(M_out, unit(x), 0)``,

where ``unit`` is the dense twin (convolutions with zero padding ``(k - 1) // 2``, BN, ReLU). A batch norm in
training mode normalizes with the batch statistics of its level's mask pixels (``M`` max-pooled by the level's
stride; all pixels when there is no mask), so ``unit(x)`` at a pixel depends on ``x`` and the mask only.
How it is executed changes the time, never the values:

- **dense** (``dense=True`` or no mask): the whole map, then the mask applied (no mask: the ordinary network);
- **sparse**: on a :class:`~detector.ops.capacity.BlockList` of the tiles whose output holds a pixel of ``M_out``
  (:func:`chain_list`; which therefore cover it), read from the map with the halo of the whole chain's receptive
  field (:mod:`detector.nn.geometry`), every convolution with VALID padding on the blocks, BN and ReLU, and the
  output tiles written with the mask applied inside them (:func:`chain_capacity`). Any tile size gives the same
  output. The list holds exactly the active blocks (:func:`chain_list` without a capacity: ``reduce_mask``'s
  data-dependent count, what ``torch.export`` sees as a dynamic dimension), or a fixed number of rows with the count
  on the device (a bucket, for CUDA graphs: :mod:`detector.nn.capacity`); padding rows are inert.

Correctness details that make the tiles equal the dense twin:

- after every intermediate layer that feeds a ``k > 1`` convolution, block pixels outside the level's
  map are zeroed (they are the dense twin's zero padding; BN/ReLU of a zero is not zero);
- batch-norm in training mode uses statistics over the mask's pixels of its level, inside the active tiles'
  regions (:mod:`detector.nn.norm`), which hold all of them; with an all-ones mask they are the dense statistics;
  running statistics are updated once per forward with them (not at all when no pixel is active).

The projection (1x1 conv, stride ``S``; BN in the post-activation form) is computed sparsely inside the blocks
from the tile's own pixels, so it costs nothing outside the active tiles.

Eval-mode BN that follows a convolution is folded into the convolution (weight * scale, bias = shift);
the pre-activation unit's input BN is applied as an affine map. Each convolution with its folded BN is one
fused op (:mod:`detector.ops.fused`: the gather fused into the first, the residual and the scatter into the last;
on the CPU their composition of the compiled gather/scatter kernels and oneDNN's convolutions).

Layout: the ops read and write NCHW and channels-last maps natively and the blocks take the map's
layout (channels-last is what oneDNN and cuDNN convolve fastest; :class:`~detector.nn.resnet.SparseResNet`
makes its input channels-last). With ``inplace=True`` - for an ``x`` the caller owns, e.g. the stage's own
intermediates - an identity unit writes its tiles into ``x`` itself. Under autograd every write is recorded in
place and what the backward keeps is block-sized: the gathered blocks, the batch norms' inputs, the written tiles
(never a map: the gather's and the scatter's gradients need the indices only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from detector.ops import reduce_mask, sparse_gather
from detector.ops.blocks import pair
from detector.ops.capacity import (
    BlockList,
    gather_windows,
    level_valid,
    reduce_mask_capacity,
    scatter_padded,
    uses_buckets,
)
from detector.ops.formulas import keep_where, memory_format_of
from detector.ops.fused import conv_blocks, conv_scatter

from .geometry import (
    ChainGeometry,
    ConvSpec,
    Level,
    LevelMasks,
    binary_mask,
    chain_geometry,
    level_masks,
    mask_at_stride,
    zero_pixels,
)
from .norm import (
    blocks_batch_norm,
    fold,
    list_batch_norm,
    list_moments,
    needs_sync,
    normalize,
    region_moments,
    running_scale_shift,
    sync_moments,
    update_running_stats,
    uses_batch_stats,
)

__all__ = ["Shortcut", "SparseConvChain", "zeros_in_layout", "chain_list", "chain_capacity", "region_weights",
           "conv_on_support"]

Shortcut = Literal["identity", "projection", "none"]


def zeros_in_layout(x: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Zeros of ``shape`` in ``x``'s memory layout (channels-last if ``x`` is)."""
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    # allocated in that layout (one fill), not zeros converted to it (a permuting copy of a map of zeros)
    return torch.empty(shape, dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last if nhwc else torch.contiguous_format).zero_()

class SparseConvChain(nn.Module):
    """Convolutions ``conv_i`` (``ksizes[i]``, ``strides[i]``, padding ``(k - 1) // 2``, no bias), each
    with a BatchNorm2d and ReLU, optionally with a residual shortcut; dense or sparse (module docstring).

    Post-activation (``preact=False``, ResNet v1)::

        a = x;  a = relu(bn_i(conv_i(a))) for i < L-1;  b = bn_{L-1}(conv_{L-1}(a))
        out = relu(b + shortcut)      shortcut: x | proj_bn(proj(x)) | 0

    Pre-activation (``preact=True``, ResNet v2)::

        a0 = relu(bn_0(x));  a = a0;  a = relu(bn_{i+1}(conv_i(a))) for i < L-1;  z = conv_{L-1}(a)
        out = z + shortcut            shortcut: x | proj(a0) | 0

    ``block_size`` is the output tile (pixels per side, int or pair); the gathered block is larger by
    the chain's halo. Sparse inputs: ``mask [N, 1, H, W]`` at the input resolution, binary at ``tol``
    (``mask > tol``): the unit computes where it is set (module docstring); a tile is active if its output
    holds a pixel of the mask at the output resolution.
    """

    def __init__(
        self,
        in_channels: int,
        channels: Sequence[int],
        ksizes: Sequence[int],
        strides: Sequence[int],
        *,
        preact: bool = False,
        shortcut: Shortcut = "none",
        block_size: int | tuple[int, int] = 16,
        tol: float = 0.5,
        name: str = "SparseConvChain",
    ) -> None:
        super().__init__()
        if not (len(channels) == len(ksizes) == len(strides) >= 1):
            raise ValueError(f"{name}: channels, ksizes and strides must have the same length >= 1")
        if shortcut not in ("identity", "projection", "none"):
            raise ValueError(f"{name}: shortcut must be 'identity', 'projection' or 'none', got {shortcut!r}")
        for k in ksizes:
            if k < 1 or k % 2 != 1:
                raise ValueError(f"{name}: kernel sizes must be odd and >= 1, got {list(ksizes)}")
        stride_total = 1
        for s in strides:
            if s < 1:
                raise ValueError(f"{name}: strides must be >= 1, got {list(strides)}")
            stride_total *= s
        if shortcut == "identity" and (stride_total != 1 or channels[-1] != in_channels):
            raise ValueError(
                f"{name}: an identity shortcut needs stride 1 and out_channels == in_channels "
                f"(got stride {stride_total}, {in_channels} -> {channels[-1]}); use shortcut='projection'"
            )
        self.name = name
        self.in_channels = in_channels
        self.out_channels = channels[-1]
        self.stride = stride_total
        self.preact = preact
        self.shortcut = shortcut
        self.block_size = block_size
        self.tol = float(tol)
        self.specs = tuple(ConvSpec(k, s, (k - 1) // 2) for k, s in zip(ksizes, strides, strict=True))
        ins = [in_channels, *channels[:-1]]
        self.convs = nn.ModuleList(
            nn.Conv2d(ci, co, k, stride=s, padding=(k - 1) // 2, bias=False)
            for ci, co, k, s in zip(ins, channels, ksizes, strides, strict=True)
        )
        # BN slots: post-activation normalizes each conv's output (level i + 1), pre-activation each
        # conv's input (level i). The post-activation projection's BN is the last slot (output level).
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for c in (ins if preact else channels))
        self.proj: nn.Conv2d | None = None
        self.proj_bn: nn.BatchNorm2d | None = None
        if shortcut == "projection":
            self.proj = nn.Conv2d(in_channels, channels[-1], 1, stride=stride_total, bias=False)
            if not preact:
                self.proj_bn = nn.BatchNorm2d(channels[-1])
        L = len(self.specs)
        # the level each BN slot normalizes
        self.slot_levels = tuple(range(L)) if preact else tuple(range(1, L + 1))
        if self.proj_bn is not None:
            self.slot_levels += (L,)
        self._geometry_cache: dict[tuple[int, int, tuple[int, int]], ChainGeometry] = {}

    def extra_repr(self) -> str:
        convs = ", ".join(f"{s.ksize}x{s.ksize}/{s.stride}" for s in self.specs)
        return (f"{self.name}: {self.in_channels} -> {self.out_channels}, convs [{convs}], shortcut={self.shortcut}, "
                f"preact={self.preact}, block_size={self.block_size}, tol={self.tol}")

    # ---------------------------------------------------------------------------------- helpers
    @property
    def slots(self) -> list[nn.BatchNorm2d]:
        """The BN slots: the chain's BNs, then the post-activation projection's BN (if any)."""
        return list(self.bns) + ([self.proj_bn] if self.proj_bn is not None else [])

    def geometry(self, H: int, W: int, tile: int | tuple[int, int] | None = None) -> ChainGeometry:
        """The chain's block geometry on an ``H x W`` input with output tiles of ``tile`` (None: its block size),
        cached: the plan asks for every candidate tile of every chain on every batch."""
        try:
            key = (H, W, pair(self.block_size if tile is None else tile, "block_size"))
            geo = self._geometry_cache.get(key)
            if geo is None:
                geo = self._geometry_cache[key] = chain_geometry(H, W, self.specs, key[2])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        return geo

    def _check_x(self, x: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"{self.name}: x must be [N, {self.in_channels}, H, W], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{self.name}: x must be a floating-point tensor, got {x.dtype}")
        return x

    def binary(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` made the unit's binary mask: 1 where it exceeds ``tol``, else 0 (float)."""
        return binary_mask(mask, self.tol)

    def active_blocks(self, mask: torch.Tensor, capacity: int | None = None) -> BlockList:
        """The block list of ``mask [N, 1, H, W]`` (input resolution) at the chain's block size
        (:func:`chain_list`): the tiles whose output holds a pixel of the mask at the output resolution."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{self.name}: mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"{self.name}: mask must be [N, 1, H, W], got {tuple(mask.shape)}")
        return chain_list(self, mask, pair(self.block_size, "block_size"), capacity)

    # ------------------------------------------------------------------------------------ dense
    def _subsample(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` at the projection's stride: a 1x1 stride-S convolution is the 1x1 convolution of every S-th
        pixel (what the sparse path computes too). Run that way because torch 2.13's CPU backward of a 1x1
        stride-2 convolution on a channels-last map crashes (heap corruption); see tests/nn/test_units.py."""
        S = self.stride
        return x if S == 1 else x[:, :, ::S, ::S]

    def _conv_bn_dense(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, a: torch.Tensor, stride: int | None = None,
                       m: torch.Tensor | None = None) -> torch.Tensor:
        stride = conv.stride if stride is None else stride
        if uses_batch_stats(bn):
            return self._norm_dense(bn, F.conv2d(a, conv.weight, conv.bias, stride, conv.padding), m)
        w, t = fold(conv.weight, bn)
        return F.conv2d(a, w, t, stride, conv.padding)

    @staticmethod
    def _norm_dense(bn: nn.BatchNorm2d, z: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """``bn`` on a whole map: with the batch statistics of the mask's pixels ``m`` (its level's), or of every
        pixel without one (``nn.BatchNorm2d`` itself); running statistics updated with them."""
        if m is None or not uses_batch_stats(bn):
            return bn(z)
        y, moments = list_batch_norm(bn, z, m)
        update_running_stats(bn, moments)
        return y

    def level_strides(self) -> list[int]:
        """Each level's stride from the chain's input (input, after conv_0, ..., output)."""
        out = [1]
        for spec in self.specs:
            out.append(out[-1] * spec.stride)
        return out

    def forward_dense(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The dense twin on the whole map; with a ``mask`` (binary, input resolution) the unit's masked function
        (module docstring): batch statistics of each level's mask pixels, the output where the mask is set."""
        convs, bns, L = self.convs, self.bns, len(self.convs)
        ms: list[torch.Tensor | None] = [None] * (L + 1)
        if mask is not None:
            strided: dict[int, torch.Tensor] = {}
            for i, r in enumerate(self.level_strides()):
                ms[i] = strided[r] = strided[r] if r in strided else mask_at_stride(mask, r)
        slot_mask = [ms[lv] for lv in self.slot_levels]
        if self.preact:
            a0 = F.relu_(self._norm_dense(bns[0], x, slot_mask[0]))
            a = a0
            for i in range(L - 1):
                a = F.relu_(self._conv_bn_dense(convs[i], bns[i + 1], a, m=slot_mask[i + 1]))
            y = convs[L - 1](a)
            if self.shortcut == "identity":
                y = y + x
            elif self.shortcut == "projection":
                y = y + F.conv2d(self._subsample(a0), self.proj.weight)
        else:
            a = x
            for i in range(L - 1):
                a = F.relu_(self._conv_bn_dense(convs[i], bns[i], a, m=slot_mask[i]))
            y = self._conv_bn_dense(convs[L - 1], bns[L - 1], a, m=slot_mask[L - 1])
            if self.shortcut == "identity":
                y = y + x
            elif self.shortcut == "projection":
                y = y + self._conv_bn_dense(self.proj, self.proj_bn, self._subsample(x), stride=1, m=slot_mask[-1])
            y = F.relu_(y)
        if mask is None:
            return y
        return keep_where(ms[L] > 0.5, y, x if self.shortcut == "identity" else 0)

    # ---------------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        blocks: BlockList | None = None,
        inplace: bool = False,
        dense: bool = False,
    ) -> torch.Tensor:
        """The unit's function of ``x`` and its ``mask`` (input resolution; module docstring); no mask: the ordinary
        dense network. Executed sparse on ``blocks`` (made from the mask by :meth:`active_blocks`, at the chain's
        block size, when not given), or on the whole map with ``dense=True`` - the same values.

        ``inplace``: an identity unit writes its tiles into ``x`` itself (the caller owns ``x`` and reads it no more).
        """
        x = self._check_x(x)
        if mask is None:
            if blocks is not None:
                raise ValueError(f"{self.name}: blocks need the mask they were made from")
            return self.forward_dense(x)
        if mask.dim() != 4 or mask.shape[0] != x.shape[0] or tuple(mask.shape[2:]) != tuple(x.shape[2:]):
            raise ValueError(
                f"{self.name}: mask must be [N, 1, H, W] matching x {tuple(x.shape)}, got {tuple(mask.shape)}"
            )
        m = self.binary(mask)
        if dense:
            return self.forward_dense(x, m)
        if blocks is None:
            blocks = self.active_blocks(m)
        return chain_capacity(self, x, blocks, m, inplace=inplace, tile=blocks.block.obsize)


# a full list's level masks, shared by the units that run on it (a stage's second and later units): (mask, per level)
_LEVEL_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _ListNorm:
    """The BN slots of ``chain`` on ``blist``'s blocks: folded into the convolutions (running statistics), or -
    a slot in training mode - applied with the batch moments of the level's mask pixels in the active rows' tile
    regions, its running statistics updated as nn.BatchNorm2d updates them. ``mask``: the unit's binary mask at its
    input resolution.

    A list of bucket rows (CUDA: padding rows past the count) takes :func:`~detector.nn.norm.list_batch_norm`
    (padding rows excluded, no host read). A list whose every row is an active block (off CUDA, where the rows are
    the count: :func:`~detector.ops.capacity.uses_buckets`) takes the blocks' own kernels
    (:func:`~detector.nn.norm.blocks_batch_norm`: nn.BatchNorm2d's, or the region sums' with a written-out
    backward) and zeroes the pixels past the map in place - the same values in fewer passes."""

    def __init__(self, chain: SparseConvChain, blist: BlockList, geo: ChainGeometry, mask: torch.Tensor) -> None:
        self.chain, self.blist, self.geo, self.mask = chain, blist, geo, mask
        self.slots = chain.slots
        self._inside: dict[Level, torch.Tensor] = {}
        # every row an active block: known without a sync only where the count is read anyway (off CUDA)
        self.full = (any(map(uses_batch_stats, self.slots)) and not uses_buckets(blist.indices.device)
                     and int(blist.count) == blist.capacity > 0)

    def batch(self, j: int | None) -> bool:
        return j is not None and uses_batch_stats(self.slots[j])

    def folded(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias of conv ``i`` with its output's BN (running statistics) folded in (none on a
        pre-activation unit's last conv)."""
        w, j = self.chain.convs[i].weight, _out_slot(self.chain, i)
        return (w, None) if j is None else fold(w, self.slots[j])

    def inside(self, level: Level) -> torch.Tensor:
        """bool ``[capacity, 1, e_h, e_w]``: the block pixels of ``level`` inside its map (made once per level)."""
        if level not in self._inside:
            self._inside[level] = level_valid(self.blist.indices, level.region, level.offset, level.extent,
                                              level.map_size)
        return self._inside[level]

    def level_masks(self, level: Level) -> LevelMasks:
        """The blocks' pixels past ``level``'s map and the region pixels its statistics count (a full list only;
        made once per list, mask and level: the units of a stage share them)."""
        shared = _LEVEL_MASKS.get(self.blist)
        if shared is None or shared[0] is not self.mask:
            shared = _LEVEL_MASKS[self.blist] = (self.mask, {})
        if level not in shared[1]:
            shared[1][level] = level_masks(self.blist.indices, level, mask_at_stride(self.mask, level.stride))
        return shared[1][level]

    def __call__(self, j: int, z: torch.Tensor) -> torch.Tensor:
        """Slot ``j`` (training mode) on the blocks ``z`` of its level."""
        lv, bn = self.geo.levels[self.chain.slot_levels[j]], self.slots[j]
        if needs_sync(bn):  # DDP: the moments of every process's pixels, one differentiable all-reduce per slot
            return self._synchronized(bn, z, lv)
        if self.full and self.level_masks(lv).count > 0:
            y, m = blocks_batch_norm(bn, z, lv, self.level_masks(lv))
        else:
            y, m = list_batch_norm(bn, z, region_weights(self.blist, lv, mask_at_stride(self.mask, lv.stride)))
        if m is not None:  # else nn.BatchNorm2d's kernel updated the running statistics itself
            update_running_stats(bn, m)
        return y

    def _synchronized(self, bn: torch.nn.SyncBatchNorm, z: torch.Tensor, lv: Level) -> torch.Tensor:
        """Slot ``bn`` with the moments of the union of every process's counted pixels (a process without any still
        takes part: every process issues the same collectives, slot by slot)."""
        if self.full:
            lm = self.level_masks(lv)
            local = region_moments(z, lv, lm) if lm.count > 0 else None
        else:
            local = list_moments(z, region_weights(self.blist, lv, mask_at_stride(self.mask, lv.stride)))
        m = sync_moments(bn, local, z)
        update_running_stats(bn, m)
        return normalize(bn, z, m)

    def relu_zero(self, a: torch.Tensor, level: Level) -> torch.Tensor:
        """ReLU, block pixels outside ``level``'s map zeroed (the dense twin's padding for the next convolution);
        in place on a full list (``a`` is a batch norm's output, which its backward does not read)."""
        if not self.full:
            return torch.where(self.inside(level), torch.relu(a), 0)
        outside = self.level_masks(level).outside
        if outside is not None:
            zero_pixels(a, outside)
        return torch.relu_(a)


def _out_slot(chain: SparseConvChain, i: int) -> int | None:
    """The BN slot that normalizes conv ``i``'s output (None: a pre-activation unit's last conv)."""
    j = i + 1 if chain.preact else i
    return j if j < len(chain.bns) else None


def region_weights(blist: BlockList, level: Level, mask: torch.Tensor) -> torch.Tensor:
    """bool ``[capacity, 1, e_h, e_w]``: the pixels of ``level``'s blocks that its batch statistics count - the pixels
    of the level's mask ``mask`` (in the map) in the active rows' tile regions (block pixels ``offset ... offset +
    region``)."""
    (eh, ew), (ph, pw), (rh, rw) = level.extent, level.offset, level.region
    dev = blist.indices.device
    ry = (torch.arange(eh, device=dev) >= ph) & (torch.arange(eh, device=dev) < ph + rh)
    rx = (torch.arange(ew, device=dev) >= pw) & (torch.arange(ew, device=dev) < pw + rw)
    on = gather_windows(mask, blist.indices, level.extent, (level.region, level.offset)) > 0.5
    return on & (ry[:, None] & rx[None, :]) & blist.valid.view(-1, 1, 1, 1)


def chain_capacity(chain: SparseConvChain, x: torch.Tensor, blist: BlockList, mask: torch.Tensor,
                   inplace: bool = False, tile: int | None = None) -> torch.Tensor:
    """The chain on ``blist`` (module docstring; made by :func:`chain_list` from ``mask``, the unit's binary mask at
    its input resolution) with output tiles of ``tile`` (None: the chain's block size); ``inplace``: an identity
    unit writes into ``x`` itself (recorded under autograd: the caller owns ``x`` and reads it no more).

    Running statistics: each conv, its BN folded in, is one fused op. Training-mode batch norm: the convolution
    unfused, the BN on its blocks with the list's batch moments (:class:`_ListNorm`), then ReLU and the level's
    zeroing; a post-activation unit's last BN before the shortcut's add and the scatter."""
    geo = chain.geometry(int(x.shape[2]), int(x.shape[3]), tile)
    if blist.block != geo.block:
        raise ValueError(f"{chain.name}: the block list was made for another geometry ({blist.block}); "
                         f"this unit needs {geo.block}")
    norm = _ListNorm(chain, blist, geo, mask)
    lv, specs, L = geo.levels, chain.specs, len(chain.convs)
    T = geo.tile
    origin0 = (lv[0].region, lv[0].offset)
    src, origin, pre, a0 = x, origin0, None, None  # the first conv's source: the map (gather fused) or blocks
    if chain.preact and norm.batch(0):
        a0 = norm.relu_zero(norm(0, sparse_gather(x, blist.indices, geo.block)), lv[0])
        src, origin = a0, None
    elif chain.preact:
        pre = running_scale_shift(chain.bns[0])

    def conv(i: int, a: torch.Tensor, **kw) -> torch.Tensor:  # noqa: ANN003
        first = i == 0 and origin is not None
        return conv_blocks(a, blist, *kw.pop("wb"), stride=specs[i].stride, origin=origin if first else None,
                           extent=lv[0].extent if first else None, pre=pre if i == 0 else None, **kw)

    a = src
    for i in range(L - 1):
        j = _out_slot(chain, i)
        if norm.batch(j):
            a = norm.relu_zero(norm(j, conv(i, a, wb=(chain.convs[i].weight, None))), lv[i + 1])
        else:
            a = conv(i, a, wb=norm.folded(i), relu=True,
                     zero=(lv[i + 1].region, lv[i + 1].offset, lv[i + 1].map_size))
    if L == 1 and origin is not None and not norm.batch(_out_slot(chain, 0)):
        # the source blocks themselves (a 1-conv chain: no fused first convolution to gather them)
        c = a.shape[1]
        eye = torch.eye(c, dtype=a.dtype, device=a.device).view(c, c, 1, 1)
        a = conv_blocks(a, blist, eye, None, origin=origin0, extent=lv[0].extent, pre=pre,
                        zero=None if pre is None else (lv[0].region, lv[0].offset, lv[0].map_size))
    post = not chain.preact
    N, (Ho, Wo) = x.shape[0], geo.block.out_size
    residual = None
    if chain.shortcut == "projection":
        residual = _projection(chain, norm, x, a0, blist, geo, pre)
    # the output map: x itself (an identity unit, in place), a copy of x, or fresh zeros; the tiles are written into
    # it in place (recorded under autograd: nothing a backward reads is map-sized)
    if chain.shortcut == "identity":
        base = x if inplace else x.clone(memory_format=memory_format_of(x) or torch.contiguous_format)
    else:
        base = zeros_in_layout(x, (N, chain.out_channels, Ho, Wo))
    add = "map" if chain.shortcut == "identity" else residual
    j = _out_slot(chain, L - 1)
    if not norm.batch(j):
        return conv_scatter(a, blist, *norm.folded(L - 1), base, tile=T, residual=add, relu=post,
                            zeros=chain.shortcut != "identity")
    t = norm(j, conv(L - 1, a, wb=(chain.convs[L - 1].weight, None)))  # post-activation: relu(bn(conv) + shortcut)
    if residual is not None:
        t = t + residual
    return scatter_padded(t, blist, base, add=chain.shortcut == "identity", relu=True, inplace=True,
                          zeros=chain.shortcut != "identity")


def _projection(chain: SparseConvChain, norm: _ListNorm, x: torch.Tensor, a0: torch.Tensor | None,
                blist: BlockList, geo: ChainGeometry, pre: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The projection shortcut's tiles ``[capacity, CO, T_h, T_w]``: the 1x1 stride-S convolution of the tile's
    own input pixels (the pre-activation's ``a0``), its BN (post-activation) folded or with batch moments."""
    T, S = geo.tile, chain.stride
    js = len(chain.bns) if chain.proj_bn is not None else None
    pw, pb = chain.proj.weight, None
    if js is not None and not norm.batch(js):
        pw, pb = fold(pw, chain.proj_bn)
    if a0 is not None:  # the pre-activation's blocks: the tile's pixels at stride S
        (ph, pw0) = geo.levels[0].offset
        r = conv_blocks(a0[:, :, ph : ph + S * T[0] : S, pw0 : pw0 + S * T[1] : S], blist, pw, pb)
    else:
        r = conv_blocks(x, blist, pw, pb, stride=S, origin=((T[0] * S, T[1] * S), (0, 0)),
                        extent=((T[0] - 1) * S + 1, (T[1] - 1) * S + 1), pre=pre)
    return norm(js, r) if norm.batch(js) else r




def chain_list(chain: SparseConvChain, mask: torch.Tensor, tile: int | tuple[int, int],
               capacity: int | None = None) -> BlockList:
    """The block list of ``chain`` at ``tile`` on ``mask`` (its input resolution, binary at the chain's ``tol``): the
    tiles whose output holds a pixel of the mask at the output resolution (the list's ``mask``, where its tiles are
    written). ``capacity`` rows (the count on the device, no host read), or None: exactly the active blocks
    (``reduce_mask``: its count is data-dependent - a host read eagerly, a dynamic dimension under ``torch.export``)."""
    geo = chain.geometry(int(mask.shape[2]), int(mask.shape[3]), tile)
    m_out = mask_at_stride(chain.binary(mask), chain.stride)
    if capacity is None:
        idx = reduce_mask(m_out, geo.select, tol=0.5)
        return BlockList(indices=idx, count=(idx[:, 0] >= 0).sum(), block=geo.block, mask=m_out)
    return replace(reduce_mask_capacity(m_out, geo.select, int(capacity)), block=geo.block, mask=m_out)


def conv_on_support(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, support: torch.Tensor,
                    tile: int = 16) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=k // 2)`` (stride 1, odd ``k``) of a map ``x`` that is zero outside
    ``support`` (``[N, 1, H, W]``, set where > 0.5: a sparse unit's output and its mask), the same values computed
    where they can differ from the bias: on the output tiles the support reaches (the kernel's radius around it),
    gathered with the kernel's halo, and the bias elsewhere. Differentiable; under ``torch.export`` the tiles' count is
    a dynamic dimension, as for :func:`chain_list`."""
    k = int(weight.shape[-1])
    if k % 2 != 1 or int(weight.shape[-2]) != k:
        raise ValueError(f"conv_on_support: a square kernel of odd size, got {tuple(weight.shape[-2:])}")
    N, (H, W), r = x.shape[0], (int(x.shape[2]), int(x.shape[3])), k // 2
    dev = x.device.type
    if torch.is_autocast_enabled(dev):  # as F.conv2d under autocast: in the autocast dtype
        x = x.to(torch.get_autocast_dtype(dev))
    geo = chain_geometry(H, W, (ConvSpec(k, 1, r),), (tile, tile))
    reach = F.max_pool2d(support, k, 1, r) if r else support
    idx = reduce_mask(reach.to(x.dtype), geo.select, tol=0.5)
    blist = BlockList(indices=idx, count=(idx[:, 0] >= 0).sum(), block=geo.block)
    lv = geo.levels[0]
    tiles = conv_blocks(x, blist, weight, bias, origin=(lv.region, lv.offset), extent=lv.extent)
    out = torch.empty((N, int(weight.shape[0]), H, W), dtype=tiles.dtype, device=x.device,
                      memory_format=memory_format_of(x) or torch.contiguous_format)
    out.copy_(bias.to(tiles.dtype).view(1, -1, 1, 1).expand_as(out))
    return scatter_padded(tiles, blist, out, add=False, relu=False, inplace=True)
