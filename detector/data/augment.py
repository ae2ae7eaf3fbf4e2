"""Training augmentation on :class:`Frame` → new :class:`Frame`, seeded by a numpy Generator per call.

Ops (each a small configurable object with ``__call__(frame, rng) -> Frame``):
- :class:`GtSampling`: paste objects of other frames (from a :class:`GtDatabase`) with their points at
  their recorded place, when their BEV box collides with no box of the frame nor another pasted one
  (exact separating-axis test on the rotated rectangles; touching counts as a collision); the frame's
  points inside a pasted box are removed. On a frame with a road map, a pasted box must touch the road.
- :class:`ObjectNoise`: per object, a random translation and rotation about its own centre; its points
  move with it; a move whose BEV box collides with another box is rejected (up to ``num_tries``
  draws). Objects whose boxes overlap another box are not moved. Background points inside a moved box
  are removed.
- :class:`GlobalFlip` (about the x axis: y → −y, yaw → −yaw), :class:`GlobalRotation` (about z),
  :class:`GlobalScaling`: points, boxes and road map together.
- Sim-to-real (simulator vs a real LiDAR): :class:`BeamDropout` (whole rings, from the elevation angle),
  :class:`ObjectPointDropout` (a share of an object's points), :class:`IntensityJitter` (reflectance gain and
  noise), :class:`GroundTilt` (small roll and pitch of the scene; objects move with their box centres).
:class:`Augmentor` applies a list of ops in order; the usual order is GT sampling, object noise, flip,
rotation, scaling (``experiment=sim2real``: GT sampling, beam dropout, object point dropout, object noise,
intensity jitter, ground tilt, flip, rotation, scaling).

Invariants: every point inside an object's box before an op is inside the box after it (up to float32
rounding of the stored coordinates), pasted points lie in their pasted box, yaw stays in [−π, π).
The returned frame has ``labels=None``: the file's raw records no longer describe the augmented
geometry (``gt_boxes``/``gt_names`` do). Its ``calib`` is the source frame's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from detector.data.road_map import RoadMap
from detector.data.structures import Frame
from detector.errors import ConfigError
from detector.geometry.boxes import Boxes3D, points_in_boxes_sparse, wrap_angle

if TYPE_CHECKING:  # pragma: no cover
    from detector.data.gt_database import GtDatabase


# --------------------------------------------------------------------------------------------------
# Geometry helpers
# --------------------------------------------------------------------------------------------------
def bev_boxes_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N, M] bool: the BEV rectangles a [N, 5] and b [M, 5] = (x, y, l, w, yaw) intersect or touch.

    Exact separating-axis test: two convex polygons are disjoint iff their projections on one of the
    4 edge normals are disjoint. Each pair's answer is elementwise arithmetic on that pair alone, so it does
    not depend on which other boxes share the call (ObjectNoise relies on it)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 5)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 5)
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)), dtype=bool)
    return _overlap(a[:, None, :], b[None, :, :])


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`bev_boxes_overlap` of the boxes ``a [..., 5]`` and ``b [..., 5]`` paired by broadcasting (float64):
    ``[..., 1, 5]`` against ``[1, ..., 5]`` is the table of every pair, equal shapes pair them one to one."""
    ca, sa, cb, sb = np.cos(a[..., 4]), np.sin(a[..., 4]), np.cos(b[..., 4]), np.sin(b[..., 4])
    dx, dy = b[..., 0] - a[..., 0], b[..., 1] - a[..., 1]
    hla, hwa, hlb, hwb = a[..., 2] / 2, a[..., 3] / 2, b[..., 2] / 2, b[..., 3] / 2
    separated = np.zeros(np.broadcast_shapes(dx.shape, ca.shape, cb.shape), dtype=bool)
    # The axes (kx, ky): a's heading u = (c, s) and normal v = (-s, c), then b's. Projection half-length of a
    # rectangle on an axis k: (l/2)|u.k| + (w/2)|v.k|; the centres' distance along it: |d.k|.
    for kx, ky in ((ca, sa), (-sa, ca), (cb, sb), (-sb, cb)):
        dist = np.abs(kx * dx + ky * dy)
        ra = hla * np.abs(kx * ca + ky * sa) + hwa * np.abs(kx * -sa + ky * ca)
        rb = hlb * np.abs(kx * cb + ky * sb) + hwb * np.abs(kx * -sb + ky * cb)
        separated |= dist > ra + rb
    return ~separated


