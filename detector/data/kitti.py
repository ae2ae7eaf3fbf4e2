"""Reading and writing the KITTI object-detection layout.

```
ROOT/ImageSets/{train,val,test}.txt         frame ids, one per line
ROOT/training/velodyne/%06d.bin             float32 x, y, z, reflectance (LiDAR frame)
ROOT/training/label_2/%06d.txt              15 fields per object (16 with a score in result files):
                                            detector.data.kitti_labels (re-exported here)
ROOT/training/calib/%06d.txt                P0..P3, R0_rect, Tr_velo_to_cam, Tr_imu_to_velo
ROOT/training/road_map/%06d.png + grid.json drivable area raster (our simulator only)
ROOT/testing/...                            same, without label_2
```
Every reader checks its input and raises :class:`KittiFormatError` naming the file (and line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from detector.data.kitti_labels import (  # noqa: F401  (the label files: re-exported here)
    CLASSES,
    DIFFICULTY_LEVELS,
    IMAGE_SIZE,
    KittiLabels,
    as_written,
    difficulty,
    fields_valid,
    format_label_lines,
    labels_from_fields,
    observation_angle,
    parse_label_lines,
    read_label,
    read_label_text,
    write_label,
)
from detector.errors import KittiFormatError

if TYPE_CHECKING:  # structures imports torch: the label reader and the metric's CLI do without it
    from detector.data.structures import Boxes3D, Frame


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
    loc, dims, ry = boxes.to_camera(calib)
    bbox, _ = boxes.project_to_image(calib, image_size)
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
    from detector.data.structures import Boxes3D

    return Boxes3D.from_camera(labels.location, labels.dimensions, labels.rotation_y, calib)


# --------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------
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
        return np.asarray(pts, dtype=np.float64) @ self._rot.T + self._trans

    def rect_to_lidar(self, pts: np.ndarray) -> np.ndarray:
        return (np.asarray(pts, dtype=np.float64) - self._trans) @ self._rot_inv.T

    def rect_to_image(self, pts: np.ndarray, camera: int = 2) -> tuple[np.ndarray, np.ndarray]:
        """Project through P{camera}: (uv [N, 2] pixels, depth [N] = third homogeneous coordinate)."""
        P = getattr(self, f"P{camera}")
        pts = np.asarray(pts, dtype=np.float64)
        h = pts @ P[:, :3].T + P[:, 3]
        with np.errstate(divide="ignore", invalid="ignore"):
            uv = h[:, :2] / h[:, 2:3]
        return uv, h[:, 2]

    def lidar_to_image(self, pts: np.ndarray, camera: int = 2) -> tuple[np.ndarray, np.ndarray]:
        return self.rect_to_image(self.lidar_to_rect(pts), camera)

    def image_to_rect(self, uv: np.ndarray, depth: np.ndarray, camera: int = 2) -> np.ndarray:
        """Back-project pixels at the given depth (third homogeneous coordinate) to the rect. frame."""
        P = getattr(self, f"P{camera}")
        uv = np.asarray(uv, dtype=np.float64)
        depth = np.asarray(depth, dtype=np.float64)
        h = np.concatenate([uv * depth[:, None], depth[:, None]], axis=1) - P[:, 3]
        return h @ np.linalg.inv(P[:, :3]).T


# --------------------------------------------------------------------------------------------------
# Point clouds, image sets, road maps
# --------------------------------------------------------------------------------------------------
def read_points(path: str | Path) -> np.ndarray:
    """[N, 4] float32 (x, y, z, reflectance) from a velodyne ``.bin``; rejects truncated, empty and
    non-finite scans."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise KittiFormatError(path, "point cloud file not found") from None
    if size == 0:
        raise KittiFormatError(path, "empty point cloud (0 bytes)")
    if size % 16:
        raise KittiFormatError(
            path, f"truncated point cloud: {size} bytes is not a multiple of 16 (4 float32 per point)"
        )
    pts = np.fromfile(path, dtype=np.float32)
    if pts.size * 4 != size:
        raise KittiFormatError(path, f"could read only {pts.size * 4} of {size} bytes")
    pts = pts.reshape(-1, 4)
    if not np.isfinite(pts).all():  # the per-point mask only on the (rare) failure path
        bad = ~np.isfinite(pts).all(axis=1)
        first = int(np.flatnonzero(bad)[0])
        raise KittiFormatError(path, f"{int(bad.sum())} points with NaN or infinite values (first: point {first})")
    return pts


def write_points(path: str | Path, points: np.ndarray) -> None:
    pts = np.ascontiguousarray(points, dtype=np.float32)
    if pts.ndim != 2 or pts.shape[1] != 4:
        raise ValueError(f"points must be [N, 4], got {pts.shape}")
    Path(path).write_bytes(pts.tobytes())


