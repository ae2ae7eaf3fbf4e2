"""KITTI labels of a simulated frame (the rules are in :mod:`detector.sim`): 2D boxes, truncation,
occlusion from ray casting from the camera, DontCare regions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detector.data.kitti_calib import Calibration
from detector.data.kitti_camera import boxes_to_labels, project_to_image
from detector.data.kitti_labels import IMAGE_SIZE, KittiLabels
from detector.geometry.boxes import BOX_EDGES, Boxes3D
from detector.sim.scene import Scene
from detector.sim.sensor import Scan, camera_center

MIN_POINTS = 3  # LiDAR returns an object needs to be labeled
MIN_HEIGHT_PX = 15.0  # 2D box height an object needs to be labeled (KITTI's hard level starts at 25 px)
OCCLUSION_LEVELS = (0.2, 0.5, 0.85)  # hidden fraction limits of levels 0, 1, 2; above: not labeled

# --------------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------------
def unclipped_image_boxes(boxes: Boxes3D, calib: Calibration, near: float = 0.1) -> np.ndarray:
    """[N, 4] (left, top, right, bottom) of the projected 3D boxes through P2 *without* clipping to the
    image (the part behind the near plane z_rect = ``near`` cut off first). NaN where no part of the box
    is in front of the camera."""
    n = len(boxes)
    if n == 0:
        return np.zeros((0, 4))
    c = calib.lidar_to_rect(boxes.corners().double().numpy().reshape(-1, 3)).reshape(n, 8, 3)
    a, b = c[:, BOX_EDGES[:, 0]], c[:, BOX_EDGES[:, 1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.clip((near - a[..., 2:]) / (b[..., 2:] - a[..., 2:]), 0.0, 1.0)
    crossing = (a[..., 2] < near) != (b[..., 2] < near)
    pts = np.concatenate([c, a + s * (b - a)], axis=1)
    ok = np.concatenate([c[..., 2] >= near, crossing], axis=1)
    uv, _ = calib.rect_to_image(pts.reshape(-1, 3))
    uv = uv.reshape(n, 20, 2)
    lo = np.where(ok[..., None], uv, np.inf).min(axis=1)
    hi = np.where(ok[..., None], uv, -np.inf).max(axis=1)
    out = np.concatenate([lo, hi], axis=1)
    out[~ok.any(axis=1)] = np.nan
    return out


def truncation(bbox_unclipped: np.ndarray, image_size: tuple[int, int] = IMAGE_SIZE) -> np.ndarray:
    """Fraction of each unclipped 2D box's area outside the image [0, W-1] × [0, H-1]."""
    w, h = image_size
    b = bbox_unclipped
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    iw = np.clip(np.minimum(b[:, 2], w - 1) - np.maximum(b[:, 0], 0), 0, None)
    ih = np.clip(np.minimum(b[:, 3], h - 1) - np.maximum(b[:, 1], 0), 0, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        inside = np.where(area > 0, iw * ih / area, 0.0)
    return np.clip(1.0 - inside, 0.0, 1.0)


def occlusion_level(hidden: np.ndarray) -> np.ndarray:
    """KITTI occlusion level (0, 1, 2) from the hidden fraction; 3 above the last limit."""
    return np.searchsorted(np.asarray(OCCLUSION_LEVELS), hidden, side="left").astype(np.int32)


def hidden_fractions(
    scene: Scene,
    objs: np.ndarray,
    calib: Calibration,
    rng: np.random.Generator,
    samples: int,
    image_size: tuple[int, int] = IMAGE_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """For each object index in ``objs``: (fraction of its surface samples that project into the image
    but are hidden from the camera, number of samples that project into the image). ``samples`` points
    are drawn per object, area-weighted on its mesh; a sample is hidden when the ray from the camera's
    optical centre to it first hits another object or the static scene."""
    v = scene.vertices.astype(np.float64)
    pts, owner = [], []
    for obj in objs:
        o = scene.objects[int(obj)]
        tris = scene.triangles[o.tri_start : o.tri_end].astype(np.int64)
        a, b, c = v[tris[:, 0]], v[tris[:, 1]], v[tris[:, 2]]
        area = 0.5 * np.linalg.norm(np.cross(b - a, c - a), axis=1)
        pick = rng.choice(len(tris), size=samples, p=area / area.sum())
        r1, r2 = rng.random(samples), rng.random(samples)
        flip = r1 + r2 > 1
        r1[flip], r2[flip] = 1 - r1[flip], 1 - r2[flip]
        pts.append(a[pick] + r1[:, None] * (b[pick] - a[pick]) + r2[:, None] * (c[pick] - a[pick]))
        owner.append(np.full(samples, obj, np.int64))
    n = len(objs)
    if n == 0:
        return np.zeros(0), np.zeros(0, np.int64)
    pts, owner = np.concatenate(pts), np.concatenate(owner)
    uv, depth = calib.lidar_to_image(pts)
    w, h = image_size
    inside = (depth > 0.1) & (uv[:, 0] >= 0) & (uv[:, 0] <= w - 1) & (uv[:, 1] >= 0) & (uv[:, 1] <= h - 1)
    cam = camera_center(calib)
    t, prim = scene.cast(cam, pts[inside] - cam)
    blocked = (prim >= 0) & (t < 1.0 - 1e-3) & (scene.tri_object[np.maximum(prim, 0)] != owner[inside])
    slot = np.repeat(np.arange(n), samples)[inside]
    n_in = np.bincount(slot, minlength=n)
    n_blocked = np.bincount(slot, weights=blocked, minlength=n)
    hidden = np.where(n_in > 0, n_blocked / np.maximum(n_in, 1), 1.0)
    return hidden, n_in


@dataclass
class FrameLabels:
    """The label file's records, and for each the index of its object in ``scene.objects`` (DontCare
    regions included: each comes from one object)."""

    labels: KittiLabels
    objects: np.ndarray

    @property
    def labeled(self) -> np.ndarray:
        """Object indices of the records that are not DontCare, in file order."""
        return self.objects[self.labels.name != "DontCare"]


def _dontcare(bbox: np.ndarray) -> KittiLabels:
    n = len(bbox)
    f = lambda val, *shape: np.full((n, *shape), val, np.float32)  # noqa: E731
    return KittiLabels(
        np.full(n, "DontCare", dtype="<U16"),
        f(-1.0),
        np.full(n, -1, np.int32),
        f(-10.0),
        bbox.astype(np.float32),
        f(-1.0, 3),
        f(-1000.0, 3),
        f(-10.0),
    )


_LABEL_FIELDS = ("name", "truncated", "occluded", "alpha", "bbox", "dimensions", "location", "rotation_y")


def _concat(a: KittiLabels, b: KittiLabels) -> KittiLabels:
    return KittiLabels(*(np.concatenate([getattr(a, k), getattr(b, k)]) for k in _LABEL_FIELDS))


def label_frame(
    scene: Scene, sweep: Scan, calib: Calibration, rng: np.random.Generator, occlusion_samples: int = 96
) -> FrameLabels:
    """KITTI labels of the scene's objects (rules in the module doc): labeled objects sorted by depth,
    then DontCare regions."""
    if not scene.objects:
        return FrameLabels(KittiLabels.empty(), np.zeros(0, np.int64))
    boxes = Boxes3D(np.stack([o.box for o in scene.objects]))
    bbox, visible = project_to_image(boxes, calib, IMAGE_SIZE)
    n_points = np.bincount(sweep.obj[sweep.obj >= 0], minlength=len(scene.objects))
    cand = np.flatnonzero(visible)
    hidden = np.ones(len(boxes))
    hidden[cand], n_in = hidden_fractions(scene, cand, calib, rng, occlusion_samples)
    keep, care = [], []
    for k, i in enumerate(cand):
        height = bbox[i, 3] - bbox[i, 1]
        if n_points[i] >= MIN_POINTS and height >= MIN_HEIGHT_PX and hidden[i] <= OCCLUSION_LEVELS[-1]:
            keep.append(i)
        elif n_points[i] > 0 or (n_in[k] > 0 and hidden[i] < 1.0):
            care.append(i)
    keep = np.asarray(keep, np.int64)
    sel = boxes[keep] if len(keep) else Boxes3D(np.zeros((0, 7)))
    trunc = truncation(unclipped_image_boxes(sel, calib))
    labels = boxes_to_labels(
        sel,
        np.array([scene.objects[i].name for i in keep], dtype="<U16"),
        calib,
        truncated=trunc,
        occluded=occlusion_level(hidden[keep]),
    )
    order = np.argsort(labels.location[:, 2], kind="stable")
    labels, keep = labels.select(order), keep[order]
    care = np.asarray(care, np.int64)
    labels = _concat(labels, _dontcare(bbox[care] if len(care) else np.zeros((0, 4))))
    return FrameLabels(labels, np.concatenate([keep, care]))
