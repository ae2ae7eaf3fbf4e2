"""A chain of conv-BN-ReLU layers (optionally residual) that runs dense, or sparse on active blocks.

:class:`SparseConvChain` is the engine behind the sparse residual units (:mod:`detector.nn.resnet`).
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
- **sparse** (a mask or precomputed :class:`ActiveBlocks`): the tiles whose output holds a pixel of ``M_out``
  (which therefore cover it), ONE ``sparse_gather`` of them with the halo of the whole chain's receptive field
  (:mod:`detector.nn.geometry`), every convolution with VALID padding on the blocks, BN and ReLU, and ONE
  ``sparse_scatter`` of the output tiles with the mask applied inside them. Any tile size gives the same output.

Correctness details that make the tiles equal the dense twin:

- after every intermediate layer that feeds a ``k > 1`` convolution, block pixels outside the level's
  map are zeroed (they are the dense twin's zero padding; BN/ReLU of a zero is not zero);
- batch-norm in training mode uses statistics over the mask's pixels of its level, inside the active tiles'
  regions (:mod:`detector.nn.norm`), which hold all of them; with an all-ones mask they are the dense statistics;
  running statistics are updated once per forward with them (not at all when no pixel is active).

The projection (1x1 conv, stride ``S``; BN in the post-activation form) is computed sparsely inside the blocks
from the tile's own pixels, so it costs nothing outside the active tiles.

Eval-mode BN that follows a convolution is folded into the convolution (weight * scale, bias = shift)
on both paths; the pre-activation unit's input BN is applied as an affine map. A training-mode BN
whose counted pixels are its whole blocks (no halo at that level, no block past the map border, the mask
covering the tiles) runs ``F.batch_norm`` itself - the same statistics, fused kernels.

Layout: the ops read and write NCHW and channels-last maps natively and the blocks take the map's
layout (channels-last is what oneDNN and cuDNN convolve fastest; :class:`~detector.nn.resnet.SparseResNet`
makes its input channels-last). An identity unit's gather and scatter are one fused pair
(:class:`detector.ops.ResidualBlocks`), ``x``'s gradient assembled in one map-sized pass. With ``inplace=True`` -
for an ``x`` the caller owns, e.g. the stage's own intermediates - the unit writes its tiles into ``x`` itself, in
training too (autograd records the in-place write), so its forward costs the blocks, not the map.

Pieces: :mod:`detector.nn.block_pass` (the chain on gathered blocks), :mod:`detector.nn.chunked` (several
chunks under a memory budget, exact statistics by passes), :mod:`detector.nn.norm` (statistics).
Memory: the active blocks are processed in chunks of at most ``memory_budget_mb`` of working tensors
(estimated as 3 x the largest level's ``C * e_h * e_w`` per block, plus the gathered input), so peak
transient memory does not grow with the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from detector.errors import ConfigError
from detector.ops import BlockParams, ResidualBlocks, reduce_mask, sparse_gather, sparse_scatter_
from detector.ops.blocks import pair
from detector.ops.formulas import keep_where, like_map

from .block_pass import BlockPass
from .chunked import run_chunked
from .geometry import (
    BlockSpan,
    ChainGeometry,
    ConvSpec,
    Level,
    LevelMasks,
    chain_geometry,
    level_masks,
    mask_at_stride,
)
from .norm import (
    list_batch_norm,
    needs_sync,
    running_scale_shift,
    sync_moments,
    update_running_stats,
    uses_batch_stats,
)

__all__ = ["ActiveBlocks", "Shortcut", "SparseConvChain", "zeros_in_layout"]

Shortcut = Literal["identity", "projection", "none"]


@dataclass(frozen=True, eq=False)
class ActiveBlocks:
    """Active blocks of a sparse layer: ``indices`` int32 ``[K, 3]`` (n, by, bx) on the ``block`` grid, and the
    unit's binary ``mask [N, 1, H, W]`` at its input resolution (what the unit computes: module docstring).

    The units of a stage share one ActiveBlocks (same indices, same geometry, same mask), and so share its level
    masks: :meth:`level_masks` builds each level's once (a host sync or two each) and keeps them."""

    indices: torch.Tensor
    block: BlockParams
    mask: torch.Tensor
    _masks: dict[Level, LevelMasks] = field(default_factory=dict, init=False, repr=False)
    _strided: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def count(self) -> int:
        return int(self.indices.shape[0])

    @cached_property
    def span(self) -> BlockSpan | None:
        """The blocks' row/column range (one host sync, once), None without blocks."""
        return BlockSpan.of(self.indices) if self.count else None

    def mask_at(self, r: int) -> torch.Tensor:
        """The mask at stride ``r`` from the unit's input (:func:`~detector.nn.geometry.mask_at_stride`), made once."""
        if r not in self._strided:
            self._strided[r] = mask_at_stride(self.mask, r)
        return self._strided[r]

    def level_masks(self, levels: Sequence[Level]) -> list[LevelMasks]:
        """:func:`~detector.nn.geometry.level_masks` of these blocks at each of ``levels``, built once per
        level (traced - torch.compile / torch.export - they are built each time, without a span)."""
        if torch.compiler.is_compiling():
            return [level_masks(self.indices, lv, self.mask_at(lv.stride)) for lv in levels]
        for lv in levels:
            if lv not in self._masks:
                self._masks[lv] = level_masks(self.indices, lv, self.mask_at(lv.stride), self.span)
        return [self._masks[lv] for lv in levels]


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
        memory_budget_mb: float = 1024.0,
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
        if memory_budget_mb <= 0:
            raise ConfigError(f"{name}: memory_budget_mb must be > 0, got {memory_budget_mb}")
        self.name = name
        self.in_channels = in_channels
        self.out_channels = channels[-1]
        self.stride = stride_total
        self.preact = preact
        self.shortcut = shortcut
        self.block_size = block_size
        self.tol = float(tol)
        self.memory_budget_mb = float(memory_budget_mb)
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
        # the level each BN slot normalizes (see BlockPass)
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
        dtype = mask.dtype if mask.is_floating_point() else torch.float32
        return (mask > self.tol).to(dtype)

    def active_blocks(self, mask: torch.Tensor) -> ActiveBlocks:
        """The active blocks of ``mask [N, 1, H, W]`` (input resolution) for this chain's geometry: the tiles whose
        output holds a pixel of the mask at the output resolution."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{self.name}: mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"{self.name}: mask must be [N, 1, H, W], got {tuple(mask.shape)}")
        geo = self.geometry(int(mask.shape[2]), int(mask.shape[3]))
        m = self.binary(mask)
        m_out = mask_at_stride(m, self.stride)
        blocks = ActiveBlocks(indices=reduce_mask(m_out, geo.select, tol=0.5), block=geo.block, mask=m)
        blocks._strided[self.stride] = m_out  # made here already: the scatter's mask
        return blocks

    def block_bytes(self, geo: ChainGeometry, itemsize: int) -> int:
        """Estimated working memory of one block: the gathered input plus 3 x the largest level."""
        chans = [self.in_channels] + [c.out_channels for c in self.convs]
        areas = [lv.extent[0] * lv.extent[1] for lv in geo.levels]
        largest = max(c * a for c, a in zip(chans, areas, strict=True))
        return itemsize * (chans[0] * areas[0] + 3 * largest)

    def chunk_blocks(self, geo: ChainGeometry, itemsize: int) -> int:
        """Blocks per chunk under the memory budget (at least 1)."""
        return max(1, int(self.memory_budget_mb * 2**20) // self.block_bytes(geo, itemsize))

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
        s, t = running_scale_shift(bn)
        return F.conv2d(a, conv.weight * s.view(-1, 1, 1, 1), t, stride, conv.padding)

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

    # ----------------------------------------------------------------------------------- sparse
    def forward_sparse(self, x: torch.Tensor, blocks: ActiveBlocks, inplace: bool = False) -> torch.Tensor:
        """The sparse path on precomputed active blocks (see the module docstring for semantics).

        ``inplace`` lets an identity-shortcut unit write its tiles into ``x`` itself instead of a copy of it
        (honoured when the blocks fit in one chunk; under autograd too, where ``x`` must not be a leaf that
        requires grad). The blocks are all gathered before anything is written, so the result is the same.
        The caller must own ``x`` (it is returned, modified).
        """
        H, W = int(x.shape[2]), int(x.shape[3])
        geo = self.geometry(H, W)
        if not isinstance(blocks, ActiveBlocks):
            raise TypeError(f"{self.name}: blocks must be ActiveBlocks, got {type(blocks).__name__}")
        if blocks.block != geo.block:
            raise ValueError(
                f"{self.name}: blocks were reduced for another geometry ({blocks.block}); "
                f"this unit needs {geo.block} (same block size and input map)"
            )
        idx = blocks.indices
        N, (Ho, Wo) = x.shape[0], geo.block.out_size
        identity = self.shortcut == "identity"
        base = x if identity else zeros_in_layout(x, (N, self.out_channels, Ho, Wo))
        # Traced (torch.compile / torch.export): K is a symbol, so no host sync on it - no K == 0 branch (the
        # ops take K = 0), one chunk (the memory budget is not applied), the level masks built without a span.
        traced = torch.compiler.is_compiling()
        if not traced and blocks.count == 0:
            tie = self._sync_empty()
            return base if tie is None else base + tie
        m_out = blocks.mask_at(self.stride)
        chunk = self.chunk_blocks(geo, x.element_size())
        idx_chunks = [idx] if traced else [idx[s : s + chunk] for s in range(0, blocks.count, chunk)]
        if len(idx_chunks) > 1:
            masks = []
            for ic in idx_chunks:
                part = ActiveBlocks(ic, geo.block, blocks.mask)
                part._strided.update(blocks._strided)
                masks.append(part.level_masks(geo.levels))
            return run_chunked(self, x, base, idx, idx_chunks, masks, geo, m_out, add=identity and self.preact)
        masks = [blocks.level_masks(geo.levels)]  # shared with the stage's other units on the same blocks
        keep = sparse_gather(m_out, idx, geo.select) > 0.5  # [K, 1, T_h, T_w]: the tiles' pixels the unit computes

        known = [None] * len(self.slots)
        if identity:  # one gather, the tiles combined into x (or a copy)
            residual = ResidualBlocks(x, idx, geo.block, inplace=inplace and not (x.is_leaf and x.requires_grad))
            xb = residual.gather()
            if self.preact:  # x + tile where the mask is set
                z, new = BlockPass(self, geo, masks[0], known, collect=False).run(xb)
                out = residual.scatter(like_map(keep_where(keep, z, 0), x), relu=False)
            else:  # relu(x + tile) where the mask is set, x elsewhere: the tiles overwrite
                b, new = BlockPass(self, geo, masks[0], known, collect=False).run(xb, skip_identity=True)
                (p0h, p0w), (th, tw) = geo.levels[0].offset, geo.tile
                xt = xb[:, :, p0h : p0h + th, p0w : p0w + tw]
                inplace_ok = not torch.is_grad_enabled() and b.dtype == xt.dtype  # (autocast: b may be narrower)
                b = b.add_(xt).relu_() if inplace_ok else torch.relu(xt + b)
                out = residual.scatter(like_map(keep_where(keep, b, xt), x), relu=False, add=False)
        else:  # tiles written into a fresh zero map
            tiles, new = BlockPass(self, geo, masks[0], known, collect=False).run(sparse_gather(x, idx, geo.block))
            out = sparse_scatter_(like_map(keep_where(keep, tiles, 0), base), idx, base, geo.block, add=False)
        for j, m in new.items():
            update_running_stats(self.slots[j], m)
        return out

    def _sync_empty(self) -> torch.Tensor | None:
        """A process with no active block still takes part in every statistics all-reduce the others
        make (DDP with synchronized BN), in their order: the post-activation projection's BN, then the
        chain's BNs; its running statistics are updated with the global moments like the others'.
        Returns a zero that depends on those all-reduces (None without any), for the caller to add to its
        output, so that backward takes part in the gradients' all-reduces too."""
        slots = self.slots
        order = ([len(self.bns)] if self.proj_bn is not None and not self.preact else []) + list(range(len(self.bns)))
        like = self.convs[0].weight.detach()
        tie = None
        for j in order:
            if needs_sync(slots[j]):
                m = sync_moments(slots[j], None, like)
                update_running_stats(slots[j], m)
                z = (m.mean.sum() + m.var.sum()) * 0.0
                tie = z if tie is None else tie + z
        if tie is not None and torch.is_grad_enabled():  # zero gradients for DDP's reducer (no unused parameter)
            tie = tie + sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        return tie

    # ---------------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        blocks: ActiveBlocks | None = None,
        inplace: bool = False,
        dense: bool = False,
    ) -> torch.Tensor:
        """The unit's function of ``x`` and its mask (module docstring): ``mask`` at the input resolution, or
        ``blocks`` made from it; neither: the ordinary dense network. Executed sparse on the active blocks, or on
        the whole map with ``dense=True`` - the same values.

        ``inplace``: see :meth:`forward_sparse` (ignored on the dense path).
        """
        x = self._check_x(x)
        if blocks is None and mask is None:
            return self.forward_dense(x)
        if blocks is None:
            if mask.dim() == 4 and (
                mask.shape[0] != x.shape[0] or tuple(mask.shape[2:]) != tuple(x.shape[2:])
            ):
                raise ValueError(
                    f"{self.name}: mask must be [N, 1, H, W] matching x {tuple(x.shape)}, "
                    f"got {tuple(mask.shape)}"
                )
        if dense:
            return self.forward_dense(x, blocks.mask if blocks is not None else self.binary(mask))
        return self.forward_sparse(x, blocks if blocks is not None else self.active_blocks(mask), inplace=inplace)
