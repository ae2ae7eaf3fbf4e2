"""The sparse network on block lists: one host read per batch, none inside the network.

Every sparse unit runs on a :class:`~detector.ops.capacity.BlockList` (:func:`~detector.nn.chain.chain_capacity`).
A stage's lists have a fixed number of rows, its *capacity*: on a GPU a bucket (so that shapes repeat and a
captured graph per bucket is replayed, :mod:`detector.nn.graphs`), elsewhere exactly the stage's count (padding
rows would only be computed and thrown away: :func:`~detector.ops.capacity.uses_buckets`). The counts of every
stage are read once, with the plan:

    caps = plan_capacities(net, x, mask, modes)          # THE host read of the batch: every stage's count
    feats, overflow, counts = forward_capacity(net, x, mask, modes, caps)   # none inside
    feats = run_checked(net, x, mask, modes, caps)       # + one read of the overflow flag; reruns if set

A stage's capacities of None take lists of exactly the active blocks (``reduce_mask``: a data-dependent count, the
dynamic dimension of an exported program, :mod:`detector.export`).

Training: a batch norm in training mode is not folded; its convolution runs unfused and the BN takes the batch
moments of the level's mask pixels in the active rows' tile regions (padding rows left out, the count a device
tensor: no read); the backward is autograd's through the ops. Synchronized BN across processes (DDP): each slot's
moments of this process's pixels, all-reduced (:func:`~detector.nn.norm.sync_moments`).

Capacity overflow (a list shorter than the active blocks, e.g. a graph captured for a smaller bucket) is never
silent: every list's ``overflow`` flag is OR-ed on the device into the returned flag, and :func:`run_checked`
reruns such a batch at the buckets of its true counts (the last bucket is the whole grid), with a warning in the
log. The whole detector (backbone, neck and head) runs on the same functions: ``BevDetector.capacity_forward``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch.utils.checkpoint import checkpoint

from detector.ops.capacity import BlockList, uses_buckets

from .chain import SparseConvChain, chain_capacity, chain_list
from .geometry import binary_mask
from .plan import AUTO, DENSE, Plan, StageInput, list_rows, settle

__all__ = ["chain_capacity", "region", "stage_capacity", "plan_capacities", "forward_capacity", "run_checked",
           "StageCapacity", "capacities", "decide_lists", "chain_list", "run_chain", "rerun_warning"]

log = logging.getLogger(__name__)

StageCapacity = tuple[int, int]  # (capacity of the first unit's list, of the other units' list)

def stage_capacity(stage: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, tile: int,
                   caps: StageCapacity | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One stage sparse at ``tile`` on lists of capacities ``caps`` (None: exactly the active blocks): (output, the
    binary mask at the output resolution, overflow flag, the lists' true counts); with capacities, no host read."""
    units, tile = list(stage.units), int(tile)
    first = units[0]
    mask = first.binary(mask)
    bl = chain_list(first, mask, tile, None if caps is None else int(caps[0]))
    x_in = x
    x = first(x, mask=mask, blocks=bl)
    overflow, counts = bl.overflow, [bl.count]
    mask = bl.mask
    if len(units) > 1:
        br = chain_list(units[1], mask, tile, None if caps is None else int(caps[1]))
        for u in units[1:]:  # in place into the stage's own intermediates only
            x = u(x, mask=mask, blocks=br, inplace=x is not x_in)
        overflow, counts = overflow | br.overflow, counts + [br.count]
    return x, mask, overflow, counts


def _check_modes(net: torch.nn.Module, modes: Sequence[int | str]) -> list[int | str]:
    modes = list(modes)
    if len(modes) != len(net.stages) or any(m != DENSE and (isinstance(m, bool) or not isinstance(m, int))
                                            for m in modes):
        raise ValueError(f"capacity path: modes must be a tile or 'dense' per stage ({len(net.stages)}), got {modes}")
    return modes


