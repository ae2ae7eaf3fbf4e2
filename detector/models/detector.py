"""The BEV detector: voxelize → computation mask → sparse backbone → top-down neck → dense head.

A plain ``nn.Module`` (the LightningModule wraps it). The same weights run sparse (given a mask) or
dense (``mask=None``); where the mask comes from:

- a data-side provider (road map, ground plane) puts it in ``Batch.mask``;
- a :class:`~detector.models.mask_net.MaskNet` (``mask_net``) predicts it from the BEV input; in
  training the computation mask is the ground truth's, the prediction's, or their union, as its
  :class:`~detector.models.mask_schedule.MaskSchedule` says step by step, and the mask network learns from the
  dilated ground-truth boxes;
- neither: dense.

The sparse network runs on block lists (:mod:`detector.nn.capacity`): one host read of the plan's counts per batch
and none inside the network; on a GPU the lists take buckets of rows and inference is captured as a CUDA graph per
(shape, plan, buckets). There, the dense network (no mask) is captured as a graph too: a sparse plan is priced, and
measured, against the best dense.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from detector.data.structures import Batch, Detections
from detector.errors import ConfigError
from detector.geometry.box_masks import boxes_mask
from detector.geometry.voxelize import BevGrid, voxelize
from detector.models.head import DetectionHead
from detector.models.losses import LossTerms, detection_loss, mask_loss
from detector.models.mask_net import MaskNet
from detector.models.mask_quality import class_boxes
from detector.models.mask_schedule import MaskSchedule
from detector.models.targets import BoxCoder
from detector.nn.capacity import (
    StageCapacity,
    chain_list,
    decide_lists,
    forward_capacity,
    region,
    rerun_warning,
    run_chain,
)
from detector.nn.capture import capture_training
from detector.nn.chain import SparseConvChain, conv_on_support
from detector.nn.graphs import GraphCache
from detector.nn.plan import AUTO, DENSE, Plan, StageInput, check_setting, measure
from detector.nn.resnet import SparseResNet, downsample_mask
from detector.ops.capacity import BlockList, uses_buckets
from detector.ops.fused import fused_backend, whole_check


class TopDownNeck(nn.Module):
    """FPN-style top-down path: from the deepest stage, upsample ×2, add the 1x1 lateral of the next
    shallower stage, 3x3 conv-BN-ReLU; stops at ``out_stride``.

    Given the computation mask at each level's resolution, every 3x3 smoothing conv computes that level's mask
    pixels only (a one-conv :class:`~detector.nn.chain.SparseConvChain`, sparse or dense as the plan says; zero
    elsewhere); the 1x1 laterals and the upsampling stay dense.
    """

    def __init__(self, in_channels: Sequence[int], strides: Sequence[int], out_stride: int = 4, channels: int = 96,
                 block_size: int = 16, tol: float = 0.5):
        super().__init__()
        use = [i for i, s in enumerate(strides) if s >= out_stride]
        if not use or strides[use[0]] != out_stride:
            raise ValueError(f"TopDownNeck: no backbone stage at stride {out_stride} (strides {list(strides)})")
        for a, b in itertools.pairwise(use):
            if strides[b] != 2 * strides[a]:
                raise ValueError(f"TopDownNeck: stage strides must double, got {list(strides)}")
        self.use = use
        self.strides = [strides[i] for i in use]
        self.out_stride = out_stride
        self.lateral = nn.ModuleList(nn.Conv2d(in_channels[i], channels, 1) for i in use)
        self.smooth = nn.ModuleList(
            SparseConvChain(channels, (channels,), (3,), (1,), shortcut="none", block_size=block_size, tol=tol,
                            name=f"TopDownNeck.smooth[{j}]")
            for j in range(len(use))
        )
        self.out_channels = channels

    def forward(self, feats: Sequence[torch.Tensor], masks: Sequence[torch.Tensor] | None = None,
                modes: Sequence[int | str | BlockList | None] | None = None) -> torch.Tensor:
        """``feats``: the backbone's stage outputs; ``masks``: None (dense) or the mask at each used
        level's resolution (``masks[j]`` for stride ``self.strides[j]``); ``modes``: how each level runs
        (:func:`~detector.nn.capacity.run_chain`; None: sparse at the chain's tile)."""
        x = None
        for j in reversed(range(len(self.use))):
            f, lateral = feats[self.use[j]], self.lateral[j]
            if masks is None or uses_buckets(f.device):  # no mask, or a GPU's captured graph: the whole map
                lat = lateral(f)
            else:  # a sparse stage's output is zero outside its mask: the 1x1 convolution there, the bias elsewhere
                lat = conv_on_support(f, lateral.weight, lateral.bias, masks[j], self.smooth[j].block_size)
            if x is not None:
                lat = add_upsampled(lat, x)
            x = run_chain(self.smooth[j], lat, None if masks is None else masks[j], None if modes is None else modes[j])
        return x


def add_upsampled(lat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``lat + F.interpolate(x, size=lat.shape[-2:], mode="nearest")``; where ``lat`` is exactly twice ``x``'s size
    and both share a layout (NCHW or channels-last), one broadcast add over ``lat`` seen as 2 x 2 cells: the
    upsampled map is never made (a full-size map less to write and read). The result in ``lat``'s layout."""
    N, C, H, W = lat.shape
    h, w = x.shape[-2:]
    if H == 2 * h and W == 2 * w:
        if lat.is_contiguous() and x.is_contiguous():
            return (lat.view(N, C, h, 2, w, 2) + x[:, :, :, None, :, None]).view(N, C, H, W)
        cl = torch.channels_last
        if lat.is_contiguous(memory_format=cl) and x.is_contiguous(memory_format=cl):
            y = lat.permute(0, 2, 3, 1).view(N, h, 2, w, 2, C) + x.permute(0, 2, 3, 1)[:, :, None, :, None, :]
            return y.view(N, H, W, C).permute(0, 3, 1, 2)
    return lat + F.interpolate(x, size=(H, W), mode="nearest")


class _ListNetwork(nn.Module):
    """``det``'s network on the capacity path at fixed modes and capacities, as a module (what
    :func:`~detector.nn.capture.capture_training` captures): (heatmap logits, regression, overflow flag)."""

    def __init__(self, det: BevDetector, modes: Sequence[int | str], caps: Sequence) -> None:
        super().__init__()
        self.det, self.modes, self.caps = det, list(modes), list(caps)
        self.training = det.training  # its own flag only: the graphs are of this state

    def forward(self, bev: torch.Tensor, mask: torch.Tensor, *level_masks: torch.Tensor):  # noqa: ANN201
        heat, reg, overflow, _ = self.det.capacity_maps(bev, mask, level_masks, self.modes, self.caps)
        return heat, reg, overflow


def masks_at_strides(mask: torch.Tensor, strides: Sequence[int]) -> list[torch.Tensor]:
    """The computation mask at each of ``strides`` (powers of 2), downsampled as the backbone's stages
    downsample it."""
    out, cur, s = [], mask, 1
    for target in strides:
        while s < target:
            cur = downsample_mask(cur)
            s *= 2
        if s != target:
            raise ValueError(f"masks_at_strides: strides must be increasing powers of 2, got {list(strides)}")
        out.append(cur)
    return out


@dataclass
class DetectorOutput:
    heatmap: torch.Tensor  # [B, K, h, w] logits
    regression: torch.Tensor  # [B, 8, h, w]
    mask: torch.Tensor | None  # [B, 1, H, W] computation mask used (None: dense)
    mask_logits: torch.Tensor | None = None  # MaskNet output at 1/d resolution
    sparsity: float = 0.0  # fraction of the input grid outside the mask
    times: dict[str, float] = field(default_factory=dict)  # seconds per stage of the forward
    plan: Plan | None = None  # the execution plan decided for this batch (block_size / head_block_size auto)


class BevDetector(nn.Module):
    """The detector: voxelize, computation mask, sparse backbone, top-down neck, dense head (module docstring).

    Built from ``configs/model`` by :func:`detector.build.build_model` (``_target_``), which passes the parts the
    other config groups decide: the grid (``bev``), the mask network and its schedule (``mask``).

    Args:
        grid: the BEV grid the points are voxelized into.
        backbone: the sparse ResNet; its tiles, tolerance and memory budget are the neck's and head's too.
        coder: the box coder: the classes, the heatmap targets and the box encoding.
        neck_channels: channels of the top-down neck.
        head_channels: channels of the head's tower.
        out_stride: the neck's and head's stride (the heatmap has ``grid.H / out_stride`` rows).
        head_block_size: output tile of the neck's and head's sparse 3x3 convs: an int, ``auto`` (the plan) or
            ``dense``.
        mask_dilation_m: metres the mask network's target reaches beyond each box of ``coder.classes``.
        sparse: use a computation mask (the batch's, or ``mask_net``'s); False: the dense twin, every cell computed.
        mask_net: predicts the computation mask from the BEV input; None: the batch's mask, if any.
        mask_schedule: how training uses ``mask_net``'s mask (required with ``mask_net``).
        mask_loss_kind: the mask network's loss (:func:`detector.models.losses.mask_loss`).
        mask_loss_weight: its weight in the total loss.
        capture_train: on a GPU, a training step runs its network's forward and backward as
            CUDA graphs, one pair per (shape, plan, buckets) seen twice (:func:`~detector.nn.capture.capture_training`).
    """

    def __init__(
        self,
        grid: BevGrid,
        *,
        backbone: SparseResNet,
        coder: BoxCoder,
        neck_channels: int,
        head_channels: int,
        out_stride: int,
        head_block_size: int | str,
        mask_dilation_m: float,
        sparse: bool,
        mask_net: MaskNet | None = None,
        mask_schedule: MaskSchedule | None = None,
        mask_loss_kind: str = "focal",
        mask_loss_weight: float = 1.0,
        capture_train: bool = False,
    ):
        super().__init__()
        if mask_net is not None and mask_schedule is None:
            raise ValueError("BevDetector: a mask_net needs a mask_schedule (how training uses its mask)")
        if mask_net is not None and not sparse:
            raise ValueError("BevDetector: a dense detector (sparse=False) computes every cell: no mask_net")
        if capture_train and backbone.checkpoint_stages:  # a captured step replays one graph: no recomputation
            raise ConfigError("model.checkpoint_stages needs model.capture_train=false (a training step captured as a "
                              "CUDA graph does not recompute stages)")
        if grid.H % out_stride or grid.W % out_stride:
            raise ValueError(f"BEV grid {grid.H}x{grid.W} is not divisible by the head's stride {out_stride}")
        self.grid = grid
        self.out_grid = grid.downsampled(out_stride)
        self.coder = coder
        self.backbone = backbone
        self.head_block_size = check_setting(head_block_size, "head_block_size")
        tile = head_block_size if isinstance(head_block_size, int) else 16  # auto / dense: set per batch
        sparse_args = dict(block_size=tile, tol=backbone.tol)
        self.neck = TopDownNeck(backbone.out_channels, backbone.strides, out_stride, neck_channels, **sparse_args)
        self.head = DetectionHead(neck_channels, coder.num_classes, head_channels, **sparse_args)
        self.mask_net = mask_net
        self.mask_schedule = mask_schedule
        self.mask_dilation_m = mask_dilation_m
        self.mask_loss_kind = mask_loss_kind
        self.mask_loss_weight = mask_loss_weight
        self.use_data_mask = sparse  # an attribute: the benchmarks switch a sparse detector's masks off and on
        self.timing = False  # record per-stage wall times (synchronizes on CUDA)
        self.graphs = GraphCache()  # the network's captured graphs in inference (CUDA)
        self.capture_train = bool(capture_train)
        self.train_graphs = GraphCache(max_graphs=8, capturer=capture_training, after=2)

    def extra_repr(self) -> str:
        g = self.grid
        mask = ("mask_net" if self.mask_net is not None else "the batch's mask") if self.use_data_mask else "dense"
        text = (f"grid={g.H}x{g.W} cells of {g.resolution:g} m, {g.C} channels, classes={list(self.coder.classes)}, "
                f"mask={mask}, head_block_size={self.head_block_size}")
        return text + (f",\nmask_schedule={self.mask_schedule}" if self.mask_schedule is not None else "")

    @property
    def mask_union_dilation_m(self) -> float:
        """Metres the ground-truth part of the training mask reaches beyond each box (the schedule's, else
        ``mask_dilation_m``)."""
        u = None if self.mask_schedule is None else self.mask_schedule.union_dilation_m
        return self.mask_dilation_m if u is None else u

    # --- forward ------------------------------------------------------------------------------------
    def _tick(self, times: dict, key: str, t0: float) -> float:
        if not self.timing:
            return t0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        times[key] = times.get(key, 0.0) + t - t0
        return t

    def voxelize(self, batch: Batch) -> torch.Tensor:
        bev, _ = voxelize(batch.points, batch.size, self.grid)
        return bev

    def forward(self, batch: Batch, bev: torch.Tensor | None = None, step: int | None = None) -> DetectorOutput:
        """``step``: the optimizer step in training (the mask's phases, :class:`MaskSchedule`)."""
        times: dict[str, float] = {}
        t = self._tick(times, "start", time.perf_counter())
        if bev is None:
            with region("voxelize", self.timing):
                bev = self.voxelize(batch)
        t = self._tick(times, "voxelize", t)
        with region("mask", self.timing):
            mask, mask_logits = self.computation_mask(batch, bev, step)
        t = self._tick(times, "mask", t)
        plan = None
        inference = not (self.training or torch.is_grad_enabled())
        if mask is None and inference and bev.is_cuda:  # dense, captured like sparse
            run = self.graphs.get(("dense", tuple(bev.shape), bev.dtype, bev.device),
                                  lambda b: self.head(self.neck(self.backbone(b))), bev)
            heat, reg = (o.clone() for o in run(bev))
            self._tick(times, "network", t)
        elif mask is None:
            feats = self.backbone(bev, mask, times=times if self.timing else None)
            t = self._tick(times, "backbone", t)
            with region("neck", self.timing):
                top = self.neck(feats)
            with region("head", self.timing):
                heat, reg = self.head(top)
            self._tick(times, "head", t)
        else:
            level_masks = masks_at_strides(mask, self.neck.strides)
            heat, reg, plan = self.capacity_forward(bev, mask, level_masks, times)
        sparsity = 0.0 if mask is None else float(1.0 - mask.mean())
        return DetectorOutput(heat, reg, mask, mask_logits, sparsity, times, plan)

    def computation_mask(self, batch: Batch, bev: torch.Tensor, step: int | None = None
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the computation mask ``[B, 1, H, W]`` the network runs on - None: dense -, the mask net's logits): the
        mask net's (in training as its schedule says at ``step``), else the batch's own mask."""
        if self.mask_net is not None:
            mask_logits = self.mask_net(bev)
            threshold = self.mask_schedule.threshold_at(step) if self.training else None
            mask = self.mask_net.computation_mask(mask_logits, bev.shape[-2:], threshold)
            source = self.mask_schedule.source_at(step) if self.training else "predicted"
            if source != "predicted":
                gt = self.object_mask(batch, downsample=1, dilation_m=self.mask_union_dilation_m).to(bev)
                mask = gt if source == "gt" else torch.maximum(mask, gt)
            return mask, mask_logits
        if self.use_data_mask and batch.mask is not None:
            return batch.mask.to(bev), None
        return None, None

    def settings(self) -> list[int | str]:
        """The configured setting of every sparse stage: the backbone's stages, the neck's levels, the head's
        tower (in that order)."""
        return list(self.backbone.block_sizes) + [self.head_block_size] * (len(self.neck.smooth) + 1)

    def plan_inputs(self, x_shape: tuple[int, ...], mask: torch.Tensor, level_masks: Sequence[torch.Tensor],
                    settings: Sequence[int | str] | None = None) -> list[StageInput]:
        """The plan inputs of every sparse stage (:meth:`settings`' order; counts on the device, unread) under
        ``settings`` (default: the configured ones)."""
        bb = self.backbone
        settings = self.settings() if settings is None else list(settings)
        nb = len(bb.stages)
        inputs = bb.plan_inputs(x_shape, mask, settings[:nb])
        N, cands = x_shape[0], bb.planner.candidates
        prune = bb.planner.prune(mask.device, mask.dtype, self.training) if AUTO in settings[nb:] else None
        for j, chain in enumerate(self.neck.smooth):
            hw = inputs[self.neck.use[j] + 1].rest_hw
            inputs.append(measure(f"neck_s{self.neck.strides[j]}", settings[nb + j], [chain], (N, *hw), level_masks[j],
                                  cands, prune))
        hw = inputs[nb].shape[1:]
        inputs.append(measure("head", settings[-1], [self.head.tower], (N, *hw), level_masks[0], cands, prune))
        return inputs

    # --- the network on block lists ------------------------------------------------------------------
    def capacity_plan(self, x_shape: tuple[int, ...], mask: torch.Tensor, level_masks: Sequence[torch.Tensor],
                      modes: Sequence[int | str] | None = None
                      ) -> tuple[list[int | str], list[StageCapacity | None], Plan | None]:
        """The modes (the plan's, where a setting is ``auto``; ``modes`` given:
        those) and the list capacities of every sparse stage, from ONE host read of all the counts."""
        settings = self.settings() if modes is None else list(modes)
        inputs = self.plan_inputs(x_shape, mask, level_masks, settings)
        return decide_lists(inputs, settings, self.backbone.planner, mask.device, mask.dtype, self.training)

    def capacity_maps(self, bev: torch.Tensor, mask: torch.Tensor, level_masks: Sequence[torch.Tensor],
                      modes: Sequence[int | str], caps: Sequence[StageCapacity | None],
                      times: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """Backbone, neck and head on block lists of capacities ``caps`` with ``modes`` (:meth:`capacity_plan`):
        (heatmap logits, regression, the device-side overflow flag, every list's true count). No host read."""
        nb = len(self.backbone.stages)
        t = time.perf_counter() if times is not None else 0.0
        feats, overflow, counts = forward_capacity(self.backbone, bev, mask, modes[:nb], caps[:nb], times,
                                                   keep=self.neck.use)
        if times is not None:
            t = self._tick(times, "backbone", t)
        lists: list[BlockList | str] = []
        chains = [*self.neck.smooth, self.head.tower]
        level_masks = [lm.to(bev.dtype) for lm in level_masks]
        for chain, m, cap, lm in zip(chains, modes[nb:], caps[nb:], [*level_masks, level_masks[0]], strict=True):
            if m == DENSE:
                lists.append(DENSE)
                counts.append([])
                continue
            bl = chain_list(chain, lm, int(m), None if cap is None else cap[0])
            overflow = overflow | bl.overflow
            counts.append([bl.count])
            lists.append(bl)
        with region("neck", times is not None):
            top = self.neck(feats, level_masks, lists[:-1])
        with region("head", times is not None):
            heat, reg = self.head(top, level_masks[0], lists[-1])
        if times is not None:
            self._tick(times, "head", t)
        return heat, reg, overflow, counts

    def capacity_forward(self, bev: torch.Tensor, mask: torch.Tensor, level_masks: Sequence[torch.Tensor],
                         times: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, Plan | None]:
        """The capacity path of one batch: the plan's one read, the network (in inference a captured graph per
        shape, plan and buckets on CUDA), then one read of the overflow flag - set only if the lists were too
        short, which the counts of this very batch rule out; checked all the same: inference reruns at the true
        counts, a training step (whose batch norm has updated its running statistics) stops with an error."""
        times = {} if times is None else times
        t = time.perf_counter() if self.timing else 0.0
        with region("plan", self.timing):
            modes, caps, plan = self.capacity_plan(tuple(bev.shape), mask, level_masks)
        t = self._tick(times, "plan", t)
        if fused_backend(bev.device, bev.dtype) == "triton":  # the kernels on this network: once, compared
            whole_check(bev.device, bev.dtype, lambda: self._inference_maps(bev, mask, level_masks, modes, caps))
        key = (tuple(bev.shape), bev.dtype, bev.device, tuple(modes), tuple(caps))
        if self.training and self.capture_train and bev.is_cuda:
            run = self.train_graphs.get(key, _ListNetwork(self, modes, caps), bev, mask, *level_masks)
            (heat, reg, overflow), counts = run(bev, mask, *level_masks), None
        elif self.training or torch.is_grad_enabled() or not bev.is_cuda:  # eager (nothing to capture off CUDA)
            heat, reg, overflow, counts = self.capacity_maps(bev, mask, level_masks, modes, caps,
                                                             times if self.timing else None)
        else:
            run = self.graphs.get(key, lambda b, m, *lm: self.capacity_maps(b, m, lm, modes, caps), bev, mask,
                                  *level_masks)
            heat, reg, overflow, counts = run(bev, mask, *level_masks)
        overflow = bool(overflow)  # the one read after the network
        if overflow and self.training:
            found = "" if counts is None else f" {[[int(c) for c in cs] for cs in counts]}"
            raise RuntimeError(f"the block lists {caps} hold fewer rows than the batch's active blocks{found}; no "
                               "block may be dropped")
        if overflow:
            modes, new_caps, _ = self.capacity_plan(tuple(bev.shape), mask, level_masks, modes)
            rerun_warning(counts, caps, new_caps)
            heat, reg, _, _ = self.capacity_maps(bev, mask, level_masks, modes, new_caps)
        if "backbone" not in times:  # a captured graph: backbone, neck and head as one (eager: timed each)
            self._tick(times, "network", t)
        if bev.is_cuda and not torch.is_grad_enabled():  # a replay's outputs are the graph's own: the next overwrites
            heat, reg = heat.clone(), reg.clone()
        return heat, reg, plan

    def _inference_maps(self, bev: torch.Tensor, mask: torch.Tensor, level_masks: Sequence[torch.Tensor],
                        modes: Sequence[int | str], caps: Sequence[StageCapacity | None]) -> tuple[torch.Tensor, ...]:
        """The capacity path's maps of one batch in inference (running statistics, nothing updated): what
        :func:`~detector.ops.fused.whole_check` compares between the kernels and the composition."""
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                return tuple(self.capacity_maps(bev, mask, level_masks, modes, caps)[:2])
        finally:
            self.train(was)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        self.graphs.clear()  # .to() / .half() move the tensors a captured graph reads
        self.train_graphs.clear()
        return super()._apply(fn, recurse)

    # --- training -----------------------------------------------------------------------------------
    def object_mask(self, batch: Batch, downsample: int, dilation_m: float | None = None) -> torch.Tensor:
        """[B, 1, H/d, W/d]: the cells of the boxes of the classes this detector finds, enlarged by ``dilation_m``
        (default ``mask_dilation_m``) - the mask net's target and, in training, the ground-truth part of the
        computation mask (enlarged by ``mask_union_dilation_m``). Other labeled objects (vans, pedestrians for a
        Car detector, and those GT sampling pastes) are not computed for: with the default augmentation they more
        than double the objects per frame and the active tiles (make train's sample: 21 objects per frame, of them
        8.5 Cars; 16-px tiles active at strides 1/2/4 with 1 m: all classes 0.34/0.50/0.78, Cars 0.25/0.39/0.69)."""
        boxes = class_boxes(batch.gt_boxes, batch.gt_names, self.coder.classes)
        return boxes_mask(boxes, self.grid, self.mask_dilation_m if dilation_m is None else dilation_m,
                          downsample=downsample)

    def loss(self, out: DetectorOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        targets = self.coder.encode(batch.gt_boxes, batch.gt_names, self.out_grid)
        terms: LossTerms = detection_loss(out.heatmap, out.regression, targets)
        total = terms.total
        logs = {"loss/cls": terms.cls.detach(), "loss/reg": terms.reg.detach()}
        if out.mask_logits is not None:
            d = self.mask_net.downsample
            target = self.object_mask(batch, downsample=d).to(out.mask_logits)
            ml = mask_loss(out.mask_logits, target, self.mask_loss_kind)
            total = total + self.mask_loss_weight * ml
            logs["loss/mask"] = ml.detach()
        logs["loss/total"] = total.detach()
        return total, logs

    # --- inference ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, out: DetectorOutput, **kwargs) -> list[Detections]:
        t0 = time.perf_counter()
        dets = self.coder.decode(out.heatmap, out.regression, self.out_grid, **kwargs)
        self._tick(out.times, "decode", t0)
        return dets