def _rotate_xy(xy: np.ndarray, angle: float | np.ndarray, repeats: list[int] | None = None) -> np.ndarray:
    """``xy [..., 2]`` rotated by ``angle`` about the origin; with ``repeats``, ``angle`` holds one angle per run of
    ``repeats[i]`` consecutive rows."""
    if repeats is None:
        c, s = math.cos(angle), math.sin(angle)
    else:
        c, s = (np.repeat([f(a) for a in angle], repeats) for f in (math.cos, math.sin))
    return np.stack([c * xy[..., 0] - s * xy[..., 1], s * xy[..., 0] + c * xy[..., 1]], axis=-1)


def _any_box(n_points: int, members: list[np.ndarray]) -> np.ndarray:
    hit = np.zeros(n_points, dtype=bool)
    for idx in members:
        hit[idx] = True
    return hit


def _boxes_like(t64: torch.Tensor, like: Boxes3D) -> Boxes3D:
    t64 = t64.clone()
    t64[:, 6] = wrap_angle(t64[:, 6])
    return Boxes3D(t64.to(like.tensor.dtype))


def _replace(frame: Frame, **kw) -> Frame:
    return dataclasses.replace(frame, labels=None, **kw)


def _on_road(road: RoadMap, boxes: np.ndarray) -> np.ndarray:
    """[N] bool: the centre or a BEV corner of each box [N, 7] lies on a drivable raster cell."""
    if len(boxes) == 0:
        return np.zeros(0, dtype=bool)
    corners = Boxes3D(torch.from_numpy(np.asarray(boxes, np.float64))).bev_corners().numpy()  # [N, 4, 2]
    pts = np.concatenate([np.asarray(boxes, np.float64)[:, None, :2], corners], axis=1)  # [N, 5, 2]
    return road.lookup(pts[..., 0], pts[..., 1]).any(axis=1)


# --------------------------------------------------------------------------------------------------
# Road-map transforms: the raster follows the global transforms by composing its coordinate map
# (O(1): the raster is never resampled).
# --------------------------------------------------------------------------------------------------
def flip_road_map(road: RoadMap) -> RoadMap:
    return road.transformed(np.diag([1.0, -1.0]))


def scale_road_map(road: RoadMap, factor: float) -> RoadMap:
    return road.transformed(np.eye(2) * factor)


def rotate_road_map(road: RoadMap, angle: float) -> RoadMap:
    c, s = math.cos(angle), math.sin(angle)
    return road.transformed(np.array([[c, -s], [s, c]]))


# --------------------------------------------------------------------------------------------------
# Global ops
# --------------------------------------------------------------------------------------------------
def _check_prob(name: str, p: float) -> None:
    if not (0.0 <= float(p) <= 1.0):
        raise ConfigError(f"{name} must be a probability in [0, 1], got {p!r}")


