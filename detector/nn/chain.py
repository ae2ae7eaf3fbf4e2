"""A chain of conv-BN-ReLU layers (optionally residual) that runs dense, or sparse on active blocks.

:class:`SparseConvChain` is the engine behind the sparse residual units (:mod:`detector.nn.resnet`).
The same parameters (same ``state_dict``) run either way:

- **dense** (no mask): the ordinary network, convolutions with zero padding ``(k - 1) // 2``;
- **sparse** (a mask or precomputed :class:`ActiveBlocks`): ONE ``sparse_gather`` of the active blocks
  with the halo of the whole chain's receptive field (:mod:`detector.nn.geometry`), every convolution
  with VALID padding on the blocks, BN and ReLU, and ONE ``sparse_scatter`` of the output tiles.

Sparse semantics, per active output tile (exactly the dense twin's values there, up to float
rounding), and elsewhere:

- residual, identity shortcut (stride 1, same channels): inactive tiles keep the input ``x``;
- projection shortcut (stride 2 or a channel change) or no shortcut: inactive tiles are **zero**.
  The projection (1x1 conv, stride ``S``; BN in the post-activation form) is computed sparsely inside
  the blocks from the tile's own pixels, so it costs nothing outside the active tiles.

Correctness details that make the active tiles equal the dense twin:

- after every intermediate layer that feeds a ``k > 1`` convolution, block pixels outside the level's
  map are zeroed (they are the dense twin's zero padding; BN/ReLU of a zero is not zero);
- batch-norm in training mode uses statistics over the active tiles' regions, in-map pixels only
  (:mod:`detector.nn.norm`); with an all-ones mask they are the dense statistics; running statistics
  are updated once per forward with them (not at all when no block is active).

Eval-mode BN that follows a convolution is folded into the convolution (weight * scale, bias = shift)
on both paths; the pre-activation unit's input BN is applied as an affine map. A training-mode BN
whose tile region is the whole block (no halo at that level, no block past the map border) runs
``F.batch_norm`` itself - the same statistics, fused kernels.

Layout: blocks are convolved channels-last (oneDNN's fast layout on CPU). Channels-last maps are
gathered and scattered as NHWC rows (:mod:`detector.nn.layout`); NCHW maps go through
:mod:`detector.ops` and the blocks are converted. For a channels-last map under autograd, an identity
unit's gather and scatter are one fused pair (:class:`~detector.nn.layout.ResidualBlocks`): ``x``'s
gradient is assembled in one map-sized pass, and the post-activation shortcut ``relu(x + tile)`` is
done by the scatter. Without autograd, ``inplace=True`` lets an identity unit write into its input
(the backbone does this for its own intermediates) instead of a copy of it.

Memory: the active blocks are processed in chunks of at most ``memory_budget_mb`` of working tensors
(estimated as 3 x the largest level's ``C * e_h * e_w`` per block, plus the gathered input), so peak
transient memory does not grow with the batch. With training-mode BN and more than one chunk the
statistics are made exact by passes: pass ``l`` recomputes the chain up to BN ``l`` chunk by chunk and
combines the chunks' moments; a last pass computes the output tiles. With autograd on, every chunk
computation is checkpointed (``torch.utils.checkpoint``, non-reentrant), so what is kept for backward
is the chunks' indices, the moments and the output tiles, not the intermediate activations; backward
recomputes them. That trades compute (about ``L + 1`` forward passes, then a recompute) for bounded
memory; with the default budget a typical batch fits in one chunk and takes the single-pass path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from detector.ops.blocks import BlockParams
from detector.ops.functional import reduce_mask, sparse_gather

from .geometry import BlockSpan, ChainGeometry, ConvSpec, LevelMasks, chain_geometry, level_masks
from .layout import (
    ResidualBlocks,
    gather_blocks,
    is_nhwc,
    scatter_blocks,
    shared_workspace,
    zero_pixels,
    zeros_like_layout,
)
from .norm import (
    Moments,
    batch_norm_native,
    check_count,
    combine_moments,
    needs_sync,
    region_moments,
    running_scale_shift,
    scale_shift,
    sync_moments,
    update_running_stats,
    uses_batch_stats,
)

__all__ = ["ActiveBlocks", "Shortcut", "SparseConvChain"]

Shortcut = Literal["identity", "projection", "none"]


@dataclass(frozen=True)
class ActiveBlocks:
    """Active blocks of a sparse layer: ``indices`` int32 ``[K, 3]`` (n, by, bx) on the ``block`` grid."""

    indices: torch.Tensor
    block: BlockParams

    @property
    def count(self) -> int:
        return int(self.indices.shape[0])


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


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
    the chain's halo. Sparse inputs: ``mask [N, 1, H, W]`` at the input resolution (a block is active
    if the mask's max over its input window exceeds ``tol``; its mean with ``avgpool=True``).
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
        avgpool: bool = False,
        memory_budget_mb: float = 1024.0,
        channels_last: bool = True,
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
            raise ValueError(f"{name}: memory_budget_mb must be > 0, got {memory_budget_mb}")
        self.name = name
        self.in_channels = in_channels
        self.out_channels = channels[-1]
        self.stride = stride_total
        self.preact = preact
        self.shortcut = shortcut
        self.block_size = block_size
        self.tol = float(tol)
        self.avgpool = avgpool
        self.memory_budget_mb = float(memory_budget_mb)
        self.channels_last = channels_last
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
        self._slot_levels = tuple(range(L)) if preact else tuple(range(1, L + 1))
        if self.proj_bn is not None:
            self._slot_levels += (L,)
        self._geometry_cache: dict[tuple[int, int, tuple[int, int]], ChainGeometry] = {}

    # ---------------------------------------------------------------------------------- helpers
    @property
    def _slots(self) -> list[nn.BatchNorm2d]:
        return list(self.bns) + ([self.proj_bn] if self.proj_bn is not None else [])

    def geometry(self, H: int, W: int) -> ChainGeometry:
        """The chain's block geometry on an ``H x W`` input (cached)."""
        key = (H, W, _pair(self.block_size))
        geo = self._geometry_cache.get(key)
        if geo is None:
            try:
                geo = chain_geometry(H, W, self.specs, key[2])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{self.name}: {exc}") from None
            self._geometry_cache[key] = geo
        return geo

    def _check_x(self, x: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"{self.name}: x must be [N, {self.in_channels}, H, W], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{self.name}: x must be a floating-point tensor, got {x.dtype}")
        return x

    def active_blocks(self, mask: torch.Tensor) -> ActiveBlocks:
        """The active blocks of ``mask [N, 1, H, W]`` (input resolution) for this chain's geometry."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{self.name}: mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"{self.name}: mask must be [N, 1, H, W], got {tuple(mask.shape)}")
        geo = self.geometry(int(mask.shape[2]), int(mask.shape[3]))
        idx = reduce_mask(mask, geo.block, tol=self.tol, avgpool=self.avgpool)
        return ActiveBlocks(indices=idx, block=geo.block)

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
    def _conv_bn_dense(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, a: torch.Tensor) -> torch.Tensor:
        if uses_batch_stats(bn):
            return bn(conv(a))
        s, t = running_scale_shift(bn)
        return F.conv2d(a, conv.weight * s.view(-1, 1, 1, 1), t, conv.stride, conv.padding)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dense twin: the ordinary network on the whole map."""
        convs, bns, L = self.convs, self.bns, len(self.convs)
        if self.preact:
            a0 = F.relu_(bns[0](x))
            a = a0
            for i in range(L - 1):
                a = F.relu_(self._conv_bn_dense(convs[i], bns[i + 1], a))
            z = convs[L - 1](a)
            if self.shortcut == "identity":
                return z + x
            if self.shortcut == "projection":
                return z + self.proj(a0)
            return z
        a = x
        for i in range(L - 1):
            a = F.relu_(self._conv_bn_dense(convs[i], bns[i], a))
        b = self._conv_bn_dense(convs[L - 1], bns[L - 1], a)
        if self.shortcut == "identity":
            return F.relu_(b + x)
        if self.shortcut == "projection":
            return F.relu_(b + self._conv_bn_dense(self.proj, self.proj_bn, x))
        return F.relu_(b)

    # ----------------------------------------------------------------------------------- blocks
    def _run_blocks(
        self,
        xb: torch.Tensor,
        geo: ChainGeometry,
        masks: list[LevelMasks],
        known: list[Moments | None],
        collect: bool,
        skip_identity: bool = False,
    ) -> tuple[torch.Tensor | None, dict[int, Moments]]:
        """Run the chain on gathered blocks ``xb [K, C, e_0, e_0]``.

        Returns the output tiles, or with ``skip_identity`` (post-activation identity unit) the last
        BN's output before the shortcut and ReLU (the residual scatter then does ``relu(x + tile)``).

        BN slot ``j`` normalizes with ``known[j]`` when given, else with the moments of this call's
        blocks (returned in the dict; for a single chunk). With ``collect``, stops at the first chain
        slot whose batch moments are unknown and returns ``(None, moments)`` for it (and for the
        post-activation projection's BN when that one is unknown too).
        """
        new: dict[int, Moments] = {}
        slots = self._slots
        lv = geo.levels
        L = len(self.convs)
        (th, tw), S = geo.tile, self.stride
        p0h, p0w = lv[0].offset

        def unknown(j: int) -> bool:
            return uses_batch_stats(slots[j]) and known[j] is None and j not in new

        def moments(j: int, z: torch.Tensor) -> Moments:
            m = region_moments(z, lv[self._slot_levels[j]], masks[self._slot_levels[j]])
            if not collect:  # inline statistics of the whole batch: a chunk may legitimately hold 1 pixel
                check_count(f"{self.name}.bn[{j}]", m.count)
            new[j] = m
            return m

        def norm(j: int, z: torch.Tensor) -> torch.Tensor:
            bn = slots[j]
            if uses_batch_stats(bn):
                m = known[j] or new.get(j)
                if m is None and not collect and needs_sync(bn):  # DDP: statistics of all processes
                    m = new[j] = sync_moments(bn, region_moments(z, lv[self._slot_levels[j]],
                                                                 masks[self._slot_levels[j]]), z)
                    check_count(f"{self.name}.bn[{j}]", m.count)
                if m is None:
                    level = self._slot_levels[j]
                    lvl, lm = lv[level], masks[level]
                    if (
                        not collect
                        and lvl.offset == (0, 0)
                        and lvl.region == lvl.extent
                        and lm.region is None
                    ):
                        # the tile region is the whole block, all in the map: nn.BatchNorm2d's own fused
                        # kernel gives the same statistics (and updates the running ones)
                        check_count(f"{self.name}.bn[{j}]", lm.count)
                        return batch_norm_native(bn, z)
                    m = moments(j, z)
                s, t = scale_shift(bn, m.mean, m.var)
            else:
                s, t = running_scale_shift(bn)
            return torch.addcmul(t.view(1, -1, 1, 1), z, s.view(1, -1, 1, 1))

        def conv_norm(conv: nn.Conv2d, j: int, a: torch.Tensor, stride: int) -> torch.Tensor:
            bn = slots[j]
            if uses_batch_stats(bn):
                return norm(j, F.conv2d(a, conv.weight, None, stride))
            s, t = running_scale_shift(bn)
            return F.conv2d(a, conv.weight * s.view(-1, 1, 1, 1), t, stride)

        def relu_zero(b: torch.Tensor, level: int, next_k: int) -> torch.Tensor:
            """ReLU, with the block pixels outside the level's map zeroed first when a k > 1 conv follows
            (in place: ``b`` comes from a conv, an affine map or batch_norm, none of which saves it)."""
            outside = masks[level].outside
            if next_k > 1 and outside is not None:
                zero_pixels(b, outside)
            return F.relu_(b)

        convs = self.convs
        if self.preact:
            if collect and unknown(0):
                moments(0, xb)
                return None, new
            a0 = relu_zero(norm(0, xb), 0, self.specs[0].ksize)
            a = a0
            for i in range(L - 1):
                j = i + 1
                if collect and unknown(j):
                    moments(j, F.conv2d(a, convs[i].weight, None, self.specs[i].stride))
                    return None, new
                a = relu_zero(conv_norm(convs[i], j, a, self.specs[i].stride), i + 1, self.specs[i + 1].ksize)
            z = F.conv2d(a, convs[L - 1].weight, None, self.specs[L - 1].stride)
            if self.shortcut == "projection":
                a0s = a0[:, :, p0h : p0h + S * th : S, p0w : p0w + S * tw : S]
                z = z.add_(F.conv2d(a0s, self.proj.weight))  # z: a fresh conv output nobody saved
            return z, new  # identity: added to x by the scatter

        sc = None
        if self.shortcut == "projection":
            js = L
            if not collect or unknown(js):
                xs = xb[:, :, p0h : p0h + S * th : S, p0w : p0w + S * tw : S]
                if collect:
                    moments(js, F.conv2d(xs, self.proj.weight))
                else:
                    sc = conv_norm(self.proj, js, xs, 1)
        a = xb
        for i in range(L):
            if collect and unknown(i):
                moments(i, F.conv2d(a, convs[i].weight, None, self.specs[i].stride))
                return None, new
            b = conv_norm(convs[i], i, a, self.specs[i].stride)
            if i < L - 1:
                a = relu_zero(b, i + 1, self.specs[i + 1].ksize)
        if self.shortcut == "identity":
            if skip_identity:
                return b, new
            sc = xb[:, :, p0h : p0h + th, p0w : p0w + tw]
        # b is a fresh conv / affine / batch_norm output that no backward needs: add and ReLU in place
        return F.relu_(b.add_(sc) if sc is not None else b), new

    def _gather(self, x: torch.Tensor, idx: torch.Tensor, geo: ChainGeometry) -> torch.Tensor:
        if is_nhwc(x) or self.channels_last:  # channels-last blocks (into the workspace without autograd)
            return gather_blocks(x, idx, geo.block, None if torch.is_grad_enabled() else shared_workspace())
        return sparse_gather(x, idx, geo.block)

    # ----------------------------------------------------------------------------------- sparse
    def forward_sparse(self, x: torch.Tensor, blocks: ActiveBlocks, inplace: bool = False) -> torch.Tensor:
        """The sparse path on precomputed active blocks (see the module docstring for semantics).

        ``inplace`` (inference only: honoured when autograd is off and the blocks fit in one chunk)
        lets an identity-shortcut unit write its tiles into ``x`` itself instead of a copy of it; the
        blocks are all gathered before anything is written, so the result is the same. The caller
        must own ``x`` (it is returned, modified).
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
        add = self.shortcut == "identity" and self.preact
        base = x if self.shortcut == "identity" else zeros_like_layout(x, (N, self.out_channels, Ho, Wo))
        K = blocks.count
        slots = self._slots
        if K == 0:
            tie = self._sync_empty()
            return base if tie is None else base + tie
        batch = [uses_batch_stats(bn) for bn in slots]
        chunk = self.chunk_blocks(geo, x.element_size())
        idx_chunks = [idx[s : s + chunk] for s in range(0, K, chunk)]
        masks = []
        for ic in idx_chunks:
            span = BlockSpan.of(ic)
            masks.append([level_masks(ic, lv, span) for lv in geo.levels])
        known: list[Moments | None] = [None] * len(slots)
        grad = torch.is_grad_enabled()

        if len(idx_chunks) == 1:
            if grad and self.shortcut == "identity" and is_nhwc(x):  # one map-sized gradient pass for x
                residual = ResidualBlocks(x, idx, geo.block, geo.block)
                post = not self.preact  # relu(x + b) done by the scatter: no slice of the blocks for x
                tiles, new = self._run_blocks(
                    residual.gather(), geo, masks[0], known, collect=False, skip_identity=post
                )
                out = residual.scatter(tiles, "add_relu" if post else "add")
                for j, m in new.items():
                    update_running_stats(slots[j], m)
                return out
            tiles, new = self._run_blocks(self._gather(x, idx, geo), geo, masks[0], known, collect=False)
            # in place: into a fresh zero base, or (inference) into the caller's x when it gave it away
            write_in_place = base is not x or (not grad and inplace)
            out = scatter_blocks(tiles, idx, base, geo.block, add=add, inplace=write_in_place)
            for j, m in new.items():
                update_running_stats(slots[j], m)
            return out

        # Several chunks: exact batch statistics first, one pass per chain BN (see module docstring).
        while any(b and known[j] is None for j, b in enumerate(batch)):
            per_chunk: list[dict[int, Moments]] = []
            for ic, mc in zip(idx_chunks, masks, strict=True):
                per_chunk.append(self._collect_chunk(x, ic, geo, mc, known, grad))
            for j in per_chunk[0]:
                known[j] = combine_moments([p[j] for p in per_chunk])
                if needs_sync(slots[j]):
                    known[j] = sync_moments(slots[j], known[j], known[j].mean)
                check_count(f"{self.name}.bn[{j}]", known[j].count)

        known_final = list(known)

        def final(
            x_: torch.Tensor, ic: torch.Tensor, mc: list[LevelMasks], *_stats: torch.Tensor
        ) -> torch.Tensor:
            return self._run_blocks(self._gather(x_, ic, geo), geo, mc, known_final, collect=False)[0]

        stats = [t for m in known if m is not None for t in (m.mean, m.var)]
        if grad:
            tiles = torch.cat(
                [
                    checkpoint(final, x, ic, mc, *stats, use_reentrant=False)
                    for ic, mc in zip(idx_chunks, masks, strict=True)
                ]
            )
            out = scatter_blocks(tiles, idx, base, geo.block, add=add, inplace=base is not x)
        else:
            out = base.clone() if base is x else base
            for ic, mc in zip(idx_chunks, masks, strict=True):
                scatter_blocks(final(x, ic, mc), ic, out, geo.block, add=add, inplace=True)
        for j, m in enumerate(known):
            if m is not None:
                update_running_stats(slots[j], m)
        return out

    def _sync_empty(self) -> torch.Tensor | None:
        """A process with no active block still takes part in every statistics all-reduce the others
        make (DDP with synchronized BN), in their order: the post-activation projection's BN, then the
        chain's BNs; its running statistics are updated with the global moments like the others'.
        Returns a zero that depends on those all-reduces (None without any), for the caller to add to its
        output, so that backward takes part in the gradients' all-reduces too."""
        slots = self._slots
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

    def _collect_chunk(
        self,
        x: torch.Tensor,
        ic: torch.Tensor,
        geo: ChainGeometry,
        mc: list[LevelMasks],
        known: list[Moments | None],
        grad: bool,
    ) -> dict[int, Moments]:
        """One chunk's moments for the next statistics pass (checkpointed under autograd)."""
        # Which slots this pass collects is fixed by `known`: the first unknown chain BN and the
        # post-activation projection's BN if unknown (what _run_blocks(collect=True) returns).
        slots = self._slots
        known = list(
            known
        )  # a snapshot: the caller fills its list in later passes, recompute must not see it
        targets = [j for j in range(len(self.bns)) if uses_batch_stats(slots[j]) and known[j] is None][:1]
        if self.proj_bn is not None and uses_batch_stats(self.proj_bn) and known[len(self.bns)] is None:
            targets.append(len(self.bns))

        def fn(x_: torch.Tensor, *_stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
            _, new = self._run_blocks(self._gather(x_, ic, geo), geo, mc, known, collect=True)
            return tuple(t for j in targets for t in (new[j].mean, new[j].var))

        stats = [t for m in known if m is not None for t in (m.mean, m.var)]
        out = checkpoint(fn, x, *stats, use_reentrant=False) if grad else fn(x, *stats)
        return {
            j: Moments(mean=out[2 * n], var=out[2 * n + 1], count=mc[self._slot_levels[j]].count)
            for n, j in enumerate(targets)
        }

    # ---------------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        blocks: ActiveBlocks | None = None,
        inplace: bool = False,
    ) -> torch.Tensor:
        """Dense when neither ``mask`` nor ``blocks`` is given; else sparse on the active blocks.

        ``inplace``: see :meth:`forward_sparse` (inference only; ignored on the dense path).
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
            blocks = self.active_blocks(mask)
        return self.forward_sparse(x, blocks, inplace=inplace)
