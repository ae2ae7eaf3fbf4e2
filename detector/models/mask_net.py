"""The predicted computation mask: a small network on the down-sampled BEV input that predicts where
objects may be; thresholded, it tells the sparse backbone which blocks to compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from detector.nn.geometry import pool_max


class MaskNet(nn.Module):
    """BEV [B, C, H, W] --max-pool by ``downsample``--> ``num_convs`` 3x3 convs --> logits [B, 1, H/d, W/d].

    Max-pooling the occupancy keeps every occupied cell visible at the low resolution; the network is
    cheap (about ``1/d²`` of a full-resolution layer of the same width).
    """

    def __init__(
        self,
        in_channels: int,
        downsample: int = 4,
        channels: int = 32,
        num_convs: int = 3,
        threshold: float = 0.3,
        dilation: int = 1,
    ):
        super().__init__()
        if downsample not in (1, 2, 4, 8, 16):
            raise ValueError(f"MaskNet.downsample must be a power of two up to 16, got {downsample}")
        if not 0 < threshold < 1:
            raise ValueError(f"MaskNet.threshold must be in (0, 1), got {threshold}")
        self.downsample = downsample
        self.threshold = threshold
        self.dilation = dilation
        layers: list[nn.Module] = []
        c = in_channels
        for _ in range(num_convs):
            layers += [
                nn.Conv2d(c, channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(channels),
                nn.ReLU(inplace=True),
            ]
            c = channels
        layers.append(nn.Conv2d(c, 1, 3, padding=1))
        self.net = nn.Sequential(*layers)
        nn.init.constant_(self.net[-1].bias, -2.0)

    def forward(self, bev: torch.Tensor) -> torch.Tensor:
        x = pool_max(bev, self.downsample, ceil_mode=False)
        return self.net(x)

    def computation_mask(self, logits: torch.Tensor, size: tuple[int, int], threshold: float | None = None
                         ) -> torch.Tensor:
        """Threshold the probabilities (at ``threshold``, default :attr:`threshold`), dilate by ``dilation``
        low-resolution cells, and upsample (nearest) to the input size: [B, 1, H, W] float 0/1."""
        m = (torch.sigmoid(logits.detach()) > (self.threshold if threshold is None else threshold)).float()
        if self.dilation > 0:
            k = 2 * self.dilation + 1
            m = F.max_pool2d(m, k, stride=1, padding=self.dilation)
        return F.interpolate(m, size=size, mode="nearest")
