"""SparseBlockConv2d: a 2-D convolution that runs only on the active blocks of a mask.

A drop-in ``nn.Conv2d`` (same parameters and ``state_dict``): ``forward(x)`` is the ordinary dense
convolution; ``forward(x, mask)`` gathers the active blocks of ``x`` (``sparse_gather``; pixels outside
the map read as 0, which is the zero padding), convolves each with VALID padding, and scatters the
output tiles:

    out = base + conv(x)   on active output tiles      (dense twin: base + conv(x) everywhere)
    out = base             elsewhere                   (base defaults to zeros)

``block_size`` is the output tile per side; the input block is ``(tile - 1) * stride + kernel``.
A tile is active if ``mask`` (``[N, 1, H, W]`` at the input resolution) exceeds ``tol`` somewhere in
its receptive field (mean instead of max with ``avgpool``). Blocks are processed in chunks of at most
``memory_budget_mb`` (input + output block bytes); under autograd each chunk is checkpointed so the
saved state does not grow with the number of chunks either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from detector.ops.blocks import BlockParams, calc_block_params
from detector.ops.functional import reduce_mask, sparse_gather

from .chain import ActiveBlocks
from .layout import gather_blocks, is_nhwc, scatter_blocks, shared_workspace, zeros_like_layout

__all__ = ["SparseBlockConv2d"]


class SparseBlockConv2d(nn.Conv2d):
    """``nn.Conv2d`` that can run on active blocks only (module docstring). Zero padding, no dilation."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int] = 3,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | None = None,
        groups: int = 1,
        bias: bool = True,
        *,
        block_size: int | tuple[int, int] = 16,
        tol: float = 0.5,
        avgpool: bool = False,
        memory_budget_mb: float = 1024.0,
        channels_last: bool = True,
    ) -> None:
        ks = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        if padding is None:
            padding = ((ks[0] - 1) // 2, (ks[1] - 1) // 2)
        super().__init__(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, groups=groups, bias=bias
        )
        if isinstance(self.padding, str):
            raise ValueError("SparseBlockConv2d: padding must be ints (string padding is not supported)")
        if memory_budget_mb <= 0:
            raise ValueError(f"SparseBlockConv2d: memory_budget_mb must be > 0, got {memory_budget_mb}")
        self.block_size = block_size
        self.tol = float(tol)
        self.avgpool = avgpool
        self.memory_budget_mb = float(memory_budget_mb)
        self.channels_last = channels_last

    def block_params(self, H: int, W: int) -> BlockParams:
        """Gather/scatter geometry on an ``H x W`` input."""
        th, tw = (self.block_size, self.block_size) if isinstance(self.block_size, int) else self.block_size
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        try:
            return calc_block_params(
                H,
                W,
                bsize=((th - 1) * sh + kh, (tw - 1) * sw + kw),
                ksize=(kh, kw),
                stride=(sh, sw),
                padding=tuple(self.padding),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"SparseBlockConv2d: {exc}") from None

    def active_blocks(self, mask: torch.Tensor) -> ActiveBlocks:
        """Active blocks of ``mask [N, 1, H, W]`` for this convolution's geometry."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(
                f"SparseBlockConv2d: mask must be a [N, 1, H, W] tensor, got {getattr(mask, 'shape', mask)}"
            )
        bp = self.block_params(int(mask.shape[2]), int(mask.shape[3]))
        return ActiveBlocks(indices=reduce_mask(mask, bp, tol=self.tol, avgpool=self.avgpool), block=bp)

    def _blocks(self, x: torch.Tensor, idx: torch.Tensor, bp: BlockParams) -> torch.Tensor:
        if is_nhwc(x) or self.channels_last:  # channels-last blocks (into the workspace without autograd)
            xb = gather_blocks(x, idx, bp, None if torch.is_grad_enabled() else shared_workspace())
        else:
            xb = sparse_gather(x, idx, bp)
        return F.conv2d(xb, self.weight, self.bias, self.stride, 0, 1, self.groups)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        base: torch.Tensor | None = None,
        blocks: ActiveBlocks | None = None,
    ) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"SparseBlockConv2d: x must be [N, {self.in_channels}, H, W], "
                f"got {tuple(getattr(x, 'shape', ()))}"
            )
        H, W = int(x.shape[2]), int(x.shape[3])
        bp = self.block_params(H, W)
        out_shape = (x.shape[0], self.out_channels, bp.out_h, bp.out_w)
        if base is not None and tuple(base.shape) != out_shape:
            raise ValueError(f"SparseBlockConv2d: base must have shape {out_shape}, got {tuple(base.shape)}")
        if mask is None and blocks is None:
            y = super().forward(x)
            return y if base is None else base + y
        if blocks is None:
            if mask.dim() == 4 and (mask.shape[0] != x.shape[0] or tuple(mask.shape[2:]) != (H, W)):
                raise ValueError(
                    f"SparseBlockConv2d: mask must be [N, 1, {H}, {W}] matching x, got {tuple(mask.shape)}"
                )
            blocks = self.active_blocks(mask)
        if blocks.block != bp:
            raise ValueError(
                "SparseBlockConv2d: blocks were reduced for another geometry (block size or map)"
            )
        if base is None:
            base = zeros_like_layout(x, out_shape)
            fresh = True
        else:
            fresh = False
        idx = blocks.indices
        K = blocks.count
        if K == 0:
            return base
        per_block = x.element_size() * (
            self.in_channels * bp.bsize_h * bp.bsize_w + 2 * self.out_channels * bp.obsize_h * bp.obsize_w
        )
        chunk = max(1, int(self.memory_budget_mb * 2**20) // per_block)
        if K <= chunk:
            return scatter_blocks(self._blocks(x, idx, bp), idx, base, bp, add=True, inplace=fresh)
        chunks = [idx[s : s + chunk] for s in range(0, K, chunk)]
        if torch.is_grad_enabled():
            tiles = torch.cat([checkpoint(self._blocks, x, ic, bp, use_reentrant=False) for ic in chunks])
            return scatter_blocks(tiles, idx, base, bp, add=True, inplace=fresh)
        out = base if fresh else base.clone()
        for ic in chunks:
            scatter_blocks(self._blocks(x, ic, bp), ic, out, bp, add=True, inplace=True)
        return out
