"""Rotated non-maximum suppression in BEV with the evaluator's exact rotated IoU."""

from __future__ import annotations

import numpy as np
import torch

from detector.geometry.iou import bev_iou


def rotated_nms(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Indices (into the inputs, by decreasing score) of the boxes kept by greedy NMS, class by class.

    boxes [N, 7] LiDAR (x, y, z, l, w, h, yaw); a box is suppressed by a higher-scoring kept box of the
    same class whose BEV IoU exceeds ``iou_threshold``.
    """
    n = boxes.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    order = torch.argsort(scores, descending=True, stable=True)
    b = boxes[order].detach().cpu().double().numpy()
    lab = labels[order].cpu().numpy()
    iou = bev_iou(b[:, [0, 1, 3, 4, 6]], b[:, [0, 1, 3, 4, 6]])
    over = (iou > iou_threshold) & (lab[:, None] == lab[None, :])
    # Greedy pass: only rows of boxes still alive matter; rows are visited once each.
    alive = np.ones(n, dtype=bool)
    for i in range(n):
        if alive[i]:
            alive[i + 1:] &= ~over[i, i + 1:]
    return order[torch.from_numpy(np.flatnonzero(alive)).to(order.device)]
