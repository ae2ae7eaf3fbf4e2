"""The records that travel through the pipeline: a frame as read, a collated batch, a frame's detections.

Boxes are :class:`detector.geometry.boxes.Boxes3D` in the LiDAR frame; a frame also carries what the KITTI
files say about it (calibration, label records, road map) for evaluation and the data-side masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from detector.geometry.boxes import Boxes3D

if TYPE_CHECKING:  # pragma: no cover
    from detector.data.kitti_calib import Calibration
    from detector.data.kitti_labels import KittiLabels
    from detector.data.lidar_labels import LidarLabels
    from detector.data.road_map import RoadMap


@dataclass
class Frame:
    """One frame, of a KITTI-format root or a LiDAR-only one, as the data pipeline sees it.

    ``points`` [N, 4] float32 (x, y, z, reflectance) in the LiDAR frame. ``gt_boxes``/``gt_names`` are
    the labeled objects (DontCare excluded) and change with augmentation; ``labels`` keeps the file's
    raw records (with DontCare) for evaluation. ``labels`` is None on a split without labels.
    ``image_size`` (width, height) of the left colour image where the root has one (real KITTI's vary:
    1224-1242 x 370-376), else None (:data:`detector.data.kitti_labels.IMAGE_SIZE` is assumed).
    """

    frame_id: str
    points: np.ndarray
    calib: Calibration | None
    gt_boxes: Boxes3D = field(default_factory=Boxes3D.empty)
    gt_names: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="<U16"))
    labels: KittiLabels | LidarLabels | None = None
    road_map: RoadMap | None = None
    image_size: tuple[int, int] | None = None


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
