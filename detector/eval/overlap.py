"""KITTI records of many frames, and the protocol's overlap between detection and GT records.

:class:`Records` is a :class:`~detector.data.kitti_labels.KittiLabels` (the project's one record type, float64
fields) holding the records of many frames concatenated, in frame order and file order within a frame
(the order the protocol's matching depends on), plus the frame index of each record and the derived
geometry the overlaps need. Values are used exactly as read: no float32 step, no decimal recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from detector.data.kitti_labels import KittiLabels
from detector.geometry.iou import bev_intersection_paired, box2d_overlap_paired, rect_area


def camera_bev(location: np.ndarray, dimensions: np.ndarray, rotation_y: np.ndarray) -> np.ndarray:
    """KITTI camera-frame boxes → BEV rectangles in the x–z plane: (x, z, l, w, −ry), [N, 5].

    ``location`` [N, 3] bottom centre, ``dimensions`` [N, 3] = (h, w, l), ``rotation_y`` [N]. The heading
    (cos ry, −sin ry) in (x, z) is (cos(−ry), sin(−ry)), hence the sign.
    """
    loc = np.asarray(location, dtype=np.float64).reshape(-1, 3)
    dims = np.asarray(dimensions, dtype=np.float64).reshape(-1, 3)
    ry = np.asarray(rotation_y, dtype=np.float64).reshape(-1)
    return np.stack([loc[:, 0], loc[:, 2], dims[:, 2], dims[:, 1], -ry], axis=1)


@dataclass
class Records(KittiLabels):
    """The records of one or many frames as one KittiLabels (its float64 fields, concatenated).

    ``frame`` [N] frame index of each record; ``offsets`` [F + 1] the records of frame f are
    ``offsets[f]:offsets[f + 1]``. ``score`` is None for ground truth.
    """

    frame: np.ndarray | None = None
    offsets: np.ndarray | None = None

    @property
    def num_frames(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_labels(cls, frames: Sequence[KittiLabels], with_score: bool) -> Records:
        """Concatenate frames (their arrays must have KittiLabels' shapes: [n], [n, 4], [n, 3])."""
        counts = np.array([len(f) for f in frames], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])

        def cat(field: str, width: int | None) -> np.ndarray:
            if not frames:
                return np.zeros((0,) if width is None else (0, width))
            return np.concatenate([getattr(f, field) for f in frames])

        name = np.concatenate([f.name for f in frames]).astype(str) if frames else np.zeros(0, str)
        return cls(
            name=name,
            truncated=cat("truncated", None),
            occluded=cat("occluded", None),
            alpha=cat("alpha", None),
            bbox=cat("bbox", 4),
            dimensions=cat("dimensions", 3),
            location=cat("location", 3),
            rotation_y=cat("rotation_y", None),
            score=cat("score", None) if with_score else None,
            frame=np.repeat(np.arange(len(frames)), counts),
            offsets=offsets,
        )

    def select(self, idx: np.ndarray) -> Records:
        """A subset as its own Records (frame indices kept; offsets recomputed)."""
        frame = self.frame[idx]
        counts = np.bincount(frame, minlength=self.num_frames)
        sub = KittiLabels.select(self, idx)
        return Records(**vars(sub), frame=frame, offsets=np.concatenate([[0], np.cumsum(counts)]))

    def height(self) -> np.ndarray:
        """2D box height, bottom − top (pixels)."""
        return self.bbox[:, 3] - self.bbox[:, 1]

    def distance(self) -> np.ndarray:
        """BEV distance of the location from the camera, sqrt(x² + z²) (m)."""
        return np.hypot(self.location[:, 0], self.location[:, 2])

    @cached_property
    def bev(self) -> np.ndarray:
        """[N, 5] rectangles (x, z, l, w, −ry) in the camera x–z plane (see :func:`camera_bev`); sizes are
        taken as absolute values, as the devkit's polygons do for DontCare's placeholder size −1."""
        r = camera_bev(self.location, self.dimensions, self.rotation_y)
        r[:, 2:4] = np.abs(r[:, 2:4])
        return r

    @cached_property
    def bev_area(self) -> np.ndarray:
        """[N] area of :attr:`bev` (shoelace, see :func:`rect_area`)."""
        return rect_area(self.bev)

    @cached_property
    def bev_aabb(self) -> np.ndarray:
        """[N, 4] axis-aligned bounds (x_min, z_min, x_max, z_max) of :attr:`bev`."""
        r = self.bev
        c, s = np.abs(np.cos(r[:, 4])), np.abs(np.sin(r[:, 4]))
        ex = (r[:, 2] * c + r[:, 3] * s) / 2
        ez = (r[:, 2] * s + r[:, 3] * c) / 2
        return np.stack([r[:, 0] - ex, r[:, 1] - ez, r[:, 0] + ex, r[:, 1] + ez], axis=1)

    @cached_property
    def bottom(self) -> np.ndarray:
        """[N] camera y of the box bottom (y points down)."""
        return self.location[:, 1]

    @cached_property
    def top(self) -> np.ndarray:
        """[N] camera y of the box top, bottom − h."""
        return self.location[:, 1] - self.dimensions[:, 0]


