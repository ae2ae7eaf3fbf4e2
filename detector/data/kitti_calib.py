"""KITTI calibration files: ``training/calib/%06d.txt`` and the frame transforms they define.

Keys P0..P3, R0_rect, Tr_velo_to_cam, Tr_imu_to_velo (older files' aliases accepted, other keys ignored).
The reader checks its input and raises :class:`KittiFormatError` naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from detector.errors import KittiFormatError

_CALIB_SHAPES = {
    "P0": (3, 4),
    "P1": (3, 4),
    "P2": (3, 4),
    "P3": (3, 4),
    "R0_rect": (3, 3),
    "Tr_velo_to_cam": (3, 4),
    "Tr_imu_to_velo": (3, 4),
}
_CALIB_ALIASES = {"R_rect": "R0_rect", "Tr_velo_cam": "Tr_velo_to_cam", "Tr_imu_velo": "Tr_imu_to_velo"}


def _affine(pts: np.ndarray, A: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``pts [N, 3] @ A.T + b`` in float64, one output row at a time into a [3, N] buffer (returned
    transposed, as a view). A [N, 3] x [3, 3] matmul goes to the multithreaded BLAS, whose threads contend
    with torch's: 40-50 ms per 120k-point frame in the data loader of a training run on 2 cores; this is
    ~3 ms, and the loader does it for every frame (writing rows, not the strided columns of an [N, 3]
    array, and reusing one temporary halved it)."""
    p = np.asarray(pts)
    cols = [p[:, j].astype(np.float64) for j in range(p.shape[1])]
    out = np.empty((A.shape[0], len(p)), dtype=np.float64)
    tmp = np.empty(len(p), dtype=np.float64)
    for i in range(A.shape[0]):
        row = np.multiply(cols[0], A[i, 0], out=out[i])
        for j in range(1, A.shape[1]):
            row += np.multiply(cols[j], A[i, j], out=tmp)
        if b is not None:
            row += b[i]
    return out.T


def _pixels(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Homogeneous image coordinates [N, 3] -> (uv [N, 2] pixels, depth [N])."""
    with np.errstate(divide="ignore", invalid="ignore"):
        uv = h[:, :2] / h[:, 2:3]
    return uv, h[:, 2]


@dataclass
class Calibration:
    """KITTI calibration: camera projections P0..P3 (rectified camera → image), R0_rect (reference →
    rectified camera), Tr_velo_to_cam (LiDAR → reference camera), Tr_imu_to_velo. Float64 matrices."""

    P0: np.ndarray
    P1: np.ndarray
    P2: np.ndarray
    P3: np.ndarray
    R0_rect: np.ndarray
    Tr_velo_to_cam: np.ndarray
    Tr_imu_to_velo: np.ndarray

    def __post_init__(self):
        for key, shape in _CALIB_SHAPES.items():
            m = np.asarray(getattr(self, key), dtype=np.float64)
            if m.shape != shape:
                raise ValueError(f"Calibration.{key} must be {shape}, got {m.shape}")
            setattr(self, key, m)
        # LiDAR -> rectified camera as one affine map, and its inverse.
        self._rot = self.R0_rect @ self.Tr_velo_to_cam[:, :3]
        self._trans = self.R0_rect @ self.Tr_velo_to_cam[:, 3]
        self._rot_inv = np.linalg.inv(self._rot)

    @classmethod
    def from_file(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise KittiFormatError(path, "calibration file not found") from None
        except UnicodeDecodeError:
            raise KittiFormatError(path, "not a text file") from None
        mats: dict[str, np.ndarray] = {}
        for i, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            key, sep, rest = raw.partition(":")
            key = _CALIB_ALIASES.get(key.strip(), key.strip())
            if not sep:
                raise KittiFormatError(path, f"expected 'KEY: values', got {raw.strip()[:60]!r}", i)
            if key not in _CALIB_SHAPES:
                continue  # other keys (e.g. raw-data extras) are allowed and ignored
            try:
                vals = np.array([float(v) for v in rest.split()], dtype=np.float64)
            except ValueError:
                raise KittiFormatError(path, f"non-numeric value in {key}", i) from None
            shape = _CALIB_SHAPES[key]
            if vals.size != shape[0] * shape[1]:
                raise KittiFormatError(path, f"{key} needs {shape[0] * shape[1]} numbers, got {vals.size}", i)
            if not np.isfinite(vals).all():
                raise KittiFormatError(path, f"NaN or infinite value in {key}", i)
            mats[key] = vals.reshape(shape)
        missing = [k for k in _CALIB_SHAPES if k not in mats]
        if missing:
            raise KittiFormatError(path, f"missing matrix {', '.join(missing)}")
        calib = cls(**mats)
        if abs(np.linalg.det(calib._rot)) < 1e-6:
            raise KittiFormatError(path, "R0_rect · Tr_velo_to_cam is singular")
        return calib

    def to_file(self, path: str | Path) -> None:
        lines = []
        for key in _CALIB_SHAPES:
            vals = getattr(self, key).reshape(-1)
            lines.append(f"{key}: " + " ".join(f"{v:.12e}" for v in vals))
        Path(path).write_text("\n".join(lines) + "\n")

    # --- transforms; points are [N, 3] arrays -------------------------------------------------------
    def lidar_to_rect(self, pts: np.ndarray) -> np.ndarray:
        return _affine(pts, self._rot, self._trans)

    def rect_to_lidar(self, pts: np.ndarray) -> np.ndarray:
        return _affine(np.asarray(pts, dtype=np.float64) - self._trans, self._rot_inv)

    def rect_to_image(self, pts: np.ndarray, camera: int = 2) -> tuple[np.ndarray, np.ndarray]:
        """Project through P{camera}: (uv [N, 2] pixels, depth [N] = third homogeneous coordinate)."""
        P = getattr(self, f"P{camera}")
        return _pixels(_affine(pts, P[:, :3], P[:, 3]))

    def lidar_to_image(self, pts: np.ndarray, camera: int = 2) -> tuple[np.ndarray, np.ndarray]:
        """``rect_to_image(lidar_to_rect(pts))`` as one affine map (P[:, :3] composed with LiDAR -> rect.):
        one pass over the points instead of two, for the data loader's field-of-view test of every frame."""
        P = getattr(self, f"P{camera}")
        return _pixels(_affine(pts, P[:, :3] @ self._rot, P[:, :3] @ self._trans + P[:, 3]))

    def image_to_rect(self, uv: np.ndarray, depth: np.ndarray, camera: int = 2) -> np.ndarray:
        """Back-project pixels at the given depth (third homogeneous coordinate) to the rect. frame."""
        P = getattr(self, f"P{camera}")
        uv = np.asarray(uv, dtype=np.float64)
        depth = np.asarray(depth, dtype=np.float64)
        h = np.concatenate([uv * depth[:, None], depth[:, None]], axis=1) - P[:, 3]
        return h @ np.linalg.inv(P[:, :3]).T
