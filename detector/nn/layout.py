"""Gather and scatter of sparse blocks for maps in either memory layout, returning channels-last blocks.

:mod:`detector.ops` implements the SBNet ops for NCHW-contiguous maps. A block gather from an NCHW map
reads one short row per (block, channel, row) - scattered over the whole map, so it is bound by cache
and TLB misses - and the blocks then need a copy to channels-last, the layout in which oneDNN runs
the block convolutions fastest. When the map itself is channels-last (NHWC) a block row is one
contiguous run of ``bw * C`` values, so this module gathers and scatters NHWC maps directly with
``index_select`` / ``index_copy`` / ``index_add`` on the ``[N*H*W, C]`` view of the map (same
semantics and geometry as :func:`detector.ops.sparse_gather` / :func:`detector.ops.sparse_scatter`;
differentiable through those ops' autograd formulas, deterministic on CPU). NCHW maps go through
:mod:`detector.ops`, and the blocks are made channels-last afterwards.

    gather:  blocks[k] = x[n, :, boffset_h + by*bstride_h : ... + bsize_h, ...]   (0 outside the map)
    scatter: out = copy(base); out[n, :, by*obsize_h : ..., bx*obsize_w : ...] (+)= blocks[k] (clipped)
"""

from __future__ import annotations

import threading

import torch

from detector.ops.blocks import BlockParams
from detector.ops.functional import sparse_gather, sparse_scatter, sparse_scatter_

__all__ = [
    "is_nhwc",
    "gather_blocks",
    "scatter_blocks",
    "zeros_like_layout",
    "zero_pixels",
    "ResidualBlocks",
    "Workspace",
    "shared_workspace",
]


def is_nhwc(x: torch.Tensor) -> bool:
    """Whether ``x [N, C, H, W]`` is stored channels-last (and not also NCHW-contiguous)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def zeros_like_layout(x: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Zeros of ``shape`` in ``x``'s memory layout (channels-last if ``x`` is)."""
    if is_nhwc(x):
        n, c, h, w = shape
        return x.new_zeros((n, h, w, c)).permute(0, 3, 1, 2)
    return x.new_zeros(shape)