class _Op:
    """Ops are plain classes (not dataclasses: Hydra would turn instantiated dataclasses inside a list
    into DictConfigs)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class GlobalFlip(_Op):
    """With probability ``prob``, mirror about the x axis: y → −y, yaw → −yaw (the KITTI left/right flip)."""

    def __init__(self, prob: float = 0.5):
        _check_prob("GlobalFlip.prob", prob)
        self.prob = float(prob)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        if rng.random() >= self.prob:
            return frame
        pts = frame.points.copy()
        pts[:, 1] = -pts[:, 1]
        road = None if frame.road_map is None else flip_road_map(frame.road_map)
        return _replace(frame, points=pts, gt_boxes=frame.gt_boxes.flip_y(), road_map=road)


class GlobalRotation(_Op):
    """Rotate the scene about the LiDAR z axis by an angle drawn uniformly in [−max_angle, max_angle]."""

    def __init__(self, max_angle: float = math.pi / 4):
        if not (math.isfinite(float(max_angle)) and float(max_angle) >= 0):
            raise ConfigError(f"GlobalRotation.max_angle must be >= 0 radians, got {max_angle!r}")
        self.max_angle = float(max_angle)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        angle = float(rng.uniform(-self.max_angle, self.max_angle))
        pts = frame.points.copy()
        pts[:, :2] = _rotate_xy(frame.points[:, :2].astype(np.float64), angle)
        boxes = _boxes_like(Boxes3D(frame.gt_boxes.tensor.double()).rotate_z(angle).tensor, frame.gt_boxes)
        road = None if frame.road_map is None else rotate_road_map(frame.road_map, angle)
        return _replace(frame, points=pts, gt_boxes=boxes, road_map=road)


class GlobalScaling(_Op):
    """Scale the scene about the LiDAR origin by a factor drawn uniformly in [min_scale, max_scale]."""

    def __init__(self, min_scale: float = 0.95, max_scale: float = 1.05):
        if not (0 < float(min_scale) <= float(max_scale) and math.isfinite(float(max_scale))):
            raise ConfigError(f"GlobalScaling needs 0 < min_scale <= max_scale: {min_scale!r}, {max_scale!r}")
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        s = float(rng.uniform(self.min_scale, self.max_scale))
        pts = frame.points.copy()
        pts[:, :3] = frame.points[:, :3].astype(np.float64) * s
        boxes = _boxes_like(Boxes3D(frame.gt_boxes.tensor.double()).scale(s).tensor, frame.gt_boxes)
        road = None if frame.road_map is None else scale_road_map(frame.road_map, s)
        return _replace(frame, points=pts, gt_boxes=boxes, road_map=road)


# --------------------------------------------------------------------------------------------------
# Per-object noise
# --------------------------------------------------------------------------------------------------
class ObjectNoise(_Op):
    """Move each object (box and points) by a translation ~ N(0, translation_std) per axis and a rotation
    about its centre ~ U(−max_rotation, max_rotation); the first of ``num_tries`` draws whose BEV box
    collides with no other box is applied, else the object stays. Applied to each object with
    probability ``prob``."""

    def __init__(
        self,
        translation_std: Sequence[float] = (0.25, 0.25, 0.25),
        max_rotation: float = math.pi / 20,
        num_tries: int = 10,
        prob: float = 1.0,
    ):
        _check_prob("ObjectNoise.prob", prob)
        std = tuple(float(v) for v in translation_std)
        if len(std) != 3 or any(not (math.isfinite(v) and v >= 0) for v in std):
            raise ConfigError(f"ObjectNoise.translation_std must be 3 values >= 0, got {std!r}")
        if not (math.isfinite(float(max_rotation)) and float(max_rotation) >= 0) or int(num_tries) < 1:
            raise ConfigError("ObjectNoise needs max_rotation >= 0 and num_tries >= 1")
        self.translation_std = std
        self.max_rotation = float(max_rotation)
        self.num_tries = int(num_tries)
        self.prob = float(prob)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        n = len(frame.gt_boxes)
        if n == 0:
            return frame
        boxes = frame.gt_boxes.tensor.detach().cpu().double().numpy().copy()  # [N, 7]
        pts = frame.points.astype(np.float64)
        members = points_in_boxes_sparse(frame.points, frame.gt_boxes)
        count = np.zeros(len(pts), dtype=np.int64)
        for idx in members:
            count[idx] += 1
        overlap = bev_boxes_overlap(boxes[:, [0, 1, 3, 4, 6]], boxes[:, [0, 1, 3, 4, 6]])
        np.fill_diagonal(overlap, False)
        # An object sharing points with another box stays put (its points are not only its own).
        movable = ~overlap.any(axis=1) & np.array([not (count[idx] > 1).any() for idx in members])
        # Draw everything up front (one fixed number of draws per object keeps the stream reproducible).
        apply = rng.random(n) < self.prob
        shift = rng.normal(0.0, 1.0, size=(n, self.num_tries, 3)) * np.asarray(self.translation_std)
        turn = rng.uniform(-self.max_rotation, self.max_rotation, size=(n, self.num_tries))
        moved = np.zeros(n, dtype=bool)
        tried = np.flatnonzero(apply & movable)
        T = self.num_tries
        # Every candidate of every object tried: [len(tried) * T, 7], object-major.
        cand = np.repeat(boxes[tried], T, axis=0)
        cand[:, 0:3] += shift[tried].reshape(-1, 3)
        cand[:, 6] += turn[tried].reshape(-1)
        # Objects move one after the other, each checked against the others where they are at its turn: the
        # original box of one not moved (yet), the chosen candidate of one moved before. The tables against the
        # original boxes and between the candidates of two objects that can reach each other (centres within both
        # circumscribed radii plus both objects' largest draw, 1 m to spare; any other pair lies apart by more
        # than that, where the test answers False) are computed at once: the overlap test is per pair, so the
        # answers are those of testing each object on its own.
        bev = [0, 1, 3, 4, 6]
        vs_orig = bev_boxes_overlap(cand[:, bev], boxes[:, bev])  # [len(tried) * T, n]
        reach = np.hypot(boxes[:, 3], boxes[:, 4]) / 2 + np.abs(shift[:, :, :2]).sum(axis=2).max(axis=1)
        near = np.hypot(*(boxes[:, None, :2] - boxes[None, :, :2]).transpose(2, 0, 1)) <= reach[:, None] + reach + 1.0
        by_obj = cand[:, bev].reshape(len(tried), T, 5)
        later, earlier = np.nonzero(np.tril(near[np.ix_(tried, tried)], -1))  # positions in tried, later first
        vs_cand = _overlap(by_obj[later][:, :, None], by_obj[earlier][:, None, :])  # [pairs, T (later), T (earlier)]
        pair_of = {(int(p), int(q)): m for m, (p, q) in enumerate(zip(later, earlier, strict=True))}
        chosen: dict[int, int] = {}  # position in tried -> its applied draw
        for p, i in enumerate(tried):
            hit_table = vs_orig[p * T:(p + 1) * T].copy()
            hit_table[:, [i, *(tried[q] for q in chosen)]] = False
            for q, k in chosen.items():
                m = pair_of.get((p, q))
                if m is not None:
                    hit_table[:, tried[q]] = vs_cand[m, :, k]
            hit = hit_table.any(axis=1)
            if hit.all():
                continue
            chosen[p] = int(np.argmin(hit))  # first collision-free draw
        # Move the chosen objects' boxes and points (no point belongs to two movable objects).
        moved[tried[list(chosen)]] = True
        if chosen:
            ps, ks = np.fromiter(chosen, np.int64), np.fromiter(chosen.values(), np.int64)
            objs, rows = tried[ps], ps * T + ks
            sel = [members[i] for i in objs]
            n_pts = [len(x) for x in sel]
            idx = np.concatenate(sel)
            local = pts[idx, :2] - np.repeat(boxes[objs, :2], n_pts, axis=0)
            pts[idx, :2] = _rotate_xy(local, turn[objs, ks], n_pts) + np.repeat(cand[rows, :2], n_pts, axis=0)
            pts[idx, 2] += np.repeat(shift[objs, ks, 2], n_pts)
            boxes[objs] = cand[rows]
        out_pts = pts.astype(np.float32)
        out_pts[:, 3] = frame.points[:, 3]
        new_boxes = _boxes_like(torch.from_numpy(boxes), frame.gt_boxes)
        if moved.any():
            # Background points now inside a moved box would become part of the object: drop them.
            moved_boxes = new_boxes[torch.from_numpy(np.flatnonzero(moved))]
            drop = _any_box(len(out_pts), points_in_boxes_sparse(out_pts, moved_boxes)) & (count == 0)
            out_pts = out_pts[~drop]
        return _replace(frame, points=out_pts, gt_boxes=new_boxes)


# --------------------------------------------------------------------------------------------------
# Sensor and scene differences between the simulator and a real LiDAR (sim-to-real)
# --------------------------------------------------------------------------------------------------
def _check_fractions(name: str, lo: float, hi: float) -> None:
    if not (0.0 <= float(lo) <= float(hi) <= 1.0):
        raise ConfigError(f"{name} needs 0 <= min_fraction <= max_fraction <= 1, got {lo!r}, {hi!r}")


def elevation_rings(points: np.ndarray, min_gap_deg: float = 0.1) -> np.ndarray:
    """[N] int64 ring index of each point (0: the lowest), from its elevation angle seen from the LiDAR
    origin, atan2(z, hypot(x, y)): sorted elevations start a new ring wherever consecutive values are more
    than ``min_gap_deg`` apart. Exact on our simulator's scans (64 beams at fixed elevations, at least 1/3°
    apart); a real scan's rings are blurred by per-laser offsets and are not separable this way."""
    if len(points) == 0:
        return np.zeros(0, dtype=np.int64)
    p = points[:, :3].astype(np.float64)
    el = np.degrees(np.arctan2(p[:, 2], np.hypot(p[:, 0], p[:, 1])))
    order = np.argsort(el, kind="stable")
    ring_sorted = np.concatenate([[0], np.cumsum(np.diff(el[order]) > min_gap_deg)])
    ring = np.empty(len(p), dtype=np.int64)
    ring[order] = ring_sorted
    return ring


