"""Autograd formulas of the sbnet ops written with the ops themselves (no imports of ours but torch):
the scatter's adjoint, the output tiles relu's adjoint needs, and the in-place scatter under autograd.
Used by :mod:`detector.ops._library` (registered formulas), :mod:`detector.ops.functional` and
:mod:`detector.ops.residual`."""

from __future__ import annotations

import torch

__all__ = ["memory_format_of", "like_map", "keep_where", "tiles_of", "scatter_backward", "ScatterInPlace"]


def memory_format_of(x: torch.Tensor) -> torch.memory_format | None:
    """``torch.channels_last`` for a channels-last map, ``torch.contiguous_format`` for an NCHW-contiguous
    one (also when it is both, e.g. one channel), None for any other stride pattern."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def like_map(tiles: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``tiles`` in the map ``m``'s dtype and memory layout, as a scatter into ``m`` takes them (under autocast the
    tiles may come out of a convolution in a lower precision; an empty ``torch.where`` loses channels-last strides)."""
    return tiles.to(m.dtype).contiguous(memory_format=memory_format_of(m) or torch.contiguous_format)


def keep_where(keep: torch.Tensor, tiles: torch.Tensor, other: torch.Tensor | float) -> torch.Tensor:
    """``where(keep, tiles, other)``: the unit's tiles where its mask is set; outside autograd written into ``tiles``
    itself (a fresh output of the unit's last op), so that inference holds no second copy of the tiles."""
    if not isinstance(other, torch.Tensor):
        return torch.where(keep, tiles, other) if torch.is_grad_enabled() else tiles.masked_fill_(~keep, other)
    if torch.is_grad_enabled() or other.dtype != tiles.dtype:  # (autocast: the other may be wider)
        return torch.where(keep, tiles, other)
    return torch.where(keep, tiles, other, out=tiles)


def tiles_of(out: torch.Tensor, indices: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The scatter output's values at the tiles, ``[K, C, th, tw]`` (what ``relu``'s backward needs)."""
    with torch.no_grad():
        return torch.ops.sbnet.sparse_gather(out, indices, list(tile), list(tile), [0, 0])


def scatter_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    out_tiles: torch.Tensor | None,
    tile: tuple[int, int],
    add: bool,
    relu: bool,
    need_blocks: bool,
    need_base: bool,
    memory_format: torch.memory_format,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of a (copying or in-place) scatter w.r.t. ``blocks`` and ``base`` (None where not
    needed). With ``add`` and no ``relu`` the base's gradient is ``grad`` itself (no copy).

    ``grad`` is taken in its own layout when it is NCHW or channels-last (a layer after this one, e.g. torch's
    1x1 convolution on one thread, may hand back the other layout than the map's): converting the map-sized
    gradient cost a full permuting copy per unit; ``out_tiles`` (K tiles) follow it instead. Other strides:
    ``memory_format`` (the map's layout)."""
    fmt = memory_format_of(grad)
    g = grad if fmt is not None else grad.contiguous(memory_format=memory_format)
    if out_tiles is not None:
        out_tiles = out_tiles.contiguous(memory_format=memory_format_of(g))
    passthrough = add and not relu
    gb, gbase = torch.ops.sbnet.sparse_scatter_backward(
        g, indices, out_tiles, list(tile), list(tile), [0, 0], add, relu, need_blocks,
        need_base and not passthrough,
    )
    if need_base and passthrough:
        gbase = grad
    return (gb if need_blocks else None), (gbase if need_base else None)


class ScatterInPlace(torch.autograd.Function):
    """The in-place scatter under autograd: ``base`` is marked dirty (its history continues through this
    node); backward is :func:`scatter_backward`."""

    @staticmethod
    def forward(ctx, blocks, indices, base, tile, add, relu):  # noqa: ANN001, ANN205 - autograd protocol
        torch.ops.sbnet.sparse_scatter_(blocks, indices, base, list(tile), [0, 0], add, relu)
        ctx.mark_dirty(base)
        ctx.save_for_backward(indices, tiles_of(base, indices, tile) if relu else None)
        ctx.args = (tile, add, relu, memory_format_of(base))
        return base

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        indices, out_tiles = ctx.saved_tensors
        tile, add, relu, fmt = ctx.args
        gb, gbase = scatter_backward(
            grad, indices, out_tiles, tile, add, relu, ctx.needs_input_grad[0], ctx.needs_input_grad[2], fmt
        )
        return gb, None, gbase, None, None, None
