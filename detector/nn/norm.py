"""Batch normalization on sparse blocks: statistics over tile regions, exact w.r.t. the dense twin.

In a sparse unit every block carries a halo (pixels that belong to neighbouring tiles) and, at the
map border, padding pixels. Training-mode statistics of a BN layer are therefore taken over the
*tile regions* of the active blocks only, in-map pixels only (:mod:`detector.nn.geometry`): every
active pixel is counted once, so with an all-ones mask they equal ``nn.BatchNorm2d``'s statistics of
the dense map. The normalization itself (``z * scale + shift``) is applied to the whole block, halo
included, with those statistics.

Running statistics follow ``nn.BatchNorm2d`` exactly: ``running_mean <- (1 - f) running_mean + f mean``,
``running_var <- (1 - f) running_var + f var * n / (n - 1)`` (unbiased), ``f = momentum`` or the
cumulative ``1 / num_batches_tracked`` when ``momentum`` is None.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ops import region_norm_grad, region_sums
from ..ops.reference import region_rows
from .geometry import Level, LevelMasks

__all__ = [
    "Moments",
    "batch_norm_native",
    "blocks_batch_norm",
    "list_moments",
    "normalize",
    "uses_batch_stats",
    "region_moments",
    "region_batch_norm",
    "list_batch_norm",
    "combine_moments",
    "scale_shift",
    "running_scale_shift",
    "fold",
    "update_running_stats",
    "needs_sync",
    "sync_moments",
]


@dataclass(frozen=True)
class Moments:
    """Per-channel mean and biased variance of ``count`` pixels (differentiable tensors, except those
    :func:`region_batch_norm` returns for the running statistics); ``count`` a device tensor on the capacity path
    (:func:`list_batch_norm`)."""

    mean: torch.Tensor
    var: torch.Tensor
    count: int | torch.Tensor


def uses_batch_stats(bn: nn.BatchNorm2d) -> bool:
    """Whether ``bn`` normalizes with batch statistics (as ``nn.BatchNorm2d.forward`` decides)."""
    return bn.training or not bn.track_running_stats


def region_moments(z: torch.Tensor, level: Level, masks: LevelMasks) -> Moments:
    """Moments of ``z [K, C, e_h, e_w]`` over the tile regions' in-map pixels (``masks.count`` of them).

    Two passes (mean, then mean squared deviation) over the region's ``[pixels, C]`` rows, a view for a
    channels-last ``z`` whose region is the whole block; much faster on CPU than ``torch.var_mean``
    over dims (0, 2, 3) of a channels-last tensor.
    """
    rows = region_rows(z, level.offset, level.region, masks.region)  # tile regions past the map: in-map pixels
    n = float(masks.count)
    mean = _channel_sums(rows) / n
    d = rows - mean
    return Moments(mean=mean, var=_channel_sums(d * d) / n, count=masks.count)


def _channel_sums(rows: torch.Tensor) -> torch.Tensor:
    """Per-channel sums of ``rows [pixels, C]``. torch's CPU reduction over the rows of a long, narrow matrix is slow:
    it runs down few, long columns; summing ``1024 // C`` rows side by side first (a view, so each reduction row is
    1024 values wide) is several times faster there. Smaller or wider matrices, where the direct sum is as fast or
    faster, and other devices sum directly (the timings: docs/speed.md)."""
    P, C = rows.shape
    if rows.device.type != "cpu" or C > 48 or P * C < 2**19:
        return rows.sum(0)
    k = 1024 // C
    q = P // k * k
    return rows[:q].reshape(-1, k * C).sum(0).view(k, C).sum(0) + rows[q:].sum(0)


def _first_region_pixel(z: torch.Tensor, level: Level, masks: LevelMasks) -> torch.Tensor:
    """The channel values ``[C]`` of the first counted tile-region pixel of ``z [K, C, e_h, e_w]``."""
    (ph, pw), (rh, rw) = level.offset, level.region
    if masks.region is None:
        return z[0, :, ph, pw]
    p = masks.region[:1]  # a tensor: no host sync on a GPU
    return z[p // (rh * rw), :, ph + p // rw % rh, pw + p % rw][0]


class _RegionBatchNorm(torch.autograd.Function):
    """``y = (z - mean) * rsqrt(var + eps) * weight + bias`` on all of ``z [K, C, e_h, e_w]`` (halo included),
    ``mean`` and ``var`` (biased) taken over the tile regions' in-map pixels only; returns ``(y, mean, var)``
    (the moments for the running statistics, not differentiable).

    The backward is written out instead of recorded: with ``n`` region pixels, ``a = weight * inv``,
    ``sum_g`` and ``sum_gx = sum g * (z - mean)`` over all of ``z``'s pixels (y depends on every pixel, the
    moments on the region's only), ``dz = g * a`` everywhere plus ``-a / n * (sum_g + (z - mean) * inv^2 *
    sum_gx)`` on the region's pixels; ``dweight = sum_gx * inv``, ``dbias = sum_g`` - nn.BatchNorm2d's
    backward when the region is the whole map. The moments are shifted sums (``c``: a region pixel's values,
    near the mean, so that ``E[(z - c)^2] - E[z - c]^2`` keeps the variance's precision) and the gradient's sums
    and ``dz`` one pass each (:func:`detector.ops.region_sums`, :func:`detector.ops.region_norm_grad`: CPU
    kernels): two passes over ``z`` forward (the sums, then ``y``) and two backward.
    """

    @staticmethod
    def forward(ctx, z, weight, bias, level: Level, masks: LevelMasks, eps: float):
        C = z.shape[1]
        n = float(masks.count)
        # one pass of shifted sums: E[z - c], E[(z - c)^2] with c a region pixel's values (near the mean, so the
        # variance E[(z - c)^2] - E[z - c]^2 keeps its precision, where c = 0 would lose it to a large mean)
        c = _first_region_pixel(z, level, masks)
        d = region_sums(z, None, level.offset, level.region, masks.region, center=c) / n
        mean = (c.double() + d[0]).to(z.dtype)
        var = (d[1] - d[0] * d[0]).clamp_min(0).to(z.dtype)
        inv = torch.rsqrt(var + eps)
        scale = inv if weight is None else weight * inv
        shift = -mean * scale if bias is None else bias - mean * scale
        y = torch.addcmul(shift.view(1, C, 1, 1), z, scale.view(1, C, 1, 1))
        ctx.save_for_backward(z, weight, mean, inv)
        ctx.level, ctx.masks = level, masks
        ctx.mark_non_differentiable(mean, var)
        ctx.set_materialize_grads(False)  # no zero gradients made for mean and var
        return y, mean, var

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _mean_grad, _var_grad):
        if g is None:  # y not used (grads are not materialized): nothing flows back
            return None, None, None, None, None, None
        z, weight, mean, inv = ctx.saved_tensors
        level, masks = ctx.level, ctx.masks
        n = float(masks.count)
        dt = torch.promote_types(g.dtype, z.dtype)  # under autocast y (float32) may be wider than z (bfloat16)
        g, z = g.to(dt), z.to(dt)
        sums = region_sums(g, z, (0, 0), tuple(z.shape[2:]))  # over all of z's pixels, in float64
        sum_g = sums[0]
        sum_gx = sums[1] - mean.double() * sum_g  # sum g * (z - mean)
        a = inv if weight is None else weight * inv
        c1 = -a * inv * inv * sum_gx.to(z.dtype) / n
        c0 = -a * sum_g.to(z.dtype) / n - mean * c1  # region correction: z * c1 + c0
        dz = region_norm_grad(g, z, a, c0, c1, level.offset, level.region, masks.region)
        sum_g, sum_gx = sum_g.to(z.dtype), sum_gx.to(z.dtype)
        dweight = None if weight is None or not ctx.needs_input_grad[1] else sum_gx * inv
        dbias = sum_g if ctx.needs_input_grad[2] else None
        return dz, dweight, dbias, None, None, None


def region_batch_norm(bn: nn.BatchNorm2d, z: torch.Tensor, level: Level, masks: LevelMasks
                      ) -> tuple[torch.Tensor, Moments]:
    """``bn`` applied to all of ``z [K, C, e_h, e_w]`` with the batch moments of its tile regions' in-map
    pixels (:func:`region_moments`'s, not differentiable: they feed the running statistics), the gradient
    flowing through the moments as it does through nn.BatchNorm2d's (:class:`_RegionBatchNorm`)."""
    weight, bias = (bn.weight, bn.bias) if bn.affine else (None, None)
    y, mean, var = _RegionBatchNorm.apply(z, weight, bias, level, masks, float(bn.eps))
    return y, Moments(mean=mean, var=var, count=masks.count)


def blocks_batch_norm(bn: nn.BatchNorm2d, z: torch.Tensor, level: Level, masks: LevelMasks
                      ) -> tuple[torch.Tensor, Moments | None]:
    """``bn`` on the blocks ``z [K, C, e_h, e_w]`` (every row an active block) with the batch moments of their tile
    regions' counted pixels (``masks``): nn.BatchNorm2d's own fused kernel where the region is the whole block and
    every pixel counts (it updates the running statistics itself: no moments returned), else
    :func:`region_batch_norm` (the caller updates the running statistics with the moments)."""
    if level.offset == (0, 0) and level.region == level.extent and masks.region is None and masks.count > 1:
        return batch_norm_native(bn, z), None
    return region_batch_norm(bn, z, level, masks)


def list_moments(z: torch.Tensor, weights: torch.Tensor) -> Moments:
    """The moments (differentiable, in at least float32) of the pixels of ``z [capacity, C, e_h, e_w]`` (a padded
    block list's blocks) where ``weights [capacity, 1, e_h, e_w]`` is set, without a host read: the count is a device
    tensor, and no pixel gives zero moments. Values outside the weights - a padding row, even an unwritten one -
    never reach them."""
    acc = torch.promote_types(z.dtype, torch.float32)
    on = weights > 0
    zc = torch.where(on, z, 0).to(acc)
    n = on.sum(dtype=acc)
    denom = n.clamp_min(1)
    mean = zc.sum((0, 2, 3)) / denom
    d = torch.where(on, zc - mean.view(1, -1, 1, 1), 0)
    return Moments(mean=mean, var=(d * d).sum((0, 2, 3)) / denom, count=n)


def normalize(bn: nn.BatchNorm2d, z: torch.Tensor, m: Moments) -> torch.Tensor:
    """``bn`` applied to ``z`` with the moments ``m`` (the gradient flows through them where they carry one)."""
    s, t = scale_shift(bn, m.mean, m.var)
    return torch.addcmul(t.view(1, -1, 1, 1).to(z.dtype), z, s.view(1, -1, 1, 1).to(z.dtype))


def list_batch_norm(bn: nn.BatchNorm2d, z: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, Moments]:
    """``bn`` applied to all of ``z [capacity, C, e_h, e_w]`` (a padded block list's blocks) with the batch
    moments of the pixels where ``weights`` is set (:func:`list_moments`: the active rows' tile regions, in-map
    pixels; the capacity path's rows past the count are left out), without a host read; an empty list gives zero
    moments (the caller's running statistics then stay as they are). The same statistics as
    :func:`region_batch_norm`'s; the gradient is autograd's of the moments, which is the one
    :class:`_RegionBatchNorm` writes out (``z`` outside the weights gets none through the moments)."""
    m = list_moments(z, weights)
    return normalize(bn, z, m), Moments(mean=m.mean.detach(), var=m.var.detach(), count=m.count)


def combine_moments(parts: list[Moments]) -> Moments:
    """Moments of the union of disjoint pixel sets (Chan et al.'s pairwise formula, all at once)."""
    parts = [p for p in parts if p.count > 0]
    if len(parts) == 1:
        return parts[0]
    n = sum(p.count for p in parts)
    mean = sum(p.mean * (p.count / n) for p in parts)
    var = sum((p.var + (p.mean - mean) ** 2) * (p.count / n) for p in parts)
    return Moments(mean=mean, var=var, count=n)


def scale_shift(
    bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)`` with ``bn(z) == z * scale + shift`` for statistics ``mean``, ``var``."""
    inv = torch.rsqrt(var + bn.eps)
    if bn.affine:
        scale = bn.weight * inv
        return scale, bn.bias - mean * scale
    return inv, -mean * inv


def running_scale_shift(bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)`` of ``bn`` in eval mode (running statistics)."""
    return scale_shift(bn, bn.running_mean, bn.running_var)


# without autograd, a convolution's weight with its batch norm folded in, per BN: (what it was made of, the pair)
_FOLDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fold(weight: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * scale, shift)``: a convolution's ``weight`` ``[CO, CI, kh, kw]`` with ``bn`` (running statistics)
    folded in. Without autograd made once per weight and statistics (their version counters): inference folds
    every unit's layers once, not per batch."""
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        s, t = running_scale_shift(bn)
        return weight * s.view(-1, 1, 1, 1), t

    if (torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.compiler.is_exporting()
            or torch.jit.is_tracing() or (weight.is_cuda and torch.cuda.is_current_stream_capturing())):
        return make()
    parts = (weight, bn.weight, bn.bias, bn.running_mean, bn.running_var)
    if any(p is not None and p.is_inference() for p in parts):  # no version counter to see a change by
        return make()
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device) if p is not None else None for p in parts)
    hit = _FOLDED.get(bn)
    if hit is None or hit[0] != key:
        hit = _FOLDED[bn] = (key, make())
    return hit[1]