def zero_pixels(t: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the pixels ``pixels`` (indices into ``K * h * w``, (k, row, column) order) of every
    channel of ``t [K, C, h, w]``; returns ``t``."""
    k, c, h, w = t.shape
    if t.is_contiguous(memory_format=torch.channels_last):
        t.permute(0, 2, 3, 1).view(k * h * w, c).index_fill_(0, pixels, 0)
    else:
        hit = torch.zeros(k * h * w, dtype=torch.bool, device=t.device).index_fill_(0, pixels, True)
        t.masked_fill_(hit.view(k, 1, h, w), 0)
    return t




def _positions(start: torch.Tensor, length: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``start + arange(length)`` per block ([K, length]), clamped to the map, and validity."""
    pos = start[:, None] + torch.arange(length, device=start.device)
    valid = (pos >= 0) & (pos < limit)
    return pos.clamp(0, limit - 1), valid


def _block_pixels(
    shape: torch.Size, idx: torch.Tensor, bp: BlockParams
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For the blocks ``idx`` of an ``[N, C, H, W]`` map: the NHWC row of every block pixel ([K * bh * bw],
    (block, row, column) order; clamped into the map) and the block pixels whose row or column lies outside
    the map (they must read as 0; None if there are none)."""
    _, _, H, W = shape
    n = idx[:, 0].long()
    rows, vr = _positions(idx[:, 1].long() * bp.bstride_h + bp.boffset_h, bp.bsize_h, H)
    cols, vc = _positions(idx[:, 2].long() * bp.bstride_w + bp.boffset_w, bp.bsize_w, W)
    flat = ((n[:, None, None] * H + rows[:, :, None]) * W + cols[:, None, :]).reshape(-1)
    if bool(vr.all()) and bool(vc.all()):
        return flat, None
    return flat, (~(vr[:, :, None] & vc[:, None, :])).reshape(-1).nonzero().flatten()


class Workspace:
    """A reusable buffer for gathered blocks (inference only: the blocks must be dead before the next use).

    Fresh multi-megabyte allocations pay page faults on this kind of machine; reusing one buffer across
    calls avoids them. Grows when a call needs more.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def rows(self, n: int, c: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized ``[n, c]`` tensor with ``like``'s dtype and device, backed by the buffer."""
        buf = self._buf
        if buf is None or buf.numel() < n * c or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buf = torch.empty(n * c, dtype=like.dtype, device=like.device)
        return buf[: n * c].view(n, c)


_thread_state = threading.local()


def shared_workspace() -> Workspace:
    """The calling thread's workspace, shared by all sparse layers (they run one after another)."""
    ws = getattr(_thread_state, "workspace", None)
    if ws is None:
        ws = _thread_state.workspace = Workspace()
    return ws


def _gather_nhwc(x: torch.Tensor, idx: torch.Tensor, bp: BlockParams, ws: Workspace | None) -> torch.Tensor:
    N, C, H, W = x.shape
    flat, outside = _block_pixels(x.shape, idx, bp)
    src = x.permute(0, 2, 3, 1).reshape(N * H * W, C)
    if ws is not None and not (torch.is_grad_enabled() and x.requires_grad):
        rows_c = torch.index_select(src, 0, flat, out=ws.rows(flat.numel(), C, x))
    else:
        rows_c = src.index_select(0, flat)
    if outside is not None:  # clamped reads outside the map must read as 0
        rows_c = rows_c.index_fill_(0, outside, 0)
    return rows_c.view(-1, bp.bsize_h, bp.bsize_w, C).permute(0, 3, 1, 2)


def gather_blocks(
    x: torch.Tensor, indices: torch.Tensor, bp: BlockParams, workspace: Workspace | None = None
) -> torch.Tensor:
    """``sparse_gather`` returning channels-last blocks ``[K, C, bsize_h, bsize_w]`` for either layout.

    ``workspace`` (NHWC maps, inference only - ignored when ``x`` requires grad): gather into its buffer
    instead of a fresh tensor; the result is only valid until the workspace's next use.
    """
    if is_nhwc(x):
        if x.shape[2:] != bp.in_size:  # the same check as the op's
            raise ValueError(f"sparse_gather: x must be [N, C, {bp.in_h}, {bp.in_w}], got {tuple(x.shape)}")
        return _gather_nhwc(x, indices, bp, workspace)
    return sparse_gather(x, indices, bp).contiguous(memory_format=torch.channels_last)


def _tile_rows(idx: torch.Tensor, bp: BlockParams, n_batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flat NHWC row of every tile pixel ([K * th * tw]) and which lie in the map (None: all)."""
    th, tw, Ho, Wo = bp.obsize_h, bp.obsize_w, bp.out_h, bp.out_w
    n = idx[:, 0].long()
    rows = idx[:, 1].long()[:, None] * th + torch.arange(th, device=idx.device)
    cols = idx[:, 2].long()[:, None] * tw + torch.arange(tw, device=idx.device)
    flat = ((n[:, None, None] * Ho + rows[:, :, None]) * Wo + cols[:, None, :]).reshape(-1)
    if bool((rows[:, -1] < Ho).all()) and bool((cols[:, -1] < Wo).all()):
        return flat, None
    return flat, ((rows < Ho)[:, :, None] & (cols < Wo)[:, None, :]).reshape(-1)


def scatter_blocks(
    blocks: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, bp: BlockParams, add: bool, inplace: bool
) -> torch.Tensor:
    """``sparse_scatter`` for either layout; with ``inplace``, written into ``base`` itself.

    The result has ``base``'s layout. ``inplace`` is for a base the caller owns: any base without
    autograd, or a fresh base (e.g. zeros) that does not require grad - for NHWC maps autograd records
    the in-place write; NCHW maps then fall back to the copying op (``sparse_scatter_`` is inference-only).
    """
    if not is_nhwc(base):
        needs_graph = torch.is_grad_enabled() and (blocks.requires_grad or base.requires_grad)
        if inplace and not needs_graph:
            return sparse_scatter_(blocks, indices, base, bp, add=add)
        return sparse_scatter(blocks, indices, base, bp, add=add)
    N, C, Ho, Wo = base.shape
    if blocks.shape[1:] != (C, bp.obsize_h, bp.obsize_w) or blocks.shape[0] != indices.shape[0]:
        raise ValueError(
            f"sparse_scatter: blocks must be [{indices.shape[0]}, {C}, {bp.obsize_h}, {bp.obsize_w}], "
            f"got {tuple(blocks.shape)}"
        )
    flat, valid = _tile_rows(indices, bp, N)
    src = blocks.permute(0, 2, 3, 1).reshape(-1, C)
    if valid is not None:
        flat, src = flat[valid], src[valid]
    view = base.permute(0, 2, 3, 1).view(N * Ho * Wo, C)
    if inplace:
        (view.index_add_ if add else view.index_copy_)(0, flat, src)
        return base
    out = view.index_add(0, flat, src) if add else view.index_copy(0, flat, src)
    return out.view(N, Ho, Wo, C).permute(0, 3, 1, 2)


class _Link:
    """Hands the output gradient from the residual scatter's backward to the gather's backward."""

    def __init__(self) -> None:
        self.grad_out: torch.Tensor | None = None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` as contiguous ``[N*H*W, C]`` rows (a view of a channels-last ``t``, else a copy)."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).contiguous().view(n * h * w, c)


class _ResidualGather(torch.autograd.Function):
    """Gather of NHWC blocks whose backward also carries the residual scatter's gradient into ``x``."""

    @staticmethod
    def forward(ctx, x, flat, outside, bsize, link):  # noqa: ANN001, ANN205 - autograd.Function protocol
        n, c, h, w = x.shape
        rows = _rows(x).index_select(0, flat)
        if outside is not None:
            rows.index_fill_(0, outside, 0)
        rows = rows.view(-1, bsize[0], bsize[1], c)
        ctx.save_for_backward(flat, outside)
        ctx.shape, ctx.link = (n, c, h, w), link
        return rows.permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_blocks):  # noqa: ANN001, ANN205
        flat, outside = ctx.saved_tensors
        n, c, h, w = ctx.shape
        g = grad_blocks.permute(0, 2, 3, 1).reshape(-1, c)
        if outside is not None:  # clamped reads: no gradient to the border pixels they read
            g = g.index_fill(0, outside, 0)
        link = ctx.link
        if link.grad_out is not None:  # the residual path: the output gradient, tiles handled by the scatter
            gx = link.grad_out
            link.grad_out = None
        else:
            gx = grad_blocks.new_zeros((n * h * w, c))
        gx.index_add_(0, flat, g)
        return gx.view(n, h, w, c).permute(0, 3, 1, 2), None, None, None, None


WRITE, ADD, ADD_RELU = "write", "add", "add_relu"  # how a residual scatter combines a tile with x


class _ResidualScatter(torch.autograd.Function):
    """Scatter of NHWC tiles into a copy of ``x`` whose ``x``-gradient is finished by the gather's backward.

    ``mode``: ``write`` (tile replaces x), ``add`` (x + tile) or ``add_relu`` (relu(x + tile): the
    post-activation shortcut fused into the scatter, so the unit needs no slice of its gathered input).
    """

    @staticmethod
    def forward(ctx, tiles, x, tile_flat, tile_valid, mode, link):  # noqa: ANN001, ANN205
        n, c, h, w = x.shape
        src = tiles.permute(0, 2, 3, 1).reshape(-1, c)
        if tile_valid is not None:
            src = src[tile_valid]
            rows_idx = tile_flat[tile_valid]
        else:
            rows_idx = tile_flat
        out = _rows(x).clone()
        positive = None
        if mode == ADD:
            out.index_add_(0, rows_idx, src)
        elif mode == WRITE:
            out.index_copy_(0, rows_idx, src)
        else:
            r = out.index_select(0, rows_idx).add_(src).relu_()
            out.index_copy_(0, rows_idx, r)
            positive = r > 0
        ctx.save_for_backward(rows_idx, tile_valid, positive)
        ctx.mode, ctx.link, ctx.tiles_shape = mode, link, tiles.shape
        return out.view(n, h, w, c).permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        rows_idx, tile_valid, positive = ctx.saved_tensors
        k, c, th, tw = ctx.tiles_shape
        go = _rows(grad_out)
        picked = go.index_select(0, rows_idx)
        if positive is not None:
            picked.mul_(positive)
        if tile_valid is not None:
            g = picked.new_zeros((k * th * tw, c))
            g[tile_valid] = picked
        else:
            g = picked
        grad_tiles = g.view(k, th, tw, c).permute(0, 3, 1, 2)
        if ctx.needs_input_grad[1]:
            # x's gradient: the output gradient with the tiles' part replaced (written: 0; relu(x + t):
            # the relu-masked gradient), finished by the gather's backward. `go` is a view of grad_out
            # for channels-last grads (copy it), else already a copy (never modify grad_out).
            gx = go.clone() if go.data_ptr() == grad_out.data_ptr() else go
            if ctx.mode == WRITE:
                gx.index_fill_(0, rows_idx, 0)
            elif ctx.mode == ADD_RELU:
                gx.index_copy_(0, rows_idx, picked)
            ctx.link.grad_out = gx
        return grad_tiles, None, None, None, None, None


class ResidualBlocks:
    """Gather of ``x``'s blocks and the scatter of a unit's tiles back into (a copy of) ``x``, NHWC only.

    Same values as :func:`gather_blocks` + :func:`scatter_blocks` with ``base = x``; under autograd
    ``x``'s gradient is assembled once - the output gradient copied, the written tiles zeroed, the
    block gradients added - instead of summing two map-sized gradients (scatter's and gather's).
    Use :meth:`gather` once, then :meth:`scatter` once.
    """

    def __init__(
        self, x: torch.Tensor, indices: torch.Tensor, gather_bp: BlockParams, scatter_bp: BlockParams
    ) -> None:
        if not is_nhwc(x):
            raise ValueError("ResidualBlocks: x must be channels-last")
        self.x, self.gather_bp, self.scatter_bp = x, gather_bp, scatter_bp
        self.indices = indices
        self.link = _Link()

    def gather(self) -> torch.Tensor:
        x, bp = self.x, self.gather_bp
        flat, outside = _block_pixels(x.shape, self.indices, bp)
        return _ResidualGather.apply(x, flat, outside, (bp.bsize_h, bp.bsize_w), self.link)

    def scatter(self, tiles: torch.Tensor, mode: str) -> torch.Tensor:
        """The output: ``x`` with each tile written (``"write"``), added (``"add"``) or combined as
        ``relu(x + tile)`` (``"add_relu"``)."""
        if mode not in (WRITE, ADD, ADD_RELU):
            raise ValueError(
                f"ResidualBlocks.scatter: mode must be 'write', 'add' or 'add_relu', got {mode!r}"
            )
        flat, valid = _tile_rows(self.indices, self.scatter_bp, self.x.shape[0])
        return _ResidualScatter.apply(tiles, self.x, flat, valid, mode, self.link)
