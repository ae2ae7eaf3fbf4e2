"""The KITTI-format LiDAR simulator: an HDL-64E-like scan of procedural street scenes, labeled like KITTI.

One frame (:func:`simulate_frame`):

1. A plausible calibration for KITTI's left colour camera (:func:`make_calibration`).
2. A street scene (:mod:`detector.data.sim_scene`, meshes from :mod:`detector.data.sim_meshes`).
3. The scan (:func:`scan`): open3d's ``RaycastingScene`` casts 64 beams (elevations from +2.0° to
   −24.8°: 32 upper beams 1/3° apart, 32 lower beams about 0.52° apart, like the HDL-64E's two laser
   blocks) × ``columns`` azimuths over 360° from the sensor, 1.70–1.76 m above the road. The HDL-64E S2
   fires about 1.33 M pulses/s, i.e. about 2080 per laser per revolution at 10 Hz (0.17°); the default is
   2083 columns (0.173°), 133 k rays. A return needs enough signal: ``albedo · cos(incidence) · (20 m /
   r)²`` must exceed ``min_signal`` (so dark surfaces at grazing angles and long range drop out), plus a
   random ``dropout`` (and extra dropout on glass); nothing beyond ``max_range``. The range gets Gaussian
   noise (σ = ``range_noise``, clipped at ±3σ) along the ray, so a point keeps its beam's elevation.
   Reflectance = ``albedo · (0.5 + 0.5·cos(incidence))`` × log-normal noise, clipped to [0, 0.99] and
   rounded to 0.01 as in KITTI's files; lane markings and zebra crossings are painted (bright), building
   windows dark.
4. Labels (:func:`label_frame`), following KITTI's rules:

   - candidates are the dynamic objects whose 3D box projects into the 1242×375 image (through P2);
   - the 2D box is the projected 3D box clipped to the image (:func:`~detector.data.kitti.boxes_to_labels`);
   - truncation = the fraction of the projected, unclipped 2D box outside the image;
   - occlusion: ``occlusion_samples`` points are drawn on the object's mesh (area-weighted); of those
     that project into the image, a point is hidden when the ray from the camera's optical centre to
     it first hits something else. Hidden fraction ≤ 0.2 → 0 (fully visible), ≤ 0.5 → 1 (partly
     occluded), ≤ 0.85 → 2 (largely occluded); 3 (unknown) is never written;
   - an object is labeled with its class when it has at least ``MIN_POINTS`` LiDAR returns, a 2D box at
     least ``MIN_HEIGHT_PX`` tall and a hidden fraction ≤ 0.85. Otherwise, if it is still partly
     seen by the camera or the LiDAR, it becomes a ``DontCare`` region (its 2D box), as in KITTI;
     objects neither camera nor LiDAR sees are left out.

5. The road map (:meth:`~detector.data.sim_scene.Street.road_map`): the drivable area (the road between
   the kerbs, and the cross street) as a LiDAR-frame BEV raster over x 0–70.4 m, y −40–40 m at 0.1 m
   (``ROAD_MAP_GRID``), written as ``road_map/%06d.png`` with the grid in ``road_map/grid.json``.

Determinism: every random draw of frame ``i`` comes from ``numpy.random.SeedSequence(seed,
spawn_key=(i,))`` and the ray casting is single-threaded, so a frame's files are byte-identical whatever
the number of worker processes (:func:`generate_dataset`) and whatever the number of frames generated,
given the same library versions and CPU type (Embree's float results may differ in the last bits between
CPU instruction sets).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from detector.data.kitti import (
    IMAGE_SIZE,
    Calibration,
    KittiLabels,
    RoadMap,
    boxes_to_labels,
    write_imageset,
    write_label,
    write_points,
    write_road_map,
)
from detector.data.sim_meshes import DROPOUT, Material
from detector.data.sim_scene import Scene, generate_scene
from detector.data.structures import BOX_EDGES, Boxes3D

MIN_POINTS = 3  # LiDAR returns an object needs to be labeled
MIN_HEIGHT_PX = 15.0  # 2D box height an object needs to be labeled (KITTI's hard level starts at 25 px)
OCCLUSION_LEVELS = (0.2, 0.5, 0.85)  # hidden fraction limits of levels 0, 1, 2; above: not labeled
ROAD_MAP_GRID = dict(x_range=(0.0, 70.4), y_range=(-40.0, 40.0), resolution=0.1)


@dataclass(frozen=True)
class LidarSpec:
    """The scan pattern and sensor model (defaults: Velodyne HDL-64E S2 at 10 Hz, see module doc)."""

    columns: int = 2083
    max_range: float = 120.0
    range_noise: float = 0.02  # m, 1 σ, clipped at ±3σ
    dropout: float = 0.02  # random loss of a return
    min_signal: float = 0.001  # see module doc
    intensity_noise: float = 0.1  # σ of the log-normal factor

    def __post_init__(self):
        if self.columns < 8:
            raise ValueError(f"LidarSpec.columns must be >= 8, got {self.columns}")
        if not self.max_range > 0:
            raise ValueError(f"LidarSpec.max_range must be > 0, got {self.max_range}")
        for k in ("range_noise", "dropout", "min_signal", "intensity_noise"):
            if getattr(self, k) < 0:
                raise ValueError(f"LidarSpec.{k} must be >= 0, got {getattr(self, k)}")
        if self.dropout >= 1:
            raise ValueError(f"LidarSpec.dropout must be < 1, got {self.dropout}")


def beam_elevations() -> np.ndarray:
    """[64] beam elevation angles (degrees), top beam first: 32 upper beams +2.0 … −8.33 (1/3° apart),
    32 lower beams −8.83 … −24.8."""
    upper = 2.0 - np.arange(32) / 3.0
    lower = np.linspace(-8.83, -24.8, 32)
    return np.concatenate([upper, lower])


@functools.lru_cache(maxsize=4)
def ray_directions(columns: int) -> np.ndarray:
    """[64 * columns, 3] unit directions (read-only), ring-major (ring r = rows r·columns …), azimuth
    from −180°."""
    el = np.deg2rad(beam_elevations())[:, None]
    az = -np.pi + (np.arange(columns) + 0.5) * (2 * np.pi / columns)
    d = np.stack(np.broadcast_arrays(np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)), axis=-1)
    d = d.reshape(-1, 3)
    d.flags.writeable = False
    return d


@dataclass
class Scan:
    """One sweep: ``points`` [N, 4] float32 (x, y, z, reflectance), and per point its ``ring`` (0 = top
    beam), the index of the ``obj`` it hit (-1: static scene) and the noise-free hit distance ``t``."""

    points: np.ndarray
    ring: np.ndarray
    obj: np.ndarray
    t: np.ndarray
    rays: int


def scan(scene: Scene, spec: LidarSpec, rng: np.random.Generator) -> Scan:
    """Cast the sweep from the LiDAR origin into ``scene`` (see module doc for the sensor model)."""
    dirs = ray_directions(spec.columns)
    t, prim = scene.cast(np.zeros(3), dirs)
    hit = (prim >= 0) & (t <= spec.max_range)
    idx = np.flatnonzero(hit)
    t, prim, d = t[idx], prim[idx], dirs[idx]
    mat = scene.tri_material[prim]
    albedo = scene.tri_albedo[prim].astype(np.float64)
    # Painted road markings and dark windows, decided where the ray lands.
    st = scene.street
    road = np.flatnonzero(mat == Material.ASPHALT)
    if len(road):
        uv = st.to_street(d[road, :2] * t[road, None])
        albedo[road[st.painted(uv[:, 0], uv[:, 1])]] = 0.9
    facade = np.flatnonzero(mat == Material.FACADE)
    if len(facade):
        p = d[facade] * t[facade, None]
        uv = st.to_street(p[:, :2])
        n_uv = st.to_street(scene.normals(prim[facade])[:, :2])
        win = st.window(uv[:, 0], uv[:, 1], p[:, 2] - st.ground_z(uv[:, 0], uv[:, 1]), n_uv)
        albedo[facade[win]] = 0.06
    cos_inc = np.abs(np.einsum("ij,ij->i", scene.normals(prim), d))
    # Returns with too little signal are lost; a few more at random (glass: many).
    signal = albedo * cos_inc * (20.0 / np.maximum(t, 1.0)) ** 2
    u = rng.random(len(t))
    keep = (signal > spec.min_signal) & (u >= spec.dropout + (1 - spec.dropout) * DROPOUT[mat])
    noise = np.clip(rng.standard_normal(len(t)), -3.0, 3.0) * spec.range_noise
    refl = albedo * (0.5 + 0.5 * cos_inc) * np.exp(rng.standard_normal(len(t)) * spec.intensity_noise)
    refl = np.round(np.clip(refl, 0.0, 0.99), 2)
    sel = np.flatnonzero(keep)
    r = t[sel] + noise[sel]
    pts = np.concatenate([d[sel] * r[:, None], refl[sel, None]], axis=1).astype(np.float32)
    ring = (idx[sel] // spec.columns).astype(np.int16)
    return Scan(pts, ring, scene.tri_object[prim[sel]].astype(np.int32), t[sel], len(dirs))


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------
def _small_rotation(rng: np.random.Generator, sigma_deg: float) -> np.ndarray:
    ax, ay, az = np.deg2rad(rng.normal(0.0, sigma_deg, 3))
    rx = np.array([[1, 0, 0], [0, math.cos(ax), -math.sin(ax)], [0, math.sin(ax), math.cos(ax)]])
    ry = np.array([[math.cos(ay), 0, math.sin(ay)], [0, 1, 0], [-math.sin(ay), 0, math.cos(ay)]])
    rz = np.array([[math.cos(az), -math.sin(az), 0], [math.sin(az), math.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx


def make_calibration(rng: np.random.Generator) -> Calibration:
    """A plausible KITTI-like calibration (our own numbers): rectified stereo rig with focal length
    ~715 px and principal point ~(608, 176) for the 1242×375 image; P0 the reference (left grey) camera,
    P1 the right grey camera 0.537 m to its right, P2 the left colour camera 0.06 m to its left, P3 the
    right colour camera 0.47 m to its right; the reference camera 0.27 m ahead of and 0.08 m below the
    LiDAR, with sub-degree rotations; the IMU 0.81 m behind, 0.32 m left of and 0.80 m below the LiDAR."""
    f = float(rng.uniform(705.0, 725.0))
    cx, cy = float(rng.uniform(603.0, 612.0)), float(rng.uniform(172.0, 180.0))
    K = np.array([[f, 0.0, cx], [0.0, f, cy], [0.0, 0.0, 1.0]])

    def proj(baseline: float, dy: float = 0.0, dz: float = 0.0) -> np.ndarray:
        # A camera at x = -baseline (right of the reference when baseline > 0) in the rectified frame.
        return np.hstack([K, K @ np.array([[baseline], [dy], [dz]])])

    P0 = proj(0.0)
    P1 = proj(-0.537)
    P2 = proj(0.06 + float(rng.normal(0, 0.002)), float(rng.normal(0, 3e-4)), float(rng.normal(0, 3e-3)))
    P3 = proj(-0.473 + float(rng.normal(0, 0.002)), float(rng.normal(0, 3e-4)), float(rng.normal(0, 3e-3)))
    R0 = _small_rotation(rng, 0.3)
    axes = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])  # LiDAR -> camera axes
    R = axes @ _small_rotation(rng, 0.3)
    cam_in_lidar = np.array([0.27, 0.0, -0.08]) + rng.normal(0.0, 0.01, 3)
    tr_velo = np.hstack([R, (-R @ cam_in_lidar)[:, None]])
    R_imu = _small_rotation(rng, 0.3)
    imu_in_lidar = np.array([-0.81, 0.32, -0.80]) + rng.normal(0.0, 0.01, 3)
    # Tr_imu_to_velo maps IMU coordinates into the LiDAR frame: p_velo = R p_imu + t.
    tr_imu = np.hstack([R_imu, imu_in_lidar[:, None]])
    return Calibration(P0=P0, P1=P1, P2=P2, P3=P3, R0_rect=R0, Tr_velo_to_cam=tr_velo, Tr_imu_to_velo=tr_imu)


def camera_center(calib: Calibration, camera: int = 2) -> np.ndarray:
    """Optical centre of camera P{camera} in the LiDAR frame."""
    P = getattr(calib, f"P{camera}")
    c_rect = -np.linalg.solve(P[:, :3], P[:, 3])
    return calib.rect_to_lidar(c_rect[None])[0]


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
    bbox, visible = boxes.project_to_image(calib, IMAGE_SIZE)
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


# --------------------------------------------------------------------------------------------------
# Frames and datasets
# --------------------------------------------------------------------------------------------------
@dataclass
class FrameTimings:
    """Wall-clock seconds of the stages of :func:`simulate_frame`."""

    scene_s: float  # calibration and scene
    scan_s: float
    labels_s: float  # labels and road map


@dataclass
class SimFrame:
    """Everything about one simulated frame (what is written, and the ground truth behind it)."""

    index: int
    calib: Calibration
    scene: Scene
    scan: Scan
    labels: FrameLabels
    road_map: RoadMap
    timings: FrameTimings


def frame_rng(seed: int, index: int) -> np.random.Generator:
    """The random generator of frame ``index`` of a dataset with ``seed`` (independent of other frames)."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))


