"""How good a computation mask is: what it keeps of the objects, and how many tiles it costs.

- **box recall**: for every ground-truth box, the share of its BEV cells (:func:`detector.geometry.box_masks.box_cells`:
  cells whose centre lies in the box's rotated rectangle, plus its centre cell) where the mask is on;
  ``mask_recall`` is the mean over boxes, ``mask_boxes_covered`` the share of boxes with every cell on.
- **active tiles per stride**: the share of ``tile``-px tiles (16) holding any active cell at strides
  1, 2, 4, 8, 16 - the mask max-pooled by 2 per stride as the backbone pools it. What the sparse layers pay
  for is tiles, not pixels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from detector.geometry.box_masks import box_cells
from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid

__all__ = ["TILE_STRIDES", "tile_activity", "box_recall", "mask_quality"]

TILE_STRIDES = (1, 2, 4, 8, 16)


def tile_activity(mask: torch.Tensor, tile: int = 16, strides: Sequence[int] = TILE_STRIDES) -> list[float]:
    """Share of ``tile``-px tiles with any cell > 0.5 at each of ``strides`` (powers of 2, increasing; the
    mask [B, 1, H, W] max-pooled by 2, ceil mode, per stride doubling; tiles past the border are partial)."""
    out, m, s = [], mask.float(), 1
    for target in strides:
        while s < target:
            m = F.max_pool2d(m, 2, 2, ceil_mode=True)
            s *= 2
        out.append(float(F.max_pool2d(m, tile, tile, ceil_mode=True).gt(0.5).double().mean()))
    return out


def box_recall(mask: torch.Tensor, boxes_per_frame: Sequence[Boxes3D], grid: BevGrid) -> torch.Tensor:
    """Per box (frames in order; boxes without a cell in the grid left out): the share of its cells where
    ``mask`` [B, 1, H, W] (the grid's cells) is > 0.5. float64 [K]."""
    if mask.shape[0] != len(boxes_per_frame) or tuple(mask.shape[2:]) != (grid.H, grid.W):
        raise ValueError(f"box_recall: mask {tuple(mask.shape)} does not fit {len(boxes_per_frame)} frames on a "
                         f"{grid.H}x{grid.W} grid")
    box, cell = box_cells(boxes_per_frame, grid, 0.0, device=mask.device)
    if box.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    on = (mask.reshape(-1)[cell] > 0.5).double()
    n = sum(len(b) for b in boxes_per_frame)
    total = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(0, box, torch.ones_like(on))
    kept = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(0, box, on)
    has = total > 0
    return (kept[has] / total[has]).cpu()


def mask_quality(mask: torch.Tensor, boxes_per_frame: Sequence[Boxes3D], grid: BevGrid) -> dict[str, float]:
    """``mask_recall``, ``mask_boxes_covered`` (nan without boxes), ``n_boxes`` and ``tiles_active_s{1..16}``."""
    r = box_recall(mask, boxes_per_frame, grid)
    out = {"mask_recall": float(r.mean()) if len(r) else float("nan"),
           "mask_boxes_covered": float((r >= 1.0).double().mean()) if len(r) else float("nan"),
           "n_boxes": float(len(r))}
    for s, a in zip(TILE_STRIDES, tile_activity(mask), strict=True):
        out[f"tiles_active_s{s}"] = a
    return out


def class_boxes(boxes_per_frame: Sequence[Boxes3D], names_per_frame: Sequence[np.ndarray],
                classes: Sequence[str]) -> list[Boxes3D]:
    """Each frame's boxes of ``classes`` (the ones the detector is asked to find)."""
    return [b[torch.from_numpy(np.isin(np.asarray(n), list(classes)))] if len(b) else b
            for b, n in zip(boxes_per_frame, names_per_frame, strict=True)]