def forward_capacity(net: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, modes: Sequence[int | str],
                     caps: Sequence[StageCapacity | None], times: dict[str, float] | None = None,
                     keep: Collection[int] | None = None) -> tuple[list[torch.Tensor | None], torch.Tensor, list]:
    """The backbone (a :class:`~detector.nn.resnet.SparseResNet`) with ``modes[i]`` (a tile, or 'dense') and the
    list capacities ``caps[i]`` per stage (None: exactly the active blocks): (the stages' features, the device-side
    overflow flag, each stage's true counts as device tensors). With capacities no host read; compiles with
    ``fullgraph=True``. ``times``: if given, each stage's wall seconds are added to it under ``backbone/<stage>``
    (synchronizing on CUDA). ``keep``: the features returned (indices into them; None: all) - the others are None,
    freed once the next stage has read them (a sparse stage keeps no map of its input). A stage named in
    ``net.checkpoint_stages`` keeps, in a training step, only its input for the backward and runs its forward again
    there (``torch.utils.checkpoint``, non-reentrant): the same values and gradients, its activations alive only
    while its own backward runs."""
    modes = _check_modes(net, modes)
    # None: the dense network (every mode 'dense'); else made binary once, at the units' common tol
    mask = None if mask is None else binary_mask(mask.to(x.dtype), net.tol)
    if net.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    overflow = torch.zeros((), dtype=torch.bool, device=x.device)
    feats, counts = [], []
    for i, stage in enumerate(net.stages):
        t0 = _now(x) if times is not None else 0.0
        with region(f"backbone/{net.stage_names[i]}", times is not None):
            if net.training and torch.is_grad_enabled() and net.stage_names[i] in net.checkpoint_stages:
                x, mask, ovf, cnt = checkpoint(_stage, stage, x, mask, modes[i], caps[i], use_reentrant=False,
                                               context_fn=lambda st=stage: (nullcontext(), _statistics_kept(st)))
            else:
                x, mask, ovf, cnt = _stage(stage, x, mask, modes[i], caps[i])
        overflow = overflow | ovf
        counts.append(cnt)
        if i > 0:
            feats.append(x if keep is None or i - 1 in keep else None)
        if times is not None:
            key = f"backbone/{net.stage_names[i]}"
            times[key] = times.get(key, 0.0) + _now(x) - t0
    return feats, overflow, counts


def region(name: str, on: bool):  # noqa: ANN201
    """A named region of the forward in a ``torch.profiler`` trace (where timing is on; otherwise nothing)."""
    return torch.profiler.record_function(name) if on else nullcontext()


def _stage(stage: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None, mode: int | str,
           cap: StageCapacity | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list]:
    """One stage at ``mode``: (output, its mask, overflow flag, the lists' counts)."""
    if mode == DENSE:
        x, mask = stage(x, mask, dense=True)
        return x, mask, torch.zeros((), dtype=torch.bool, device=x.device), []
    return stage_capacity(stage, x, mask, int(mode), cap)


@contextmanager
def _statistics_kept(stage: torch.nn.Module):  # noqa: ANN202
    """A checkpointed stage's recomputation leaves its batch norms' running statistics as the forward left them
    (the recomputed forward normalizes with the same batch moments, and would count the batch twice)."""
    bufs = [b for m in stage.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for b in m.buffers()]
    kept = [b.clone() for b in bufs]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, k in zip(bufs, kept, strict=True):
                b.copy_(k)


def _now(x: torch.Tensor) -> float:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


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
    """The plan of a batch from its plan ``inputs`` (counts unread): ONE host read of all the
    counts, the modes (``planner``'s choice, priced for this path and for a training step or inference, where a
    setting is 'auto'; else the settings) and the list capacities of every stage: buckets on a GPU, the counts
    elsewhere (:func:`~detector.ops.capacity.uses_buckets`)."""
    inputs = settle(inputs)  # the one read
    plan = planner.decide(inputs, device, dtype, training) if AUTO in settings else None
    modes = list(plan.choices) if plan is not None else list(settings)
    return modes, capacities(inputs, modes, smallest, uses_buckets(device)), plan


def plan_capacities(net: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor,
                    modes: Sequence[int | str] | None = None, smallest: int = 8
                    ) -> tuple[list[int | str], list[StageCapacity | None]]:
    """Each stage's mode and the smallest buckets that hold its active blocks (:func:`decide_lists` on
    :meth:`SparseResNet.plan_inputs`)."""
    settings = _settings(net, modes)
    inputs = net.plan_inputs(tuple(x.shape), mask.to(x.dtype), settings)
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


def run_chain(chain: SparseConvChain, x: torch.Tensor, mask: torch.Tensor | None,
              mode: int | str | BlockList | None = None) -> torch.Tensor:
    """``chain`` on ``x`` and its level's ``mask`` - the one call the neck and the head make: no mask: the dense twin;
    ``mode`` a :class:`BlockList` (made by :func:`chain_list`): on it, at the tile it was made for; a tile (None: the
    chain's block size): on the list of that tile's active blocks; 'dense': the whole map, the mask applied. The
    same values every way."""
    if mask is None:
        return chain(x)
    if mode == DENSE:
        return chain(x, mask=mask, dense=True)
    if not isinstance(mode, BlockList):
        mode = chain_list(chain, mask, chain.block_size if mode is None else int(mode))
    return chain(x, mask=mask, blocks=mode)