Metric = Literal["2d", "bev", "3d"]


def bev_intersection_records(det: Records, di: np.ndarray, gt: Records, gi: np.ndarray) -> np.ndarray:
    """[P] exact BEV intersection areas of detection records ``di`` with GT records ``gi``."""
    return bev_intersection_paired(det.bev[di], gt.bev[gi])


def aabb_intersection(det: Records, di: np.ndarray, gt: Records, gi: np.ndarray) -> np.ndarray:
    """[P] an upper bound of the BEV intersection of the pairs: the overlap of their axis-aligned bounds,
    capped by both areas. Put in :func:`overlap_from_intersection` in place of the exact intersection, it
    bounds the overlap from above (overlaps grow with the intersection); used to skip the exact clipping
    for pairs that cannot exceed a minimum overlap."""
    a, b = det.bev_aabb[di], gt.bev_aabb[gi]
    w = np.minimum(a[:, 2], b[:, 2]) - np.maximum(a[:, 0], b[:, 0])
    h = np.minimum(a[:, 3], b[:, 3]) - np.maximum(a[:, 1], b[:, 1])
    inter = np.maximum(w, 0.0) * np.maximum(h, 0.0)
    return np.minimum(np.minimum(inter, det.bev_area[di]), gt.bev_area[gi])


def overlap_from_intersection(
    metric: Metric,
    det: Records,
    di: np.ndarray,
    gt: Records,
    gi: np.ndarray,
    inter: np.ndarray,
    criterion: Literal["iou", "a"] = "iou",
) -> np.ndarray:
    """BEV or 3D overlap of the pairs from their BEV intersection areas ``inter`` (see
    :func:`overlap_pairs`)."""
    if metric == "bev":
        size_d = det.bev_area[di]
        size_g = gt.bev_area[gi] if criterion == "iou" else None
    elif metric == "3d":
        dy = np.minimum(det.bottom[di], gt.bottom[gi]) - np.maximum(det.top[di], gt.top[gi])
        inter = inter * np.maximum(dy, 0.0)
        # Volumes from the same bottom/top values as the overlap: identical boxes give exactly 1.
        size_d = det.bev_area[di] * (det.bottom[di] - det.top[di])
        size_g = gt.bev_area[gi] * (gt.bottom[gi] - gt.top[gi]) if criterion == "iou" else None
    else:
        raise ValueError(f"metric must be 'bev' or '3d' here, got {metric!r}")
    denom = size_d + size_g - inter if criterion == "iou" else size_d
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denom > 0, inter / np.where(denom > 0, denom, 1.0), 0.0)


def overlap_pairs(
    metric: Metric,
    det: Records,
    di: np.ndarray,
    gt: Records,
    gi: np.ndarray,
    criterion: Literal["iou", "a"] = "iou",
) -> np.ndarray:
    """Overlap of detection records ``di`` with GT records ``gi`` (paired index arrays) → [P] float64.

    "2d": image boxes; "bev": rotated rectangles in the camera x–z plane; "3d": those × the vertical
    extent [y − h, y] (camera y points down; y is the bottom). ``criterion="iou"``: intersection over
    union; ``"a"``: intersection over the detection's area (volume), the DontCare test. A pair whose
    denominator is 0 (degenerate boxes) has overlap 0.
    """
    if metric == "2d":
        return box2d_overlap_paired(det.bbox[di], gt.bbox[gi], criterion)
    if metric not in ("bev", "3d"):
        raise ValueError(f"metric must be '2d', 'bev' or '3d', got {metric!r}")
    inter = bev_intersection_records(det, di, gt, gi)
    return overlap_from_intersection(metric, det, di, gt, gi, inter, criterion)