class BeamDropout(_Op):
    """With probability ``prob``, remove whole rings of the scan: a share drawn uniformly in
    [min_fraction, max_fraction] of the frame's rings (:func:`elevation_rings`, rounded down), chosen
    uniformly without replacement; every point of a chosen ring goes, the others stay. Boxes are kept (as
    on a real scan, an object may then have fewer or no points). Apply it before ops that move objects
    off their beams' elevations (ObjectNoise, GroundTilt); GT sampling pastes objects at their recorded
    place, so their rings are the frame's."""

    def __init__(self, prob: float = 0.5, min_fraction: float = 0.0, max_fraction: float = 0.25,
                 min_gap_deg: float = 0.1):
        _check_prob("BeamDropout.prob", prob)
        _check_fractions("BeamDropout", min_fraction, max_fraction)
        if not (math.isfinite(float(min_gap_deg)) and float(min_gap_deg) > 0):
            raise ConfigError(f"BeamDropout.min_gap_deg must be > 0, got {min_gap_deg!r}")
        self.prob = float(prob)
        self.min_fraction = float(min_fraction)
        self.max_fraction = float(max_fraction)
        self.min_gap_deg = float(min_gap_deg)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        apply = rng.random() < self.prob
        share = float(rng.uniform(self.min_fraction, self.max_fraction))
        if not apply or len(frame.points) == 0:
            return frame
        ring = elevation_rings(frame.points, self.min_gap_deg)
        n_rings = int(ring.max()) + 1
        dropped = rng.choice(n_rings, size=int(share * n_rings), replace=False)
        return _replace(frame, points=frame.points[~np.isin(ring, dropped)])


