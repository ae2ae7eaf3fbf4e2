"""A sparse conv chain over its active blocks in chunks, with exact batch statistics (bounded memory).

When the active blocks' working tensors exceed the chain's ``memory_budget_mb``, the blocks are processed
in chunks. With training-mode BN the statistics are made exact by passes: pass ``l`` recomputes the chain
up to the first BN whose moments are unknown, chunk by chunk, and combines the chunks' moments
(synchronized across processes for a SyncBatchNorm, in the same order as the one-chunk path: the
post-activation projection's BN first, then the chain's BNs); a last pass computes the output tiles.
With autograd on, every chunk computation is checkpointed (``torch.utils.checkpoint``, non-reentrant), so
what is kept for backward is the chunks' indices, the moments and the output tiles, not the intermediate
activations; backward recomputes them. That trades compute (about ``L + 1`` forward passes, then a
recompute) for bounded memory; with the default budget a typical batch fits in one chunk.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from detector.ops import BlockParams, sparse_gather, sparse_scatter, sparse_scatter_
from detector.ops.formulas import keep_where, like_map

from .block_pass import BlockPass, Chain
from .geometry import ChainGeometry, LevelMasks
from .norm import (
    Moments,
    combine_moments,
    needs_sync,
    sync_moments,
    update_running_stats,
    uses_batch_stats,
)

__all__ = ["collect_targets", "run_chunked"]


def collect_targets(chain: Chain, known: list[Moments | None]) -> list[int]:
    """The BN slots one statistics pass collects, in the order their moments are synchronized: the
    post-activation projection's BN if unknown, then the first unknown chain BN (what
    ``BlockPass(collect=True).run`` computes)."""
    slots, L = chain.slots, len(chain.bns)
    targets = []
    if chain.proj_bn is not None and uses_batch_stats(chain.proj_bn) and known[L] is None:
        targets.append(L)
    targets += [j for j in range(L) if uses_batch_stats(slots[j]) and known[j] is None][:1]
    return targets


def _collect_chunk(
    chain: Chain,
    x: torch.Tensor,
    ic: torch.Tensor,
    geo: ChainGeometry,
    mc: list[LevelMasks],
    known: list[Moments | None],
    grad: bool,
) -> dict[int, Moments]:
    """One chunk's moments for the next statistics pass (checkpointed under autograd)."""
    known = list(known)  # a snapshot: the caller fills its list in later passes, recompute must not see it
    targets = collect_targets(chain, known)

    def fn(x_: torch.Tensor, *_stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _, new = BlockPass(chain, geo, mc, known, collect=True).run(sparse_gather(x_, ic, geo.block))
        return tuple(t for j in targets for t in (new[j].mean, new[j].var))

    stats = [t for m in known if m is not None for t in (m.mean, m.var)]
    out = checkpoint(fn, x, *stats, use_reentrant=False) if grad else fn(x, *stats)
    return {
        j: Moments(mean=out[2 * n], var=out[2 * n + 1], count=mc[chain.slot_levels[j]].count)
        for n, j in enumerate(targets)
    }


def run_chunked(
    chain: Chain,
    x: torch.Tensor,
    base: torch.Tensor,
    idx: torch.Tensor,
    idx_chunks: list[torch.Tensor],
    masks: list[list[LevelMasks]],
    geo: ChainGeometry,
    mask_out: torch.Tensor,
    add: bool,
) -> torch.Tensor:
    """The chain's output on several chunks of active blocks: tiles combined into a copy of ``base`` (``x``
    for an identity unit; the tiles then include the shortcut, ``add`` for pre-activation) or into
    ``base`` itself when it is a fresh zero map; only where the unit's mask at the output, ``mask_out``, is set."""
    slots = chain.slots
    grad = torch.is_grad_enabled()
    known: list[Moments | None] = [None] * len(slots)
    while any(uses_batch_stats(bn) and known[j] is None for j, bn in enumerate(slots)):
        per_chunk = [
            _collect_chunk(chain, x, ic, geo, mc, known, grad) for ic, mc in zip(idx_chunks, masks, strict=True)
        ]
        for j in per_chunk[0]:  # collect_targets order: the same collectives, in the same order, on every rank
            known[j] = combine_moments([p[j] for p in per_chunk])
            if needs_sync(slots[j]):
                known[j] = sync_moments(slots[j], known[j], known[j].mean)
    known_final = list(known)
    bp: BlockParams = geo.block

    identity = base is x
    (p0h, p0w), (th, tw) = geo.levels[0].offset, geo.tile

    def final(x_: torch.Tensor, ic: torch.Tensor, mc: list[LevelMasks], *_stats: torch.Tensor) -> torch.Tensor:
        xb = sparse_gather(x_, ic, bp)
        tiles = BlockPass(chain, geo, mc, known_final, collect=False).run(xb)[0]
        keep = sparse_gather(mask_out, ic, geo.select) > 0.5
        # outside the mask: x's own value where the tiles overwrite x (post-activation identity), else nothing
        outside = xb[:, :, p0h : p0h + th, p0w : p0w + tw] if identity and not add else 0
        return like_map(keep_where(keep, tiles, outside), base)

    stats = [t for m in known if m is not None for t in (m.mean, m.var)]
    if grad:
        chunks = zip(idx_chunks, masks, strict=True)
        tiles = torch.cat([checkpoint(final, x, ic, mc, *stats, use_reentrant=False) for ic, mc in chunks])
        scatter = sparse_scatter if base is x else sparse_scatter_  # into a copy of x, or a fresh zero map
        out = scatter(tiles, idx, base, bp, add=add)
    else:
        out = base.clone(memory_format=torch.preserve_format) if base is x else base
        for ic, mc in zip(idx_chunks, masks, strict=True):
            sparse_scatter_(final(x, ic, mc), ic, out, bp, add=add)
    for j, m in enumerate(known):
        if m is not None:
            update_running_stats(slots[j], m)
    return out
