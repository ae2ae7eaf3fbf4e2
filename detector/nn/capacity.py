"""The sparse network on block lists of a bounded capacity: no host sync inside a stage, in inference and in
training.

The exact path (:meth:`SparseConvChain.forward_sparse`) sizes everything by ``K``, the active blocks, which on a
GPU is read by the host (``reduce_mask``'s ``nonzero``, the level masks' spans and counts): a sync per stage
and a new shape per batch. Here each stage takes a :class:`~detector.ops.capacity.BlockList` of a fixed
capacity (a bucket) and the ops honour its padding rows, so a stage makes no data-dependent host call and its
shapes repeat (a captured graph per bucket, :mod:`detector.nn.graphs`):

    caps = plan_capacities(net, x, mask, modes)          # THE host read of the batch: every stage's count
    feats, overflow, counts = forward_capacity(net, x, mask, modes, caps)   # none inside
    feats = run_checked(net, x, mask, modes, caps)       # + one read of the overflow flag; reruns if set

Per unit: :func:`chain_capacity` runs the chain with the fused ops (:mod:`detector.ops.fused`: the gather fused
into the first convolution, batch norm folded, the residual and the scatter fused into the last one; on the CPU
their composition of the compiled kernels and oneDNN's convolutions). It computes the unit's masked function
(:mod:`detector.nn.chain`): the tiles are those holding a pixel of the unit's mask at the output, and only the
mask's pixels are written - the exact path's values, whatever the tile.

Training: a batch norm in training mode is not folded; its convolution runs unfused and the BN takes the batch
moments of the level's mask pixels in the active rows' tile regions (padding rows left out, the count a device
tensor: no read), as the exact path's statistics do; the backward is autograd's through the ops. Synchronized BN
across processes (DDP): each slot's moments of this process's pixels, all-reduced
(:func:`~detector.nn.norm.sync_moments`).

Capacity overflow (a list shorter than the active blocks, e.g. a graph captured for a smaller bucket) is never
silent: every list's ``overflow`` flag is OR-ed on the device into the returned flag, and :func:`run_checked`
reruns such a batch at the buckets of its true counts (the last bucket is the whole grid), with a warning in the
log. The whole detector (backbone, neck and head) runs on the same functions: ``BevDetector.capacity_forward``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import replace

import torch

from detector.ops import sparse_gather
from detector.ops.capacity import (
    BlockList,
    gather_windows,
    level_valid,
    reduce_mask_capacity,
    scatter_padded,
    uses_buckets,
)
from detector.ops.fused import conv_blocks, conv_scatter

from .chain import SparseConvChain, zeros_in_layout
from .geometry import ChainGeometry, Level, LevelMasks, level_masks, mask_at_stride, zero_pixels
from .norm import (
    blocks_batch_norm,
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
from .plan import AUTO, DENSE, Plan, StageInput, list_rows, settle

__all__ = ["chain_capacity", "stage_capacity", "plan_capacities", "forward_capacity", "run_checked",
           "StageCapacity", "capacities", "decide_lists", "chain_list", "run_chain", "rerun_warning"]

log = logging.getLogger(__name__)

StageCapacity = tuple[int, int]  # (capacity of the first unit's list, of the other units' list)

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
        if j is None:
            return w, None
        s, t = running_scale_shift(self.slots[j])
        return w * s.view(-1, 1, 1, 1), t

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
    unit writes into ``x`` itself (not under autograd).

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
    grad = torch.is_grad_enabled()
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
    if chain.shortcut == "identity":
        base = x if inplace and not grad else x.clone(memory_format=_format(x))
    else:
        base = zeros_in_layout(x, (N, chain.out_channels, Ho, Wo))
    add = "map" if chain.shortcut == "identity" else residual
    j = _out_slot(chain, L - 1)
    if not norm.batch(j):
        return conv_scatter(a, blist, *norm.folded(L - 1), base, tile=T, residual=add, relu=post)
    t = norm(j, conv(L - 1, a, wb=(chain.convs[L - 1].weight, None)))  # post-activation: relu(bn(conv) + shortcut)
    if residual is not None:
        t = t + residual
    return scatter_padded(t, blist, base, add=chain.shortcut == "identity", relu=True, inplace=False)


def _projection(chain: SparseConvChain, norm: _ListNorm, x: torch.Tensor, a0: torch.Tensor | None,
                blist: BlockList, geo: ChainGeometry, pre: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The projection shortcut's tiles ``[capacity, CO, T_h, T_w]``: the 1x1 stride-S convolution of the tile's
    own input pixels (the pre-activation's ``a0``), its BN (post-activation) folded or with batch moments."""
    T, S = geo.tile, chain.stride
    js = len(chain.bns) if chain.proj_bn is not None else None
    pw, pb = chain.proj.weight, None
    if js is not None and not norm.batch(js):
        s, t = running_scale_shift(chain.proj_bn)
        pw, pb = pw * s.view(-1, 1, 1, 1), t
    if a0 is not None:  # the pre-activation's blocks: the tile's pixels at stride S
        (ph, pw0) = geo.levels[0].offset
        r = conv_blocks(a0[:, :, ph : ph + S * T[0] : S, pw0 : pw0 + S * T[1] : S], blist, pw, pb)
    else:
        r = conv_blocks(x, blist, pw, pb, stride=S, origin=((T[0] * S, T[1] * S), (0, 0)),
                        extent=((T[0] - 1) * S + 1, (T[1] - 1) * S + 1), pre=pre)
    return norm(js, r) if norm.batch(js) else r


