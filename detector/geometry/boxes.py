"""Oriented 3D boxes in the LiDAR frame, and which points lie inside them.

LiDAR frame (KITTI): x forward, y left, z up. A box is (x, y, z, l, w, h, yaw): (x, y, z) its geometric
centre, l along its heading, w across, h vertical, yaw the heading angle about +z measured from +x
(counter-clockwise seen from above). KITTI's camera frame and its labels: :mod:`detector.data.kitti_camera`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# Unit-box corner signs, ordered: 4 bottom corners (counter-clockwise from front-left seen from above),
# then the 4 top corners in the same order.
_CORNER_SIGNS = torch.tensor(
    [
        [1, 1, -1], [-1, 1, -1], [-1, -1, -1], [1, -1, -1],
        [1, 1, 1], [-1, 1, 1], [-1, -1, 1], [1, -1, 1],
    ],
    dtype=torch.float64,
) / 2
# The 12 edges of a box as pairs of corner indices.
BOX_EDGES = np.array(
    [[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4], [0, 4], [1, 5], [2, 6], [3, 7]]
)


def wrap_angle(a: torch.Tensor | np.ndarray | float, period: float = 2 * math.pi):
    """Map angles to [-period/2, period/2)."""
    return (a + period / 2) % period - period / 2


class Boxes3D:
    """A set of N oriented 3D boxes in the LiDAR frame: ``tensor`` [N, 7] = (x, y, z, l, w, h, yaw).

    (x, y, z) is the box centre. Any float dtype and device; operations keep them.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor | np.ndarray | Sequence):
        t = torch.as_tensor(np.asarray(tensor) if not isinstance(tensor, torch.Tensor) else tensor)
        if t.numel() == 0:
            t = t.reshape(0, 7)
        if t.dim() != 2 or t.shape[1] != 7:
            raise ValueError(f"Boxes3D expects a [N, 7] tensor (x, y, z, l, w, h, yaw), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            t = t.float()
        self.tensor = t

    @classmethod
    def empty(cls, dtype: torch.dtype = torch.float32) -> Boxes3D:
        return cls(torch.zeros(0, 7, dtype=dtype))

    @classmethod
    def cat(cls, boxes: Sequence[Boxes3D]) -> Boxes3D:
        if not boxes:
            return cls.empty()
        return cls(torch.cat([b.tensor for b in boxes]))

    # --- basic access -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.tensor.shape[0]

    def __getitem__(self, idx) -> Boxes3D:
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return Boxes3D(self.tensor[idx])

    def __repr__(self) -> str:
        return f"Boxes3D(n={len(self)}, dtype={self.tensor.dtype}, device={self.tensor.device})"

    def clone(self) -> Boxes3D:
        return Boxes3D(self.tensor.clone())

    def to(self, *args, **kwargs) -> Boxes3D:
        return Boxes3D(self.tensor.to(*args, **kwargs))

    def numpy(self) -> np.ndarray:
        return self.tensor.detach().cpu().numpy()

    @property
    def center(self) -> torch.Tensor:
        return self.tensor[:, 0:3]

    @property
    def dims(self) -> torch.Tensor:
        """(l, w, h)"""
        return self.tensor[:, 3:6]

    @property
    def yaw(self) -> torch.Tensor:
        return self.tensor[:, 6]

    def bev(self) -> torch.Tensor:
        """[N, 5] rotated BEV rectangles (x, y, l, w, yaw)."""
        return self.tensor[:, [0, 1, 3, 4, 6]]

    # --- geometry -----------------------------------------------------------------------------
    def corners(self) -> torch.Tensor:
        """[N, 8, 3] corners in the LiDAR frame (bottom 4, then top 4)."""
        t = self.tensor
        local = _CORNER_SIGNS.to(t) * t[:, None, 3:6]  # [N, 8, 3]
        c, s = torch.cos(t[:, 6])[:, None], torch.sin(t[:, 6])[:, None]
        x = local[..., 0] * c - local[..., 1] * s
        y = local[..., 0] * s + local[..., 1] * c
        return torch.stack([x, y, local[..., 2]], dim=-1) + t[:, None, 0:3]

    def bev_corners(self) -> torch.Tensor:
        """[N, 4, 2] BEV corners (counter-clockwise)."""
        return self.corners()[:, :4, :2]

    def points_in_boxes(self, points: torch.Tensor | np.ndarray, margin: float = 0.0) -> torch.Tensor:
        """[M, N] bool: point m lies inside (or on the surface of) box n, enlarged by ``margin`` metres."""
        p = torch.as_tensor(points)[:, :3].to(self.tensor)
        t = self.tensor
        return _inside(p[:, None, :] - t[None, :, 0:3], torch.cos(t[:, 6]), torch.sin(t[:, 6]), t[:, 3:6] / 2 + margin)

    def contains(self, points: torch.Tensor | np.ndarray, box: torch.Tensor | np.ndarray) -> torch.Tensor:
        """[M] bool: point m lies inside box ``box[m]`` - :meth:`points_in_boxes` (margin 0) for these pairs
        only, with the same arithmetic, so the same answers bit for bit."""
        p = torch.as_tensor(points)[:, :3].to(self.tensor)
        t, box = self.tensor, torch.as_tensor(box, dtype=torch.long)
        c, s = torch.cos(t[:, 6]), torch.sin(t[:, 6])
        return _inside(p - t[box, 0:3], c[box], s[box], (t[:, 3:6] / 2)[box])

    # --- rigid transforms (for augmentation) ------------------------------------------------------
    def rotate_z(self, angle: float) -> Boxes3D:
        """Rotate every box about the LiDAR origin's z axis by ``angle`` (radians)."""
        t = self.tensor.clone()
        c, s = math.cos(angle), math.sin(angle)
        x, y = t[:, 0].clone(), t[:, 1].clone()
        t[:, 0], t[:, 1] = c * x - s * y, s * x + c * y
        t[:, 6] = wrap_angle(t[:, 6] + angle)
        return Boxes3D(t)

    def flip_y(self) -> Boxes3D:
        """Mirror about the x axis (y -> -y): the KITTI left/right flip."""
        t = self.tensor.clone()
        t[:, 1] = -t[:, 1]
        t[:, 6] = wrap_angle(-t[:, 6])
        return Boxes3D(t)

    def scale(self, factor: float) -> Boxes3D:
        t = self.tensor.clone()
        t[:, 0:6] *= factor
        return Boxes3D(t)

    def translate(self, offset: torch.Tensor | Sequence[float]) -> Boxes3D:
        t = self.tensor.clone()
        t[:, 0:3] += torch.as_tensor(offset).to(t)
        return Boxes3D(t)


def _inside(d: torch.Tensor, c: torch.Tensor, s: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """The inside test on offsets ``d`` [..., 3] from box centres, the boxes' cos / sin of yaw [...] and half
    sizes [..., 3] (broadcast): within the half length and width in the box's own axes, and the half height."""
    lx = d[..., 0] * c + d[..., 1] * s
    ly = -d[..., 0] * s + d[..., 1] * c
    return (lx.abs() <= half[..., 0]) & (ly.abs() <= half[..., 1]) & (d[..., 2].abs() <= half[..., 2])


_CELL_M = 2.0  # points_in_boxes_sparse's bucket: 2 m x 2 m cells over [-128, 128) m (clamped), 128 x 128 of them
_CELLS = 128


def _cell(v: np.ndarray) -> np.ndarray:
    """Bucket column / row of coordinates ``v`` (clamped into the 128 cells; NaN to the last one)."""
    half = _CELLS // 2
    return np.clip(np.floor(np.fmax(np.fmin(v / _CELL_M, half), -half - 1)), -half, half - 1).astype(np.int16) + half


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The integer runs ``starts[i] .. starts[i] + lengths[i] - 1`` laid end to end (one array, no loop)."""
    return np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)


def points_in_boxes_sparse(points: np.ndarray, boxes: Boxes3D) -> list[np.ndarray]:
    """Per box, the sorted indices of the ``points`` [M, >=3] inside it, with exactly the semantics (and
    arithmetic) of ``Boxes3D.points_in_boxes`` (margin 0), without the dense [M, N] test: the points are
    bucketed in 2 m BEV cells (sorted by a 16-bit cell key: numpy sorts those by radix), each box tests only
    the points of the cells its (padded) BEV bounding box touches - one run of keys per cell column - and
    every step runs on all boxes at once (a frame with GT sampling has ~25 boxes, and a training frame takes
    three of these calls). Cells clamp at +-128 m, so points and boxes beyond stay correct (their border
    cells are tested exactly like the others); a NaN or inf point fails the exact test."""
    n = len(boxes)
    if n == 0:
        return []
    x, y = points[:, 0], points[:, 1]
    key = _cell(x) * _CELLS + _cell(y)  # < 2**14: int16
    order = np.argsort(key, kind="stable")
    keys = key[order]
    corners = boxes.bev_corners().detach().cpu().double().numpy()  # [N, 4, 2]
    pad = 1e-3  # beyond any float32 rounding of the exact test
    lo, hi = corners.min(axis=1) - pad, corners.max(axis=1) + pad
    cxlo, cxhi, cylo, cyhi = (_cell(v).astype(np.int64) for v in (lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1]))
    # one key run per (box, cell column): cells cylo..cyhi of that column
    ncol = cxhi - cxlo + 1
    run_box = np.repeat(np.arange(n), ncol)
    col = _runs(cxlo, ncol)
    start = np.searchsorted(keys, col * _CELLS + cylo[run_box], "left")
    stop = np.searchsorted(keys, col * _CELLS + cyhi[run_box], "right")
    # the runs' points laid end to end
    sizes = stop - start
    box = np.repeat(run_box, sizes)
    cand = order[_runs(start, sizes)]
    cx, cy = x[cand], y[cand]
    window = (cx >= lo[box, 0]) & (cx <= hi[box, 0]) & (cy >= lo[box, 1]) & (cy <= hi[box, 1])
    cand, box = cand[window], box[window]
    inside = boxes.contains(points[cand], box).numpy()  # one exact test for all boxes
    cand, box = cand[inside], box[inside]
    by_box = np.lexsort((cand, box))  # by box, then point index
    return np.split(cand[by_box], np.cumsum(np.bincount(box, minlength=n))[:-1])
