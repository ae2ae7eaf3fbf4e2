"""The sensors of a simulated frame: the LiDAR (an HDL-64E-like scan pattern and sensor model, see
:mod:`detector.sim`) and a KITTI-like camera rig calibration."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from detector.data.kitti_calib import Calibration
from detector.errors import ConfigError
from detector.sim.meshes import DARK, DROPOUT, Material
from detector.sim.scene import Scene


@dataclass(frozen=True)
class LidarSpec:
    """The scan pattern and sensor model (defaults: Velodyne HDL-64E S2 at 10 Hz, see module doc)."""

    columns: int = 2083
    max_range: float = 120.0
    range_noise: float = 0.02  # m, 1 σ, clipped at ±3σ
    dropout: float = 0.02  # random loss of a return
    min_signal: float = 0.001  # see module doc
    intensity_noise: float = 0.18  # σ of the log-normal factor
    zero_signal: float = 0.1  # a return weaker than this (see module doc) reads reflectance 0
    zero_spread: float = 1.0  # σ of the log-normal factor in that test
    # The ego car under the sensor, (x0, x1, y0, y1, z) metres in the LiDAR frame: a ray that meets this
    # horizontal rectangle at height z returns nothing (None: no ego car).
    ego_body: tuple[float, float, float, float, float] | None = (-1.8, 0.3, -0.85, 0.85, -0.5)

    def __post_init__(self):
        if self.columns < 8:
            raise ConfigError(f"LidarSpec.columns must be >= 8, got {self.columns}")
        if not self.max_range > 0:
            raise ConfigError(f"LidarSpec.max_range must be > 0, got {self.max_range}")
        for k in ("range_noise", "dropout", "min_signal", "intensity_noise", "zero_signal", "zero_spread"):
            if getattr(self, k) < 0:
                raise ConfigError(f"LidarSpec.{k} must be >= 0, got {getattr(self, k)}")
        if self.dropout >= 1:
            raise ConfigError(f"LidarSpec.dropout must be < 1, got {self.dropout}")
        if self.ego_body is not None:
            e = tuple(float(v) for v in self.ego_body)
            if len(e) != 5 or not (e[0] < e[1] and e[2] < e[3] and e[4] < 0):
                raise ConfigError(f"LidarSpec.ego_body must be (x0 < x1, y0 < y1, z < 0), got {self.ego_body}")
            object.__setattr__(self, "ego_body", e)


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


@functools.lru_cache(maxsize=4)
def open_rays(columns: int, ego_body: tuple[float, float, float, float, float] | None) -> np.ndarray:
    """Indices (read-only) of the rays of :func:`ray_directions` that the ego car's body (see
    ``LidarSpec.ego_body``) does not block."""
    d = ray_directions(columns)
    if ego_body is None:
        out = np.arange(len(d))
    else:
        x0, x1, y0, y1, z = ego_body
        down = np.flatnonzero(d[:, 2] < 0)
        s = z / d[down, 2]
        x, y = d[down, 0] * s, d[down, 1] * s
        blocked = np.zeros(len(d), dtype=bool)
        blocked[down] = (x > x0) & (x < x1) & (y > y0) & (y < y1)
        out = np.flatnonzero(~blocked)
    out.flags.writeable = False
    return out


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
    all_dirs = ray_directions(spec.columns)
    rays = open_rays(spec.columns, spec.ego_body)
    dirs = all_dirs[rays]
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
    # Weak returns are kept but read 0 (KITTI: ~14 % of the points in the camera's view; 5 % at 10-20 m, 25 %
    # at 20-40 m, 67 % beyond 40 m), and so do many returns from glossy or dark materials (DARK).
    weak = albedo * (20.0 / np.maximum(t, 1.0)) ** 2 * np.exp(rng.standard_normal(len(t)) * spec.zero_spread)
    refl[(weak < spec.zero_signal) | (rng.random(len(t)) < DARK[mat])] = 0.0
    sel = np.flatnonzero(keep)
    r = t[sel] + noise[sel]
    pts = np.concatenate([d[sel] * r[:, None], refl[sel, None]], axis=1).astype(np.float32)
    ring = (rays[idx[sel]] // spec.columns).astype(np.int16)
    return Scan(pts, ring, scene.tri_object[prim[sel]].astype(np.int32), t[sel], len(all_dirs))



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