def batch_norm_native(bn: nn.BatchNorm2d, z: torch.Tensor) -> torch.Tensor:
    """``bn(z)`` with batch statistics of all of ``z`` - exactly what ``nn.BatchNorm2d.forward`` does in
    training mode, running statistics included - for blocks whose tile region is the whole block."""
    if bn.training and bn.track_running_stats:
        bn.num_batches_tracked.add_(1)
        f = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
        return F.batch_norm(z, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, f, bn.eps)
    return F.batch_norm(z, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)


@torch.no_grad()
def update_running_stats(bn: nn.BatchNorm2d, m: Moments) -> None:
    """Update ``bn``'s running statistics with batch moments ``m`` exactly as ``nn.BatchNorm2d`` does. A count
    that is a device tensor (the capacity path) is not read: an empty batch then updates nothing by arithmetic."""
    if not (bn.training and bn.track_running_stats):
        return
    if isinstance(m.count, torch.Tensor):
        on = m.count > 0
        bn.num_batches_tracked.add_(on.to(bn.num_batches_tracked.dtype))
        tracked = bn.num_batches_tracked.clamp_min(1).to(m.mean.dtype)
        f = (1.0 / tracked if bn.momentum is None else torch.full_like(tracked, bn.momentum)) * on.to(m.mean.dtype)
        unbiased = m.var * (m.count / (m.count - 1).clamp_min(1)).to(m.var.dtype)
        bn.running_mean.mul_((1 - f).to(bn.running_mean.dtype)).add_((m.mean * f).to(bn.running_mean.dtype))
        bn.running_var.mul_((1 - f).to(bn.running_var.dtype)).add_((unbiased * f).to(bn.running_var.dtype))
        return
    if m.count == 0:
        return
    bn.num_batches_tracked.add_(1)
    f = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    unbiased = m.var.detach() * (m.count / max(m.count - 1, 1))
    bn.running_mean.mul_(1 - f).add_(m.mean.detach(), alpha=f)
    bn.running_var.mul_(1 - f).add_(unbiased, alpha=f)


