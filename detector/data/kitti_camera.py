"""KITTI's camera frame: LiDAR boxes ↔ camera-frame label geometry, the 2D box of a projected 3D box,
and boxes ↔ label records (through a frame's :class:`~detector.data.kitti_calib.Calibration`).

Rectified camera: x right, y down, z forward. A KITTI label gives the box's *bottom* centre there, its
dimensions as (h, w, l) and rotation_y about the camera's y axis, heading = (cos ry, 0, -sin ry).
The LiDAR and camera vertical axes differ by a fraction of a degree on KITTI; like every KITTI tool we
use the convention ``rotation_y = -yaw - pi/2`` so the conversion is exact both ways. The LiDAR box
convention: :mod:`detector.geometry.boxes`.
"""

from __future__ import annotations

import numpy as np
import torch

from detector.data.kitti_calib import Calibration
from detector.data.kitti_labels import IMAGE_SIZE, KittiLabels, observation_angle
from detector.geometry.boxes import BOX_EDGES, Boxes3D, wrap_angle


def boxes_to_camera(boxes: Boxes3D, calib: Calibration) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KITTI label geometry: (location [N,3] bottom centre in rect. camera, dims [N,3] (h, w, l),
    rotation_y [N]), float64."""
    t = boxes.tensor.detach().cpu().double().numpy()
    bottom = t[:, 0:3].copy()
    bottom[:, 2] -= t[:, 5] / 2
    loc = calib.lidar_to_rect(bottom)
    dims = t[:, [5, 4, 3]]
    ry = wrap_angle(-t[:, 6] - np.pi / 2)
    return loc, dims, ry

def boxes_from_camera(
    location: np.ndarray, dims_hwl: np.ndarray, rotation_y: np.ndarray, calib: Calibration
) -> Boxes3D:
    """Inverse of :func:`boxes_to_camera`."""
    location = np.asarray(location, dtype=np.float64).reshape(-1, 3)
    dims_hwl = np.asarray(dims_hwl, dtype=np.float64).reshape(-1, 3)
    ry = np.asarray(rotation_y, dtype=np.float64).reshape(-1)
    center = calib.rect_to_lidar(location)
    center[:, 2] += dims_hwl[:, 0] / 2
    yaw = wrap_angle(-ry - np.pi / 2)
    t = np.concatenate([center, dims_hwl[:, [2, 1, 0]], yaw[:, None]], axis=1)
    return Boxes3D(torch.from_numpy(t))

def project_to_image(
    boxes: Boxes3D, calib: Calibration, image_size: tuple[int, int] = IMAGE_SIZE, near: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """2D image boxes of the 3D boxes through P2, clipped to the image.

    The box is first clipped against the camera's near plane (z_rect = ``near``) so boxes that
    reach behind the camera project correctly. Returns (bbox [N, 4] = left, top, right, bottom,
    visible [N] bool: some part lies in front of the camera and inside the image).
    ``image_size`` is (width, height).
    """
    n = len(boxes)
    if n == 0:
        return np.zeros((0, 4)), np.zeros(0, dtype=bool)
    corners = calib.lidar_to_rect(boxes.corners().detach().cpu().double().numpy().reshape(-1, 3))
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


def boxes_to_labels(
    boxes: Boxes3D,
    names: np.ndarray,
    calib: Calibration,
    scores: np.ndarray | None = None,
    image_size: tuple[int, int] = IMAGE_SIZE,
    truncated: np.ndarray | None = None,
    occluded: np.ndarray | None = None,
) -> KittiLabels:
    """LiDAR-frame boxes → KITTI label/result records: camera-frame geometry, alpha, and the 2D box of
    the projected 3D box clipped to the image. Boxes entirely outside the image keep a zero 2D box.
    float32 scores (a network's output) become the shortest decimal of their float32 value."""
    n = len(boxes)
    loc, dims, ry = boxes_to_camera(boxes, calib)
    bbox, _ = project_to_image(boxes, calib, image_size)
    if scores is not None:
        scores = np.asarray(scores).reshape(n)
        if scores.dtype == np.float32:
            scores = np.array([float(np.format_float_positional(v, unique=True)) for v in scores])
    return KittiLabels(
        name=np.asarray(names, dtype="<U16").reshape(n),
        truncated=np.zeros(n) if truncated is None else truncated,
        occluded=np.zeros(n) if occluded is None else occluded,
        alpha=observation_angle(loc, ry),
        bbox=bbox,
        dimensions=dims,
        location=loc,
        rotation_y=ry,
        score=scores,
    )


def in_camera_fov(points: np.ndarray, calib: Calibration, image_size: tuple[int, int] = IMAGE_SIZE) -> np.ndarray:
    """[N] bool: LiDAR points in front of the left colour camera that project inside its image. KITTI
    labels only objects in this field of view, so training and evaluation keep only these points."""
    uv, depth = calib.lidar_to_image(points[:, :3])
    w, h = image_size
    return (depth > 0) & (uv[:, 0] >= 0) & (uv[:, 0] < w) & (uv[:, 1] >= 0) & (uv[:, 1] < h)


def labels_to_boxes(labels: KittiLabels, calib: Calibration) -> Boxes3D:
    """The 3D boxes of all records in the LiDAR frame (callers drop DontCare first)."""
    return boxes_from_camera(labels.location, labels.dimensions, labels.rotation_y, calib)