def _format(x: torch.Tensor) -> torch.memory_format:
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if nhwc else torch.contiguous_format


def stage_capacity(stage: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, tile: int, caps: StageCapacity
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One stage sparse at ``tile`` on lists of capacities ``caps``: (output, the binary mask at the output
    resolution, overflow flag, the lists' true counts), all without a host read."""
    units, tile = list(stage.units), int(tile)
    first = units[0]
    mask = first.binary(mask)
    bl = chain_list(first, mask, tile, int(caps[0]))
    x_in = x
    x = chain_capacity(first, x, bl, mask, inplace=False, tile=tile)
    overflow, counts = bl.overflow, [bl.count]
    mask = bl.mask
    if len(units) > 1:
        br = chain_list(units[1], mask, tile, int(caps[1]))
        for u in units[1:]:  # in place into the stage's own intermediates only
            x = chain_capacity(u, x, br, mask, inplace=x is not x_in, tile=tile)
        overflow, counts = overflow | br.overflow, counts + [br.count]
    return x, mask, overflow, counts


def _check_modes(net: torch.nn.Module, modes: Sequence[int | str]) -> list[int | str]:
    modes = list(modes)
    if len(modes) != len(net.stages) or any(m != DENSE and (isinstance(m, bool) or not isinstance(m, int))
                                            for m in modes):
        raise ValueError(f"capacity path: modes must be a tile or 'dense' per stage ({len(net.stages)}), got {modes}")
    return modes


def forward_capacity(net: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, modes: Sequence[int | str],
                     caps: Sequence[StageCapacity | None]) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """The backbone (a :class:`~detector.nn.resnet.SparseResNet`) with ``modes[i]`` (a tile, or 'dense') and the
    list capacities ``caps[i]`` per stage: (the stages' features, the device-side overflow flag, each stage's
    true counts as device tensors). No host read; compiles with ``fullgraph=True``."""
    modes = _check_modes(net, modes)
    mask = mask.to(x.dtype)
    if net.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    overflow = torch.zeros((), dtype=torch.bool, device=x.device)
    feats, counts = [], []
    for i, stage in enumerate(net.stages):
        if modes[i] == DENSE:
            x, mask = stage(x, mask, dense=True)
            counts.append([])
        else:
            x, mask, ovf, cnt = stage_capacity(stage, x, mask, int(modes[i]), caps[i])
            overflow = overflow | ovf
            counts.append(cnt)
        if i > 0:
            feats.append(x)
    return feats, overflow, counts


def _settings(net: torch.nn.Module, modes: Sequence[int | str] | None) -> list[int | str]:
    return list(net.block_sizes if modes is None else modes)


def capacities(inputs: Sequence[StageInput], modes: Sequence[int | str], smallest: int = 8, buckets: bool = True
               ) -> list[StageCapacity | None]:
    """Per stage the list capacities of ``modes`` (None where dense): the smallest buckets that hold the counts
    of the settled plan ``inputs`` at the chosen tile, or the counts (``buckets`` False;
    :func:`~detector.nn.plan.list_rows`)."""
    out: list[StageCapacity | None] = []
    for inp, mode in zip(inputs, modes, strict=True):
        if mode == DENSE:
            out.append(None)
            continue
        _, k1, kr = next(c for c in inp.counts if c[0] == mode)
        out.append(list_rows(inp, int(mode), k1, kr, smallest, buckets))
    return out


def decide_lists(inputs: Sequence[StageInput], settings: Sequence[int | str], planner, device: torch.device,  # noqa: ANN001
                 dtype: torch.dtype, training: bool = False, smallest: int = 8
                 ) -> tuple[list[int | str], list[StageCapacity | None], Plan | None]:
    """The capacity path's plan of a batch from its plan ``inputs`` (counts unread): ONE host read of all the
    counts, the modes (``planner``'s choice, priced for this path and for a training step or inference, where a
    setting is 'auto'; else the settings) and the list capacities of every stage: buckets on a GPU, the counts
    elsewhere (:func:`~detector.ops.capacity.uses_buckets`)."""
    inputs = settle(inputs)  # the one read
    plan = planner.decide(inputs, device, dtype, training, "capacity") if AUTO in settings else None
    modes = list(plan.choices) if plan is not None else list(settings)
    return modes, capacities(inputs, modes, smallest, uses_buckets(device)), plan


def plan_capacities(net: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor,
                    modes: Sequence[int | str] | None = None, smallest: int = 8
                    ) -> tuple[list[int | str], list[StageCapacity | None]]:
    """Each stage's mode and the smallest buckets that hold its active blocks (:func:`decide_lists` on
    :meth:`SparseResNet.plan_inputs`)."""
    settings = _settings(net, modes)
    inputs = net.plan_inputs(tuple(x.shape), mask.to(x.dtype), settings, path="capacity")
    chosen, caps, _ = decide_lists(inputs, settings, net.planner, x.device, x.dtype, net.training, smallest)
    return chosen, caps


def rerun_warning(counts: list, caps: Sequence, new_caps: Sequence) -> None:
    log.warning("capacity overflow: more active blocks than the list's capacity (counts %s, capacities %s); "
                "rerun at capacities %s", [[int(c) for c in cs] for cs in counts], list(caps), list(new_caps))


def run_checked(net: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, modes: Sequence[int | str],
                caps: Sequence[StageCapacity | None], forward=None, smallest: int = 8) -> list[torch.Tensor]:  # noqa: ANN001
    """:func:`forward_capacity` (or ``forward``, e.g. a captured graph's replay, with the same signature), then
    ONE host read of its overflow flag; if set, the batch reruns at the buckets of its true counts (those of
    ``modes``; a count that fills its grid gets the whole grid). Logged as a warning; never a dropped block."""
    run = forward or (lambda *a: forward_capacity(net, *a))
    feats, overflow, counts = run(x, mask, modes, caps)
    if not bool(overflow):
        return feats
    modes, new_caps = plan_capacities(net, x, mask, modes, smallest)
    rerun_warning(counts, caps, new_caps)
    feats, _, _ = forward_capacity(net, x, mask, modes, new_caps)
    return feats


def chain_list(chain: SparseConvChain, mask: torch.Tensor, tile: int, capacity: int) -> BlockList:
    """The block list of ``chain`` at ``tile`` on ``mask`` (its input resolution, binary at the chain's ``tol``), of
    ``capacity`` rows: the tiles whose output holds a pixel of the mask at the output resolution (the list's
    ``mask``, where its tiles are written); no host read."""
    geo = chain.geometry(int(mask.shape[2]), int(mask.shape[3]), int(tile))
    m_out = mask_at_stride(chain.binary(mask), chain.stride)
    return replace(reduce_mask_capacity(m_out, geo.select, int(capacity)), block=geo.block, mask=m_out)


def run_chain(chain: SparseConvChain, x: torch.Tensor, mask: torch.Tensor | None,
              mode: int | str | BlockList | None = None) -> torch.Tensor:
    """``chain`` on ``x`` and its level's ``mask`` - the one call the neck and the head make for either path:
    no mask: the dense twin; ``mode`` a tile (or None: the chain's block size): the exact path; a
    :class:`BlockList` (made by :func:`chain_list`): the capacity path at the tile it was made for; 'dense': the
    whole map, the mask applied. The same values every way."""
    if mask is None:
        return chain(x)
    if isinstance(mode, BlockList):
        return chain_capacity(chain, x, mode, chain.binary(mask), tile=mode.block.obsize)
    if mode == DENSE:
        return chain(x, mask=mask, dense=True)
    if mode is not None:
        chain.block_size = int(mode)
    return chain(x, mask=mask)
