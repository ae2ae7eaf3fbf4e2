"""Bird's-eye-view images of a frame: points, computation mask, ground-truth and predicted boxes.

Used by TensorBoard logging and ``scripts/visualize.py`` (which also renders 3D views with open3d).
The image is drawn with numpy only: x (forward) points up, y (left) points left, like a driver's map; open3d
(imported when a PNG is written) writes it.
"""

from __future__ import annotations

import numpy as np
import torch

from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid

GT_COLOR = (60, 220, 60)
DET_COLOR = (255, 60, 60)
MASK_COLOR = (40, 70, 140)


def _to_pixels(grid: BevGrid, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Image (row, col) of LiDAR (x, y): row 0 at x_max, col 0 at y_max."""
    r = (grid.x_range[1] - x) / grid.resolution
    c = (grid.y_range[1] - y) / grid.resolution
    return r, c


def _draw_boxes(img: np.ndarray, grid: BevGrid, boxes: Boxes3D, color, heading: bool = True) -> None:
    if len(boxes) == 0:
        return
    corners = boxes.bev_corners().detach().cpu().double().numpy()  # [N, 4, 2]
    segs = [(corners[:, i], corners[:, (i + 1) % 4]) for i in range(4)]
    if heading:  # a line from the centre to the front edge's middle
        c = corners.mean(axis=1)
        segs.append((c, (corners[:, 0] + corners[:, 3]) / 2))
    h, w = img.shape[:2]
    t = np.linspace(0, 1, 64)[None, :, None]
    for a, b in segs:
        p = a[:, None, :] + t * (b - a)[:, None, :]  # [N, 64, 2]
        r, cc = _to_pixels(grid, p[..., 0].ravel(), p[..., 1].ravel())
        r, cc = np.round(r).astype(int), np.round(cc).astype(int)
        ok = (r >= 0) & (r < h) & (cc >= 0) & (cc < w)
        img[r[ok], cc[ok]] = color


def bev_image(
    points: np.ndarray | torch.Tensor,
    grid: BevGrid,
    gt_boxes: Boxes3D | None = None,
    det_boxes: Boxes3D | None = None,
    det_scores: torch.Tensor | None = None,
    mask: torch.Tensor | np.ndarray | None = None,
    score_threshold: float = 0.3,
) -> np.ndarray:
    """[W, H, 3] uint8 image (rows along -x, columns along -y) of one frame."""
    H, W = grid.H, grid.W
    img = np.zeros((W, H, 3), dtype=np.uint8)
    if mask is not None:
        m = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask) > 0.5  # [H(y), W(x)]
        img[np.flipud(np.fliplr(m.T))] = MASK_COLOR
    pts = np.asarray(points.detach().cpu() if isinstance(points, torch.Tensor) else points)
    r, c = _to_pixels(grid, pts[:, 0], pts[:, 1])
    r, c = np.floor(r).astype(int), np.floor(c).astype(int)
    ok = (r >= 0) & (r < W) & (c >= 0) & (c < H)
    shade = np.clip(120 + 400 * pts[ok, 3], 120, 255).astype(np.uint8)
    img[r[ok], c[ok]] = shade[:, None]
    if gt_boxes is not None:
        _draw_boxes(img, grid, gt_boxes, GT_COLOR)
    if det_boxes is not None:
        keep = slice(None) if det_scores is None else (det_scores.detach().cpu() >= score_threshold)
        _draw_boxes(img, grid, det_boxes[keep] if det_scores is not None else det_boxes, DET_COLOR)
    return img


def write_png(path, img: np.ndarray) -> None:
    """Write an [H, W, 3] uint8 image as PNG (open3d's writer)."""
    import open3d as o3d

    if not o3d.io.write_image(str(path), o3d.geometry.Image(np.ascontiguousarray(img))):
        raise OSError(f"{path}: could not write PNG")