def simulate_frame(seed: int, index: int, spec: LidarSpec = LidarSpec()) -> SimFrame:
    """Simulate frame ``index`` of the dataset with ``seed`` (see module doc)."""
    t0 = time.perf_counter()
    rng = frame_rng(seed, index)
    calib = make_calibration(rng)
    scene = generate_scene(rng, calib)
    t1 = time.perf_counter()
    sweep = scan(scene, spec, rng)
    t2 = time.perf_counter()
    labels = label_frame(scene, sweep, calib, rng)
    road = scene.street.road_map(**ROAD_MAP_GRID)
    t3 = time.perf_counter()
    return SimFrame(index, calib, scene, sweep, labels, road, FrameTimings(t1 - t0, t2 - t1, t3 - t2))


FRAME_DIRS = ("velodyne", "label_2", "calib", "road_map")


def write_frame(root: str | Path, frame: SimFrame) -> None:
    """Write the frame's velodyne/label_2/calib/road_map files under ``root/training``."""
    base = Path(root) / "training"
    for sub in FRAME_DIRS:
        (base / sub).mkdir(parents=True, exist_ok=True)
    fid = f"{frame.index:06d}"
    write_points(base / "velodyne" / f"{fid}.bin", frame.scan.points)
    write_label(base / "label_2" / f"{fid}.txt", frame.labels.labels)
    frame.calib.to_file(base / "calib" / f"{fid}.txt")
    write_road_map(base / "road_map" / f"{fid}.png", frame.road_map)


