"""The dense detection head: a small conv tower, then a per-class heatmap and 8 regression channels."""

from __future__ import annotations

import math

import torch
from torch import nn

from detector.models.targets import REG_CHANNELS


class DetectionHead(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, channels: int = 64, num_convs: int = 2, prior: float = 0.01):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for _ in range(num_convs):
            layers += [
                nn.Conv2d(c, channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(channels),
                nn.ReLU(inplace=True),
            ]
            c = channels
        self.tower = nn.Sequential(*layers)
        self.heatmap = nn.Conv2d(c, num_classes, 3, padding=1)
        self.regression = nn.Conv2d(c, len(REG_CHANNELS), 3, padding=1)
        nn.init.constant_(self.heatmap.bias, -math.log((1 - prior) / prior))  # start at p = prior
        nn.init.normal_(self.regression.weight, std=0.01)
        nn.init.zeros_(self.regression.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, C, h, w] -> (heatmap logits [B, K, h, w], regression [B, 8, h, w])."""
        x = self.tower(x)
        return self.heatmap(x), self.regression(x)