def read_imageset(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        raise KittiFormatError(path, "image set file not found") from None
    for i, s in enumerate(lines, start=1):
        if not s.isdigit():
            raise KittiFormatError(path, f"frame id must be digits, got {s!r}", i)
    return lines


def write_imageset(path: str | Path, ids: list[str]) -> None:
    Path(path).write_text("".join(f"{i}\n" for i in ids))


@dataclass
class RoadMap:
    """Drivable area as a BEV raster: ``raster`` [rows, cols] bool, row r / column c covering
    y' in [y_min + r·res, y_min + (r+1)·res) and x' in [x_min + c·res, ...), where (x', y') are the
    raster's own coordinates: the LiDAR frame's (x, y), or ``to_raster`` [2, 3] @ (x, y, 1) once
    augmentation has flipped, rotated or scaled the scene (the raster itself is never resampled)."""

    raster: np.ndarray
    x_min: float
    y_min: float
    resolution: float
    to_raster: np.ndarray | None = None

    def grid(self) -> dict:
        return {
            "x_min": self.x_min,
            "y_min": self.y_min,
            "resolution": self.resolution,
            "rows": int(self.raster.shape[0]),
            "cols": int(self.raster.shape[1]),
            "rows_axis": "y",
            "cols_axis": "x",
            "frame": "lidar",
        }

    def transformed(self, matrix: np.ndarray) -> RoadMap:
        """The road map of the scene after the linear map ``matrix`` [2, 2] (points p -> matrix @ p)."""
        inv = np.linalg.inv(np.asarray(matrix, dtype=np.float64))
        cur = np.eye(2, 3) if self.to_raster is None else self.to_raster
        new = np.concatenate([cur[:, :2] @ inv, cur[:, 2:]], axis=1)
        return RoadMap(self.raster, self.x_min, self.y_min, self.resolution, new)

    def lookup(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Drivable (bool, same shape as x) at LiDAR positions (x, y); outside the raster: False."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if self.to_raster is not None:
            m = self.to_raster
            x, y = m[0, 0] * x + m[0, 1] * y + m[0, 2], m[1, 0] * x + m[1, 1] * y + m[1, 2]
        rows, cols = self.raster.shape
        c = np.floor((x - self.x_min) / self.resolution).astype(np.int64)
        r = np.floor((y - self.y_min) / self.resolution).astype(np.int64)
        ok = (r >= 0) & (r < rows) & (c >= 0) & (c < cols)
        out = np.zeros(x.shape, dtype=bool)
        out[ok] = self.raster[r[ok], c[ok]]
        return out


def write_road_map(png_path: str | Path, road: RoadMap) -> None:
    """Write the raster as an 8-bit PNG (255 = drivable) and the grid as ``grid.json`` beside it."""
    import open3d as o3d

    if road.to_raster is not None:
        raise ValueError("write_road_map: a transformed (augmented) road map cannot be written")
    png_path = Path(png_path)
    img = np.ascontiguousarray(road.raster.astype(np.uint8) * 255)
    if not o3d.io.write_image(str(png_path), o3d.geometry.Image(img)):
        raise OSError(f"{png_path}: could not write PNG")
    grid_path = png_path.parent / "grid.json"
    text = json.dumps(road.grid(), indent=1)
    if not grid_path.exists() or grid_path.read_text() != text:
        grid_path.write_text(text)


def read_road_map(png_path: str | Path) -> RoadMap:
    import open3d as o3d

    png_path = Path(png_path)
    grid_path = png_path.parent / "grid.json"
    if not png_path.exists():
        raise KittiFormatError(png_path, "road map not found")
    try:
        grid = json.loads(grid_path.read_text())
    except FileNotFoundError:
        raise KittiFormatError(grid_path, "road map grid description not found") from None
    except json.JSONDecodeError as e:
        raise KittiFormatError(grid_path, f"invalid JSON: {e}") from None
    img = np.asarray(o3d.io.read_image(str(png_path)))
    if img.ndim == 3:
        img = img[..., 0]
    if img.shape != (grid.get("rows"), grid.get("cols")):
        raise KittiFormatError(
            png_path, f"raster is {img.shape}, grid.json says {(grid.get('rows'), grid.get('cols'))}"
        )
    return RoadMap(img > 127, float(grid["x_min"]), float(grid["y_min"]), float(grid["resolution"]))


# --------------------------------------------------------------------------------------------------
# A KITTI-format root
# --------------------------------------------------------------------------------------------------
class KittiRoot:
    """A KITTI-format dataset root (real KITTI or our simulator's output)."""

    def __init__(self, root: str | Path, split_dir: str = "training"):
        self.root = Path(root)
        self.dir = self.root / split_dir
        if not self.root.is_dir():
            raise KittiFormatError(self.root, "dataset root not found")
        if not self.dir.is_dir():
            raise KittiFormatError(self.dir, f"no '{split_dir}' folder in the dataset root")

    def imageset(self, name: str) -> list[str]:
        """Frame ids of ``ImageSets/{name}.txt``."""
        return read_imageset(self.root / "ImageSets" / f"{name}.txt")

    def path(self, kind: str, frame_id: str) -> Path:
        ext = {"velodyne": "bin", "road_map": "png", "image_2": "png"}.get(kind, "txt")
        return self.dir / kind / f"{frame_id}.{ext}"

    def has_labels(self) -> bool:
        return (self.dir / "label_2").is_dir()

    def has_road_maps(self) -> bool:
        return (self.dir / "road_map" / "grid.json").is_file()

    def read_frame(self, frame_id: str, road_map: bool = False) -> Frame:
        """Load a frame; raises KittiFormatError naming the bad or missing file."""
        from detector.data.structures import Boxes3D, Frame

        points = read_points(self.path("velodyne", frame_id))
        calib = Calibration.from_file(self.path("calib", frame_id))
        labels = None
        boxes, names = Boxes3D.empty(), np.zeros(0, dtype="<U16")
        if self.has_labels():
            labels = read_label(self.path("label_2", frame_id), with_score=False)
            obj = labels.name != "DontCare"
            names = labels.name[obj]
            boxes = Boxes3D(labels_to_boxes(labels.select(obj), calib).tensor.float())
        road = None
        if road_map:
            if not self.has_road_maps():
                raise KittiFormatError(
                    self.dir / "road_map",
                    "no road maps in this dataset (real KITTI has none): use mask=predicted, ground or none",
                )
            road = read_road_map(self.path("road_map", frame_id))
        return Frame(frame_id, points, calib, boxes, names, labels, road)
