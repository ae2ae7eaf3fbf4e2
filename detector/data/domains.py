"""Domain statistics of a KITTI-format root, and distances between two domains (simulated vs real).

What decides whether a detector trained on one domain transfers to another is measured per root
(:func:`collect`) on what the detector sees (the points in the left camera's field of view, as training
keeps them) and on the labels:

- points per frame (whole scan and field of view); the beam elevation ``atan2(z, hypot(x, y))`` of every
  point (its histogram is the points per ring); range ``|xyz|``; reflectance overall, on cars (points
  inside Car boxes) and on the ground (points within ``GROUND_BAND`` of the frame's ground plane);
- the ground plane per frame: the RANSAC planes of :class:`~detector.data.masks.GroundMask` (one per
  range ring); its height below the sensor at the origin and its slope, from the innermost ring's plane;
- per Car: points inside its box by distance band, size (l, w, h), yaw, distance, occlusion, truncation;
- labeled objects per frame by class (DontCare included) and by distance band;
- the BEV input (the project's voxelizer on a given grid): the share of cells occupied per height slice
  per frame, and the mean / std of every channel over all cells.

Two domains are compared per 1-D distribution (:func:`compare`) with the 1-D Wasserstein distance W1
(the area between the two CDFs; in the statistic's unit), W1 divided by the real (reference) distribution's
standard deviation (comparable across statistics), and the Kolmogorov–Smirnov statistic (largest gap
between the CDFs, 0..1).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from detector.data.kitti import KittiRoot
from detector.data.kitti_camera import in_camera_fov
from detector.data.masks import GroundMask
from detector.geometry.boxes import points_in_boxes_sparse
from detector.geometry.voxelize import BevGrid, voxelize

GROUND_BAND = 0.15  # m: a point this close to its ground plane is a ground point
DISTANCE_BANDS = ((0.0, 20.0), (20.0, 40.0), (40.0, math.inf))  # m, horizontal distance of a box centre
ELEVATION_BIN_DEG = 0.1


def band_name(lo: float, hi: float) -> str:
    return f"{lo:g}-{hi:g}m" if math.isfinite(hi) else f"{lo:g}m+"


# The 1-D statistics, in report order: name -> (unit, what one sample is).
STATISTICS: dict[str, tuple[str, str]] = {
    "points_per_frame": ("points", "points of the whole scan, per frame"),
    "points_per_frame_fov": ("points", "points in the camera's field of view, per frame"),
    "elevation_deg": ("deg", "beam elevation atan2(z, hypot(x, y)) of a point (FOV)"),
    "range_m": ("m", "distance |xyz| of a point (FOV)"),
    "intensity": ("", "reflectance of a point (FOV)"),
    "intensity_car": ("", "reflectance of a point inside a Car box"),
    "intensity_ground": ("", f"reflectance of a point within {GROUND_BAND} m of the ground plane (FOV)"),
    "ground_height_m": ("m", "ground plane height at the sensor's x, y (LiDAR frame), per frame"),
    "ground_slope_deg": ("deg", "tilt of the ground plane (range < 20 m), per frame"),
    **{
        f"car_points_{band_name(lo, hi)}": ("points", f"points inside a Car box {band_name(lo, hi)} away")
        for lo, hi in DISTANCE_BANDS
    },
    "car_length_m": ("m", "Car box length"),
    "car_width_m": ("m", "Car box width"),
    "car_height_m": ("m", "Car box height"),
    "car_yaw_deg": ("deg", "Car yaw in the LiDAR frame folded to [-90, 90) (front/back alike; 0: along x)"),
    "car_distance_m": ("m", "horizontal distance of a Car box centre"),
    "car_occlusion": ("level", "Car occlusion level (0 visible .. 3 unknown)"),
    "car_truncation": ("", "Car truncation"),
    "cars_per_frame": ("objects", "labeled Cars per frame"),
    "objects_per_frame": ("objects", "labeled objects per frame, DontCare included"),
}


# --------------------------------------------------------------------------------------------------
# Distances between 1-D samples
# --------------------------------------------------------------------------------------------------
def _sorted(a) -> np.ndarray:
    a = np.sort(np.asarray(a, dtype=np.float64).ravel())
    if a.size == 0:
        raise ValueError("a distance needs non-empty samples")
    return a


def wasserstein_1d(a, b) -> float:
    """W1 between the empirical distributions of samples ``a`` and ``b``: the integral of |F_a - F_b|."""
    a, b = _sorted(a), _sorted(b)
    x = np.sort(np.concatenate([a, b]))
    fa = np.searchsorted(a, x[:-1], side="right") / a.size
    fb = np.searchsorted(b, x[:-1], side="right") / b.size
    return float(np.sum(np.abs(fa - fb) * np.diff(x)))


def ks_statistic(a, b) -> float:
    """Two-sample Kolmogorov–Smirnov statistic: max over x of |F_a(x) - F_b(x)|."""
    a, b = _sorted(a), _sorted(b)
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / a.size
    fb = np.searchsorted(b, x, side="right") / b.size
    return float(np.max(np.abs(fa - fb)))


# --------------------------------------------------------------------------------------------------
# Per-frame measurements
# --------------------------------------------------------------------------------------------------
def elevation_deg(points: np.ndarray) -> np.ndarray:
    """[N] elevation angle (degrees) of each point seen from the LiDAR origin: atan2(z, hypot(x, y))."""
    p = np.asarray(points, dtype=np.float64)
    return np.degrees(np.arctan2(p[:, 2], np.hypot(p[:, 0], p[:, 1])))


@dataclass(frozen=True)
class GroundFit:
    """The ground of one frame: ``height`` (z of the innermost plane at x = y = 0, m), ``slope_deg`` (its
    tilt from horizontal) and ``is_ground`` [N] (point within GROUND_BAND of its ring's plane)."""

    height: float
    slope_deg: float
    is_ground: np.ndarray


def fit_ground(xyz: np.ndarray, fitter: GroundMask | None = None) -> GroundFit | None:
    """The ground planes of :meth:`GroundMask.fit_planes` (RANSAC per range ring) for ``xyz`` [N, 3];
    None when no plane is found near the expected ground. open3d's RANSAC runs on one thread here: with
    several, its result varies from call to call despite the seed."""
    import open3d as o3d

    fitter = fitter or GroundMask()
    xyz = np.asarray(xyz, dtype=np.float64)
    threads = o3d.utility.get_max_threads()
    o3d.utility.set_max_threads(1)
    try:
        fit = fitter.fit_planes(xyz)
    finally:
        o3d.utility.set_max_threads(threads)
    if fit is None:
        return None
    planes, zone = fit
    a, b, c, d = planes[0]
    p = planes[zone]
    dist = xyz[:, 0] * p[:, 0] + xyz[:, 1] * p[:, 1] + xyz[:, 2] * p[:, 2] + p[:, 3]
    return GroundFit(float(-d / c), float(np.degrees(np.arccos(min(abs(c), 1.0)))), np.abs(dist) <= GROUND_BAND)


def bev_of(points: np.ndarray, grid: BevGrid) -> torch.Tensor:
    """[C, H, W] BEV input of one frame's points (the project's voxelizer)."""
    p = torch.from_numpy(np.ascontiguousarray(points, dtype=np.float32))
    bev, _ = voxelize(torch.cat([torch.zeros(len(p), 1), p], dim=1), 1, grid)
    return bev[0]


# --------------------------------------------------------------------------------------------------
# A domain
# --------------------------------------------------------------------------------------------------
@dataclass
class DomainStats:
    """The statistics of one KITTI-format root (module doc). ``samples[name]`` holds the 1-D samples of
    each statistic of :data:`STATISTICS`; ``elevation_hist`` the points per frame in each
    ``ELEVATION_BIN_DEG`` bin from ``elevation_edges``; ``objects[class][band]`` labeled objects per frame
    (band ``all`` for every class, distance bands for the non-DontCare ones); ``bev_occupancy`` [S] the
    mean share of occupied cells per height slice, ``bev_mean``/``bev_std`` [C] per channel over all cells."""

    root: str
    frames: int
    samples: dict[str, np.ndarray]
    elevation_edges: np.ndarray
    elevation_hist: np.ndarray
    objects: dict[str, dict[str, float]]
    bev_occupancy_per_frame: np.ndarray  # [frames, S]
    bev_mean: np.ndarray
    bev_std: np.ndarray
    ground_fit_failures: int = 0
    car_points_distance: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # [cars, (distance, points)]

    @property
    def bev_occupancy(self) -> np.ndarray:
        return self.bev_occupancy_per_frame.mean(axis=0)


def frame_ids(root: KittiRoot, split: str) -> list[str]:
    """``ImageSets/{split}.txt``, or every velodyne file for ``split='all'``."""
    if split == "all":
        return sorted(p.stem for p in (root.dir / "velodyne").glob("*.bin"))
    return root.imageset(split)


def collect(
    root: str | Path, grid: BevGrid, split: str = "all", max_frames: int = 0, ids: Iterable[str] | None = None
) -> DomainStats:
    """Measure the statistics of the module doc on the frames of ``split`` (at most ``max_frames``, 0: all)
    of a KITTI-format root with labels and calibration."""
    kroot = KittiRoot(root)
    ids = list(ids) if ids is not None else frame_ids(kroot, split)
    if max_frames > 0:
        ids = ids[:max_frames]
    if not ids:
        raise ValueError(f"{root}: no frames in split {split!r}")
    s: dict[str, list] = {k: [] for k in STATISTICS}
    edges = np.round(np.arange(-30.0, 10.0 + 1e-9, ELEVATION_BIN_DEG), 6)
    el_hist = np.zeros(len(edges) - 1)
    objects: dict[str, Counter] = {}
    occ, ch_sum, ch_sq, n_cells = [], np.zeros(grid.C), np.zeros(grid.C), 0
    fitter = GroundMask()
    failures = 0
    car_pd = []
    for fid in ids:
        f = kroot.read_frame(fid)
        pts = f.points
        fov = pts[in_camera_fov(pts, f.calib)]
        s["points_per_frame"].append([len(pts)])
        s["points_per_frame_fov"].append([len(fov)])
        el = elevation_deg(fov)
        s["elevation_deg"].append(el)
        el_hist += np.histogram(el, edges)[0]
        s["range_m"].append(np.linalg.norm(fov[:, :3].astype(np.float64), axis=1))
        s["intensity"].append(fov[:, 3])
        g = fit_ground(fov[:, :3][np.hypot(fov[:, 0], fov[:, 1]) < 60.0], fitter)
        if g is None:
            failures += 1
        else:
            s["ground_height_m"].append([g.height])
            s["ground_slope_deg"].append([g.slope_deg])
            near = fov[np.hypot(fov[:, 0], fov[:, 1]) < 60.0]
            s["intensity_ground"].append(near[g.is_ground, 3])
        # Objects.
        names = f.labels.name if f.labels is not None else np.zeros(0, str)
        s["objects_per_frame"].append([len(names)])
        for name in names:
            objects.setdefault(str(name), Counter())["all"] += 1
        centres = f.gt_boxes.center.numpy().astype(np.float64)
        dist = np.hypot(centres[:, 0], centres[:, 1])
        for name, d in zip(f.gt_names, dist, strict=True):
            for lo, hi in DISTANCE_BANDS:
                if lo <= d < hi:
                    objects[str(name)][band_name(lo, hi)] += 1
        car = f.gt_names == "Car"
        s["cars_per_frame"].append([int(car.sum())])
        if car.any():
            cars = f.gt_boxes[torch.from_numpy(car)]
            inside = points_in_boxes_sparse(pts, cars)
            counts = np.array([len(i) for i in inside])
            for lo, hi in DISTANCE_BANDS:
                s[f"car_points_{band_name(lo, hi)}"].append(counts[(dist[car] >= lo) & (dist[car] < hi)])
            car_pd.append(np.stack([dist[car], counts], axis=1))
            if any(len(i) for i in inside):
                s["intensity_car"].append(pts[np.concatenate(inside), 3])
            t = cars.tensor.numpy().astype(np.float64)
            s["car_length_m"].append(t[:, 3])
            s["car_width_m"].append(t[:, 4])
            s["car_height_m"].append(t[:, 5])
            s["car_yaw_deg"].append(np.degrees(np.mod(t[:, 6] + np.pi / 2, np.pi) - np.pi / 2))
            s["car_distance_m"].append(dist[car])
            lab = f.labels.select(f.labels.name == "Car")
            s["car_occlusion"].append(lab.occluded)
            s["car_truncation"].append(lab.truncated)
        # BEV input.
        bev = bev_of(fov, grid).double()
        occ.append(bev[: grid.n_slices].mean(dim=(1, 2)).numpy())
        ch_sum += bev.sum(dim=(1, 2)).numpy()
        ch_sq += (bev * bev).sum(dim=(1, 2)).numpy()
        n_cells += grid.H * grid.W
    samples = {k: np.concatenate([np.asarray(x, np.float64) for x in v]) if v else np.zeros(0) for k, v in s.items()}
    mean = ch_sum / n_cells
    n = len(ids)
    return DomainStats(
        root=str(root),
        frames=n,
        samples=samples,
        elevation_edges=edges,
        elevation_hist=el_hist / n,
        objects={k: {b: c / n for b, c in v.items()} for k, v in sorted(objects.items())},
        bev_occupancy_per_frame=np.stack(occ),
        bev_mean=mean,
        bev_std=np.sqrt(np.maximum(ch_sq / n_cells - mean**2, 0.0)),
        ground_fit_failures=failures,
        car_points_distance=np.concatenate(car_pd) if car_pd else np.zeros((0, 2)),
    )


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Distance:
    """One statistic compared: sample counts and means of both domains, W1 (statistic's unit), W1 / std of
    the reference domain, and KS. Distances are NaN where a domain has no sample."""

    name: str
    n: int
    n_ref: int
    mean: float
    mean_ref: float
    w1: float
    w1_norm: float
    ks: float


def distance(name: str, a: np.ndarray, ref: np.ndarray) -> Distance:
    a, ref = np.asarray(a, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    if a.size == 0 or ref.size == 0:
        nan = float("nan")
        ma = float(a.mean()) if a.size else nan
        mr = float(ref.mean()) if ref.size else nan
        return Distance(name, a.size, ref.size, ma, mr, nan, nan, nan)
    w1 = wasserstein_1d(a, ref)
    sd = float(ref.std())
    return Distance(
        name, a.size, ref.size, float(a.mean()), float(ref.mean()), w1, w1 / sd if sd > 0 else float("nan"),
        ks_statistic(a, ref),
    )


def compare(stats: DomainStats, ref: DomainStats) -> list[Distance]:
    """Every statistic of :data:`STATISTICS`, then the BEV occupancy of each height slice (per frame), of
    ``stats`` against the reference ``ref`` (the real domain)."""
    out = [distance(k, stats.samples[k], ref.samples[k]) for k in STATISTICS]
    for k in range(stats.bev_occupancy_per_frame.shape[1]):
        out.append(
            distance(f"bev_occupancy_slice{k}", stats.bev_occupancy_per_frame[:, k], ref.bev_occupancy_per_frame[:, k])
        )
    return out