@dataclass
class FrameStats:
    """What :func:`generate_dataset` reports per frame."""

    index: int
    points: int
    rays: int
    objects: dict[str, int]  # labeled objects per class (DontCare included)
    scene_s: float
    scan_s: float
    labels_s: float
    write_s: float
    cpu_s: float  # CPU time of the whole frame (simulation and writing) in its process


def _make_one(args: tuple[str, int, int, LidarSpec]) -> FrameStats:
    root, seed, index, spec = args
    cpu0 = time.process_time()
    frame = simulate_frame(seed, index, spec)
    t0 = time.perf_counter()
    write_frame(root, frame)
    write_s = time.perf_counter() - t0
    counts = Counter(frame.labels.labels.name.tolist())
    tm = frame.timings
    return FrameStats(
        index,
        len(frame.scan.points),
        frame.scan.rays,
        dict(counts),
        tm.scene_s,
        tm.scan_s,
        tm.labels_s,
        write_s,
        time.process_time() - cpu0,
    )


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


@dataclass
class DatasetSummary:
    root: Path
    frames: list[FrameStats]
    seconds: float
    workers: int

    def table(self) -> str:
        n = len(self.frames)
        pts = np.array([f.points for f in self.frames])
        per_class = Counter()
        for f in self.frames:
            per_class.update(f.objects)
        cars = np.array([f.objects.get("Car", 0) for f in self.frames])
        lines = [
            f"{n} frames in {self.seconds:.1f} s with {self.workers} worker(s): "
            f"{n / self.seconds:.2f} frames/s",
            f"points per frame: mean {pts.mean():.0f}, min {pts.min()}, max {pts.max()}",
            f"labeled cars per frame: mean {cars.mean():.1f}, median {np.median(cars):.0f}, "
            f"10th-90th pct {np.percentile(cars, 10):.0f}-{np.percentile(cars, 90):.0f}",
            "objects: " + ", ".join(f"{k} {v}" for k, v in sorted(per_class.items())),
        ]
        return "\n".join(lines)