class IntensityJitter(_Op):
    """With probability ``prob``, reflectance r → clip(s·r + ε, 0, 1) with one gain s ~ U(min_scale,
    max_scale) per frame and ε ~ N(0, noise_std) per point (a real sensor's reflectance calibration
    differs from the simulator's material model). Coordinates and boxes are unchanged."""

    def __init__(self, prob: float = 1.0, min_scale: float = 0.8, max_scale: float = 1.2, noise_std: float = 0.03):
        _check_prob("IntensityJitter.prob", prob)
        if not (0 <= float(min_scale) <= float(max_scale) and math.isfinite(float(max_scale))):
            raise ConfigError(f"IntensityJitter needs 0 <= min_scale <= max_scale: {min_scale!r}, {max_scale!r}")
        if not (math.isfinite(float(noise_std)) and float(noise_std) >= 0):
            raise ConfigError(f"IntensityJitter.noise_std must be >= 0, got {noise_std!r}")
        self.prob = float(prob)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.noise_std = float(noise_std)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        if rng.random() >= self.prob:
            return frame
        gain = float(rng.uniform(self.min_scale, self.max_scale))
        pts = frame.points.copy()
        r = pts[:, 3].astype(np.float64) * gain
        if self.noise_std > 0:
            r += rng.normal(0.0, self.noise_std, size=len(r))
        pts[:, 3] = np.clip(r, 0.0, 1.0)
        return _replace(frame, points=pts)


