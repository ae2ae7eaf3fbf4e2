"""The detection head: a conv tower (computing the mask's pixels given a mask), then a per-class
heatmap and 8 regression channels."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from detector.models.targets import REG_CHANNELS
from detector.nn.capacity import run_chain
from detector.nn.chain import SparseConvChain, conv_on_support
from detector.ops.capacity import uses_buckets


class DetectionHead(nn.Module):
    """``num_convs`` 3x3 conv-BN-ReLU (one :class:`~detector.nn.chain.SparseConvChain`: dense without a
    mask, the mask's pixels with one: one gather / VALID convs / one scatter on its tiles), then the 3x3
    heatmap and regression convolutions, dense: with 1 + 8 output channels they cost a few percent of
    the tower. Where the tower did not run its output is zero, so the logits there are the convolutions'
    biases (the heatmap's is trained towards background)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        channels: int = 64,
        num_convs: int = 2,
        prior: float = 0.01,
        block_size: int = 16,
        tol: float = 0.5,
    ):
        super().__init__()
        if num_convs < 1:
            raise ValueError(f"DetectionHead: num_convs must be >= 1, got {num_convs}")
        self.tower = SparseConvChain(
            in_channels, (channels,) * num_convs, (3,) * num_convs, (1,) * num_convs, shortcut="none",
            block_size=block_size, tol=tol, name="DetectionHead.tower",
        )
        self.heatmap = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.regression = nn.Conv2d(channels, len(REG_CHANNELS), 3, padding=1)
        nn.init.constant_(self.heatmap.bias, -math.log((1 - prior) / prior))  # start at p = prior
        nn.init.normal_(self.regression.weight, std=0.01)
        nn.init.zeros_(self.regression.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, mode=None  # noqa: ANN001
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, C, h, w] (+ mask [B, 1, h, w]; ``mode``: how the tower runs, :func:`~detector.nn.capacity.run_chain`)
        -> (heatmap logits [B, K, h, w], regression [B, 8, h, w])."""
        x = run_chain(self.tower, x, mask, mode)
        k = self.heatmap.out_channels
        w = torch.cat([self.heatmap.weight, self.regression.weight])  # both in one convolution
        b = torch.cat([self.heatmap.bias, self.regression.bias])
        if mask is None or uses_buckets(x.device):  # no mask, or a GPU's captured graph: the whole map
            y = F.conv2d(x, w, b, padding=self.heatmap.padding)
        else:  # the tower's output is zero outside its mask: convolved where it reaches, the bias elsewhere
            y = conv_on_support(x, w, b, mask, self.tower.block_size)
        return y[:, :k], y[:, k:]