_FRAME_FILE = re.compile(r"^\d{6}\.(bin|txt|png)$")


def _prepare_root(root: Path, frames: int) -> None:
    marker = root / "sim.json"
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"{root}: exists and is not a directory")
    if root.exists() and any(root.iterdir()) and not marker.is_file():
        raise FileExistsError(
            f"{root}: directory is not empty and was not written by the simulator (no sim.json); "
            "choose another out=DIR"
        )
    for sub in FRAME_DIRS:
        d = root / "training" / sub
        d.mkdir(parents=True, exist_ok=True)
        for p in d.iterdir():  # frames left over from an earlier, larger run
            if _FRAME_FILE.match(p.name) and int(p.name[:6]) >= frames:
                p.unlink()
    (root / "ImageSets").mkdir(exist_ok=True)
    # The road maps' shared grid description, written once here so the workers only compare it.
    rows = int(
        round((ROAD_MAP_GRID["y_range"][1] - ROAD_MAP_GRID["y_range"][0]) / ROAD_MAP_GRID["resolution"])
    )
    cols = int(
        round((ROAD_MAP_GRID["x_range"][1] - ROAD_MAP_GRID["x_range"][0]) / ROAD_MAP_GRID["resolution"])
    )
    grid = RoadMap(
        np.zeros((rows, cols), bool),
        ROAD_MAP_GRID["x_range"][0],
        ROAD_MAP_GRID["y_range"][0],
        ROAD_MAP_GRID["resolution"],
    ).grid()
    (root / "training" / "road_map" / "grid.json").write_text(json.dumps(grid, indent=1))