def tilt_matrix(roll: float, pitch: float) -> np.ndarray:
    """[3, 3] rotation about the LiDAR x axis by ``roll``, then about the y axis by ``pitch`` (radians)."""
    cr, sr, cp, sp = math.cos(roll), math.sin(roll), math.cos(pitch), math.sin(pitch)
    rx = np.array([[1.0, 0.0, 0.0], [0.0, cr, -sr], [0.0, sr, cr]])
    ry = np.array([[cp, 0.0, sp], [0.0, 1.0, 0.0], [-sp, 0.0, cp]])
    return ry @ rx


class GroundTilt(_Op):
    """With probability ``prob``, tilt the scene about the LiDAR origin by a roll and a pitch each drawn
    uniformly in [−max_angle, max_angle] (a sensor mounted or a road sloped differently from the
    simulator's level ground). Background points rotate; box centres rotate; an object's points move
    with its box centre (c → R c), unrotated, since a box has a yaw only: every point inside a box stays
    inside its moved box. Yaw, sizes and the road map are kept (a 2D raster: at the default 2° a ground
    point within 50 m moves by at most about 0.1 m in x, y, far less than the road mask's 2 m dilation)."""

    def __init__(self, prob: float = 0.5, max_angle: float = 0.035):
        _check_prob("GroundTilt.prob", prob)
        if not (math.isfinite(float(max_angle)) and 0 <= float(max_angle) < math.pi / 4):
            raise ConfigError(f"GroundTilt.max_angle must be in [0, pi/4) radians, got {max_angle!r}")
        self.prob = float(prob)
        self.max_angle = float(max_angle)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        apply = rng.random() < self.prob
        roll, pitch = (float(a) for a in rng.uniform(-self.max_angle, self.max_angle, size=2))
        if not apply:
            return frame
        rot = tilt_matrix(roll, pitch)
        xyz = frame.points[:, :3].astype(np.float64)
        out = xyz @ rot.T
        boxes = frame.gt_boxes.tensor.detach().cpu().double().numpy().copy()
        centres = boxes[:, :3] @ rot.T
        taken = np.zeros(len(xyz), dtype=bool)
        for j, idx in enumerate(points_in_boxes_sparse(frame.points, frame.gt_boxes)):
            idx = idx[~taken[idx]]  # a point in two boxes moves with the first
            out[idx] = xyz[idx] + (centres[j] - boxes[j, :3])
            taken[idx] = True
        boxes[:, :3] = centres
        pts = frame.points.copy()
        pts[:, :3] = out
        return _replace(frame, points=pts, gt_boxes=_boxes_like(torch.from_numpy(boxes), frame.gt_boxes))


class ObjectPointDropout(_Op):
    """Each object, with probability ``prob``, loses a share drawn uniformly in [min_fraction,
    max_fraction] of its points (rounded down), chosen uniformly (a real scan returns fewer points from
    dark paint, glass and partly occluded cars than the simulator's surfaces). Background points and
    boxes are unchanged."""

    def __init__(self, prob: float = 0.5, min_fraction: float = 0.0, max_fraction: float = 0.5):
        _check_prob("ObjectPointDropout.prob", prob)
        _check_fractions("ObjectPointDropout", min_fraction, max_fraction)
        self.prob = float(prob)
        self.min_fraction = float(min_fraction)
        self.max_fraction = float(max_fraction)

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        n = len(frame.gt_boxes)
        apply = rng.random(n) < self.prob
        share = rng.uniform(self.min_fraction, self.max_fraction, size=n)
        if not apply.any():
            return frame
        drop = np.zeros(len(frame.points), dtype=bool)
        for j, idx in enumerate(points_in_boxes_sparse(frame.points, frame.gt_boxes)):
            if apply[j] and len(idx):
                drop[rng.choice(idx, size=int(share[j] * len(idx)), replace=False)] = True
        return _replace(frame, points=frame.points[~drop])


