"""Typed structures that travel through the pipeline: 3D boxes, frames, batches.

Coordinate frames (KITTI):
- LiDAR: x forward, y left, z up. A box is (x, y, z, l, w, h, yaw): (x, y, z) its geometric centre,
  l along its heading, w across, h vertical, yaw the heading angle about +z measured from +x
  (counter-clockwise seen from above).
- Rectified camera: x right, y down, z forward. A KITTI label gives the box's *bottom* centre there,
  its dimensions as (h, w, l) and rotation_y about the camera's y axis, heading = (cos ry, 0, -sin ry).

The LiDAR and camera vertical axes differ by a fraction of a degree on KITTI; like every KITTI tool we
use the convention ``rotation_y = -yaw - pi/2`` so the conversion is exact both ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from detector.data.kitti import Calibration, KittiLabels, RoadMap

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
        d = p[:, None, :] - t[None, :, 0:3]  # [M, N, 3]
        c, s = torch.cos(t[:, 6]), torch.sin(t[:, 6])
        lx = d[..., 0] * c + d[..., 1] * s
        ly = -d[..., 0] * s + d[..., 1] * c
        half = t[:, 3:6] / 2 + margin
        return (lx.abs() <= half[:, 0]) & (ly.abs() <= half[:, 1]) & (d[..., 2].abs() <= half[:, 2])

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

    # --- KITTI camera frame -----------------------------------------------------------------------
    def to_camera(self, calib: Calibration) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """KITTI label geometry: (location [N,3] bottom centre in rect. camera, dims [N,3] (h, w, l),
        rotation_y [N]), float64."""
        t = self.tensor.detach().cpu().double().numpy()
        bottom = t[:, 0:3].copy()
        bottom[:, 2] -= t[:, 5] / 2
        loc = calib.lidar_to_rect(bottom)
        dims = t[:, [5, 4, 3]]
        ry = wrap_angle(-t[:, 6] - np.pi / 2)
        return loc, dims, ry

    @classmethod
    def from_camera(
        cls, location: np.ndarray, dims_hwl: np.ndarray, rotation_y: np.ndarray, calib: Calibration
    ) -> Boxes3D:
        """Inverse of :meth:`to_camera`."""
        location = np.asarray(location, dtype=np.float64).reshape(-1, 3)
        dims_hwl = np.asarray(dims_hwl, dtype=np.float64).reshape(-1, 3)
        ry = np.asarray(rotation_y, dtype=np.float64).reshape(-1)
        center = calib.rect_to_lidar(location)
        center[:, 2] += dims_hwl[:, 0] / 2
        yaw = wrap_angle(-ry - np.pi / 2)
        t = np.concatenate([center, dims_hwl[:, [2, 1, 0]], yaw[:, None]], axis=1)
        return cls(torch.from_numpy(t))

    def project_to_image(
        self, calib: Calibration, image_size: tuple[int, int] = (1242, 375), near: float = 0.1
    ) -> tuple[np.ndarray, np.ndarray]:
        """2D image boxes of the 3D boxes through P2, clipped to the image.

        The box is first clipped against the camera's near plane (z_rect = ``near``) so boxes that
        reach behind the camera project correctly. Returns (bbox [N, 4] = left, top, right, bottom,
        visible [N] bool: some part lies in front of the camera and inside the image).
        ``image_size`` is (width, height).
        """
        n = len(self)
        if n == 0:
            return np.zeros((0, 4)), np.zeros(0, dtype=bool)
        corners = calib.lidar_to_rect(self.corners().detach().cpu().double().numpy().reshape(-1, 3))
        corners = corners.reshape(n, 8, 3)
        a = corners[:, BOX_EDGES[:, 0]]  # [N, 12, 3]
        b = corners[:, BOX_EDGES[:, 1]]
        za, zb = a[..., 2:3], b[..., 2:3]
        # Point where each edge crosses the near plane (used when exactly one end is behind it).
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.clip((near - za) / (zb - za), 0.0, 1.0)
        cross = a + s * (b - a)
        cross_ok = ((za < near) != (zb < near))[..., 0]
        pts = np.concatenate([corners, cross], axis=1)  # [N, 20, 3]
        ok = np.concatenate([corners[..., 2] >= near, cross_ok], axis=1)
        uv, _ = calib.rect_to_image(pts.reshape(-1, 3))
        uv = uv.reshape(n, 20, 2)
        big = np.inf
        lo = np.where(ok[..., None], uv, big).min(axis=1)
        hi = np.where(ok[..., None], uv, -big).max(axis=1)
        w, h = image_size
        x1, y1 = np.clip(lo[:, 0], 0, w - 1), np.clip(lo[:, 1], 0, h - 1)
        x2, y2 = np.clip(hi[:, 0], 0, w - 1), np.clip(hi[:, 1], 0, h - 1)
        any_front = ok.any(axis=1)
        visible = any_front & (hi[:, 0] >= 0) & (lo[:, 0] <= w - 1) & (hi[:, 1] >= 0) & (lo[:, 1] <= h - 1)
        visible &= (x2 > x1) & (y2 > y1)
        bbox = np.stack([x1, y1, x2, y2], axis=1)
        bbox[~visible] = 0.0
        return bbox, visible


def points_in_boxes_sparse(points: np.ndarray, boxes: Boxes3D) -> list[np.ndarray]:
    """Per box, the sorted indices of the ``points`` [M, >=3] inside it, with exactly the semantics (and
    arithmetic) of ``Boxes3D.points_in_boxes`` (margin 0), without the dense [M, N] test: each box only
    tests the points of its (padded) BEV bounding box, found in the x-sorted points."""
    n = len(boxes)
    if n == 0:
        return []
    order = np.argsort(points[:, 0], kind="stable")
    xs = points[order, 0]
    corners = boxes.bev_corners().detach().cpu().double().numpy()  # [N, 4, 2]
    pad = 1e-3  # beyond any float32 rounding of the exact test
    lo, hi = corners.min(axis=1) - pad, corners.max(axis=1) + pad
    out = []
    for j in range(n):
        cand = order[np.searchsorted(xs, lo[j, 0], "left"): np.searchsorted(xs, hi[j, 0], "right")]
        y = points[cand, 1]
        cand = cand[(y >= lo[j, 1]) & (y <= hi[j, 1])]
        if len(cand):
            cand = cand[boxes[j].points_in_boxes(points[cand]).numpy()[:, 0]]
        out.append(np.sort(cand))
    return out


@dataclass
class Frame:
    """One KITTI-format frame as the data pipeline sees it.

    ``points`` [N, 4] float32 (x, y, z, reflectance) in the LiDAR frame. ``gt_boxes``/``gt_names`` are
    the labeled objects (DontCare excluded) and change with augmentation; ``labels`` keeps the file's
    raw records (with DontCare) for evaluation. ``labels`` is None on a split without labels.
    """

    frame_id: str
    points: np.ndarray
    calib: Calibration
    gt_boxes: Boxes3D = field(default_factory=Boxes3D.empty)
    gt_names: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="<U16"))
    labels: KittiLabels | None = None
    road_map: RoadMap | None = None


@dataclass
class Batch:
    """Frames collated for the model. ``points`` [ΣN, 5] = (batch index, x, y, z, reflectance).
    ``mask`` [B, 1, H, W] is the computation mask of a data-side mask provider (road map, ground), if any."""

    points: torch.Tensor
    gt_boxes: list[Boxes3D]
    gt_names: list[np.ndarray]
    frames: list[Frame]
    mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.frames)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.points.to(device, non_blocking=True),
            [b.to(device) for b in self.gt_boxes],
            self.gt_names,
            self.frames,
            None if self.mask is None else self.mask.to(device, non_blocking=True),
        )


def collate_frames(frames: Sequence[Frame]) -> Batch:
    """Concatenate the frames' points with a leading batch-index column."""
    pts = []
    for i, f in enumerate(frames):
        p = torch.from_numpy(np.ascontiguousarray(f.points, dtype=np.float32))
        pts.append(torch.cat([torch.full((p.shape[0], 1), float(i)), p], dim=1))
    points = torch.cat(pts) if pts else torch.zeros(0, 5)
    return Batch(points, [f.gt_boxes for f in frames], [f.gt_names for f in frames], list(frames))


@dataclass
class Detections:
    """One frame's detections: boxes in the LiDAR frame, scores [N], class indices [N] (into the
    detector's class list)."""

    boxes: Boxes3D
    scores: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.boxes)

    def to(self, device: torch.device | str) -> Detections:
        return Detections(self.boxes.to(device), self.scores.to(device), self.labels.to(device))