def generate_dataset(
    root: str | Path,
    frames: int,
    seed: int = 0,
    workers: int | None = None,
    spec: LidarSpec = LidarSpec(),
    progress: bool = True,
    val_every: int = 5,
    on_frame: Callable[[FrameStats], None] | None = None,
) -> DatasetSummary:
    """Write a KITTI-format dataset of ``frames`` simulated frames to ``root``.

    Frames are simulated in a pool of ``workers`` forked processes (default: one per CPU core this process
    may use), each writing its own files; a progress bar shows on stderr. ``ImageSets/val.txt`` gets every
    ``val_every``-th frame (ids 4, 9, … for 5, i.e. 20 %), ``train.txt`` the others; they are written last,
    so their presence marks a complete dataset. ``root/sim.json`` records the generation parameters.
    """
    if not isinstance(frames, int) or frames < 1:
        raise ValueError(f"frames must be a positive integer, got {frames!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    workers = min(workers or len(os.sched_getaffinity(0)), frames)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    root = Path(root)
    _prepare_root(root, frames)
    imagesets = [root / "ImageSets" / f"{s}.txt" for s in ("train", "val")]
    for p in imagesets:
        p.unlink(missing_ok=True)
    meta = {
        "generator": "detector.data.sim",
        "seed": seed,
        "frames": frames,
        "lidar": asdict(spec),
        "val_every": val_every,
        "road_map_grid": {k: list(v) if isinstance(v, tuple) else v for k, v in ROAD_MAP_GRID.items()},
    }
    (root / "sim.json").write_text(json.dumps(meta, indent=1) + "\n")
    jobs = [(str(root), seed, i, spec) for i in range(frames)]
    from tqdm import tqdm

    stats: list[FrameStats] = []
    pool = None
    t0 = time.perf_counter()
    bar = tqdm(
        total=frames, desc=f"simulating {root}", unit="frame", disable=not progress, dynamic_ncols=True
    )
    try:
        if workers == 1:
            _init_worker()
            results = map(_make_one, jobs)
        else:
            import multiprocessing as mp

            import open3d  # noqa: F401  (imported once here, inherited by the forked workers)

            pool = mp.get_context("fork").Pool(workers, initializer=_init_worker)
            results = pool.imap_unordered(_make_one, jobs)
        for s in results:
            stats.append(s)
            bar.update(1)
            if on_frame is not None:
                on_frame(s)
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - t0
    ids = [f"{i:06d}" for i in range(frames)]
    val = [fid for i, fid in enumerate(ids) if i % val_every == val_every - 1]
    write_imageset(imagesets[1], val)
    write_imageset(imagesets[0], [fid for fid in ids if fid not in set(val)])
    stats.sort(key=lambda s: s.index)
    return DatasetSummary(root, stats, seconds, workers)