# --------------------------------------------------------------------------------------------------
# Ground-truth sampling
# --------------------------------------------------------------------------------------------------
class GtSampling(_Op):
    """Paste up to ``counts[class]`` database objects per class into each frame.

    Candidates: database objects of the class with at least ``min_points`` points and (when
    ``max_difficulty`` is set) a KITTI difficulty in [0, max_difficulty], not from the frame itself.
    They are drawn without replacement and accepted greedily in draw order when their BEV box collides
    with no box of the frame and no box accepted before (and, on a frame with a road map and
    ``require_road``, touches a drivable cell: see ``_on_road``). The frame's points inside the
    accepted boxes are removed and the objects' points added.
    """

    def __init__(
        self,
        database: GtDatabase,
        counts: Mapping[str, int],
        min_points: int | Mapping[str, int] = 5,
        max_difficulty: int | None = 2,
        require_road: bool = True,
    ):
        self.database = database
        self.counts = {str(k): int(v) for k, v in dict(counts).items()}
        if any(v < 0 for v in self.counts.values()):
            raise ConfigError(f"GtSampling.counts must be >= 0, got {self.counts}")
        mp = min_points if isinstance(min_points, Mapping) else {c: int(min_points) for c in self.counts}
        self.min_points = {str(k): int(v) for k, v in dict(mp).items()}
        self.max_difficulty = max_difficulty
        self.require_road = bool(require_road)
        n_pts = database.num_points
        self._pool: dict[str, np.ndarray] = {}
        for cls in self.counts:
            ok = (database.names == cls) & (n_pts >= self.min_points.get(cls, 0))
            if max_difficulty is not None:
                ok &= (database.difficulty >= 0) & (database.difficulty <= int(max_difficulty))
            self._pool[cls] = np.flatnonzero(ok)

    def pool_size(self, cls: str) -> int:
        return len(self._pool.get(cls, ()))

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        db = self.database
        existing = frame.gt_boxes.tensor.detach().cpu().double().numpy()[:, [0, 1, 3, 4, 6]]
        chosen: list[int] = []
        for cls, want in self.counts.items():
            pool = self._pool[cls]
            pool = pool[db.frame_ids[pool] != frame.frame_id]
            if want == 0 or len(pool) == 0:
                continue
            cand = rng.choice(pool, size=min(want, len(pool)), replace=False)
            cbev = db.boxes[cand][:, [0, 1, 3, 4, 6]].astype(np.float64)
            ok = ~bev_boxes_overlap(cbev, existing).any(axis=1)
            if self.require_road and frame.road_map is not None:
                ok &= _on_road(frame.road_map, db.boxes[cand])
            pair = bev_boxes_overlap(cbev, cbev)
            accepted = []
            for j in np.flatnonzero(ok):
                if not any(pair[j, a] for a in accepted):
                    accepted.append(j)
            chosen.extend(int(c) for c in cand[accepted])
            existing = np.concatenate([existing, cbev[accepted]])
        if not chosen:
            return frame
        idx = np.asarray(chosen)
        pasted = Boxes3D(torch.from_numpy(db.boxes[idx]).to(frame.gt_boxes.tensor.dtype))
        keep = ~_any_box(len(frame.points), points_in_boxes_sparse(frame.points, pasted))
        obj_pts = np.concatenate([db.object_points(int(k)) for k in idx])
        points = np.concatenate([frame.points[keep], obj_pts]).astype(np.float32)
        boxes = Boxes3D.cat([frame.gt_boxes, pasted])
        names = np.concatenate([frame.gt_names, db.names[idx]]).astype("<U16")
        return _replace(frame, points=points, gt_boxes=boxes, gt_names=names)


# --------------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------------
class Augmentor:
    """Applies ``ops`` in order: ``augmentor(frame, rng) -> Frame`` (a new Frame; the input is not
    modified). Pass one Generator per sample (e.g. seeded from (seed, epoch, index)) so DataLoader
    workers are deterministic."""

    def __init__(self, ops: Sequence = ()):
        self.ops = list(ops)
        for op in self.ops:
            if not callable(op):
                raise ValueError(f"Augmentor ops must be callable (frame, rng) -> Frame, got {op!r}")

    def __call__(self, frame: Frame, rng: np.random.Generator) -> Frame:
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"Augmentor needs a numpy Generator (np.random.default_rng(seed)), got {rng!r}")
        out = _replace(frame, points=frame.points.copy(), gt_boxes=frame.gt_boxes.clone(),
                       gt_names=frame.gt_names.copy())
        for op in self.ops:
            out = op(out, rng)
        return out
