"""Peak memory of a training step and of inference, estimated from shapes (the model is not run), and measured.

:func:`estimate` walks the detector's sparse chains (stem, backbone units, neck smoothing convs, head tower) with
their block geometry (:meth:`~detector.nn.chain.SparseConvChain.geometry`) and counts, for a batch of ``N`` frames
and an active-tile share per stage, the tensors that are alive at the peak:

- parameters, their gradients and the optimizer state (``state_per_param`` tensors like each parameter: Adam 2);
- training: the activations autograd saves - per conv-BN-ReLU two maps of the conv's output (the conv output BN
  keeps, the ReLU output the next conv keeps), on the whole map (dense) or on the ``K`` gathered blocks with their
  halo (sparse: ``K = share * N * blocks per frame``; plus the gathered input blocks and the relu's output
  tiles); full maps a later layer keeps (stage outputs for the neck's laterals, the sparse output maps the head
  reads); the peak is the end of the forward (the backward frees saved maps as it makes gradients) or, sparse,
  a stage at work (its full-size input and output maps beside the blocks saved so far); a stage in
  ``model.checkpoint_stages`` saves nothing but its input, and peaks again when its backward recomputes it;
- inference: the input, the stage outputs the neck reads later and the largest chain's working set (its input
  and output maps, gathered blocks, two block tensors of its widest level; a dense conv's input reorder);
- the mask network (``mask=predicted``) at its 1/d resolution: its logits, and in training its pooled input and
  two maps per conv-BN-ReLU saved for backward.

:func:`measure_peak` measures a callable's peak from the CPU allocator's events (``torch.profiler`` memory
events, every allocation and free of the c10 allocator), on top of the bytes of the tensors alive before it; on
CUDA ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from detector.models.detector import BevDetector, masks_at_strides
from detector.nn.chain import SparseConvChain
from detector.nn.resnet import downsample_mask

__all__ = ["MemoryEstimate", "estimate", "stage_shares", "largest_fitting", "measure_peak", "tensor_bytes", "MB"]

MB = 2**20


@dataclass
class MemoryEstimate:
    batch: int
    mode: str  # "train" or "infer"
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward (train) or live maps (infer)
    workspace: int  # inference: the largest chain's working set (training: 0, the peak is the forward's end)
    per_stage: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.workspace

    @property
    def peak_mb(self) -> float:
        return self.peak / MB

    def describe(self) -> str:
        """One line: the peak and its parts in MB."""
        what = "training step" if self.mode == "train" else "inference"
        parts = ", ".join(f"{k} {getattr(self, k) / MB:.0f}" for k in
                          ("params", "grads", "optimizer", "activations", "workspace"))
        return f"memory estimate, batch {self.batch}: {what} peak ~{self.peak_mb:.0f} MB ({parts} MB)"


@dataclass
class _Chain:
    name: str
    chain: SparseConvChain
    in_hw: tuple[int, int]
    share: float  # active-tile share of its grid (1.0: dense)
    dense: bool
    blocks: int | None = None  # active blocks, when counted from a mask
    first: bool = False  # the backbone's first chain (its input is the BEV tensor's channels-last copy)


def _count(chain: SparseConvChain, hw: tuple[int, int], mask: torch.Tensor | None) -> int | None:
    """Active blocks of ``mask`` (at the chain's input resolution ``hw``) on the chain's grid, as the chain selects
    them (None without a mask)."""
    if mask is None:
        return None
    return chain.active_blocks(mask).capacity


def _chains(model: BevDetector, shares: Sequence[float], dense: bool, mask: torch.Tensor | None = None
            ) -> tuple[list[_Chain], list[tuple[int, int]]]:
    """The detector's chains in forward order with their input sizes and shares (one share per stage: stem,
    backbone stages, neck levels, head) or, given a ``mask``, their active block counts; the stage output sizes."""
    H, W = model.grid.H, model.grid.W
    out, stage_hw = [], []
    names = model.backbone.stage_names
    m = mask
    for i, stage in enumerate(model.backbone.stages):
        for u, unit in enumerate(stage.units):
            out.append(_Chain(f"{names[i]}.{u}", unit, (H, W), shares[i], dense, _count(unit, (H, W), m), not out))
            H, W = unit.geometry(H, W).levels[-1].map_size
            if u == 0 and unit.stride == 2 and m is not None:
                m = downsample_mask(m)
        if i > 0:
            stage_hw.append((H, W))
    nb = len(model.backbone.stages)
    level = masks_at_strides(mask, model.neck.strides) if mask is not None else [None] * len(model.neck.smooth)
    for j in reversed(range(len(model.neck.smooth))):
        hw = stage_hw[model.neck.use[j]]
        smooth = model.neck.smooth[j]
        out.append(_Chain(f"neck{j}", smooth, hw, shares[nb + j], dense, _count(smooth, hw, level[j])))
    hw = stage_hw[model.neck.use[0]]
    out.append(_Chain("head", model.head.tower, hw, shares[-1], dense, _count(model.head.tower, hw, level[0])))
    return out, stage_hw


def _chain_bytes(c: _Chain, N: int, f: int, train: bool) -> tuple[int, int, int, int]:
    """(saved for backward, working set, output map bytes, largest block tensor after the first) of one chain."""
    ch = c.chain
    geo = ch.geometry(*c.in_hw)
    chans = [ch.in_channels] + [conv.out_channels for conv in ch.convs]
    maps = [N * ci * lv.map_size[0] * lv.map_size[1] * f for ci, lv in zip(chans, geo.levels, strict=True)]
    out_map = maps[-1]
    if c.dense:  # live while it runs: its input and two maps of its widest level (the output among them); an
        # input whose channel count is not a multiple of 4 is copied by the CPU convolution (measured: 11 BEV
        # channels at bev=small are, 36 at bev=kitti are not). The first chain's input is the BEV tensor (made
        # channels-last by the voxelizer), which its first conv keeps for backward: counted once, as the BEV.
        saved = 2 * sum(maps[1:]) + (out_map if ch.proj is not None else 0)
        copy = maps[0] if chans[0] % 4 else 0
        proj = 2 * out_map if ch.proj is not None else 0  # the projection's output and the sum
        return (saved if train else 0), (0 if c.first else maps[0]) + copy + 2 * max(maps[1:]) + proj, out_map, 0
    bp = geo.block
    K = c.blocks if c.blocks is not None else int(round(c.share * N * bp.bcount_h * bp.bcount_w))
    blocks = [K * ci * lv.extent[0] * lv.extent[1] * f for ci, lv in zip(chans, geo.levels, strict=True)]
    tiles = K * chans[-1] * geo.tile[0] * geo.tile[1] * f
    identity = ch.shortcut == "identity"
    new_map = 0 if identity else out_map  # identity units write into their input (the stage's own map)
    # training saves the gathered input, per conv-BN-ReLU the conv output (BN keeps it) and the ReLU output (the
    # next conv keeps it), a residual unit's output tiles and a post-activation projection's gathered input; not
    # the output map: the scatter's backward needs none, and the maps still alive at the end of the forward are the
    # ones a later layer reads (estimate: kept)
    saved = blocks[0] + 2 * sum(blocks[1:]) + (tiles if identity or ch.proj is not None else 0)
    if ch.proj is not None and not ch.preact:  # the projection's own gather: its tile's input pixels at stride S
        S = ch.stride
        saved += K * chans[0] * ((geo.tile[0] - 1) * S + 1) * ((geo.tile[1] - 1) * S + 1) * f
    # working set: the input map (not the first chain's: the BEV tensor, counted as such), its gathered blocks, two
    # block tensors of the widest level, the projection's tiles (computed first, alive until the scatter), the
    # scatter's tiles (an identity unit's: the map's old tiles, their sum with the new ones and its ReLU; else the
    # masked tiles) and the output map
    proj = tiles if ch.proj is not None else 0
    scatter = 3 * tiles if identity else tiles
    src = 0 if c.first else maps[0]
    if not train:  # inference frees as it goes: each convolution's input, output and its level's zeroing, then the
        # last convolution's input and output tiles, the scatter's tensors and the output map
        convs = max(a + 2 * b for a, b in itertools.pairwise(blocks))
        return 0, src + max(convs + proj, blocks[-2] + blocks[-1] + proj + scatter + new_map), out_map, 0
    return saved, src + blocks[0] + 2 * max(blocks[1:]) + proj + scatter + new_map, out_map, max(blocks[1:])


def _folded_bytes(model: BevDetector) -> int:
    """Inference keeps each convolution's weight with its batch norm folded in (:func:`~detector.nn.norm.fold`):
    a second copy of those weights."""
    total = 0
    for c in model.modules():
        if isinstance(c, SparseConvChain):
            folded = list(c.convs) if not c.preact else list(c.convs)[:-1]
            if c.shortcut == "projection" and c.proj_bn is not None:
                folded.append(c.proj)
            total += sum(m.weight.numel() * m.weight.element_size() for m in folded)
    return total


def _mask_net_bytes(model: BevDetector, N: int, f: int, train: bool) -> tuple[int, int]:
    """(alive at the peak, working set) of the mask network ((0, 0) without one), at its 1/d resolution: the
    logits (the detector's output keeps them); in training also what its backward needs - its max-pooled
    input, per conv-BN-ReLU the conv output (BN keeps it) and the ReLU output (the next conv keeps it) - and
    the loss's maps of the logits' size. The full-resolution maps it makes (its upsampled mask, the object
    mask, their union) are freed by the end of the forward but the computation mask, counted with the BEV
    tensor. Inference: its working set is the larger of its pooling's (the input reduced over rows only, ``d`` times
    the pooled input, beside the pooled input: :func:`~detector.nn.geometry.pool_max`) and its convolutions' (the
    pooled input and two maps of its widest conv)."""
    net = model.mask_net
    if net is None:
        return 0, 0
    d, H, W = net.downsample, model.grid.H, model.grid.W
    px = N * (-(-H // d)) * (-(-W // d)) * f
    convs = [m for m in net.net if isinstance(m, torch.nn.Conv2d)]
    if not train:
        C = model.grid.C
        return px, px * max((d + 1) * C if d > 1 else 0, C + 2 * max(c.out_channels for c in convs))
    return px * (model.grid.C + sum(2 * c.out_channels for c in convs[:-1]) + 4), 0


def estimate(model: BevDetector, batch: int, shares: Sequence[float] | float | None, train: bool,
             itemsize: int = 4, state_per_param: int = 2, mask: torch.Tensor | None = None) -> MemoryEstimate:
    """Predicted peak memory of a training step (``train``) or of inference for ``batch`` frames.

    ``shares``: the active-tile share per stage (stem, backbone stages, neck levels, head; one number: every
    stage), or None for the dense network; or ``mask`` [N, 1, H, W] (the computation mask itself: the
    blocks it activates are counted per chain with ``reduce_mask``, no layer runs). Block sizes are the chains'
    current tiles (a ``block_size=auto`` plan is not evaluated: set fixed tiles, or the estimate uses 16).
    """
    n_stages = len(model.backbone.stages) + len(model.neck.smooth) + 1
    dense = shares is None
    if shares is None or isinstance(shares, (int, float)):
        shares = [1.0 if shares is None else float(shares)] * n_stages
    if len(shares) != n_stages:
        raise ValueError(f"estimate: {n_stages} shares needed (stem, stages, neck levels, head), got {len(shares)}")
    N, f = batch, itemsize
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    P += sum(b.numel() * b.element_size() for b in model.buffers())
    chains, stage_hw = _chains(model, shares, dense, None if dense else mask)
    C, H, W = model.grid.C, model.grid.H, model.grid.W
    bev = N * C * H * W * f + N * H * W * f  # BEV tensor + mask
    feats = [N * c * h * w * f for c, (h, w) in zip(model.backbone.out_channels, stage_hw, strict=True)]
    kept = sum(feats[i] for i in model.neck.use)  # the laterals read the stage outputs at the end of the backbone
    per_stage, saved_total, work_max = {}, 0, 0
    n_back = sum(len(s.units) for s in model.backbone.stages)
    ends = {sum(len(s.units) for s in model.backbone.stages[: i + 2]) - 1: feats[i] for i in model.neck.use}
    alive = 0  # stage outputs produced so far that the neck reads later
    # checkpointed stages (training): their saved activations exist only while their own backward recomputes them;
    # the step keeps their input instead. Dense: a stage's input is the previous stage's output, which that stage
    # saved - unless it is checkpointed too: so each checkpointed stage's output map is counted. Sparse: no stage
    # saves a map; a checkpointed stage's input is counted unless it is the BEV tensor or a map the neck reads.
    ckpt = model.backbone.checkpoint_stages if train else frozenset()
    names = model.backbone.stage_names
    stage_of = [c.name.split(".")[0] for c in chains]
    # stage -> what its recomputation holds in the backward: the saved before it, its own saved, two maps of its
    # output (dense: its gradient and one the backward makes inside it; sparse: the recomputed output and its
    # gradient), its input's gradient (not the stem's) and, sparse, the gradients of its widest blocks
    recomputed: dict[str, list[int]] = {}
    inputs_kept = walk = 0
    for k, c in enumerate(chains):
        saved, work, out_map, block = _chain_bytes(c, N, f, train)
        in_map = N * c.chain.in_channels * c.in_hw[0] * c.in_hw[1] * f
        per_stage[c.name] = saved if train else work
        if stage_of[k] in ckpt:
            si = names.index(stage_of[k])
            first_chain = stage_of[k] not in recomputed
            if dense and (k + 1 == n_back or stage_of[k + 1] != stage_of[k]):  # the stage's output
                inputs_kept += out_map
            elif not dense and first_chain and si > 0 and si - 2 not in model.neck.use:  # its input
                inputs_kept += in_map
            r = recomputed.setdefault(stage_of[k], [saved_total, 0, 0, in_map if si > 0 else 0, 0])
            r[1] += saved
            r[2] = 2 * out_map  # dense: the output's gradient and one inside; sparse: the output and its gradient
            r[4] = max(r[4], 2 * block)  # sparse: the blocks' gradients
            saved = 0
        saved_total += saved
        work_max = max(work_max, work + (alive if k < n_back else kept))
        if train and not c.dense and k < n_back:  # a sparse stage at work: its maps beside what is saved so far
            walk = max(walk, saved_total + alive + work)
        alive += ends.get(k, 0)
    neck_c, (h0, w0) = model.neck.out_channels, stage_hw[model.neck.use[0]]
    neck_maps = sum(N * neck_c * stage_hw[i][0] * stage_hw[i][1] * f for i in model.neck.use)
    head_out = N * (model.head.heatmap.out_channels + model.head.regression.out_channels) * h0 * w0 * f
    net_alive, net_work = _mask_net_bytes(model, N, f, train)
    if net_alive:
        per_stage["mask_net"] = net_alive if train else net_work
    if not train:
        return MemoryEstimate(N, "infer", P + _folded_bytes(model), 0, 0, bev + net_alive, max(work_max, net_work),
                              per_stage)
    extra = net_alive + neck_maps + head_out * 3  # the neck's sums (smoothing inputs), head outputs and loss terms
    if not dense:
        extra += kept + N * neck_c * h0 * w0 * f  # sparse: the stage outputs and the tower output kept for backward
    # the peak is the largest of: the end of the forward (the backward frees each layer's saved maps as it makes
    # their gradients), a sparse stage's forward (its input and output maps at full size beside the blocks saved so
    # far and the mask net's tensors: at bev=kitti the stem's and stage 1's maps) and a checkpointed stage's
    # recomputation in the backward
    end = bev + saved_total + extra + inputs_kept
    peak = max([end, bev + net_alive + walk] + [bev + net_alive + sum(r) for r in recomputed.values()])
    return MemoryEstimate(N, "train", P, P, state_per_param * P, peak, 0, per_stage)


def stage_shares(model: BevDetector, mask: torch.Tensor) -> list[float]:
    """The active-tile share per stage (stem, backbone stages, neck levels, head) of a computation ``mask``:
    its active blocks on each stage's grids over the grids' blocks (``reduce_mask`` only)."""
    n_back = len(model.backbone.stages)
    chains, _ = _chains(model, [1.0] * (n_back + len(model.neck.smooth) + 1), False, mask)
    groups: dict[str, list[int]] = {}
    for c in chains:
        bp = c.chain.geometry(*c.in_hw).block
        key = c.name.split(".")[0]
        k, n = groups.get(key, [0, 0])
        groups[key] = [k + c.blocks, n + mask.shape[0] * bp.bcount_h * bp.bcount_w]
    names = model.backbone.stage_names + [f"neck{j}" for j in range(len(model.neck.smooth))] + ["head"]
    return [groups[n][0] / groups[n][1] for n in names]


def largest_fitting(model: BevDetector, shares: Sequence[float] | float | None, budget: float,
                    max_batch: int) -> int:
    """The largest batch (1 ... ``max_batch``) whose training step is predicted to fit in ``budget`` bytes;
    0 when not even batch 1 fits."""
    best = 0
    for b in range(1, max_batch + 1):
        if estimate(model, b, shares, train=True).peak > budget:
            break
        best = b
    return best


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an iterable of tensors, None skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure_peak(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before (CPU: the profiler's memory
    events of the c10 allocator; CUDA: ``max_memory_allocated``)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