def needs_sync(bn: nn.Module) -> bool:
    """Whether ``bn`` is a SyncBatchNorm that must combine its batch statistics across processes (DDP
    with ``sync_batchnorm``): training mode and more than one process."""
    return (
        isinstance(bn, nn.SyncBatchNorm)
        and uses_batch_stats(bn)
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(bn.process_group or dist.group.WORLD) > 1
    )


def sync_moments(bn: nn.SyncBatchNorm, m: Moments | None, like: torch.Tensor) -> Moments:
    """The moments of the union of every process's active pixels: one differentiable all-reduce of
    (count, sum, sum of squares). ``m`` None: this process has no active pixel (it still takes part in
    the collective, so that every process issues the same sequence of collectives). ``like``: a tensor
    with the dtype and device of the statistics."""
    import warnings

    with warnings.catch_warnings():  # the differentiable all-reduce; its successor is not differentiable yet
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed.nn.functional import all_reduce

    C = bn.num_features
    if m is None:  # a leaf that requires grad, so that backward takes part in the gradient all-reduce
        packed = like.new_zeros(2 * C + 1).requires_grad_(torch.is_grad_enabled())
    else:
        n = float(m.count)
        packed = torch.cat([m.mean * n, (m.var + m.mean * m.mean) * n, like.new_full((1,), n)])
    group = bn.process_group or dist.group.WORLD
    packed = all_reduce(packed, group=group)
    count = int(round(float(packed[-1].detach())))
    if count == 0:
        return Moments(mean=like.new_zeros(C), var=like.new_ones(C), count=0)
    mean = packed[:C] / count
    var = (packed[C : 2 * C] / count - mean * mean).clamp_min(0)
    return Moments(mean=mean, var=var, count=count)
